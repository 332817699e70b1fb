"""On a GPU host: does a capture whose recording runs on a side stream (``recording_stream=side``,
the default) store what the model's own stream stores (``main``)? One model load (the small
Qwen3-Next shape), the same windows captured teacher-forced at batch 16 and generated at batch 8,
each with side, main and side again; the content hashes of the files. Then, per stream, one
profiled teacher-forced pass: the device time of the kernels on each stream and the host calls
that wait for the device.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/recording_stream_check.py``
(writes DIR/recording_stream_check.json). Result: docs/capture/recording_stream_check_*.json
(docs/CAPTURE.md).
"""
import collections
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from traces.atomic import atomic_write_text
from traces.capture.capture import batch_tokens, build_meta, capture_windows, open_writer
from traces.capture.config import CaptureConfig, GenerateConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents
from traces.format import recorded_content_hash

out = Path(os.environ.get("OUT", "/tmp/recording_stream_check"))
out.mkdir(parents=True, exist_ok=True)
base = CaptureConfig(model=ModelConfig(config="traces/fixtures/shapes/qwen3_next_small.json",
                                       tokenizer="traces/fixtures/model"), batch_size=16)
model, tokenizer, sites, name = load_model(base.model)
windows, domains = make_windows(read_documents(["docs", "traces", "simulator"]), tokenizer, 512,
                                max_tokens=int(os.environ.get("TOKENS", 65536)))
probs = router_returns_probabilities(model, sites)
configs = {"teacher_forced": base,
           "generate": replace(base, mode="generate", batch_size=8,
                               generate=GenerateConfig(prompt_tokens=64, new_tokens=32))}
hashes: dict = {}
with tempfile.TemporaryDirectory() as tmp:
    for mode, cfg in configs.items():
        for run, stream in (("side", "side"), ("main", "main"), ("side_again", "side")):
            c = replace(cfg, recording_stream=stream)
            meta = build_meta(model, sites, name, domains, c, {}, probs)
            path = Path(tmp) / f"{mode}_{run}.parquet"
            with open_writer(path, meta, batch_tokens=batch_tokens(c)) as w:
                stats = capture_windows(model, sites, windows if mode == "teacher_forced" else windows[:32], c,
                                        lambda rows: w.write(**rows.columns()), logits_are_probs=probs,
                                        block=w.block)
            hashes.setdefault(mode, {})[run] = {"hash": recorded_content_hash(path), "tokens": stats["tokens"]}


def profiled(stream: str) -> dict:
    """Device ms per stream and the host's waiting calls in one teacher-forced pass (rows dropped)."""
    cfg = replace(base, recording_stream=stream)
    capture_windows(model, sites, windows, cfg, lambda rows: None, logits_are_probs=probs)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        capture_windows(model, sites, windows, cfg, lambda rows: None, logits_are_probs=probs)
        torch.cuda.synchronize()

    per_stream: dict = collections.defaultdict(float)
    waits: dict = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":  # a kernel or copy: its resource is the stream
            stream_id = e.device_resource_id if e.device_resource_id is not None else e.thread
            per_stream[f"stream {stream_id}"] += e.time_range.elapsed_us() / 1e3
        elif any(w in e.name for w in ("Synchronize", "cudaMemcpy", "item", "nonzero")):
            waits[e.name] += 1
    return {"device_ms": {k: round(v, 2) for k, v in sorted(per_stream.items())}, "host_waits": dict(waits),
            "forwards": len(windows) // base.batch_size}


result = {
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "hashes": hashes,
    "equal": {mode: len({h["hash"] for h in runs.values()}) == 1 for mode, runs in hashes.items()},
    "profile": {stream: profiled(stream) for stream in ("main", "side")} if torch.cuda.is_available() else None,
}
print(json.dumps(result, indent=2))
atomic_write_text(out / "recording_stream_check.json", json.dumps(result, indent=2) + "\n")
