"""Numba engine: the semantics of docs/semantics.md with O(1) / O(log n) structures.

Kernels take only arrays and scalars; :class:`KernelSimulator` is the thin Python wrapper that
owns the state arrays between chunks. Eviction orders live per pool:

- ``lru`` / ``fifo``: a doubly linked list (``link[PREV|NEXT, x]``, ``ends[HEAD|TAIL, p]``), the
  victim end at the head; a use moves an lru entry to the tail.
- ``lfu`` / ``belady``: an indexed binary min-heap in the pool's segment of ``items`` (position
  of x in ``slot[x]``) with the keys of :func:`simulator.policies.eviction.eviction_key` stored
  beside each entry (``hkey1``, ``hkey2``). Belady keys are updated eagerly. Lfu keys only grow,
  so they are refreshed lazily: a stored key may lag behind the expert's real one, and a trim
  that finds a stale key at the top refreshes it and sifts it down before trusting the top.
- ``random``: the pool's residents in its segment of ``items``, swap-removed.

Each layer also keeps its residents in a swap-removed list (``layer_res``), so a substitute is
found by scanning residents, not all E experts. Residents used in the current step carry
``mark[x] == stamp``; the stamp grows by one per step and per background admission, so nothing
needs clearing. The background queue and the recorded completions are ring buffers of capacity
L*E (an expert is at most once in either); host RAM is a second linked list.
"""
from __future__ import annotations

import numpy as np

from simulator.engine.layout import frequency_fill, make_layout
from simulator.engine.params import MASS_BINS, MISS_ACTIONS, SUBSTITUTE_BY, SimParams, SimResult
from simulator.jit import jit
from simulator.policies.admission import accumulate_substituted
from simulator.policies.eviction import (
    BELADY,
    FIFO,
    LFU,
    LFU_RENORMALISE_ABOVE,
    LRU,
    NEVER_STEP,
    RANDOM,
    eviction_key,
    next_use_step,
    splitmix64,
)
from simulator.policies.miss_rule import fetch_on_miss
from traces.format import PHASE_DECODE, TraceChunk, TraceMeta

_fetch_on_miss = jit(fetch_on_miss, allocates=False)
_accumulate_substituted = jit(accumulate_substituted, allocates=False)
_eviction_key = jit(eviction_key, allocates=False)
_next_use_step = jit(next_use_step, allocates=False)
_splitmix64 = jit(splitmix64, allocates=False)

CPU_ACTION = MISS_ACTIONS["cpu"]
BY_LOGIT = SUBSTITUTE_BY["logit"]

# rows of link arrays / ends arrays
PREV, NEXT = 0, 1
HEAD, TAIL = 0, 1
# columns of pools[P, 4]
BUDGET, BYTES, COUNT, OFFSET = 0, 1, 2, 3
# rows of the ring buffers ring_x[2, X], ring_t[2, X]
QUEUE, DONE = 0, 1
# istate[] entries
(
    STAMP,
    Q_HEAD,
    Q_LEN,
    D_HEAD,
    D_LEN,
    RAM_BYTES,
    PREFILL_LOOKUPS,
    PREFILL_HITS,
    BYTES_FETCHED,
    BACKGROUND_BYTES,
    BACKGROUND_ADMISSIONS,
    BACKGROUND_ENQUEUED,
    SSD_READS,
    EVICTIONS,
) = range(14)
N_ISTATE = 14
# fstate[] entries
CLOCK, LINK_FREE, INC = 0, 1, 2
# columns of layer_counts[L, 8] (decode steps, except background admissions)
(
    L_CALLS,
    L_HITS,
    L_FETCHES,
    L_FORCED,
    L_SUBSTITUTIONS,
    L_FIRST_CHOICE_SUBSTITUTIONS,
    L_CPU_CALLS,
    L_BACKGROUND_ADMISSIONS,
) = range(8)
N_LAYER_COUNTS = 8


# ---- linked lists (lru, fifo, host RAM) --------------------------------------------------


@jit(allocates=False)
def _list_unlink(x, p, link, ends):
    a = link[PREV, x]
    b = link[NEXT, x]
    if a >= 0:
        link[NEXT, a] = b
    else:
        ends[HEAD, p] = b
    if b >= 0:
        link[PREV, b] = a
    else:
        ends[TAIL, p] = a


@jit(allocates=False)
def _list_append(x, p, link, ends):
    t = ends[TAIL, p]
    link[PREV, x] = t
    link[NEXT, x] = -1
    if t >= 0:
        link[NEXT, t] = x
    else:
        ends[HEAD, p] = x
    ends[TAIL, p] = x


# ---- random: the pool's residents, swap-removed -----------------------------------------


