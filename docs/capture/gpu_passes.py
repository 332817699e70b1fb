"""What the GPU-host checks in this folder share (forward_times.py, recording_parts.py): the small
Qwen3-Next shape over the repository's text, the capture bench's passes timed forward by forward,
and rounds in turn, every other one reversed, as the bench runs them."""
import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from traces.capture.bench import _sync, overhead_interval
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


class Setup(NamedTuple):
    args: argparse.Namespace
    out: Path  # $OUT
    model: object
    sites: list
    name: str
    windows: list
    domains: list
    cfg: CaptureConfig  # the capture's defaults at --batch, rows shared on a GPU
    probs: bool  # the routers return probabilities


def setup(prog: str, doc: str, rounds: int) -> Setup:
    """Parse ``[ROUNDS] [TOKENS] [--batch B]``, load the model (``DEVICE``, default auto) and cut the text."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("rounds", nargs="?", type=int, default=rounds)
    p.add_argument("tokens", nargs="?", type=int, default=524288, help="input tokens per pass")
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    if min(args.rounds, args.tokens, args.batch) < 1:
        p.error(f"rounds={args.rounds}, tokens={args.tokens}, batch={args.batch}: each must be at least 1")
    out = Path(os.environ.get("OUT", f"/tmp/{Path(prog).stem}"))
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, sites, name = load_model(ModelConfig(config=CONFIG, tokenizer="traces/fixtures/model",
                                                           device=os.environ.get("DEVICE", "auto")))
    windows, domains = make_windows(read_documents(["docs", "README.md", "traces", "simulator", "analysis",
                                                    "tests", "conf"]), tokenizer, 512, max_tokens=args.tokens)
    cfg = replace(CaptureConfig(), batch_size=args.batch, shared_rows=model.device.type == "cuda")
    return Setup(args, out, model, sites, name, windows, domains, cfg, router_returns_probabilities(model, sites))


class Marks:
    """A progress bar's ``update`` that keeps the time of each call (one per forward)."""

    def __init__(self):
        self.times = [time.perf_counter()]

    def update(self, n=0):
        self.times.append(time.perf_counter())


def forward(s: Setup) -> Marks:
    """The bench's first pass: the model alone."""
    marks = Marks()
    with torch.inference_mode():
        for batch in batches(s.windows, s.cfg.batch_size):
            _, _, input_ids, mask = right_padded(batch, s.model.device)
            s.model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            marks.update()
    _sync(s.model.device)
    marks.times.append(time.perf_counter())
    return marks


def recording(s: Setup) -> Marks:
    """The bench's second pass: moe-capture's loop with the rows dropped."""
    marks = Marks()
    capture_windows(s.model, s.sites, s.windows, s.cfg, lambda rows: None, progress=marks, logits_are_probs=s.probs)
    marks.times.append(time.perf_counter())
    return marks


def capture(s: Setup) -> Marks:
    """The bench's third pass: and the trace writer (its open left out, as the bench; its close in)."""
    marks = Marks()
    meta = build_meta(s.model, s.sites, s.name, s.domains, s.cfg, {}, s.probs)
    with tempfile.TemporaryDirectory() as tmp:
        with open_writer(Path(tmp) / "bench.parquet", meta, s.cfg.writers, s.cfg.writer, s.cfg.unit_tokens,
                         batch_tokens(s.cfg), sum(len(x.tokens) for x in s.windows)) as w:
            marks.times[0] = time.perf_counter()
            capture_windows(s.model, s.sites, s.windows, s.cfg, lambda rows: w.write(**rows.columns()),
                            progress=marks, logits_are_probs=s.probs, block=w.block if s.cfg.shared_rows else None)
        marks.times.append(time.perf_counter())  # the file closed
    return marks


def timed_rounds(passes: dict, rounds: int) -> dict[str, list[list[float]]]:
    """Each pass (``label -> () -> Marks``) once untimed (kernels, allocator, the writer's
    processes), then ``rounds`` rounds, every other one reversed: per pass and round the seconds of
    each forward (from one hand-off to the next), then of the pass's end."""
    for fn in passes.values():
        fn()
    timed: dict[str, list[list[float]]] = {k: [] for k in passes}
    for r in range(rounds):
        for label, fn in (reversed(passes.items()) if r % 2 else passes.items()):
            t = fn().times
            timed[label].append([round(b - a, 6) for a, b in zip(t[:-1], t[1:], strict=True)])
            print(label, r, f"{t[-1] - t[0]:.3f} s", flush=True)
    return timed


def probe_deltas(walls: list[list[float]], samples: list[list[tuple]]) -> list[tuple]:
    """Per forward of every round but each pass's first (the capture's includes the writer's
    open): its wall seconds, then the change of each field of the probe's samples over it
    (``walls``: :func:`timed_rounds`' runs of one pass; ``samples``: per run, one tuple at each
    mark)."""
    out = []
    for run, rows in zip(walls, samples, strict=True):
        for i, wall in enumerate(run[1:-1], start=1):
            out.append((wall, *(b - a for a, b in zip(rows[i], rows[i + 1], strict=True))))
    return out


def summarise(timed: dict[str, list[list[float]]], pairs: tuple[tuple[str, str], ...] = ()) -> dict:
    """What :func:`timed_rounds` measured, per pass: its median length, its overhead over the
    ``forward`` pass (the ratio of the medians, with a 95 % bootstrap interval over the rounds),
    its median forward and its median end; and per ``(old, new)`` in ``pairs``, ``new`` against
    ``old`` round by round (the median ratio, the rounds it was faster in, a 95 % interval)."""
    pass_s = {label: [sum(run) for run in runs] for label, runs in timed.items()}
    base = statistics.median(pass_s["forward"])
    out = {}
    for label, runs in timed.items():
        out[label] = {"pass_s": round(statistics.median(pass_s[label]), 4),
                      "over_forward_pct": round(100 * (statistics.median(pass_s[label]) / base - 1), 2),
                      "over_forward_95pct": overhead_interval(pass_s[label], pass_s["forward"]),
                      "median_forward_ms": round(1e3 * statistics.median(x for run in runs for x in run[:-1]), 3),
                      "end_ms": round(1e3 * statistics.median(run[-1] for run in runs), 2)}
    for old, new in pairs:
        ratios = [b / a for a, b in zip(pass_s[old], pass_s[new], strict=True)]
        out[f"{new} against {old}, round by round"] = {
            "median_ratio": round(statistics.median(ratios), 4), "faster_rounds": sum(r < 1 for r in ratios),
            "rounds": len(ratios), "median_pct_95pct": overhead_interval(pass_s[new], pass_s[old], by_round=True)}
    return out
