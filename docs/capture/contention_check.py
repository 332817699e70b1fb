"""On a GPU host: what slows a launch-bound model's forwards when a capture runs beside them?

The capture's work outside the model's thread is of two kinds: Python threads of the capturing
process (the drain, the threads that talk to the encoder processes over pipes), which take the
interpreter lock the model's thread needs for every kernel launch; and the encoder processes,
which take CPU cores, memory bandwidth and caches but no lock. This check times the same
teacher-forced forwards (small Qwen3-Next shape, batch 16) alone and beside each kind of load,
in rounds (one pass of each in turn), so that a host whose speed drifts moves all alike:

- ``forward``: the model alone;
- ``lock_bursts``: a thread of this process that runs ``--bursts`` pure-Python bursts of
  ``--burst-us`` microseconds per second (about the capture's other threads' CPU per pass);
- ``pipe_talk``: a thread of this process that sends a small pickled request to a child process
  and reads its pickled answer, ``--messages`` times per second (the writer's pattern);
- ``busy_processes``: ``--processes`` child processes compressing 1 MiB buffers without pause
  (CPU cores taken, little memory traffic);
- ``memory_processes``: as many child processes copying 512 MiB arrays without pause (memory
  bandwidth and the shared cache taken, as encoders reading rows and writing files take them).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/contention_check.py``
(writes DIR/contention_check.json). Result: docs/capture/contention_check_*.json
(docs/CAPTURE.md).
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from traces.capture.bench import Timed, _by_round, _forward_only, _timed_rounds
from traces.capture.config import ModelConfig
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents

ECHO = ("import pickle,sys\nwhile True:\n    try:\n        r = pickle.load(sys.stdin.buffer)\n    except EOFError:\n"
        "        break\n    pickle.dump(r, sys.stdout.buffer); sys.stdout.buffer.flush()")
BUSY = "import os,zlib\nb=os.urandom(1<<20)\nwhile True:\n    zlib.compress(b, 3)"
STREAM = "import numpy as np\na=np.ones(1<<26)\nb=np.empty_like(a)\nwhile True:\n    np.copyto(b, a)"


class Load:
    """A background load started before a pass and stopped after it."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop


def thread_load(run, stop: threading.Event) -> Load:
    """A load that runs ``run`` in a thread of this process until ``stop`` is set."""
    thread = [None]

    def start():
        stop.clear()
        thread[0] = threading.Thread(target=run, daemon=True)
        thread[0].start()

    def end():
        stop.set()
        thread[0].join()

    return Load(start, end)


def lock_bursts(per_s: int, burst_us: float) -> Load:
    stop = threading.Event()

    def run():
        period, burst = 1.0 / per_s, burst_us * 1e-6
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < burst:  # holds the lock, as Python code does
                pass
            time.sleep(max(period - burst, 0.0))

    return thread_load(run, stop)


def pipe_talk(per_s: int) -> Load:
    child = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stop = threading.Event()
    request = ("unit", [("/dev/shm/x", 1 << 20, [("logits", "<f2", (3206, 8, 64), 0)] * 10)], b"f" * 2048)

    def run():
        period = 1.0 / per_s
        while not stop.is_set():
            t = time.perf_counter()
            pickle.dump(request, child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            child.stdin.flush()
            pickle.load(child.stdout)
            time.sleep(max(period - (time.perf_counter() - t), 0.0))

    return thread_load(run, stop)


def busy_processes(n: int, code: str = BUSY) -> Load:
    procs = []

    def start():
        procs.extend(subprocess.Popen([sys.executable, "-c", code]) for _ in range(n))
        time.sleep(0.5)  # running before the pass starts

    def end():
        for p in procs:
            p.kill()
            p.wait()
        procs.clear()

    return Load(start, end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=262144)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bursts", type=int, default=800)
    p.add_argument("--burst-us", type=float, default=100.0)
    p.add_argument("--messages", type=int, default=700)
    p.add_argument("--processes", type=int, default=4)
    args = p.parse_args()
    model, tokenizer, sites, name = load_model(ModelConfig(config="traces/fixtures/shapes/qwen3_next_small.json",
                                                           tokenizer="traces/fixtures/model"))
    windows, _ = make_windows(read_documents(["docs", "README.md", "traces", "simulator", "analysis", "tests",
                                              "conf"]), tokenizer, 512, max_tokens=args.tokens)
    loads = {"forward": None, "lock_bursts": lock_bursts(args.bursts, args.burst_us),
             "pipe_talk": pipe_talk(args.messages), "busy_processes": busy_processes(args.processes),
             "memory_processes": busy_processes(args.processes, STREAM)}

    def under(load):
        def fn():
            if load is not None:
                load.start()
            try:
                start = time.perf_counter()
                _forward_only(model, windows, args.batch_size)
                return Timed(time.perf_counter() - start, None)  # the load's start and stop not timed
            finally:
                if load is not None:
                    load.stop()
        return fn

    medians, _, rounds, cpu = _timed_rounds({k: under(v) for k, v in loads.items()}, args.repeats)
    result = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpus": os.cpu_count(),
        "model": name, "tokens": sum(len(w.tokens) for w in windows), "batch_size": args.batch_size,
        "args": vars(args),
        "slowdown_pct": {k: round(100 * (medians[k] / medians["forward"] - 1), 1) for k in loads},
        "slowdown_by_round_pct": {k: _by_round(rounds[k], rounds["forward"]) for k in loads},
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
        "cpu_s": cpu,
    }
    print(json.dumps(result, indent=2))
    out = Path(os.environ.get("OUT", "/tmp/contention_check"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "contention_check.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