@jit(allocates=False)
def _slot_append(x, p, items, slot, pools):
    n = pools[p, COUNT]
    items[pools[p, OFFSET] + n] = x
    slot[x] = n
    pools[p, COUNT] = n + 1


@jit(allocates=False)
def _slot_swap_remove(x, p, items, slot, pools):
    off = pools[p, OFFSET]
    n = pools[p, COUNT] - 1
    last = items[off + n]
    j = slot[x]
    items[off + j] = last
    slot[last] = j
    pools[p, COUNT] = n


# ---- lfu / belady: min-heap of (key1, key2, x) per pool ----------------------------------


@jit(allocates=False)
def _key_before(a1, a2, ax, b1, b2, bx):
    if a1 != b1:
        return a1 < b1
    if a2 != b2:
        return a2 < b2
    return ax < bx


@jit(allocates=False)
def _heap_place(q, x, k1, k2, off, items, hkey1, hkey2, slot):
    items[q] = x
    hkey1[q] = k1
    hkey2[q] = k2
    slot[x] = q - off


@jit(allocates=False)
def _sift_up(pos, off, items, hkey1, hkey2, slot):
    q = off + pos
    x = items[q]
    k1 = hkey1[q]
    k2 = hkey2[q]
    while pos > 0:
        parent = (pos - 1) >> 1
        r = off + parent
        if not _key_before(k1, k2, x, hkey1[r], hkey2[r], items[r]):
            break
        _heap_place(off + pos, items[r], hkey1[r], hkey2[r], off, items, hkey1, hkey2, slot)
        pos = parent
    _heap_place(off + pos, x, k1, k2, off, items, hkey1, hkey2, slot)


@jit(allocates=False)
def _sift_down(pos, off, n, items, hkey1, hkey2, slot):
    q = off + pos
    x = items[q]
    k1 = hkey1[q]
    k2 = hkey2[q]
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        r = off + child
        if child + 1 < n and _key_before(
            hkey1[r + 1], hkey2[r + 1], items[r + 1], hkey1[r], hkey2[r], items[r]
        ):
            child += 1
            r += 1
        if not _key_before(hkey1[r], hkey2[r], items[r], k1, k2, x):
            break
        _heap_place(off + pos, items[r], hkey1[r], hkey2[r], off, items, hkey1, hkey2, slot)
        pos = child
    _heap_place(off + pos, x, k1, k2, off, items, hkey1, hkey2, slot)


@jit(allocates=False)
def _heap_push(x, p, ev, pools, items, hkey1, hkey2, slot, freq, last_use, next_step):
    off = pools[p, OFFSET]
    n = pools[p, COUNT]
    k1, k2 = _eviction_key(ev, freq[x], last_use[x], next_step[x])
    _heap_place(off + n, x, k1, k2, off, items, hkey1, hkey2, slot)
    pools[p, COUNT] = n + 1
    _sift_up(n, off, items, hkey1, hkey2, slot)


@jit(allocates=False)
def _heap_rekey(x, p, ev, pools, items, hkey1, hkey2, slot, freq, last_use, next_step):
    """Store x's current key and restore the heap order."""
    off = pools[p, OFFSET]
    q = off + slot[x]
    hkey1[q], hkey2[q] = _eviction_key(ev, freq[x], last_use[x], next_step[x])
    _sift_up(slot[x], off, items, hkey1, hkey2, slot)
    _sift_down(slot[x], off, pools[p, COUNT], items, hkey1, hkey2, slot)


@jit(allocates=False)
def _heap_pop(p, pools, items, hkey1, hkey2, slot):
    """Remove and return the top of pool p's heap."""
    off = pools[p, OFFSET]
    n = pools[p, COUNT] - 1
    x = items[off]
    pools[p, COUNT] = n
    if n > 0:
        _heap_place(off, items[off + n], hkey1[off + n], hkey2[off + n], off, items, hkey1,
                    hkey2, slot)
        _sift_down(0, off, n, items, hkey1, hkey2, slot)
    return x


