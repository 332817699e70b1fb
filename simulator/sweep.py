"""Sweep progress and outcome: a Hydra callback that prints one line per finished job of a
multirun and tallies how the jobs ended.

It works with every launcher (basic, joblib, submitit) because finished jobs count themselves
on disk, in ``SWEEP_DIR/.progress``: each job claims the next finishing number by creating the
file of that name exclusively, so jobs that end at the same moment in parallel workers still
print ``1/4``, ``2/4``, ... once each (counting the jobs whose outputs exist would print the
same count twice when two jobs end together). The total comes from the sweep's own overrides
in ``multirun.yaml``. Each number's file holds how its job ended (``completed``, ``failed``:
the job recorded an input error in its ``error.txt``, ``crashed``: any other exception); at the
end of the sweep the callback tallies them for ``moe-sim``'s exit code (:func:`take_outcome`).

The module is also callable: it is the Python API's ``sweep()`` (:func:`simulator.api.sweep`), so
that ``from simulator import sweep`` gives that function whether or not this module was imported
first (importing a submodule binds its name in the package).
"""
from __future__ import annotations

import collections
import math
import os
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

PROGRESS_DIR = ".progress"  # one file per finished job, named by its finishing number
COMPLETED, FAILED, CRASHED = "completed", "failed", "crashed"


@dataclass(frozen=True)
class JobFailed:
    """What a sweep job returns when it failed (its error.txt holds ``message``)."""

    message: str
    input_error: bool


@dataclass(frozen=True)
class SweepOutcome:
    """How the jobs of a finished multirun ended."""

    sweep_dir: Path
    finished: int
    failed_input: int
    crashed: int

    @property
    def failed(self) -> int:
        return self.failed_input + self.crashed


_outcome: SweepOutcome | None = None  # of the last multirun this process ran


def take_outcome() -> SweepOutcome | None:
    """The outcome of the multirun this process last ran (once; None if none ran)."""
    global _outcome
    outcome, _outcome = _outcome, None
    return outcome


def job_status(job_return: Any) -> str:
    """``completed``, ``failed`` (an input error, recorded) or ``crashed``."""
    status = getattr(getattr(job_return, "status", None), "name", "COMPLETED")
    if status != "COMPLETED":
        return CRASHED
    value = job_return.return_value if hasattr(job_return, "return_value") else None
    if isinstance(value, JobFailed):
        return FAILED if value.input_error else CRASHED
    return COMPLETED


def sweep_size(overrides: list[str]) -> int | None:
    """Jobs a basic-sweeper multirun over these overrides launches (None if not countable)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception:  # an override only the sweeper understands: no total, still progress
        return None
    sizes = [len(list(o.sweep_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


def claim_finish_number(progress_dir: Path, status: str = COMPLETED) -> int:
    """The next finishing number (1, 2, ...), unique among all jobs of the sweep; its file holds
    ``status``.

    A number is claimed by creating its file with O_EXCL, which exactly one of several
    concurrent creators wins, on local and on NFS file systems alike; the loser tries the next.
    Numbers are taken in order, so the files present are always 1..n and the search starts there.
    """
    progress_dir.mkdir(parents=True, exist_ok=True)
    number = sum(1 for _ in progress_dir.iterdir())
    while True:
        number += 1
        try:
            fd = os.open(progress_dir / str(number), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        try:
            os.write(fd, status.encode())
        finally:
            os.close(fd)
        return number


def tally(progress_dir: Path) -> collections.Counter:
    """How many finished jobs ended in each status."""
    counts: collections.Counter = collections.Counter()
    for path in progress_dir.glob("*"):
        try:
            counts[path.read_text().strip() or COMPLETED] += 1
        except OSError:
            counts[COMPLETED] += 1
    return counts


class SweepProgress(Callback):
    """Prints ``[sweep] done/total jobs finished (job N: status)`` to stderr once per job."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A sweep directory given by hand may hold the numbers of an earlier sweep.
        shutil.rmtree(Path(config.hydra.sweep.dir) / PROGRESS_DIR, ignore_errors=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _outcome
        progress = Path(config.hydra.sweep.dir) / PROGRESS_DIR
        counts = tally(progress)
        _outcome = SweepOutcome(Path(config.hydra.sweep.dir), sum(counts.values()),
                                counts[FAILED], counts[CRASHED])
        shutil.rmtree(progress, ignore_errors=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hc = config.hydra
        if str(hc.mode) != "RunMode.MULTIRUN":
            return
        sweep_dir = Path(hc.sweep.dir)
        total = _sweep_total(sweep_dir / "multirun.yaml")
        status = job_status(job_return) if job_return is not None else None
        done = claim_finish_number(sweep_dir / PROGRESS_DIR, status or COMPLETED)
        of = f"/{total}" if total else ""
        write_line(f"[sweep] {done}{of} jobs finished (job {hc.job.num}: {status or 'done'})")


_TOTALS: dict[tuple[str, int, int], int | None] = {}  # multirun.yaml (path, mtime, size) -> jobs


def _sweep_total(multirun: Path) -> int | None:
    """The sweep's job count from its multirun.yaml (None without one), read once per file."""
    try:
        st = multirun.stat()
    except OSError:
        return None
    key = (str(multirun), st.st_mtime_ns, st.st_size)
    if key not in _TOTALS:
        _TOTALS[key] = sweep_size(OmegaConf.load(multirun).hydra.overrides.task)
    return _TOTALS[key]


def write_line(line: str) -> None:
    """Write one line to stderr in a single system call.

    print() writes the text and its newline separately, and the lines of jobs that finish
    together in parallel workers then run into each other; one write of up to PIPE_BUF bytes
    reaches a pipe or terminal whole.
    """
    data = line + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a descriptor (captured)
        sys.stderr.write(data)
        sys.stderr.flush()
        return
    sys.stderr.flush()
    os.write(fd, data.encode())


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any):
        """The Python API's sweep(): see :func:`simulator.api.sweep`."""
        from simulator.api import sweep

        return sweep(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
