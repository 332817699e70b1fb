"""The yardsticks of ``make bench``: the least code that gives fetch_all + LRU's hit counts,
rule015 + LRU's hits, substitutions and fetches, and fetch_all + LFU's hits.

A per-layer LRU cache of ``capacity`` experts per layer, fetch every miss, decode steps only
(one token at one layer), with the engine's step semantics (docs/semantics.md): a step's
lookups see the pool as it was at the step's start plus the step's own fetches, hits and
fetches become the most recently used in rank order, and the pool is trimmed after the step,
least recently used first. Nothing else: no clock, no byte budgets, no frequencies, no
per-token outputs; the ids as the trace stores them. The benchmark runs it beside the engine on
the same trace and checks the hit counts are equal, so the engine's cost over it is what its
generality costs.

:func:`rule_counts` adds the threshold rule and logit substitution to the same LRU: a miss of
rank >= ``protect_ranks`` whose gate weight is below ``tau`` takes the first resident of the
token-layer's top-R order of unselected logit ids (the walk), or, once the walk has passed all R,
the resident of highest logit not selected and not yet used in the step (ties: the lower id);
none left: the miss is fetched. Its time against :func:`lru_hits`' is what substitution itself
costs (the gate, the order's rows, the rule's branches), whatever engine runs it.

:func:`lfu_hits` is fetch_all with per-layer LFU in the same least code: a binary min-heap of
each layer's residents keyed (selections, step of last use, id), re-keyed at every selection; the
trim pops the least key that the step did not use. It says what the frequency order costs
against a lookup in a textbook structure.
"""
from __future__ import annotations

import numpy as np

from simulator.jit import jit, prefetch


@jit(allocates=False, inline=True)
def _use(e, layer, fetched, prev, nxt, head, tail):
    """Make e (a hit, a substitute, or ``fetched``) the most recent of its layer's list."""
    if not fetched:
        if tail[layer] == e:
            return
        a, b = prev[layer, e], nxt[layer, e]  # unlink (e is not the tail)
        if a >= 0:
            nxt[layer, a] = b
        else:
            head[layer] = b
        prev[layer, b] = a
    a = tail[layer]  # append at the most recent end
    prev[layer, e] = a
    nxt[layer, e] = -1
    if a >= 0:
        nxt[layer, a] = e
    else:
        head[layer] = e
    tail[layer] = e


@jit(allocates=False, inline=True)
def _trim(layer, capacity, prev, nxt, head, count, resident):
    """Evict least recently used first down to capacity (the step's experts are the most recent)."""
    while count[layer] > capacity:
        v = head[layer]
        b = nxt[layer, v]
        head[layer] = b
        prev[layer, b] = -1
        resident[layer, v] = 0
        count[layer] -= 1


@jit(allocates=False)
def _lru_hits(experts, capacity, prev, nxt, head, tail, count, resident, hits):
    T, L, K = experts.shape
    for t in range(T):
        for layer in range(L):
            for i in range(K):
                e = experts[t, layer, i]
                fetched = not resident[layer, e]
                if fetched:
                    resident[layer, e] = 1
                    count[layer] += 1
                else:
                    hits[layer] += 1
                _use(e, layer, fetched, prev, nxt, head, tail)
            _trim(layer, capacity, prev, nxt, head, count, resident)


