"""On a GPU host: does the model alone run faster on a stream of a higher priority? The bench's
forward-only pass (the model on the default stream) against the same forwards inside
``traces.capture.capture.model_stream`` (``recording_stream=side_low``'s stream), in alternating
rounds. If the priority alone sped the forward up, ``side_low``'s capture would be compared with
a slower forward than its own; with nothing else on the device it should not.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/stream_priority_check.py [ROUNDS] [TOKENS]``
(writes DIR/stream_priority_check.json).
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from traces.atomic import atomic_write_text
from traces.capture.bench import _forward_only, overhead_interval
from traces.capture.capture import model_stream
from traces.capture.config import ModelConfig
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents

CONFIG = "traces/fixtures/shapes/qwen3_next_small.json"
p = argparse.ArgumentParser(prog="docs/capture/stream_priority_check.py", description=__doc__.split("\n\n")[0])
p.add_argument("rounds", nargs="?", type=int, default=8)
p.add_argument("tokens", nargs="?", type=int, default=524288, help="input tokens per pass")
p.add_argument("--batch", type=int, default=16)
args = p.parse_args()
out = Path(os.environ.get("OUT", "/tmp/stream_priority_check"))
out.mkdir(parents=True, exist_ok=True)
model, tokenizer, sites, name = load_model(ModelConfig(config=CONFIG, tokenizer="traces/fixtures/model",
                                                       device=os.environ.get("DEVICE", "auto")))
windows, _ = make_windows(read_documents(["docs", "README.md", "traces", "simulator", "analysis", "tests", "conf"]),
                          tokenizer, 512, max_tokens=args.tokens)


def timed(high: bool) -> float:
    start = time.perf_counter()
    with model_stream(model.device, high):
        _forward_only(model, windows, args.batch)
    return time.perf_counter() - start


times = {"default": [], "high": []}
timed(False), timed(True)  # warm-up
for r in range(args.rounds):
    for label in (("high", "default") if r % 2 else ("default", "high")):
        times[label].append(timed(label == "high"))
        print(label, r, f"{times[label][-1]:.3f} s", flush=True)
low, high = overhead_interval(times["high"], times["default"])
result = {"model": name, "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
          "batch": args.batch, "tokens": sum(len(w.tokens) for w in windows), "rounds": args.rounds,
          "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
          "high_over_default_pct": round(100 * (statistics.median(times["high"]) / statistics.median(times["default"]) - 1), 2),
          "high_over_default_95pct": [low, high], "pass_s": times}
atomic_write_text(out / "stream_priority_check.json", json.dumps(result) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "pass_s"}, indent=1))
