"""A probe of another structure for LFU's victims: a vectorised scan of packed keys per layer.

Each layer keeps its residents' keys in one int64 array, (selections << 40 | step of last use
<< 10 | id), so that the least key is LFU's victim (fewer selections, then used longer ago, then
the lower id) and tells its id. A use stores the resident's new key (one store); a step's used
residents carry a flag bit, cleared after the trim, so that the trim is a plain minimum over
the layer's array, which LLVM vectorises. The cost of a victim does not fall with a heap's
depth but grows with the pool (here 128 residents a layer).

It runs beside `simulator.yardstick.lru_hits` (the minimal fetch_all + LRU kernel),
`simulator.yardstick.lfu_hits` (the textbook heap) and the engine's fetch_all + LRU and
fetch_all + LFU rows, in rounds on the same synthetic trace (by default the Qwen3-Next shape,
4,096 tokens, seed 0, per-layer cache at 25 %), checks the hits equal, and prints each one's median
time and the medians of the rounds' ratios. From the repository root:
``python docs/bench/lfu_scan_probe.py [--rounds 25] [--shape Qwen3-30B-A3B --tokens 8192]``. Results: the "What substitution and LFU
themselves cost" note of docs/BENCHMARKS.md.
"""
import argparse
import os
import statistics
import sys
import tempfile

import numba as nb
import numpy as np

sys.path.insert(0, os.getcwd())

ID_BITS, LAST_BITS = 10, 30
ID_MASK = (1 << ID_BITS) - 1
BIG = np.int64(2**63 - 1)
USED = np.int64(1 << 62)  # flag of a key used in the current step: above every unflagged key


@nb.njit(boundscheck=False)
def _scan_hits(experts, capacity, keys, slot, n, freq, hits):
    T, L, K = experts.shape
    for t in range(T):
        stamp = (np.int64(t) << ID_BITS) | USED
        for layer in range(L):
            kl = keys[layer]
            for i in range(K):
                e = np.int64(experts[t, layer, i])
                f = freq[layer, e] + 1
                freq[layer, e] = f
                key = (f << (ID_BITS + LAST_BITS)) | stamp | e
                s = slot[layer, e]
                if s >= 0:
                    hits[layer] += 1
                    kl[s] = key
                else:
                    m = n[layer]
                    kl[m] = key
                    slot[layer, e] = m
                    n[layer] = m + 1
            m = n[layer]
            while m > capacity:
                best = BIG
                for j in range(m):
                    best = min(best, kl[j])
                v = best & ID_MASK
                s = slot[layer, v]
                m -= 1
                moved = kl[m]
                kl[s] = moved
                slot[layer, moved & ID_MASK] = s
                slot[layer, v] = -1
            n[layer] = m
            for i in range(K):
                kl[slot[layer, experts[t, layer, i]]] &= ~USED


def scan_hits(experts: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """Hits per layer of fetch_all + per-layer LFU (undecayed) by the packed-key scan."""
    T, L, K = experts.shape
    if T >= 1 << LAST_BITS or T >= 1 << (63 - ID_BITS - LAST_BITS - 1) or num_experts > 1 << ID_BITS:
        raise ValueError("the trace is too long or has too many experts for the packed keys")
    hits = np.zeros(L, np.int64)
    _scan_hits(experts, capacity, np.zeros((L, capacity + K), np.int64), np.full((L, num_experts), -1, np.int32),
               np.zeros(L, np.int64), np.zeros((L, num_experts), np.int64), hits)
    return hits


def main() -> None:
    p = argparse.ArgumentParser(prog="docs/bench/lfu_scan_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--shape", default="Qwen3-Next-80B-A3B", help="a shape of simulator.bench.SHAPES")
    args = p.parse_args()
    if args.rounds < 1 or not 1 <= args.tokens < 1 << (63 - ID_BITS - LAST_BITS - 1):
        p.error(f"--rounds must be at least 1 and --tokens between 1 and {(1 << 22) - 1:,}: the packed keys hold "
                "a count of at most 22 bits")
    from simulator.bench import POLICIES, SHAPES, _timed, sim_params
    from simulator.engine import read_options, simulate
    from simulator.trace_cache import cached_source
    from simulator.yardstick import lfu_hits, lru_hits
    from traces.synth import write_synth_trace

    with tempfile.TemporaryDirectory() as work:
        trace = os.path.join(work, "trace.parquet")
        shape = {sh.name: sh for sh in SHAPES}.get(args.shape)
        if shape is None:
            p.error(f"--shape {args.shape}: choose from {', '.join(sh.name for sh in SHAPES)}")
        write_synth_trace(trace, args.tokens, shape.layers, shape.experts, shape.top_k, seed=0, logits="full",
                          prompt_share=0.0)
        source = cached_source(trace, os.path.join(work, "cache"))
        meta = source.meta
        rows = ("fetch_all+lru", "fetch_all+lfu")
        params = {n: sim_params(meta, POLICIES[n] + [f"model={shape.model}"]) for n in rows}
        lru = params["fetch_all+lru"]
        capacity = int(lru.pool_budget_bytes[0] // int(lru.expert_bytes[0]))
        experts = np.concatenate([c.experts for c in source.iter_chunks(**read_options(lru, source))])
        E = meta.num_experts
        runs = {"minimal LRU": lambda: lru_hits(experts, E, capacity),
                "minimal LFU, heap": lambda: lfu_hits(experts, E, capacity),
                "minimal LFU, scan": lambda: scan_hits(experts, E, capacity)}
        runs.update({f"engine {n}": (lambda q=q: simulate(source, q).layer_hits) for n, q in params.items()})
        hits = {name: run() for name, run in runs.items()}  # compiles; not timed
        lfu = [h for name, h in hits.items() if "LFU" in name or "lfu" in name]
        if not all(np.array_equal(h, lfu[0]) for h in lfu) or not np.array_equal(hits["minimal LRU"],
                                                                                   hits["engine fetch_all+lru"]):
            sys.exit("lfu_scan_probe.py: the hits differ; the comparison is void")
        cpu = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                cpu[name].append(_timed(run)[1])
    print(f"{shape.name} shape ({shape.layers} layers, {E} experts, top-{shape.top_k}; expert sizes of model="
          f"{shape.model}, moe-sim's default hardware profile): synthetic trace (traces.synth, seed 0), {args.tokens:,} "
          f"decode tokens, {experts.size:,} lookups, per-layer cache of {capacity} experts (25 %); "
          f"CPU time, medians of {args.rounds} rounds; hits equal")
    for name, xs in cpu.items():
        print(f"{name:26s} {statistics.median(xs) * 1e3:7.1f} ms  {statistics.median(xs) / experts.size * 1e9:6.2f} ns/lookup")

    def ratio(a, b):
        return statistics.median([x / y for x, y in zip(cpu[a], cpu[b], strict=True)])

    print(f"minimal LFU, scan / minimal LRU  {ratio('minimal LFU, scan', 'minimal LRU'):.2f}x")
    print(f"minimal LFU, heap / minimal LRU  {ratio('minimal LFU, heap', 'minimal LRU'):.2f}x")
    print(f"engine LFU / engine LRU          {ratio('engine fetch_all+lfu', 'engine fetch_all+lru'):.2f}x")
    print(f"engine LRU / minimal LRU         {ratio('engine fetch_all+lru', 'minimal LRU'):.2f}x")
    print(f"engine LFU / minimal LFU, scan   {ratio('engine fetch_all+lfu', 'minimal LFU, scan'):.2f}x")


if __name__ == "__main__":
    main()
