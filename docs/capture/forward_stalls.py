"""On a GPU host: what makes single forwards of a capture slow? Run 1207v's host ran the small
Qwen3-Next shape's forward at batch 16 at about 30 ms in some stretches and 42 ms in others, and
in the fast stretches every third forward of the capture (with the trace writer), none of the
forward alone's, took 43-47 ms. This check times every forward of five passes and, per forward,
what could explain such a stall:

- the CPU time of the model's thread (``time.thread_time``): a stall with as much more CPU is
  work on that thread (or the thread running slower); without, waiting;
- the model's thread's involuntary context switches (``/proc/thread-self/status``): another
  task took its CPU;
- Python's garbage collections in the process (``gc.callbacks``): their count and seconds, any
  thread's (a collection holds the interpreter lock the model's thread needs);
- the host's steal time (``/proc/stat``, all CPUs, in clock ticks): the hypervisor ran others.

Passes, in rounds in turn, every other one reversed (as the bench runs them): ``forward``,
``recording`` (rows dropped), ``capture`` (the capture's defaults), ``capture, pinned`` (the
model's thread on a CPU of its own and the writer's threads and processes on the others:
moe-capture's ``pin_threads``), ``capture, gc frozen`` (``gc.freeze()`` for the pass: the
collections skip every object made before it, the model's included).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/forward_stalls.py [ROUNDS] [TOKENS]``
(writes DIR/forward_stalls.json; ``DEVICE=cpu`` for a dry run).
"""
import gc
import json
import os
import statistics
import time

import gpu_passes
import torch

from traces.atomic import atomic_write_text
from traces.capture.cores import descendants, isolated

s = gpu_passes.setup("docs/capture/forward_stalls.py", __doc__, rounds=12)
TICK = os.sysconf("SC_CLK_TCK")


class Collections:
    """Seconds and count of the garbage collections so far (every thread's)."""

    def __init__(self):
        self.seconds, self.count, self._start = 0.0, 0, None
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.count += 1
            self._start = None


COLLECTIONS = Collections()


def _switches() -> int:
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def _steal() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


class Probes(gpu_passes.Marks):
    """Marks, and at each mark the model's thread's CPU, its involuntary switches, the
    collections so far and the host's steal ticks."""

    def __init__(self):
        super().__init__()
        self.rows = [self._sample()]

    @staticmethod
    def _sample():
        return (time.thread_time(), _switches(), COLLECTIONS.count, COLLECTIONS.seconds, _steal())

    def update(self, n=0):
        super().update(n)
        self.rows.append(self._sample())


def probed(run, pinned: bool = False, frozen: bool = False):
    """A pass of gpu_passes with :class:`Probes` as its marks; ``pinned``: within
    ``cores.isolated``; ``frozen``: with ``gc.freeze()`` for its length."""
    def timed():
        original = gpu_passes.Marks
        gpu_passes.Marks = Probes
        if frozen:
            gc.freeze()
        try:
            with isolated(pinned):
                marks = run(s)
        finally:
            gpu_passes.Marks = original
            if frozen:
                gc.unfreeze()
            if pinned:
                _everywhere()
        return marks
    return timed


def _everywhere() -> None:
    """Every thread of this process's descendants (the writer's, kept for the next pass) back on
    every CPU this process may use, as an unpinned pass expects them."""
    allowed = os.sched_getaffinity(0)
    for pid in descendants(os.getpid()):
        try:
            tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for task in tasks:
            try:
                os.sched_setaffinity(task, allowed)
            except OSError:
                pass


passes = {"forward": probed(gpu_passes.forward), "recording": probed(gpu_passes.recording),
          "capture": probed(gpu_passes.capture), "capture, pinned": probed(gpu_passes.capture, pinned=True),
          "capture, gc frozen": probed(gpu_passes.capture, frozen=True)}
samples: dict[str, list] = {k: [] for k in passes}


def keeping(label, fn):
    def run():
        marks = fn()
        samples[label].append(marks.rows)
        return marks
    return run


timed = gpu_passes.timed_rounds({k: keeping(k, fn) for k, fn in passes.items()}, s.args.rounds)
for label in samples:  # drop the untimed first pass
    samples[label] = samples[label][1:]


def per_forward(label):
    """Per forward of every round but each pass's first (the capture's includes the writer's open
    in its samples): (wall s, thread CPU s, switches, collections, gc s, steal ticks)."""
    return gpu_passes.probe_deltas(timed[label], samples[label])


fast = statistics.quantiles([f[0] for f in per_forward("forward")], n=4)[0]  # the forward alone's first quartile
summary = gpu_passes.summarise(timed, (("capture", "capture, pinned"), ("capture", "capture, gc frozen")))
for label in timed:
    rows = per_forward(label)
    slow = [r for r in rows if r[0] > 1.25 * fast]
    rest = [r for r in rows if r[0] <= 1.25 * fast]

    def mean(rs, i, scale=1.0, digits=6):
        return round(scale * statistics.mean(r[i] for r in rs), digits) if rs else None

    summary[label].update({
        "forwards": len(rows),
        "slow_forwards (over 1.25x the forward alone's first quartile)": len(slow),
        "per forward, slow / others: wall ms": [mean(slow, 0, 1e3, 2), mean(rest, 0, 1e3, 2)],
        "thread CPU ms": [mean(slow, 1, 1e3, 2), mean(rest, 1, 1e3, 2)],
        "involuntary switches": [mean(slow, 2), mean(rest, 2)],
        "collections": [mean(slow, 3), mean(rest, 3)],
        "collection ms": [mean(slow, 4, 1e3, 3), mean(rest, 4, 1e3, 3)],
        "steal ms (all CPUs)": [mean(slow, 5, 1e3 / TICK, 2), mean(rest, 5, 1e3 / TICK, 2)]})
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "cpus": len(os.sched_getaffinity(0)), "batch": s.cfg.batch_size,
          "tokens": sum(len(w.tokens) for w in s.windows), "rounds": s.args.rounds,
          "summary": summary, "per_forward": {label: per_forward(label) for label in timed},
          "per_forward_s": timed}
atomic_write_text(s.out / "forward_stalls.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
