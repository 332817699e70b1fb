"""On a GPU host: which part of the recording costs a launch-bound forward its time? The capture
loop built up one part at a time, each pass timed forward by forward, in rounds:

1. ``forward``: the model alone (the bench's first pass);
2. ``hooks``: the router hooks and the routing stacked after each forward, nothing more;
3. ``device``: and the stored forms made on the drain's stream (casts, the top-R selection, the
   per-token NLL), neither copied nor handed on;
4. ``recording``: moe-capture's loop with the rows dropped (the bench's second pass: the host
   columns, the copies into pinned memory, the drain thread);
5. ``capture``: and the trace writer (the bench's third pass; the writer's open left out, its close in).

So ``hooks - forward`` bounds what the hooks cost, ``device - hooks`` what the device work and its
launches cost, ``recording - device`` the copies, host columns and drain, and ``capture -
recording`` the writer. Rounds in turn, every other one reversed, as the bench runs them.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/recording_parts.py [ROUNDS] [TOKENS]``
(writes DIR/recording_parts.json; ``DEVICE=cpu`` for a dry run).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from traces.atomic import atomic_write_text
from traces.capture.bench import _sync, overhead_interval
from traces.capture.capture import (
    CAPTURE_SWITCH_INTERVAL_S,
    Storage,
    _Drain,
    _real,
    _routing_parts,
    batch_tokens,
    batches,
    build_meta,
    capture_windows,
    open_writer,
    right_padded,
)
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.hooks import RouterRecorder, router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.nll import token_nll
from traces.capture.text import make_windows, read_documents

CONFIG = "traces/fixtures/shapes/qwen3_next_small.json"
p = argparse.ArgumentParser(prog="docs/capture/recording_parts.py", description=__doc__.split("\n\n")[0])
p.add_argument("rounds", nargs="?", type=int, default=10)
p.add_argument("tokens", nargs="?", type=int, default=524288, help="input tokens per pass")
p.add_argument("--batch", type=int, default=16)
args = p.parse_args()
if min(args.rounds, args.tokens, args.batch) < 1:
    p.error(f"rounds={args.rounds}, tokens={args.tokens}, batch={args.batch}: each must be at least 1")
out = Path(os.environ.get("OUT", "/tmp/recording_parts"))
out.mkdir(parents=True, exist_ok=True)
model, tokenizer, sites, name = load_model(ModelConfig(config=CONFIG, tokenizer="traces/fixtures/model",
                                                       device=os.environ.get("DEVICE", "auto")))
windows, domains = make_windows(read_documents(["docs", "README.md", "traces", "simulator", "analysis", "tests",
                                                "conf"]), tokenizer, 512, max_tokens=args.tokens)
cfg = replace(CaptureConfig(), batch_size=args.batch, shared_rows=model.device.type == "cuda")
probs = router_returns_probabilities(model, sites)
storage = Storage.of(cfg, sites[0].num_experts, len(sites))
if storage.lookahead:
    sys.exit("this check times the default capture, without look-ahead")


class Marks:
    """A progress bar's ``update`` that keeps the time of each call (one per forward)."""

    def __init__(self):
        self.times = [time.perf_counter()]

    def update(self, n=0):
        self.times.append(time.perf_counter())


def forward() -> Marks:
    marks = Marks()
    with torch.inference_mode():
        for batch in batches(windows, cfg.batch_size):
            _, _, input_ids, mask = right_padded(batch, model.device)
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            marks.update()
    _sync(model.device)
    marks.times.append(time.perf_counter())
    return marks


def partial(device_work: bool) -> Marks:
    """The capture loop's forwards with the hooks, and with ``device_work`` the stored forms made
    on the drain's stream; nothing copied to the host. As capture_windows, with its switch interval."""
    marks = Marks()
    drain = _Drain(lambda rows: None, model.device, side=cfg.recording_stream == "side")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, CAPTURE_SWITCH_INTERVAL_S))
    try:
        with torch.inference_mode(), RouterRecorder(sites, storage.logits != "none", probs) as rec:
            for batch in batches(windows, cfg.batch_size):
                ids, lengths, input_ids, mask = right_padded(batch, model.device)
                B, S = ids.shape
                lm = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
                routing = rec.collect(B * S)
                if device_work:  # as teacher_forced: the real token slots where windows are padded
                    slots = None
                    if mask is not None:
                        slots = torch.from_numpy(np.concatenate([b * S + np.arange(n) for b, n in enumerate(lengths)]))
                        slots = slots.to(model.device)
                    with drain.beside(*routing.tensors(), lm.logits, input_ids, slots):
                        dev = _routing_parts(routing, slots, storage, None, cfg.top_r_kernel)
                        dev["nll"] = _real(token_nll(lm.logits, input_ids).reshape(-1), slots)
                marks.update()
        _sync(model.device)
    finally:
        drain.close()
        sys.setswitchinterval(interval)
    marks.times.append(time.perf_counter())
    return marks


def recording() -> Marks:
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
            marks.times[0] = time.perf_counter()  # the writer open (its fixed cost) left out, as the bench
            capture_windows(model, sites, windows, cfg, lambda rows: w.write(**rows.columns()), progress=marks,
                            logits_are_probs=probs, block=w.block if cfg.shared_rows else None)
        marks.times.append(time.perf_counter())  # the file closed
    return marks


passes = {"forward": forward, "hooks": lambda: partial(False), "device": lambda: partial(True),
          "recording": recording, "capture": capture}
for fn in passes.values():  # warm-up: kernels, allocator, the writer's processes
    fn()
timed: dict[str, list[list[float]]] = {k: [] for k in passes}
for r in range(args.rounds):
    for label, fn in (reversed(passes.items()) if r % 2 else passes.items()):
        t = fn().times
        timed[label].append([round(b - a, 6) for a, b in zip(t[:-1], t[1:], strict=True)])  # per forward, then the end
        print(label, r, f"{t[-1] - t[0]:.3f} s", flush=True)

pass_s = {label: [sum(run) for run in runs] for label, runs in timed.items()}
base = statistics.median(pass_s["forward"])
summary = {}
for label, runs in timed.items():
    low, high = overhead_interval(pass_s[label], pass_s["forward"])
    summary[label] = {
        "pass_s": round(statistics.median(pass_s[label]), 4),
        "over_forward_pct": round(100 * (statistics.median(pass_s[label]) / base - 1), 2),
        "over_forward_95pct": [round(low, 2), round(high, 2)],
        "median_forward_ms": round(1e3 * statistics.median(x for run in runs for x in run[:-1]), 3),
        "end_ms": round(1e3 * statistics.median(run[-1] for run in runs), 2)}
gpu = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None
result = {"model": name, "config": CONFIG, "device": str(model.device), "gpu": gpu, "batch": cfg.batch_size,
          "tokens": sum(len(w.tokens) for w in windows), "rounds": args.rounds,
          "forwards": len(timed["forward"][0]) - 1, "summary": summary, "per_forward_s": timed}
atomic_write_text(out / "recording_parts.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
