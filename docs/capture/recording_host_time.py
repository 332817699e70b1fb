"""On a GPU host: where the model's thread spends its time per forward when the capture records.

A launch-bound forward pays for every host-side operation the recording adds on the thread that
drives the model. This check runs the small Qwen3-Next shape teacher-forced (the capture's loop,
rows discarded, as the bench's ``hooks`` pass) and times, per forward, each segment of that
thread's work: the router hooks (inside the forward), the forward less its hooks, stacking the
routing (``collect``), the stored forms (casts, the top-R selection), the NLL, and handing the
block to the drain. CPU seconds of the thread (``time.thread_time``) and wall seconds, per forward,
medians over the passes; the forward alone for comparison.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/recording_host_time.py``
(``TOKENS`` per pass at batch 16, default 131,072, a sixteenth of it at batch 1; ``PASSES``,
default 5). Writes DIR/recording_host_time.json.
"""
import collections
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from same_bytes import load, out_dir  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402
from traces.capture import capture, hooks, nll  # noqa: E402
from traces.capture.bench import _forward_only  # noqa: E402

SPENT: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # segment -> [cpu, wall]
STACK: list[list[float]] = []  # per open segment: the time of the segments inside it


@contextlib.contextmanager
def segment(name: str):
    """Time a segment of the calling thread, less the segments inside it (counted as their own)."""
    STACK.append([0.0, 0.0])
    cpu, wall = time.thread_time(), time.perf_counter()
    try:
        yield
    finally:
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        inner = STACK.pop()
        SPENT[name][0] += cpu - inner[0]
        SPENT[name][1] += wall - inner[1]
        if STACK:
            STACK[-1][0] += cpu
            STACK[-1][1] += wall


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with segment(name):
            return fn(*args, **kwargs)
    return wrapper


class Timed:
    """The model, its calls timed as the forward (its router hooks apart)."""

    def __init__(self, model):
        self.model, self.device = model, model.device

    def __call__(self, *args, **kwargs):
        with segment("forward (less its hooks)"):
            return self.model(*args, **kwargs)


def instrument() -> None:
    """Wrap the recording's steps where the capture loop looks them up (module globals, methods)."""
    capture.right_padded = timed("inputs to the device", capture.right_padded)
    capture._routing_parts = timed("stored forms: casts", capture._routing_parts)
    capture.top_r_logits = timed("top-R selection", capture.top_r_logits)
    capture.token_nll = timed("NLL: the rest", capture.token_nll)
    nll.log_sum_exp = timed("NLL: the kernel", nll.log_sum_exp)
    capture._Drain.put = timed("hand to the drain (copies queued)", capture._Drain.put)
    hooks.RouterRecorder.take = timed("take (the hooks' outputs)", hooks.RouterRecorder.take)
    hooks.StepRouting.stacked = classmethod(timed("stacking the routing", hooks.StepRouting.stacked.__func__))
    make_hook = hooks.RouterRecorder._hook
    hooks.RouterRecorder._hook = lambda self, j: timed("router hooks", make_hook(self, j))


def one_pass(s, batch: int, record: bool) -> dict[str, list[float]]:
    SPENT.clear()
    cfg = dataclasses.replace(s.base, batch_size=batch)
    model = Timed(s.model)
    forwards = -(-len(s.windows) // batch)
    cpu, wall = time.thread_time(), time.perf_counter()
    if record:
        capture.capture_windows(model, s.sites, s.windows, cfg, lambda rows: None, logits_are_probs=s.probs)
    else:
        _forward_only(model, s.windows, batch)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    out = {name: [1e3 * v / forwards for v in spent] for name, spent in SPENT.items()}
    out["whole pass"] = [1e3 * cpu / forwards, 1e3 * wall / forwards]
    out["the rest of the loop"] = [w - sum(v[i] for k, v in out.items() if k != "whole pass")
                                   for i, w in enumerate(out["whole pass"])]
    return out


def whole(name: str, default: int) -> int:
    """A positive whole number from the environment variable ``name``, or one line and a non-zero exit."""
    text = os.environ.get(name, str(default))
    if not text.isdigit() or int(text) < 1:
        sys.exit(f"recording_host_time: {name}={text!r} is not a whole number >= 1; set e.g. {name}={default}")
    return int(text)


def main() -> None:
    tokens, passes = whole("TOKENS", 131072), whole("PASSES", 5)
    out = out_dir("/tmp/recording_host_time")
    s = load(tokens)
    instrument()
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "model": s.name, "shape": s.base.model.config, "tokens": tokens,
              "passes": passes, "unit": "ms per forward: [thread CPU, wall]", "batches": {}}
    for batch in (16, 1):
        windows = s.windows if batch == 16 else s.windows[: max(1, len(s.windows) // 16)]
        sub = s._replace(windows=windows)
        runs = {"forward alone": [], "recording": []}
        one_pass(sub, batch, True)  # warm-up: kernels, allocator
        one_pass(sub, batch, False)
        for _ in range(passes):
            for name, record in (("forward alone", False), ("recording", True)):
                runs[name].append(one_pass(sub, batch, record))
        medians = {}
        for name, passes_ in runs.items():
            keys = passes_[0].keys()
            medians[name] = {k: [round(statistics.median(p[k][i] for p in passes_), 3) for i in (0, 1)]
                             for k in keys}
        result["batches"][batch] = {"forwards": -(-len(windows) // batch), **medians}
        print(f"batch {batch}:", json.dumps(medians, indent=1), flush=True)
    atomic_write_text(out / "recording_host_time.json", json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
