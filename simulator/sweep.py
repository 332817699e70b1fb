"""Sweep progress: a Hydra callback that prints one line per finished job of a multirun.

It works with every launcher (basic, joblib, submitit) because finished jobs count themselves
on disk, in ``SWEEP_DIR/.progress``: each job claims the next finishing number by creating the
file of that name exclusively, so jobs that end at the same moment in parallel workers still
print ``1/4``, ``2/4``, ... once each (counting the jobs whose outputs exist would print the
same count twice when two jobs end together). The total comes from the sweep's own overrides
in ``multirun.yaml``.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

PROGRESS_DIR = ".progress"  # one empty file per finished job, named by its finishing number


def sweep_size(overrides: list[str]) -> int | None:
    """Jobs a basic-sweeper multirun over these overrides launches (None if not countable)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception:  # an override only the sweeper understands: no total, still progress
        return None
    sizes = [len(list(o.sweep_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


def claim_finish_number(progress_dir: Path) -> int:
    """The next finishing number (1, 2, ...), unique among all jobs of the sweep.

    A number is claimed by creating its file with O_EXCL, which exactly one of several
    concurrent creators wins, on local and on NFS file systems alike; the loser tries the next.
    Numbers are taken in order, so the files present are always 1..n and the search starts there.
    """
    progress_dir.mkdir(parents=True, exist_ok=True)
    number = sum(1 for _ in progress_dir.iterdir())
    while True:
        number += 1
        try:
            os.close(os.open(progress_dir / str(number), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return number


class SweepProgress(Callback):
    """Prints ``[sweep] done/total jobs finished (job N: status)`` to stderr once per job."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A sweep directory given by hand may hold the numbers of an earlier sweep.
        shutil.rmtree(Path(config.hydra.sweep.dir) / PROGRESS_DIR, ignore_errors=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        shutil.rmtree(Path(config.hydra.sweep.dir) / PROGRESS_DIR, ignore_errors=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hc = config.hydra
        if str(hc.mode) != "RunMode.MULTIRUN":
            return
        sweep_dir = Path(hc.sweep.dir)
        total = None
        multirun = sweep_dir / "multirun.yaml"
        if multirun.exists():
            total = sweep_size(OmegaConf.load(multirun).hydra.overrides.task)
        done = claim_finish_number(sweep_dir / PROGRESS_DIR)
        status = getattr(getattr(job_return, "status", None), "name", "")
        of = f"/{total}" if total else ""
        write_line(f"[sweep] {done}{of} jobs finished (job {hc.job.num}: "
                   f"{status.lower() or 'done'})")


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
