"""On a GPU host: does the drain thread's wait for each block's copies slow the model's thread?

The drain thread waits on a CUDA event once a block (at batch 16, once a forward) until the
block's copies reach the host. By default the CUDA runtime spins on a CPU core for such waits,
in calls into the driver while the model's thread launches the next forward's kernels through it.
An event created with ``cudaEventBlockingSync`` makes the thread sleep until the device signals
instead (``traces.capture.capture.DRAIN_BLOCKING_WAIT``). Five passes in each round, timed forward
by forward, every other round reversed (as the bench runs them):

1. ``forward``: the model alone;
2. ``recording``: moe-capture's loop with the rows dropped, the drain spinning (the default);
3. ``recording, blocking wait``: the same with the drain sleeping;
4. ``capture``: with the trace writer (its open left out, its close in), the drain spinning;
5. ``capture, blocking wait``: the same with the drain sleeping.

Reports each pass against the forward and, round by round, each blocking pass against its
spinning one (median ratio, rounds faster, 95 % interval; ``gpu_passes.summarise``).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/drain_wait.py [ROUNDS] [TOKENS]``
(writes DIR/drain_wait.json; ``DEVICE=cpu`` for a dry run: no events there, so both ways are one).
"""
import json
import os

import gpu_passes
import torch

from traces.atomic import atomic_write_text
from traces.capture import capture as capture_module

if not hasattr(capture_module, "DRAIN_BLOCKING_WAIT"):
    raise SystemExit("drain_wait.py needs the tree of 810f31f (DRAIN_BLOCKING_WAIT was taken out after run 1207v)")
s = gpu_passes.setup("docs/capture/drain_wait.py", __doc__, rounds=12)


def waiting(blocking: bool, run):
    """``run`` (a pass of gpu_passes) with the drain's wait set to ``blocking`` for its length."""
    def timed():
        before = capture_module.DRAIN_BLOCKING_WAIT
        capture_module.DRAIN_BLOCKING_WAIT = blocking
        try:
            return run(s)
        finally:
            capture_module.DRAIN_BLOCKING_WAIT = before
    return timed


passes = {"forward": lambda: gpu_passes.forward(s),
          "recording": waiting(False, gpu_passes.recording),
          "recording, blocking wait": waiting(True, gpu_passes.recording),
          "capture": waiting(False, gpu_passes.capture),
          "capture, blocking wait": waiting(True, gpu_passes.capture)}
timed = gpu_passes.timed_rounds(passes, s.args.rounds)
summary = gpu_passes.summarise(timed, (("recording", "recording, blocking wait"),
                                       ("capture", "capture, blocking wait")))
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "cpus": len(os.sched_getaffinity(0)), "batch": s.cfg.batch_size,
          "tokens": sum(len(w.tokens) for w in s.windows), "rounds": s.args.rounds,
          "forwards": len(timed["forward"][0]) - 1, "summary": summary, "per_forward_s": timed}
atomic_write_text(s.out / "drain_wait.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