@jit(allocates=False)
def _heap_rebuild(p, ev, pools, items, hkey1, hkey2, slot, freq, last_use, next_step):
    """Store every entry's current key and heapify (after frequencies were rescaled)."""
    off = pools[p, OFFSET]
    n = pools[p, COUNT]
    for q in range(off, off + n):
        x = items[q]
        hkey1[q], hkey2[q] = _eviction_key(ev, freq[x], last_use[x], next_step[x])
    for pos in range(n // 2 - 1, -1, -1):
        _sift_down(pos, off, n, items, hkey1, hkey2, slot)


# ---- one pool: insert, use, trim ---------------------------------------------------------


@jit(allocates=False)
def _insert(x, layer, p, s, size, ev, resident, layer_res, layer_res_n, res_pos, pools, link,
            ends, items, hkey1, hkey2, slot, freq, last_use, next_step):
    """Make x (of ``layer``) resident in pool p at step s (an insertion is a use)."""
    resident[x] = 1
    n = layer_res_n[layer]
    layer_res[layer, n] = x
    res_pos[x] = n
    layer_res_n[layer] = n + 1
    pools[p, BYTES] += size
    last_use[x] = s
    if ev == LRU or ev == FIFO:
        _list_append(x, p, link, ends)
    elif ev == RANDOM:
        _slot_append(x, p, items, slot, pools)
    else:
        _heap_push(x, p, ev, pools, items, hkey1, hkey2, slot, freq, last_use, next_step)


@jit(allocates=False)
def _use(x, p, s, ev, link, ends, last_use):
    """A use of resident x at step s (lfu's heap key is refreshed lazily)."""
    last_use[x] = s
    if ev == LRU:
        _list_unlink(x, p, link, ends)
        _list_append(x, p, link, ends)


@jit(allocates=False)
def _drop(x, p, expert_bytes, num_experts, resident, layer_res, layer_res_n, res_pos, pools,
          istate):
    """Bookkeeping of evicting x (already out of the pool's order structure)."""
    layer = x // num_experts
    resident[x] = 0
    n = layer_res_n[layer] - 1
    last = layer_res[layer, n]
    layer_res[layer, res_pos[x]] = last
    res_pos[last] = res_pos[x]
    layer_res_n[layer] = n
    pools[p, BYTES] -= expert_bytes[layer]
    istate[EVICTIONS] += 1


@jit(allocates=False, inline=True)
def _trim(
    p, stamp, ev, expert_bytes, num_experts, resident, layer_res, layer_res_n, res_pos, mark,
    pools, link, ends, items, hkey1, hkey2, slot, freq, last_use, next_step, rng, scratch,
    istate,
):
    """Evict from pool p down to its budget: policy order, residents marked ``stamp`` last."""
    if ev == LRU or ev == FIFO:
        x = ends[HEAD, p]
        while x >= 0 and pools[p, BYTES] > pools[p, BUDGET]:
            nxt = link[NEXT, x]
            if mark[x] != stamp:
                _list_unlink(x, p, link, ends)
                _drop(x, p, expert_bytes, num_experts, resident, layer_res, layer_res_n,
                      res_pos, pools, istate)
            x = nxt
        while pools[p, BYTES] > pools[p, BUDGET]:  # only marked residents are left
            x = ends[HEAD, p]
            _list_unlink(x, p, link, ends)
            _drop(x, p, expert_bytes, num_experts, resident, layer_res, layer_res_n, res_pos,
                  pools, istate)
    elif ev == RANDOM:
        off = pools[p, OFFSET]
        while pools[p, BYTES] > pools[p, BUDGET]:
            n = pools[p, COUNT]
            state, z = _splitmix64(rng[0])
            rng[0] = state
            j = np.int64(z % np.uint64(n))
            victim = items[off + j]
            for d in range(n):
                y = items[off + (j + d) % n]
                if mark[y] != stamp:
                    victim = y
                    break
            _slot_swap_remove(victim, p, items, slot, pools)
            _drop(victim, p, expert_bytes, num_experts, resident, layer_res, layer_res_n,
                  res_pos, pools, istate)
    else:
        # pop the heap; marked residents are set aside (in eviction order) and pushed back
        off = pools[p, OFFSET]
        aside = 0
        taken = 0
        while pools[p, BYTES] > pools[p, BUDGET]:
            if pools[p, COUNT] > 0:
                victim = items[off]
                k1, k2 = _eviction_key(ev, freq[victim], last_use[victim], next_step[victim])
                if k1 != hkey1[off] or k2 != hkey2[off]:  # a stale key: refresh, look again
                    hkey1[off] = k1
                    hkey2[off] = k2
                    _sift_down(0, off, pools[p, COUNT], items, hkey1, hkey2, slot)
                    continue
                _heap_pop(p, pools, items, hkey1, hkey2, slot)
                if mark[victim] == stamp:
                    scratch[aside] = victim
                    aside += 1
                    continue
            else:
                victim = scratch[taken]
                taken += 1
            _drop(victim, p, expert_bytes, num_experts, resident, layer_res, layer_res_n,
                  res_pos, pools, istate)
        for i in range(taken, aside):
            _heap_push(scratch[i], p, ev, pools, items, hkey1, hkey2, slot, freq, last_use,
                       next_step)


@jit(allocates=False)
def _substitute_order(layer, scores, m, layer_res, layer_res_n, mark, stamp, out):
    """The up to ``m`` best substitutes of a step, best first, into ``out``; returns how many.

    Candidates are the layer's residents not marked ``stamp``, by ``scores[e]`` (float[E])
    descending, ties by the lower id. One scan serves the whole step: during a step experts
    only ever leave the eligible set (a used substitute), so the order never changes."""
    E = scores.shape[0]
    base = layer * E
    n = 0
    for j in range(layer_res_n[layer]):
        y = layer_res[layer, j]
        if mark[y] == stamp:
            continue
        v = scores[y - base]
        if n == m:
            w = out[n - 1]
            vw = scores[w - base]
            if v < vw or (v == vw and y > w):
                continue
            n -= 1
        k = n
        while k > 0:
            w = out[k - 1]
            vw = scores[w - base]
            if vw > v or (vw == v and w < y):
                break
            out[k] = w
            k -= 1
        out[k] = y
        n += 1
    return n


# ---- link and host RAM -------------------------------------------------------------------


@jit(allocates=False, inline=True)
def _transfer_us(x, layer, size, ram_budget, in_ram, ram_link, ram_ends, expert_bytes,
                 num_experts, pcie_us, ssd_us, istate):
    """Duration of one transfer of x; the source read updates the host RAM tier."""
    if ram_budget < 0:
        return pcie_us[layer]
    if in_ram[x]:
        _list_unlink(x, 0, ram_link, ram_ends)
        _list_append(x, 0, ram_link, ram_ends)
        return pcie_us[layer]
    istate[SSD_READS] += 1
    while ram_ends[HEAD, 0] >= 0 and istate[RAM_BYTES] + size > ram_budget:
        y = ram_ends[HEAD, 0]
        _list_unlink(y, 0, ram_link, ram_ends)
        in_ram[y] = 0
        istate[RAM_BYTES] -= expert_bytes[y // num_experts]
    if istate[RAM_BYTES] + size <= ram_budget:
        _list_append(x, 0, ram_link, ram_ends)
        in_ram[x] = 1
        istate[RAM_BYTES] += size
    return ssd_us[layer] + pcie_us[layer]


@jit(allocates=False)
def _advance_link(t, resident, pending, ring_x, ring_t, expert_bytes, num_experts, ram_budget,
                  in_ram, ram_link, ram_ends, pcie_us, ssd_us, istate, fstate):
    """Start queued background transfers that can begin before t; record their completions."""
    cap = ring_x.shape[1]
    while istate[Q_LEN] > 0 and fstate[LINK_FREE] < t:
        h = istate[Q_HEAD]
        x = ring_x[QUEUE, h]
        if resident[x]:
            istate[Q_HEAD] = (h + 1) % cap
            istate[Q_LEN] -= 1
            pending[x] = 0
            continue
        start = max(fstate[LINK_FREE], ring_t[QUEUE, h])
        if start >= t:
            break
        istate[Q_HEAD] = (h + 1) % cap
        istate[Q_LEN] -= 1
        layer = x // num_experts
        size = expert_bytes[layer]
        end = start + _transfer_us(x, layer, size, ram_budget, in_ram, ram_link, ram_ends,
                                   expert_bytes, num_experts, pcie_us, ssd_us, istate)
        fstate[LINK_FREE] = end
        istate[BYTES_FETCHED] += size
        istate[BACKGROUND_BYTES] += size
        d = (istate[D_HEAD] + istate[D_LEN]) % cap
        ring_x[DONE, d] = x
        ring_t[DONE, d] = end
        istate[D_LEN] += 1


@jit(allocates=False, inline=True)
def _sync_transfer(c, x, layer, resident, pending, ring_x, ring_t, expert_bytes, num_experts,
                   ram_budget, in_ram, ram_link, ram_ends, pcie_us, ssd_us, istate, fstate):
    """A synchronous fetch's link time from clock c; returns its end."""
    if istate[Q_LEN] > 0:
        _advance_link(c, resident, pending, ring_x, ring_t, expert_bytes, num_experts,
                      ram_budget, in_ram, ram_link, ram_ends, pcie_us, ssd_us, istate,
                      fstate)
    size = expert_bytes[layer]
    start = max(c, fstate[LINK_FREE])
    end = start + _transfer_us(x, layer, size, ram_budget, in_ram, ram_link, ram_ends,
                               expert_bytes, num_experts, pcie_us, ssd_us, istate)
    fstate[LINK_FREE] = end
    istate[BYTES_FETCHED] += size
    return end


# ---- the chunk kernel --------------------------------------------------------------------


@jit(allocates=False)
def run_chunk(
    # the chunk: T tokens, L layers, k ranks, E experts
    experts, gates, logits, group, phase, next_use,
    # policy and hardware constants
    ev, protect_ranks, tau, miss_action, substitute_by, beta, lfu_decay, ram_budget,
    pool_of_layer, expert_bytes, nonexpert_us, gpu_expert_us, cpu_expert_us, pcie_us, ssd_us,
    # state carried between chunks
    resident, layer_res, layer_res_n, res_pos, mark, freq, acc, pending, last_use, next_step,
    pools, link, ends, items, hkey1, hkey2, slot, ram_link, ram_ends, in_ram, ring_x, ring_t,
    rng, istate, fstate, uniq, scratch,
    layer_counts, layer_mass, mass_hist,
    # per-token outputs [T]
    out_time, out_stall, out_mass, out_hits, out_fetches, out_substitutions, out_cpu_calls,
):
    """Simulate every group of one chunk (docs/semantics.md), updating the state in place.

    ``experts`` int32[T, L, k]; ``gates`` float32[T, L, k]; ``logits`` float32[T, L, E] or
    [0, L, E]; ``group`` int64[T]; ``phase`` int8[T]; ``next_use`` int32[T, L, k] next-use
    group ordinals (belady) or [0, L, k]. Times in microseconds, sizes in bytes.
    """
    T, L, K = experts.shape
    E = resident.shape[0] // L
    X = L * E
    track_next = next_use.shape[0] > 0
    a = 0
    while a < T:
        g = group[a]
        b = a + 1
        while b < T and group[b] == g:
            b += 1
        decode = phase[a] == PHASE_DECODE
        inc = fstate[INC] / lfu_decay
        if inc > LFU_RENORMALISE_ABOVE:
            for x in range(X):
                freq[x] = freq[x] / inc
            inc = inc / inc
            if ev == LFU:
                for p in range(pools.shape[0]):
                    _heap_rebuild(p, ev, pools, items, hkey1, hkey2, slot, freq, last_use,
                                  next_step)
        fstate[INC] = inc
        group_start = fstate[CLOCK]
        group_stall = 0.0
        group_mass = 0.0
        group_hits = 0
        group_fetches = 0
        group_substitutions = 0
        group_cpu_calls = 0

        for layer in range(L):
            s = g * L + layer
            base = layer * E
            p = pool_of_layer[layer]
            # step start: background transfers that completed by t0 become resident
            t0 = fstate[CLOCK]
            if istate[Q_LEN] > 0:
                _advance_link(t0, resident, pending, ring_x, ring_t, expert_bytes, E, ram_budget,
                              in_ram, ram_link, ram_ends, pcie_us, ssd_us, istate,
                              fstate)
            while istate[D_LEN] > 0 and ring_t[DONE, istate[D_HEAD]] <= t0:
                x = ring_x[DONE, istate[D_HEAD]]
                istate[D_HEAD] = (istate[D_HEAD] + 1) % X
                istate[D_LEN] -= 1
                pending[x] = 0
                if resident[x]:
                    continue
                lx = x // E
                px = pool_of_layer[lx]
                istate[STAMP] += 1
                mark[x] = istate[STAMP]  # the admitted expert is evicted last
                _insert(x, lx, px, s, expert_bytes[lx], ev, resident, layer_res, layer_res_n,
                        res_pos, pools, link, ends, items, hkey1, hkey2, slot, freq, last_use,
                        next_step)
                if pools[px, BYTES] > pools[px, BUDGET]:
                    _trim(px, istate[STAMP], ev, expert_bytes, E, resident, layer_res,
                          layer_res_n, res_pos, mark, pools, link, ends, items, hkey1, hkey2,
                          slot, freq, last_use, next_step, rng, scratch, istate)
                istate[BACKGROUND_ADMISSIONS] += 1
                layer_counts[lx, L_BACKGROUND_ADMISSIONS] += 1
            istate[STAMP] += 1
            stamp = istate[STAMP]

            # selections: frequency (and next use) advance; every selected expert is marked
            n_unique = 0
            for t in range(a, b):
                for i in range(K):
                    x = base + experts[t, layer, i]
                    freq[x] += inc
                    if track_next:
                        next_step[x] = _next_use_step(next_use[t, layer, i], layer, L)
                    if ev == BELADY and resident[x]:
                        _heap_rekey(x, p, ev, pools, items, hkey1, hkey2, slot, freq, last_use,
                                    next_step)
                    if mark[x] != stamp:
                        mark[x] = stamp
                        uniq[n_unique] = x
                        n_unique += 1

            t1 = t0 + nonexpert_us[layer]
            c = t1
            size = expert_bytes[layer]
            if decode:
                hits = 0
                fetches = 0
                forced = 0
                substitutions = 0
                cpu_calls = 0
                m = 0.0
                n_cand = -1
                next_cand = 0
                for i in range(K):
                    x = base + experts[a, layer, i]
                    if resident[x]:
                        hits += 1
                        _use(x, p, s, ev, link, ends, last_use)
                        continue
                    gate = np.float64(gates[a, layer, i])
                    if not _fetch_on_miss(i, gate, protect_ranks, tau):
                        if miss_action == CPU_ACTION:
                            cpu_calls += 1
                            continue
                        if n_cand < 0:
                            if substitute_by == BY_LOGIT:
                                n_cand = _substitute_order(layer, logits[a, layer], K - i, layer_res,
                                                           layer_res_n, mark, stamp, scratch)
                            else:
                                n_cand = _substitute_order(layer, freq[base : base + E], K - i, layer_res,
                                                           layer_res_n, mark, stamp, scratch)
                        best = -1
                        if next_cand < n_cand:
                            best = scratch[next_cand]
                            next_cand += 1
                        if best >= 0:
                            substitutions += 1
                            if i == 0:
                                layer_counts[layer, L_FIRST_CHOICE_SUBSTITUTIONS] += 1
                            mark[best] = stamp
                            _use(best, p, s, ev, link, ends, last_use)
                            m += gate
                            new_acc, admit = _accumulate_substituted(acc[x], gate, beta)
                            acc[x] = new_acc
                            if admit and pending[x] == 0:
                                pending[x] = 1
                                q = (istate[Q_HEAD] + istate[Q_LEN]) % X
                                ring_x[QUEUE, q] = x
                                ring_t[QUEUE, q] = t1
                                istate[Q_LEN] += 1
                                istate[BACKGROUND_ENQUEUED] += 1
                            continue
                        forced += 1
                    fetches += 1
                    c = _sync_transfer(c, x, layer, resident, pending, ring_x, ring_t,
                                       expert_bytes, E, ram_budget, in_ram, ram_link, ram_ends,
                                       pcie_us, ssd_us, istate, fstate)
                    _insert(x, layer, p, s, size, ev, resident, layer_res, layer_res_n, res_pos,
                            pools, link, ends, items, hkey1, hkey2, slot, freq, last_use,
                            next_step)
                stall = c - t1
                gpu_phase = (hits + fetches + substitutions) * gpu_expert_us[layer]
                cpu_phase = cpu_calls * cpu_expert_us[layer]
                end = c + max(gpu_phase, cpu_phase)
                layer_counts[layer, L_CALLS] += K
                layer_counts[layer, L_HITS] += hits
                layer_counts[layer, L_FETCHES] += fetches
                layer_counts[layer, L_FORCED] += forced
                layer_counts[layer, L_SUBSTITUTIONS] += substitutions
                layer_counts[layer, L_CPU_CALLS] += cpu_calls
                layer_mass[layer] += m
                mass_hist[min(np.int64(m * MASS_BINS), MASS_BINS)] += 1
                group_mass += m
                group_substitutions += substitutions
                group_cpu_calls += cpu_calls
            else:
                # prefill: each unique expert looked up once, misses fetched
                hits = 0
                for j in range(n_unique):
                    x = uniq[j]
                    if resident[x]:
                        hits += 1
                        _use(x, p, s, ev, link, ends, last_use)
                    else:
                        c = _sync_transfer(c, x, layer, resident, pending, ring_x, ring_t,
                                           expert_bytes, E, ram_budget, in_ram, ram_link,
                                           ram_ends, pcie_us, ssd_us, istate, fstate)
                        _insert(x, layer, p, s, size, ev, resident, layer_res, layer_res_n,
                                res_pos, pools, link, ends, items, hkey1, hkey2, slot, freq,
                                last_use, next_step)
                fetches = n_unique - hits
                stall = c - t1
                end = c + n_unique * gpu_expert_us[layer]
                istate[PREFILL_LOOKUPS] += n_unique
                istate[PREFILL_HITS] += hits
            if pools[p, BYTES] > pools[p, BUDGET]:
                _trim(p, stamp, ev, expert_bytes, E, resident, layer_res, layer_res_n, res_pos,
                      mark, pools, link, ends, items, hkey1, hkey2, slot, freq, last_use,
                      next_step, rng, scratch, istate)
            fstate[CLOCK] = end
            group_stall += stall
            group_hits += hits
            group_fetches += fetches

        # per-token outputs; a prefill group's lookups are counted on its first token
        n = b - a
        group_time = fstate[CLOCK] - group_start
        for t in range(a, b):
            out_time[t] = group_time / n
            out_stall[t] = group_stall / n
            out_mass[t] = group_mass
            out_hits[t] = group_hits if t == a else 0
            out_fetches[t] = group_fetches if t == a else 0
            out_substitutions[t] = group_substitutions
            out_cpu_calls[t] = group_cpu_calls
        a = b


@jit(allocates=False)
def _warm_insert(fill, p, ev, expert_bytes, num_experts, resident, layer_res, layer_res_n,
                 res_pos, pools, link, ends, items, hkey1, hkey2, slot, freq, last_use,
                 next_step):
    """init=frequency: insert a pool's fill, least frequent first; last use -1 - fill index."""
    for i in range(fill.shape[0] - 1, -1, -1):
        x = fill[i]
        layer = x // num_experts
        _insert(x, layer, p, -1 - i, expert_bytes[layer], ev, resident, layer_res, layer_res_n,
                res_pos, pools, link, ends, items, hkey1, hkey2, slot, freq, last_use,
                next_step)


# ---- the Python wrapper ------------------------------------------------------------------


def kernel_array(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as a C-contiguous, writable array of ``dtype`` (copied only if it is not one).

    Numba compiles a separate specialisation for read-only arrays (a memory map, an Arrow
    buffer); a copy of one chunk costs far less than compiling the kernel again.
    """
    a = np.ascontiguousarray(a, dtype=dtype)
    return a if a.flags.writeable else a.copy()

_TOKEN_FIELDS = (
    "time_us", "stall_us", "mass", "hits", "fetches", "substitutions", "cpu_calls",
)


class KernelSimulator:
    """Owns the kernel's state arrays; feeds it one chunk at a time (same protocol as
    :class:`simulator.engine.reference.ReferenceSimulator`: ``warm``, ``run_chunk``, ``result``).
    """

    def __init__(self, params: SimParams, meta: TraceMeta, first_use: np.ndarray | None = None):
        self.params = params
        self.layout = lay = make_layout(params, meta)
        L, E, K = params.num_layers, params.num_experts, params.top_k
        X = L * E
        P = lay.pool_budget_bytes.shape[0]
        self._expert_bytes = np.ascontiguousarray(params.expert_bytes, dtype=np.int64)
        self._constants = (
            int(params.eviction),
            int(params.protect_ranks),
            float(params.tau),
            int(params.miss_action),
            int(params.substitute_by),
            float(params.beta),
            float(params.lfu_decay),
            int(params.host_ram_budget_bytes),
            lay.pool_of_layer,
            self._expert_bytes,
            np.ascontiguousarray(params.nonexpert_us, dtype=np.float64),
            np.ascontiguousarray(params.gpu_expert_us, dtype=np.float64),
            np.ascontiguousarray(params.cpu_expert_us, dtype=np.float64),
            lay.pcie_us,
            lay.ssd_us,
        )
        self.resident = np.zeros(X, np.int8)
        self.layer_res = np.zeros((L, E), np.int32)  # residents of each layer, swap-removed
        self.layer_res_n = np.zeros(L, np.int32)
        self.res_pos = np.zeros(X, np.int32)
        self.mark = np.zeros(X, np.int64)
        self.freq = np.zeros(X, np.float64)
        self.acc = np.zeros(X, np.float64)
        self.pending = np.zeros(X, np.int8)
        self.last_use = np.zeros(X, np.int64)
        self.next_step = np.full(X, NEVER_STEP, np.int64)
        if first_use is not None:
            self.next_step[:] = [next_use_step(int(first_use[x]), x // E, L) for x in range(X)]
        self.pools = np.zeros((P, 4), np.int64)
        self.pools[:, BUDGET] = lay.pool_budget_bytes
        self.pools[:, OFFSET] = lay.pool_offset
        self.link = np.full((2, X), -1, np.int32)
        self.ends = np.full((2, P), -1, np.int32)
        capacity = int(lay.pool_capacity.sum())
        self.items = np.zeros(capacity, np.int32)
        self.hkey1 = np.zeros(capacity, np.float64)
        self.hkey2 = np.zeros(capacity, np.int64)
        self.slot = np.zeros(X, np.int32)
        self.ram_link = np.full((2, X), -1, np.int32)
        self.ram_ends = np.full((2, 1), -1, np.int32)
        self.in_ram = np.zeros(X, np.int8)
        self.ring_x = np.zeros((2, X), np.int32)
        self.ring_t = np.zeros((2, X), np.float64)
        self.rng = np.array([int(params.seed) % 2**64], dtype=np.uint64)
        self.istate = np.zeros(N_ISTATE, np.int64)
        self.fstate = np.array([0.0, 0.0, 1.0])  # CLOCK, LINK_FREE, INC
        self.uniq = np.zeros(X, np.int32)
        self.scratch = np.zeros(X, np.int32)
        self.layer_counts = np.zeros((L, N_LAYER_COUNTS), np.int64)
        self.layer_mass = np.zeros(L, np.float64)
        self.mass_hist = np.zeros(MASS_BINS + 1, np.int64)
        self._no_logits = np.zeros((0, L, E), np.float32)
        self._no_next_use = np.zeros((0, L, K), np.int32)
        self._tokens: list[dict[str, np.ndarray]] = []

    def _state(self):
        """The state arrays, in ``run_chunk``'s argument order."""
        return (
            self.resident, self.layer_res, self.layer_res_n, self.res_pos, self.mark,
            self.freq, self.acc, self.pending, self.last_use, self.next_step, self.pools,
            self.link, self.ends, self.items, self.hkey1, self.hkey2, self.slot, self.ram_link,
            self.ram_ends, self.in_ram, self.ring_x, self.ring_t, self.rng, self.istate,
            self.fstate, self.uniq, self.scratch, self.layer_counts, self.layer_mass,
            self.mass_hist,
        )

    def warm(self, counts: np.ndarray) -> None:
        """init=frequency: fill each pool by the warm-up tokens' selection counts (int64[L*E])."""
        counts = np.asarray(counts, dtype=np.int64)
        self.freq[:] = counts
        ev = int(self.params.eviction)
        for p, fill in enumerate(frequency_fill(counts, self.params, self.layout)):
            _warm_insert(
                fill, p, ev, self._expert_bytes, self.params.num_experts, self.resident,
                self.layer_res, self.layer_res_n, self.res_pos, self.pools, self.link,
                self.ends, self.items, self.hkey1, self.hkey2, self.slot, self.freq,
                self.last_use, self.next_step,
            )

    def run_chunk(self, chunk: TraceChunk, next_use: np.ndarray | None = None) -> None:
        """Simulate every group of a chunk; ``next_use``: int32[T, L, k] rows (belady)."""
        T = chunk.num_tokens
        out = {
            "time_us": np.empty(T, np.float64),
            "stall_us": np.empty(T, np.float64),
            "mass": np.empty(T, np.float64),
            "hits": np.empty(T, np.int32),
            "fetches": np.empty(T, np.int32),
            "substitutions": np.empty(T, np.int32),
            "cpu_calls": np.empty(T, np.int32),
        }
        logits = self._no_logits if chunk.logits.shape[0] == 0 else chunk.logits
        run_chunk(
            kernel_array(chunk.experts, np.int32),
            kernel_array(chunk.gates, np.float32),
            kernel_array(logits, np.float32),
            kernel_array(chunk.group, np.int64),
            kernel_array(chunk.phase, np.int8),
            self._no_next_use if next_use is None else kernel_array(next_use, np.int32),
            *self._constants,
            *self._state(),
            *(out[name] for name in _TOKEN_FIELDS),
        )
        out["seq"] = np.array(chunk.seq, dtype=np.int32)
        out["pos"] = np.array(chunk.pos, dtype=np.int32)
        out["phase"] = np.array(chunk.phase, dtype=np.int8)
        out["domain"] = np.array(chunk.domain, dtype=np.int16)
        self._tokens.append(out)

    def result(self) -> SimResult:
        """The run's outputs so far."""

        def tokens(name, dtype):
            parts = [t[name] for t in self._tokens]
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        lc = self.layer_counts
        st = self.istate
        return SimResult(
            seq=tokens("seq", np.int32),
            pos=tokens("pos", np.int32),
            phase=tokens("phase", np.int8),
            domain=tokens("domain", np.int16),
            time_us=tokens("time_us", np.float64),
            stall_us=tokens("stall_us", np.float64),
            mass=tokens("mass", np.float64),
            hits=tokens("hits", np.int32),
            fetches=tokens("fetches", np.int32),
            substitutions=tokens("substitutions", np.int32),
            cpu_calls=tokens("cpu_calls", np.int32),
            layer_calls=lc[:, L_CALLS].copy(),
            layer_hits=lc[:, L_HITS].copy(),
            layer_fetches=lc[:, L_FETCHES].copy(),
            layer_forced_fetches=lc[:, L_FORCED].copy(),
            layer_substitutions=lc[:, L_SUBSTITUTIONS].copy(),
            layer_first_choice_substitutions=lc[:, L_FIRST_CHOICE_SUBSTITUTIONS].copy(),
            layer_cpu_calls=lc[:, L_CPU_CALLS].copy(),
            layer_mass=self.layer_mass.copy(),
            layer_background_admissions=lc[:, L_BACKGROUND_ADMISSIONS].copy(),
            prefill_lookups=int(st[PREFILL_LOOKUPS]),
            prefill_hits=int(st[PREFILL_HITS]),
            bytes_fetched=int(st[BYTES_FETCHED]),
            background_bytes=int(st[BACKGROUND_BYTES]),
            background_admissions=int(st[BACKGROUND_ADMISSIONS]),
            background_enqueued=int(st[BACKGROUND_ENQUEUED]),
            ssd_reads=int(st[SSD_READS]),
            evictions=int(st[EVICTIONS]),
            mass_hist=self.mass_hist.copy(),
            sim_end_us=float(self.fstate[CLOCK]),
        )
