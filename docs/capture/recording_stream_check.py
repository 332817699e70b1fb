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
import sys
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from same_bytes import equal, generating, hashes, load, out_dir  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402
from traces.capture.capture import capture_windows  # noqa: E402

out = out_dir("/tmp/recording_stream_check")
setup = load(int(os.environ.get("TOKENS", 65536)))
base, model, sites, windows, probs = setup.base, setup.model, setup.sites, setup.windows, setup.probs
runs = {"side": {"recording_stream": "side"}, "main": {"recording_stream": "main"},
        "side_again": {"recording_stream": "side"}}
found = {"teacher_forced": hashes(setup, base, runs), "generate": hashes(setup, generating(base), runs, windows[:32])}


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
    "hashes": found,
    "equal": {mode: equal(runs) for mode, runs in found.items()},
    "profile": {stream: profiled(stream) for stream in ("main", "side")} if torch.cuda.is_available() else None,
}
print(json.dumps(result, indent=2))
atomic_write_text(out / "recording_stream_check.json", json.dumps(result, indent=2) + "\n")
