"""On a GPU host: where in a pass does the capture lose its time? The capture bench's three
passes (the forward alone, recording with the rows dropped, recording and the trace writer), with
the time of every forward: the loop's host time from one forward's hand-off to the next (the
launch-bound forward's pace), then the pass's end (the device synchronised; for the capture, the
file closed). Rounds in turn, every other one reversed, as the bench runs them.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/forward_times.py [ROUNDS] [TOKENS]``
(writes DIR/forward_times.json; ``DEVICE=cpu`` for a dry run). Result of run 1206c:
docs/capture/forward_times_1206c.json (docs/CAPTURE.md).
"""
import json
import statistics

import gpu_passes
import torch

from traces.atomic import atomic_write_text

s = gpu_passes.setup("docs/capture/forward_times.py", __doc__, rounds=8)
passes = {"forward": lambda: gpu_passes.forward(s), "hooks": lambda: gpu_passes.recording(s),
          "capture": lambda: gpu_passes.capture(s)}
timed = gpu_passes.timed_rounds(passes, s.args.rounds)
n = min(len(v) for runs in timed.values() for v in runs)


def median_at(label, i):
    return statistics.median(run[i] for run in timed[label])


summary = {label: {"pass_s": round(statistics.median(sum(run) for run in timed[label]), 4),
                   "first_forwards_ms": [round(1e3 * median_at(label, i), 2) for i in range(min(8, n - 1))],
                   "median_forward_ms": round(1e3 * statistics.median(x for run in timed[label] for x in run[:-1]), 3),
                   "last_forward_ms": round(1e3 * median_at(label, n - 2), 2),
                   "end_ms": round(1e3 * statistics.median(run[-1] for run in timed[label]), 2)}
           for label in passes}
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "batch": s.cfg.batch_size, "tokens": sum(len(w.tokens) for w in s.windows), "rounds": s.args.rounds,
          "forwards": n - 1, "summary": summary, "per_forward_s": timed}
atomic_write_text(s.out / "forward_times.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
