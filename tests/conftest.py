"""Fixtures shared by the test modules."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

import pytest

from traces.format import ArraySource
from traces.synth import synth_trace


# The capture writer's shared-memory files of this test process (and of the children it starts,
# which inherit the variable) in a folder of its own, so that tests counting the files left behind
# do not see those of the other test processes running beside it (pytest -n). Removed at exit,
# after the writer's own clean-up (atexit runs in reverse order; the writer is imported later).
# Those of test processes killed before their exit are removed by the next run.
def _shared_folder() -> str:
    from pathlib import Path

    from traces.atomic import pid_alive

    parent = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    for old in parent.glob("moe-tests-*-*"):
        pid = old.name.split("-")[2]
        # an hour untouched too: a process id not running here may run in another container
        if pid.isdigit() and not pid_alive(int(pid)) and time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"moe-tests-{os.getpid()}-", dir=parent)


_SHARED = _shared_folder()
os.environ["MOE_TRACE_SHARED_DIR"] = _SHARED
atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)


@pytest.fixture
def tiny_trace():
    """Factory of small synthetic traces: ``tiny_trace(**overrides) -> ArraySource``.

    Defaults: 64 tokens, 3 layers, 16 experts, top-2, seed 0, full logits, sequences of ~16
    tokens of which most open with a short prefill prompt; any ``synth_trace`` option can be
    overridden (``tokens``, ``layers``, ``experts``, ``top_k``, ``seed``, ``logits``, ...).
    """

    def make(**overrides) -> ArraySource:
        options = dict(tokens=64, layers=3, experts=16, top_k=2, seed=0, logits="full",
                       seq_tokens=16, prompt_tokens=5, prompt_share=0.8)
        options.update(overrides)
        return ArraySource(*synth_trace(**options))

    return make


@pytest.fixture
def broken_kernel():
    """A Triton kernel whose every launch fails, as on a host Triton cannot compile for: (the
    kernel, the grids it was launched with)."""
    calls = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError("no compiler for this GPU\nmore detail")
            return launch

    return Broken(), calls
