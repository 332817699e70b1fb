"""The yardstick of ``make bench``: the least code that gives fetch_all + LRU's hit counts.

A per-layer LRU cache of ``capacity`` experts per layer, fetch every miss, decode steps only
(one token at one layer), with the engine's step semantics (docs/semantics.md): a step's
lookups see the pool as it was at the step's start plus the step's own fetches, hits and
fetches become the most recently used in rank order, and the pool is trimmed after the step,
least recently used first. Nothing else: no clock, no byte budgets, no frequencies, no
per-token outputs, 32-bit indices. The benchmark runs it beside the engine on the same trace
and checks the hit counts are equal, so the engine's cost over it is what its generality costs.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _lru_hits(experts, capacity, prev, nxt, head, tail, count, resident, hits):
    T, L, K = experts.shape
    total = 0
    for t in range(T):
        for layer in range(L):
            for i in range(K):
                e = experts[t, layer, i]
                if resident[layer, e]:
                    hits[layer] += 1
                    total += 1
                    if tail[layer] == e:
                        continue
                    a, b = prev[layer, e], nxt[layer, e]  # unlink (e is not the tail)
                    if a >= 0:
                        nxt[layer, a] = b
                    else:
                        head[layer] = b
                    prev[layer, b] = a
                else:
                    resident[layer, e] = 1
                    count[layer] += 1
                a = tail[layer]  # append at the most recent end
                prev[layer, e] = a
                nxt[layer, e] = -1
                if a >= 0:
                    nxt[layer, a] = e
                else:
                    head[layer] = e
                tail[layer] = e
            while count[layer] > capacity:  # trim: the step's experts are the most recent
                v = head[layer]
                b = nxt[layer, v]
                head[layer] = b
                prev[layer, b] = -1
                resident[layer, v] = 0
                count[layer] -= 1
    return total


def lru_hits(experts: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """Hits per layer (int64[L]) of fetch_all + per-layer LRU with ``capacity`` experts per layer
    over decode-only selections int32[T, L, k] (distinct experts within a token-layer), from an
    empty cache; capacity >= k."""
    experts = np.ascontiguousarray(experts, dtype=np.int32)
    T, L, K = experts.shape
    if capacity < K:
        raise ValueError(f"capacity {capacity} is below top-k {K}: a step's experts must fit")
    prev = np.full((L, num_experts), -1, np.int32)
    nxt = np.full((L, num_experts), -1, np.int32)
    head = np.full(L, -1, np.int32)
    tail = np.full(L, -1, np.int32)
    count = np.zeros(L, np.int32)
    resident = np.zeros((L, num_experts), np.int8)
    hits = np.zeros(L, np.int64)
    _lru_hits(experts, np.int32(capacity), prev, nxt, head, tail, count, resident, hits)
    return hits
