"""What recording adds to a forward in operator launches: the top-level aten ops of one forward
alone and of the same forward recorded (router hooks, top-R selection, NLL, the copies; rows
dropped), counted with the torch profiler on the CPU. A randomly initialised model from a
config, the fixture's tokenizer, B windows of S random tokens.

From the repository root: ``PYTHONPATH=. python docs/capture/recording_ops.py [CONFIG] [B] [S]``
(default: the small Qwen3-Next shape, 2 windows of 64 tokens). Results: docs/CAPTURE.md, run w.
"""
import argparse
import collections
import sys

import numpy as np
from torch.profiler import ProfilerActivity, profile

from traces.capture.bench import _forward_only
from traces.capture.capture import capture_windows
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.model import load_model
from traces.capture.text import Window
from traces.errors import InputError

p = argparse.ArgumentParser(prog="docs/capture/recording_ops.py", description=__doc__.split("\n\n")[0])
p.add_argument("config", nargs="?", default="traces/fixtures/shapes/qwen3_next_small.json",
               help="config.json of the model to initialise randomly")
p.add_argument("B", nargs="?", type=int, default=2, help="windows per forward")
p.add_argument("S", nargs="?", type=int, default=64, help="tokens per window")
args = p.parse_args()
if min(args.B, args.S) < 1:
    p.error(f"B={args.B}, S={args.S}: windows and tokens per window must be at least 1")
config, B, S = args.config, args.B, args.S
try:
    model, _, sites, _ = load_model(ModelConfig(config=config, tokenizer="traces/fixtures/model", dtype="float32",
                                                device="cpu"))
except InputError as e:
    sys.exit(f"recording_ops.py: {e}")
windows = [Window(seq=i, domain=0, tokens=np.random.default_rng(i).integers(1, 4000, S), source="random")
           for i in range(B)]
cfg = CaptureConfig()
cfg.batch_size = B


def forward():
    _forward_only(model, windows, B)


def recorded():
    capture_windows(model, sites, windows, cfg, lambda rows: None)


def top_level_ops(fn) -> collections.Counter:
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


alone, with_recording = top_level_ops(forward), top_level_ops(recorded)
added = with_recording - alone
print(f"{config}, {B} x {S} tokens: top-level aten ops per forward {sum(alone.values())}, recorded "
      f"{sum(with_recording.values())}, added {sum(added.values())}:")
print(", ".join(f"{name} {n}" for name, n in added.most_common()))