@jit(allocates=False)
def _rule_counts(experts, gates, order, logit_bits, f16, capacity, protect_ranks, tau, prev, nxt, head,
                 tail, count, resident, taken, counts):
    T, L, K = experts.shape
    R = order.shape[2]
    step = 0
    for t in range(T):
        for layer in range(L):
            step += 1
            prefetch(order, ((t * L + layer) + 2) * R)  # the walk reads each order row once, in order
            j = 0  # the walk's position; R: it has passed them all (the scan from then on)
            for i in range(K):
                e = experts[t, layer, i]
                fetched = not resident[layer, e]
                if not fetched:
                    counts[layer, 0] += 1
                else:
                    y = -1
                    if i >= protect_ranks and np.float64(gates[t, layer, i]) < tau:
                        while j < R:
                            c = order[t, layer, j]
                            j += 1
                            if resident[layer, c]:
                                y = c
                                break
                        if y < 0:
                            y = _scan(experts, order, logit_bits, f16, resident, taken, t, layer, step)
                    if y < 0:
                        counts[layer, 2] += 1
                        resident[layer, e] = 1
                        count[layer] += 1
                    else:
                        counts[layer, 1] += 1
                        e = y
                        fetched = False
                _use(e, layer, fetched, prev, nxt, head, tail)
            _trim(layer, capacity, prev, nxt, head, count, resident)


@jit(allocates=False)
def _scan(experts, order, logit_bits, f16, resident, taken, t, layer, step):
    """After the walk: the resident of highest logit that the step neither selected nor used (the
    walk used every resident of the order row); ties by the lower id; -1 if none."""
    if taken[layer, experts[t, layer, 0]] != step:  # the step's first scan: mark what is not eligible
        for i in range(experts.shape[2]):
            taken[layer, experts[t, layer, i]] = step
        for j in range(order.shape[2]):
            taken[layer, order[t, layer, j]] = step
    best, best_score = -1, np.float32(0.0)
    for e in range(resident.shape[1]):
        if resident[layer, e] and taken[layer, e] != step:
            score = f16[logit_bits[t, layer, e]]
            if best < 0 or score > best_score:
                best, best_score = e, score
    if best >= 0:
        taken[layer, best] = step
    return best


@jit(allocates=False, inline=True)
def _before(a, b, layer, freq, last):
    """Heap order of experts a and b of ``layer``: fewer selections, then used longer ago, then id."""
    if freq[layer, a] != freq[layer, b]:
        return freq[layer, a] < freq[layer, b]
    if last[layer, a] != last[layer, b]:
        return last[layer, a] < last[layer, b]
    return a < b


@jit(allocates=False, inline=True)
def _place(heap, pos, layer, i, x):
    heap[layer, i] = x
    pos[layer, x] = i


