"""On a GPU host: is the capture's overhead on the model's thread work, a slower CPU, or waiting?

Run 1207w found the small Qwen3-Next shape's forward at batch 16 taking as much of its thread's
CPU as of the wall clock, with recording and with the writer too. But by the CUDA runtime's
default a thread that waits for the device spins, and spinning is CPU time: the forward waits for
its stream several times a forward (``nonzero``, ``item``), so "thread CPU = wall" cannot tell
work from waiting. This check tells them apart, per forward of the bench's three passes (the
forward alone, recording with the rows dropped, the capture's defaults):

- ``SYNC=blocking`` makes the device's primary context block on a wait (the driver's
  ``CU_CTX_SCHED_BLOCKING_SYNC``, set before torch makes the context): a thread waiting for the
  device then sleeps, so wall - thread CPU is the waiting (for the device, or for the
  interpreter lock) and thread CPU is work. ``SYNC=spin`` (the default): as moe-capture runs.
- The thread's hardware counters (``perf_event_open``, user mode; null where the host refuses
  them): instructions (how much work) and cycles (at what clock: cycles per CPU second; and
  instructions per cycle: how fast that work runs).

So if the writer beside the forward slows the thread through its CPU (a lower clock, shared
caches), the capture's instructions per forward equal the recording's and its cycles or CPU time
grow; if the recording costs device waits, its wall - CPU grows under ``SYNC=blocking``.

From the repository root: ``OUT=DIR SYNC=blocking PYTHONPATH=. python docs/capture/thread_counters.py [ROUNDS] [TOKENS]``
(writes DIR/thread_counters_<SYNC>.json; ``DEVICE=cpu`` for a dry run).
"""
import ctypes
import json
import os
import statistics
import threading
import time

SYNC = os.environ.get("SYNC", "spin")
if SYNC not in ("spin", "blocking"):
    raise SystemExit(f"SYNC={SYNC}: give spin or blocking")


def blocking_sync() -> dict:
    """Set the primary context of device 0 to block on waits, before anything makes it."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    rc = [cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), 0),
          cuda.cuDevicePrimaryCtxSetFlags_v2(dev, 0x04),  # CU_CTX_SCHED_BLOCKING_SYNC
          cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))]
    return {"driver_rc": rc, "flags": flags.value}


context = blocking_sync() if SYNC == "blocking" and os.environ.get("DEVICE", "auto") != "cpu" else None

import gpu_passes  # noqa: E402 - after the context's flags
import torch  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402

s = gpu_passes.setup("docs/capture/thread_counters.py", __doc__, rounds=8)

# perf_event_open(2): PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES / _INSTRUCTIONS, this thread
_LIBC = ctypes.CDLL(None, use_errno=True)
_PERF_EVENT_OPEN = 298  # x86-64


def _counter(config: int, tid: int) -> tuple[int | None, str]:
    attr = (ctypes.c_uint64 * 16)()  # 128 zeroed bytes; the first 64 are perf_event_attr VER0
    ctypes.cast(attr, ctypes.POINTER(ctypes.c_uint32))[0] = 0  # type: hardware
    ctypes.cast(attr, ctypes.POINTER(ctypes.c_uint32))[1] = 64  # size
    attr[1] = config
    for flags, mode in (((1 << 6), "user+kernel"), ((1 << 5) | (1 << 6), "user")):  # exclude_hv; exclude_kernel
        attr[5] = flags
        fd = _LIBC.syscall(_PERF_EVENT_OPEN, attr, tid, -1, -1, 0)
        if fd >= 0:
            return fd, mode
    return None, f"refused (errno {ctypes.get_errno()})"


TID = threading.get_native_id()
COUNTERS = {name: _counter(config, TID) for name, config in (("cycles", 0), ("instructions", 1))}


def _read(fd: int | None) -> int:
    return int.from_bytes(os.read(fd, 8), "little") if fd is not None else 0


class Probes(gpu_passes.Marks):
    """Marks, and at each mark the thread's CPU time, cycles and instructions."""

    def __init__(self):
        super().__init__()
        self.rows = [self._sample()]

    @staticmethod
    def _sample():
        return (time.thread_time(), _read(COUNTERS["cycles"][0]), _read(COUNTERS["instructions"][0]))

    def update(self, n=0):
        super().update(n)
        self.rows.append(self._sample())


samples: dict[str, list] = {}


def probed(label, run):
    samples[label] = []

    def timed():
        original = gpu_passes.Marks
        gpu_passes.Marks = Probes
        try:
            marks = run(s)
        finally:
            gpu_passes.Marks = original
        samples[label].append(marks.rows)
        return marks
    return timed


passes = {"forward": probed("forward", gpu_passes.forward), "recording": probed("recording", gpu_passes.recording),
          "capture": probed("capture", gpu_passes.capture)}
timed = gpu_passes.timed_rounds(passes, s.args.rounds)
for label in samples:  # drop the untimed first pass
    samples[label] = samples[label][1:]


def per_forward(label):
    """Per forward (each pass's first left out): (wall s, thread CPU s, cycles, instructions)."""
    return gpu_passes.probe_deltas(timed[label], samples[label])


summary = gpu_passes.summarise(timed)
for label in timed:
    rows = per_forward(label)

    def med(i, scale=1.0, digits=3, rows=rows):
        return round(scale * statistics.median(r[i] for r in rows), digits)

    cpu = [r[1] for r in rows]
    summary[label].update({
        "forwards": len(rows),
        "wall ms per forward": med(0, 1e3),
        "thread CPU ms per forward": med(1, 1e3),
        "wall - CPU ms per forward (median of each forward's)": round(
            1e3 * statistics.median(r[0] - r[1] for r in rows), 3),
        "M cycles per forward": med(2, 1e-6),
        "M instructions per forward": med(3, 1e-6),
        "GHz (cycles per thread CPU second)": round(
            statistics.median(r[2] / r[1] for r in rows if r[1] > 0) * 1e-9, 3)
        if COUNTERS["cycles"][0] is not None and sum(cpu) else None,
        "instructions per cycle": round(statistics.median(r[3] / r[2] for r in rows if r[2]), 3)
        if COUNTERS["cycles"][0] is not None else None})
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "sync": SYNC, "context": context, "counters": {k: v[1] for k, v in COUNTERS.items()},
          "cpus": len(os.sched_getaffinity(0)), "batch": s.cfg.batch_size,
          "tokens": sum(len(w.tokens) for w in s.windows), "rounds": s.args.rounds,
          "summary": summary, "per_forward": {label: per_forward(label) for label in timed},
          "per_forward_s": timed}
atomic_write_text(s.out / f"thread_counters_{SYNC}.json", json.dumps(result) + "\n")
print(json.dumps({"sync": SYNC, "context": context, "counters": result["counters"], "summary": summary}, indent=1))
