"""On a GPU host: where in a pass does the capture lose its time? The capture bench's three
passes (the forward alone, recording with the rows dropped, recording and the trace writer), with
the time of every forward: the loop's host time from one forward's hand-off to the next (the
launch-bound forward's pace), then the pass's end (the device synchronised; for the capture, the
file closed). Rounds in turn, every other one reversed, as the bench runs them.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/forward_times.py [ROUNDS] [TOKENS]``
(writes DIR/forward_times.json; ``DEVICE=cpu`` for a dry run). Result of run 1206c:
docs/capture/forward_times_1206c.json (docs/CAPTURE.md).
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from traces.atomic import atomic_write_text
from traces.capture.bench import _sync
from traces.capture.capture import (
    batch_tokens,
    batches,
    build_meta,
    capture_windows,
    open_writer,
    right_padded,
)
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents

CONFIG = "traces/fixtures/shapes/qwen3_next_small.json"
p = argparse.ArgumentParser(prog="docs/capture/forward_times.py", description=__doc__.split("\n\n")[0])
p.add_argument("rounds", nargs="?", type=int, default=8)
p.add_argument("tokens", nargs="?", type=int, default=524288, help="input tokens per pass")
p.add_argument("--batch", type=int, default=16)
args = p.parse_args()
if min(args.rounds, args.tokens, args.batch) < 1:
    p.error(f"rounds={args.rounds}, tokens={args.tokens}, batch={args.batch}: each must be at least 1")
out = Path(os.environ.get("OUT", "/tmp/forward_times"))
out.mkdir(parents=True, exist_ok=True)
model, tokenizer, sites, name = load_model(ModelConfig(config=CONFIG, tokenizer="traces/fixtures/model",
                                                       device=os.environ.get("DEVICE", "auto")))
windows, domains = make_windows(read_documents(["docs", "README.md", "traces", "simulator", "analysis", "tests",
                                                "conf"]), tokenizer, 512, max_tokens=args.tokens)
defaults = CaptureConfig()
cfg = replace(defaults, batch_size=args.batch, shared_rows=model.device.type == "cuda")
probs = router_returns_probabilities(model, sites)


class Marks:
    """A progress bar's ``update`` that keeps the time of each call (one per forward)."""

    def __init__(self):
        self.times = [time.perf_counter()]

    def update(self, n):
        self.times.append(time.perf_counter())


def forward() -> Marks:
    marks = Marks()
    with torch.inference_mode():
        for batch in batches(windows, cfg.batch_size):
            _, _, input_ids, mask = right_padded(batch, model.device)
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            marks.update(0)
    _sync(model.device)
    marks.times.append(time.perf_counter())
    return marks


def hooks() -> Marks:
    marks = Marks()
    capture_windows(model, sites, windows, cfg, lambda rows: None, progress=marks, logits_are_probs=probs)
    marks.times.append(time.perf_counter())
    return marks


def capture() -> Marks:
    marks = Marks()
    meta = build_meta(model, sites, name, domains, cfg, {}, probs)
    with tempfile.TemporaryDirectory() as tmp:
        with open_writer(Path(tmp) / "bench.parquet", meta, cfg.writers, cfg.writer, cfg.unit_tokens,
                         batch_tokens(cfg), sum(len(x.tokens) for x in windows)) as w:
            marks.times[0] = time.perf_counter()  # the writer open (its fixed cost) left out, as above
            capture_windows(model, sites, windows, cfg, lambda rows: w.write(**rows.columns()), progress=marks,
                            logits_are_probs=probs, block=w.block if cfg.shared_rows else None)
        marks.times.append(time.perf_counter())  # the file closed
    return marks


passes = {"forward": forward, "hooks": hooks, "capture": capture}
for fn in passes.values():  # warm-up: kernels, allocator, the writer's processes
    fn()
timed: dict[str, list[list[float]]] = {k: [] for k in passes}
for r in range(args.rounds):
    for label, fn in (reversed(passes.items()) if r % 2 else passes.items()):
        t = fn().times
        timed[label].append([round(b - a, 6) for a, b in zip(t[:-1], t[1:], strict=True)])  # per forward, then the end
        print(label, r, f"{t[-1] - t[0]:.3f} s", flush=True)

n = min(len(v) for runs in timed.values() for v in runs)


def median_at(label, i):
    return statistics.median(run[i] for run in timed[label])


summary = {label: {"pass_s": round(statistics.median(sum(run) for run in timed[label]), 4),
                   "first_forwards_ms": [round(1e3 * median_at(label, i), 2) for i in range(min(8, n - 1))],
                   "median_forward_ms": round(1e3 * statistics.median(x for run in timed[label] for x in run[:-1]), 3),
                   "last_forward_ms": round(1e3 * median_at(label, n - 2), 2),
                   "end_ms": round(1e3 * statistics.median(run[-1] for run in timed[label]), 2)}
           for label in passes}
gpu = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None
result = {"model": name, "config": CONFIG, "device": str(model.device), "gpu": gpu, "batch": cfg.batch_size,
          "tokens": sum(len(w.tokens) for w in windows), "rounds": args.rounds, "forwards": n - 1,
          "summary": summary, "per_forward_s": timed}
atomic_write_text(out / "forward_times.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