@jit(allocates=False, inline=True)
def _sift(heap, pos, layer, i, n, freq, last):
    """Restore the heap order of layer's heap (n entries) around position i."""
    x = heap[layer, i]
    while i > 0 and _before(x, heap[layer, (i - 1) // 2], layer, freq, last):  # up
        _place(heap, pos, layer, i, heap[layer, (i - 1) // 2])
        i = (i - 1) // 2
    while 2 * i + 1 < n:  # down
        c = 2 * i + 1
        if c + 1 < n and _before(heap[layer, c + 1], heap[layer, c], layer, freq, last):
            c += 1
        if not _before(heap[layer, c], x, layer, freq, last):
            break
        _place(heap, pos, layer, i, heap[layer, c])
        i = c
    _place(heap, pos, layer, i, x)


@jit(allocates=False)
def _lfu_hits(experts, capacity, heap, pos, size, freq, last, resident, aside, hits):
    T, L, K = experts.shape
    for t in range(T):
        for layer in range(L):
            for i in range(K):  # a selection counts at its lookup: only the trim reads the counts
                e = experts[t, layer, i]
                freq[layer, e] += 1
                last[layer, e] = t
                if resident[layer, e]:
                    hits[layer] += 1
                    _sift(heap, pos, layer, pos[layer, e], size[layer], freq, last)
                else:
                    resident[layer, e] = 1
                    n = size[layer]
                    heap[layer, n] = e
                    size[layer] = n + 1
                    _sift(heap, pos, layer, n, n + 1, freq, last)
            n_aside = 0
            while size[layer] + n_aside > capacity:  # trim: pop the least key not used in the step
                e = heap[layer, 0]
                n = size[layer] - 1
                heap[layer, 0] = heap[layer, n]
                pos[layer, heap[layer, 0]] = 0
                size[layer] = n
                _sift(heap, pos, layer, 0, n, freq, last)
                if last[layer, e] == t:
                    aside[n_aside] = e
                    n_aside += 1
                else:
                    resident[layer, e] = 0
            for j in range(n_aside):  # the step's own experts go back
                e = aside[j]
                heap[layer, size[layer]] = e
                size[layer] += 1
                _sift(heap, pos, layer, size[layer] - 1, size[layer], freq, last)


def lfu_hits(experts: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """Hits per layer (int64[L]) of fetch_all + per-layer LFU (undecayed; ties by least recently
    used, then the lower id) with ``capacity`` experts per layer over decode-only selections
    int[T, L, k], from an empty cache; capacity >= k."""
    experts, _ = _empty_cache(experts, num_experts, capacity)
    L = experts.shape[1]
    heap = np.zeros((L, num_experts), np.int32)
    pos = np.zeros((L, num_experts), np.int32)
    hits = np.zeros(L, np.int64)
    _lfu_hits(experts, np.int32(capacity), heap, pos, np.zeros(L, np.int64), np.zeros((L, num_experts), np.int64),
              np.full((L, num_experts), -1, np.int64), np.zeros((L, num_experts), np.int8),
              np.zeros(experts.shape[2], np.int32), hits)
    return hits


def rule_counts(experts: np.ndarray, gates: np.ndarray, order: np.ndarray, logits: np.ndarray,
                num_experts: int, capacity: int, protect_ranks: int, tau: float) -> np.ndarray:
    """int64[L, 3]: hits, substitutions and fetches per layer of the threshold rule with logit
    substitution over per-layer LRU caches of ``capacity`` experts (decode-only selections
    int[T, L, k], gate weights float32[T, L, k], the top-R order int[T, L, R] of
    ``iter_chunks(order_r=R)``, float16 logits [T, L, E]), from an empty cache; capacity >= k."""
    from traces.format import F16_TO_F32

    experts, lists = _empty_cache(experts, num_experts, capacity)
    T, L, _ = experts.shape
    bits = np.ascontiguousarray(logits, dtype=np.float16).view(np.uint16)
    if bits.shape != (T, L, num_experts):
        raise ValueError(f"logits have shape {bits.shape}; rule_counts needs full logits {(T, L, num_experts)}")
    taken = np.zeros((L, num_experts), np.int64)
    counts = np.zeros((L, 3), np.int64)
    _rule_counts(experts, np.ascontiguousarray(gates, dtype=np.float32), np.ascontiguousarray(order, dtype=np.int16),
                 bits, F16_TO_F32, np.int32(capacity), int(protect_ranks), float(tau), *lists, taken, counts)
    return counts


def _empty_cache(experts: np.ndarray, num_experts: int, capacity: int):
    """The selections as given (int16 from a trace: no copy in the timed call) and empty per-layer
    LRU lists (prev, next, head, tail, count, resident)."""
    experts = np.ascontiguousarray(experts)
    _, L, K = experts.shape
    if capacity < K:
        raise ValueError(f"capacity {capacity} is below top-k {K}: a step's experts must fit")
    return experts, (np.full((L, num_experts), -1, np.int32), np.full((L, num_experts), -1, np.int32),
                     np.full(L, -1, np.int32), np.full(L, -1, np.int32), np.zeros(L, np.int32),
                     np.zeros((L, num_experts), np.int8))


def lru_hits(experts: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """Hits per layer (int64[L]) of fetch_all + per-layer LRU with ``capacity`` experts per layer
    over decode-only selections int[T, L, k] (distinct experts within a token-layer), from an
    empty cache; capacity >= k."""
    experts, lists = _empty_cache(experts, num_experts, capacity)
    hits = np.zeros(experts.shape[1], np.int64)
    _lru_hits(experts, np.int32(capacity), *lists, hits)
    return hits
