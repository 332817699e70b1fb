"""On a GPU host: why do passes of the same forward take different times? The small Qwen3-Next
shape's forward alone, pass after pass (teacher-forced, rows not recorded), first with the
model's thread free to move, then pinned to one CPU (``pin_threads``): per pass its wall time,
the thread's CPU time, and the CPUs the thread was seen on (sampled every 10 ms).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/pass_drift.py [PASSES] [TOKENS]``
(writes DIR/pass_drift.json). Result: docs/capture/pass_drift_*.json (docs/CAPTURE.md).
"""
import argparse
import collections
import json
import os
import threading
import time
from pathlib import Path

import torch

from traces.atomic import atomic_write_text
from traces.capture.bench import _forward_only
from traces.capture.config import ModelConfig
from traces.capture.cores import isolated
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents

CONFIG = "traces/fixtures/shapes/qwen3_next_small.json"
p = argparse.ArgumentParser(prog="docs/capture/pass_drift.py", description=__doc__.split("\n\n")[0])
p.add_argument("passes", nargs="?", type=int, default=12, help="timed passes each way")
p.add_argument("tokens", nargs="?", type=int, default=131072, help="input tokens per pass")
args = p.parse_args()
if min(args.passes, args.tokens) < 1:
    p.error(f"passes={args.passes}, tokens={args.tokens}: both must be at least 1")
passes, tokens = args.passes, args.tokens
out = Path(os.environ.get("OUT", "/tmp/pass_drift"))
out.mkdir(parents=True, exist_ok=True)
model, tokenizer, sites, name = load_model(ModelConfig(config=CONFIG, tokenizer="traces/fixtures/model"))
windows, _ = make_windows(read_documents(["docs", "traces", "simulator"]), tokenizer, 512, max_tokens=tokens)


def cpu_of(tid: int) -> int:
    """The CPU the thread last ran on (field 39 of its stat line)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


def run(label: str) -> list[dict]:
    tid = threading.get_native_id()
    rows = []
    _forward_only(model, windows, 16)  # warm
    for _ in range(passes):
        seen: collections.Counter = collections.Counter()
        done = threading.Event()

        def sample(seen=seen, done=done):
            while not done.wait(0.01):
                seen[cpu_of(tid)] += 1

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start, cpu = time.perf_counter(), time.thread_time()
        _forward_only(model, windows, 16)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        done.set()
        sampler.join()
        rows.append({"wall_s": round(wall, 3), "thread_cpu_s": round(cpu, 3), "cpus_seen": dict(seen.most_common())})
        print(label, rows[-1], flush=True)
    return rows


gpu = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None
result = {"model": name, "config": CONFIG, "device": str(model.device), "gpu": gpu, "batch": 16,
          "tokens": sum(len(w.tokens) for w in windows), "free": run("free")}
with isolated(True) as cpu:
    result["pinned"] = run(f"pinned to CPU {cpu}")
    result["pinned_cpu"] = cpu
atomic_write_text(out / "pass_drift.json", json.dumps(result, indent=2) + "\n")
