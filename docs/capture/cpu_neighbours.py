"""Which other CPUs slow the thread that launches a model's kernels, and by how much, on a GPU host.

A launch-bound forward runs slower beside the trace writer's busy processes (docs/CAPTURE.md),
also with its thread on a core of its own. On a virtual machine the CPUs it lists may share
physical cores or caches in ways its topology does not show. This probe pins a measuring thread
to the last allowed CPU and times two workloads there: a pure-Python loop, and (with CUDA) a
loop of tiny kernel launches with a synchronise after each hundred, like the forward's. It times
them alone, then beside a busy process pinned to each other CPU in turn, of two kinds: a Python
spin (a core's compute) and numpy copies of 64 MiB arrays (memory traffic through the shared
cache), then beside 4 and 8 of each at once. Ratios are medians of ``--repeats`` timings over
the same workload alone, measured alternately.

    OUT=DIR python docs/capture/cpu_neighbours.py --repeats 5
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _spin(cpu: int, kind: str, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    if kind == "compute":
        x = 0
        while not stop.is_set():
            for i in range(10000):
                x += i * i
    else:
        import numpy as np

        a, b = np.ones(8 << 20), np.empty(8 << 20)  # 64 MiB each, far beyond a core's L2
        while not stop.is_set():
            np.copyto(b, a)
            np.copyto(a, b)


def _python_work() -> float:
    start = time.perf_counter()
    d = {}
    for i in range(300000):
        d[i & 1023] = d.get(i & 1023, 0) + i
    return time.perf_counter() - start


def _launch_work():
    import torch

    x = torch.zeros(256, device="cuda")

    def work() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(3000):
            x.add_(1.0)
            if i % 100 == 99:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    work()
    return work


def _median_ratio(work, loaded, repeats: int) -> float:
    """Median over ``repeats`` of (time with ``loaded`` busy processes) / (time alone), alternating."""
    ratios = []
    for _ in range(repeats):
        alone = work()
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(cpu, kind, stop), daemon=True) for cpu, kind in loaded]
        for p in procs:
            p.start()
        time.sleep(0.15)  # the loads running
        busy = work()
        stop.set()
        for p in procs:
            p.join()
        ratios.append(busy / alone)
    return round(statistics.median(ratios), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: timings per CPU must be at least 1")
    allowed = sorted(os.sched_getaffinity(0))
    me, others = allowed[-1], allowed[:-1]
    os.sched_setaffinity(0, {me})
    works, gpu = {"python": _python_work}, None
    try:
        import torch

        if torch.cuda.is_available():
            works["launches"], gpu = _launch_work(), torch.cuda.get_device_name()
    except ImportError:
        pass
    out = {"gpu": gpu, "cpus": os.cpu_count(), "cpu": me, "others": others, "alone_s": {k: round(statistics.median(w() for _ in range(5)), 4)
                                                    for k, w in works.items()}, "single": {}, "many": {}}
    for kind in ("compute", "memory"):
        for name, work in works.items():
            out["single"][f"{kind}/{name}"] = {cpu: _median_ratio(work, [(cpu, kind)], args.repeats) for cpu in others}
            out["many"][f"{kind}/{name}"] = {n: _median_ratio(work, [(c, kind) for c in others[:n]], args.repeats)
                                             for n in (4, 8, len(others))}
            print(kind, name, "single:", out["single"][f"{kind}/{name}"], "many:", out["many"][f"{kind}/{name}"],
                  flush=True)
    if os.environ.get("OUT"):  # whole or not at all: written beside, then renamed
        path = os.path.join(os.environ["OUT"], "cpu_neighbours.json")
        with open(path + ".part", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".part", path)


if __name__ == "__main__":
    mp.set_start_method("fork")
    main()
