"""Sweep progress: a Hydra callback that prints jobs done / total after every job of a multirun.

It works with every launcher (basic, joblib, submitit) because it counts finished jobs on disk
(a job is finished once it wrote ``summary.json`` or ``error.txt``) and derives the total from
the sweep's own overrides in ``multirun.yaml``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

DONE_MARKERS = ("summary.json", "error.txt")


def sweep_size(overrides: list[str]) -> int | None:
    """Jobs a basic-sweeper multirun over these overrides launches (None if not countable)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception:  # an override only the sweeper understands: no total, still progress
        return None
    sizes = [len(list(o.sweep_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


def jobs_done(sweep_dir: Path) -> int:
    return sum(1 for d in sweep_dir.iterdir() if d.is_dir() and any((d / m).exists() for m in DONE_MARKERS))


class SweepProgress(Callback):
    """Prints ``[sweep] done/total jobs finished`` to stderr after each multirun job."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hc = config.hydra
        if str(hc.mode) != "RunMode.MULTIRUN":
            return
        sweep_dir = Path(hc.sweep.dir)
        total = None
        multirun = sweep_dir / "multirun.yaml"
        if multirun.exists():
            total = sweep_size(OmegaConf.load(multirun).hydra.overrides.task)
        done = jobs_done(sweep_dir)
        status = getattr(getattr(job_return, "status", None), "name", "")
        of = f"/{total}" if total else ""
        print(f"[sweep] {done}{of} jobs finished (job {hc.job.num}: {status.lower() or 'done'})",
              file=sys.stderr, flush=True)
