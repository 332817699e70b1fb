"""Capture overhead: tokens/s of the same teacher-forced forwards with and without recording.

Three variants over the same windows and batches: ``forward`` (the model alone), ``hooks``
(router hooks, NLL, copies to the host; rows discarded) and ``capture`` (hooks plus the trace
writer, file closed). Each is timed ``repeats`` times after one warm-up pass; the median counts.

    python -m traces.capture.bench --model traces/fixtures/model --input capture.jsonl --out bench.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from traces.capture.capture import batches, build_meta, capture_windows, open_writer, right_padded
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_only(model, windows, batch_size: int) -> None:
    with torch.inference_mode():
        for batch in batches(windows, batch_size):
            _, _, input_ids, mask = right_padded(batch, model.device)
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    _sync(model.device)


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: kernels, allocator, first writer
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_overhead(model, sites, windows, name: str, domains: list[str], batch_size: int,
                     logits: str = "full", repeats: int = 3) -> dict:
    """Tokens/s of forward, hooks and capture for one batch size; overheads in % of forward time."""
    tokens = sum(len(w.tokens) for w in windows)
    cfg = CaptureConfig(batch_size=batch_size, logits=logits)
    probs = router_returns_probabilities(model, sites)

    def hooks() -> None:
        capture_windows(model, sites, windows, cfg, lambda rows: None, logits_are_probs=probs)

    def capture() -> None:
        meta = build_meta(model, sites, name, domains, logits, {}, probs)
        with tempfile.TemporaryDirectory() as tmp, open_writer(Path(tmp) / "bench.parquet", meta) as w:
            capture_windows(model, sites, windows, cfg, lambda rows: w.write(**rows.columns()),
                            logits_are_probs=probs)

    t_fwd = _timed(lambda: _forward_only(model, windows, batch_size), repeats)
    t_hooks = _timed(hooks, repeats)
    t_cap = _timed(capture, repeats)
    return {
        "logits": logits,
        "batch_size": batch_size,
        "tokens": tokens,
        "forward_tokens_per_s": round(tokens / t_fwd),
        "hooks_tokens_per_s": round(tokens / t_hooks),
        "capture_tokens_per_s": round(tokens / t_cap),
        "hooks_overhead_pct": round(100 * (t_hooks / t_fwd - 1), 1),
        "capture_overhead_pct": round(100 * (t_cap / t_fwd - 1), 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--config", help="config.json of a randomly initialised model")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--input", nargs="+", required=True, help="text files, folders or JSONL")
    p.add_argument("--tokens", type=int, default=20480, help="input tokens per measured pass")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--logits", default="full,none", help="logits storages to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    mcfg = ModelConfig(path=args.model, config=args.config, tokenizer=args.tokenizer, dtype=args.dtype)
    model, tokenizer, sites, name = load_model(mcfg)
    docs = read_documents(args.input)
    windows, domains = make_windows(docs, tokenizer, args.window, max_tokens=args.tokens)
    results = {"model": name, "device": str(model.device),
               "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
               "layers": len(sites), "experts": sites[0].num_experts, "top_k": sites[0].top_k,
               "parameters": sum(p.numel() for p in model.parameters()), "runs": []}
    for logits in args.logits.split(","):
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            r = measure_overhead(model, sites, windows, name, domains, bs, logits, args.repeats)
            results["runs"].append(r)
            print(f"{name} logits={logits} batch {bs}: forward {r['forward_tokens_per_s']} tok/s, "
                  f"hooks {r['hooks_tokens_per_s']} ({r['hooks_overhead_pct']:+.1f} %), "
                  f"capture {r['capture_tokens_per_s']} ({r['capture_overhead_pct']:+.1f} %)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
