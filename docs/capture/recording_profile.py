"""On a GPU host: the passes a sampling profiler watches, to place the recording's CPU on the model's thread.

Run 1207aa found the recording costing the thread that drives the small Qwen3-Next shape's
forward at batch 16 about 1.4 ms of CPU a forward, and run 1205u's timers (recording_host_time.py)
left about 0.5 ms of that in no segment they timed. This script only runs the passes: the forward
alone, recording (rows dropped) and capture (the default writer), in rounds, every other one
reversed (gpu_passes.timed_rounds), each pass in a function of its own name so that a profiler's
stacks tell them apart. ``profile_split.py`` then reads py-spy's raw output.

From the repository root, under py-spy (which samples every thread, native frames too)::

    py-spy record -r 1000 --threads --native -f raw -o DIR/profile.txt -- \\
        env OUT=DIR PYTHONPATH=.:docs/capture python docs/capture/recording_profile.py [ROUNDS] [TOKENS]

(``DEVICE=cpu`` for a dry run). Writes DIR/recording_profile.json: the passes' times, so that the
profile's samples can be set against them.
"""
import json
import os
import time

import gpu_passes
import torch

from traces.atomic import atomic_write_text

s = gpu_passes.setup("docs/capture/recording_profile.py", __doc__, rounds=4)


def pass_forward_alone():
    return gpu_passes.forward(s)


def pass_recording():
    return gpu_passes.recording(s)


def pass_capture():
    return gpu_passes.capture(s)


start = time.perf_counter()
timed = gpu_passes.timed_rounds({"forward": pass_forward_alone, "recording": pass_recording,
                                 "capture": pass_capture}, s.args.rounds)
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "cpus": len(os.sched_getaffinity(0)), "tokens": sum(len(w.tokens) for w in s.windows),
          "rounds": s.args.rounds, "timed_s": round(time.perf_counter() - start, 1),
          "summary": gpu_passes.summarise(timed), "per_forward_s": timed}
atomic_write_text(s.out / "recording_profile.json", json.dumps(result) + "\n")
print(json.dumps(result["summary"], indent=1))
