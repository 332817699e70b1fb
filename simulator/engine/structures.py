"""Order structures the kernel's policies and tiers are built from, O(1) / O(log n) per change.

- :class:`Lists`: doubly linked lists, one per pool (``link[PREV|NEXT, x]``, ``ends[HEAD|TAIL,
  p]``); the head is the oldest end.
- :class:`Heap`: indexed binary min-heaps of ``(key1, key2, x)``, one per pool in the pool's
  segment of ``items`` (``consts.pool_offset``); ``slot[x]`` is x's position in its heap.
- :class:`Slots`: each pool's members in its segment of ``items``, swap-removed.
- :class:`Packed`: each pool's members as whole keys (an integer that holds the id in some of
  its low bits) in its segment of ``keys``, swap-removed; the victim is the least key, found by a pass over the
  pool that the compiler vectorises.
- :func:`insert_ranked`: a short best-first list (a predictor's top P, a step's substitutes).

All functions work in the arrays they are given and allocate nothing. Victim searches remove
the victim from the structure and return it; the engine does the rest of the eviction
(:func:`simulator.engine.state.drop`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.state import FRESH
from simulator.jit import ix, jit

# rows of Lists.link and Lists.ends
PREV, NEXT = 0, 1
HEAD, TAIL = 0, 1


class Lists(NamedTuple):
    link: np.ndarray  # int32[2, X]
    ends: np.ndarray  # int32[2, P]


def make_lists(num_items: int, num_lists: int) -> Lists:
    return Lists(np.full((2, num_items), -1, np.int32), np.full((2, num_lists), -1, np.int32))


@jit(allocates=False, inline=True)
def list_unlink(lists, x, p):
    link, ends = lists.link, lists.ends
    a = link[PREV, x]
    b = link[NEXT, x]
    if a >= 0:
        link[NEXT, ix(a)] = b
    else:
        ends[HEAD, p] = b
    if b >= 0:
        link[PREV, ix(b)] = a
    else:
        ends[TAIL, p] = a


@jit(allocates=False, inline=True)
def list_append(lists, x, p):
    link, ends = lists.link, lists.ends
    t = ends[TAIL, p]
    link[PREV, x] = t
    link[NEXT, x] = -1
    if t >= 0:
        link[NEXT, ix(t)] = x
    else:
        ends[HEAD, p] = x
    ends[TAIL, p] = x


@jit(allocates=False, inline=True)
def list_to_tail(lists, x, p):
    """Move x, in pool p's list, to its tail (the newest end): nothing to do where it is there."""
    link, ends = lists.link, lists.ends
    t = ends[TAIL, p]
    if t == x:
        return
    a = link[PREV, x]
    b = link[NEXT, x]  # >= 0: x is not the tail
    if a >= 0:
        link[NEXT, ix(a)] = b
    else:
        ends[HEAD, p] = b
    link[PREV, ix(b)] = a
    link[PREV, x] = t
    link[NEXT, x] = -1
    link[NEXT, ix(t)] = x  # t >= 0: the list holds x
    ends[TAIL, p] = x


@jit(allocates=False)
def list_victim(lists, mark, p, stamp):
    """Unlink and return pool p's victim: the first entry from the head not marked ``stamp``,
    or, if every entry is marked, the head; the head for a negative ``stamp``
    (``simulator.engine.state.NO_STAMP``: nothing is marked)."""
    x = lists.ends[HEAD, p]
    if stamp >= 0:
        while x >= 0 and mark[ix(x)] == stamp:
            x = lists.link[NEXT, ix(x)]
        if x < 0:
            x = lists.ends[HEAD, p]
    list_unlink(lists, ix(x), p)
    return x


class Slots(NamedTuple):
    items: np.ndarray  # int32[capacity]: pool segments
    slot: np.ndarray  # int32[X]
    count: np.ndarray  # int64[P]


def make_slots(capacity: int, num_items: int, num_pools: int) -> Slots:
    return Slots(np.zeros(capacity, np.int32), np.zeros(num_items, np.int32),
                 np.zeros(num_pools, np.int64))


@jit(allocates=False, inline=True)
def slot_append(s, c, x, p):
    n = s.count[p]
    s.items[c.pool_offset[p] + n] = x
    s.slot[x] = n
    s.count[p] = n + 1


class Packed(NamedTuple):
    # int64[capacity + 1]: pool segments of keys, each with its expert's id in its low bits; the
    # last entry is no pool's: where the slot of every non-member points, so that a store for
    # one needs no test
    keys: np.ndarray
    slot: np.ndarray  # int32[X]: a member's position in keys
    count: np.ndarray  # int64[P]


# bit 62 of a key marks it during a pass (packed_least): keys must stay below it
PACKED_FLAG = np.int64(1 << 62)
_NO_KEY = np.int64(2**63 - 1)


def make_packed(capacity: int, num_items: int, num_pools: int) -> Packed:
    return Packed(np.zeros(capacity + 1, np.int64), np.full(num_items, capacity, np.int32),
                  np.zeros(num_pools, np.int64))


@jit(allocates=False, inline=True)
def packed_insert(pk, c, x, p, key):
    n = pk.count[p]
    j = c.pool_offset[p] + n
    pk.keys[ix(j)] = key
    pk.slot[x] = j
    pk.count[p] = n + 1


@jit(allocates=False, inline=True)
def packed_store(pk, x, key):
    """x's new key (where x is not a member, into the spare entry)."""
    pk.keys[ix(pk.slot[x])] = key


@jit(allocates=False, inline=True)
def packed_flag(pk, x, bits):
    """Set ``bits`` in x's key (x a member)."""
    pk.keys[ix(pk.slot[x])] |= bits


@jit(allocates=False)
def packed_least(keys, off, n, field, value):
    """The least of ``keys[off : off + n]``, each key whose bits ``field`` equal ``value`` read
    with PACKED_FLAG set (after all others; ``field`` 0 and ``value`` -1: none)."""
    pool = keys[off:off + n]  # indexed from 0: no index can wrap, so the loop is vectorised
    best = _NO_KEY
    for j in range(pool.shape[0]):
        k = pool[j]
        best = min(best, k | (PACKED_FLAG if (k & field) == value else 0))
    return best


@jit(allocates=False, inline=True)
def packed_take(pk, c, p, id_shift, id_bits, field, value):
    """Remove and return pool p's member of the least key (:func:`packed_least`); a key's id is
    its ``id_bits`` bits from bit ``id_shift``."""
    off = c.pool_offset[p]
    n = pk.count[p] - 1
    mask = (np.int64(1) << id_bits) - 1
    x = (packed_least(pk.keys, off, n + 1, field, value) >> id_shift) & mask
    last = pk.keys[ix(off + n)]
    j = pk.slot[x]
    pk.keys[ix(j)] = last
    pk.slot[(last >> id_shift) & mask] = j
    pk.slot[x] = pk.keys.shape[0] - 1  # the spare entry
    pk.count[p] = n
    return x


class Heap(NamedTuple):
    items: np.ndarray  # int32[capacity]
    hkey1: np.ndarray  # float64[capacity]: stored keys beside each entry
    hkey2: np.ndarray  # int64[capacity]
    slot: np.ndarray  # int32[X]
    count: np.ndarray  # int64[P]
    aside: np.ndarray  # int32[X]: residents set aside during a trim (used in the step)
    # int64[4]: set aside so far, taken back as victims so far; held residents (heap_victim_held)
    # sorted to the front, -1 outside a trim, and taken as victims so far
    trim: np.ndarray


def make_heap(capacity: int, num_items: int, num_pools: int) -> Heap:
    return Heap(np.zeros(capacity, np.int32), np.zeros(capacity, np.float64),
                np.zeros(capacity, np.int64), np.zeros(num_items, np.int32),
                np.zeros(num_pools, np.int64), np.zeros(num_items, np.int32),
                np.array([0, 0, -1, 0], np.int64))


@jit(allocates=False, inline=True)
def _before(a1, a2, ax, b1, b2, bx):
    if a1 != b1:
        return a1 < b1
    if a2 != b2:
        return a2 < b2
    return ax < bx


@jit(allocates=False, inline=True)
def _place(h, q, x, k1, k2, off):
    h.items[ix(q)] = x
    h.hkey1[ix(q)] = k1
    h.hkey2[ix(q)] = k2
    h.slot[ix(x)] = q - off


@jit(allocates=False, inline=True)
def _sift_up(h, pos, off):
    q = ix(off + pos)
    x = h.items[q]
    k1 = h.hkey1[q]
    k2 = h.hkey2[q]
    while pos > 0:
        parent = (pos - 1) >> 1
        r = ix(off + parent)
        if not _before(k1, k2, x, h.hkey1[r], h.hkey2[r], h.items[r]):
            break
        _place(h, off + pos, h.items[r], h.hkey1[r], h.hkey2[r], off)
        pos = parent
    _place(h, off + pos, x, k1, k2, off)


@jit(allocates=False, inline=True)
def _sift_down(h, pos, off, n):
    q = ix(off + pos)
    x = h.items[q]
    k1 = h.hkey1[q]
    k2 = h.hkey2[q]
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        r = ix(off + child)
        r1 = ix(off + child + 1)
        if child + 1 < n and _before(h.hkey1[r1], h.hkey2[r1], h.items[r1],
                                     h.hkey1[r], h.hkey2[r], h.items[r]):
            child += 1
            r = r1
        if not _before(h.hkey1[r], h.hkey2[r], h.items[r], k1, k2, x):
            break
        _place(h, off + pos, h.items[r], h.hkey1[r], h.hkey2[r], off)
        pos = child
    _place(h, off + pos, x, k1, k2, off)


@jit(allocates=False)
def heap_push(h, c, x, p, k1, k2):
    off = c.pool_offset[ix(p)]
    n = h.count[ix(p)]
    _place(h, off + n, x, k1, k2, off)
    h.count[p] = n + 1
    _sift_up(h, n, off)


@jit(allocates=False, inline=True)
def heap_rekey_before(h, c, x, p, k1, k2):
    """:func:`heap_rekey` for a key that never comes after x's stored key: x can only move
    toward the top (one sift, inlined)."""
    off = c.pool_offset[p]
    pos = h.slot[x]
    q = ix(off + pos)
    h.hkey1[q] = k1
    h.hkey2[q] = k2
    _sift_up(h, pos, off)


@jit(allocates=False)
def heap_rekey(h, c, x, p, k1, k2):
    """Store x's new key and restore the heap order."""
    heap_rekey_before(h, c, x, p, k1, k2)
    _sift_down(h, h.slot[x], c.pool_offset[p], h.count[p])


@jit(allocates=False, inline=True)
def heap_before_top(h, off, p, x, k1, k2):
    """Whether key (k1, k2, x) is before the stored key of pool p's top (False if empty)."""
    return h.count[p] > 0 and _before(k1, k2, x, h.hkey1[ix(off)], h.hkey2[ix(off)], h.items[ix(off)])


@jit(allocates=False)
def heap_rebuild(h, c, p, key1, key2):
    """Store every entry's current key (``key1[x]``, ``key2[x]``) and heapify."""
    off = c.pool_offset[p]
    n = h.count[p]
    for q in range(off, off + n):
        x = h.items[q]
        h.hkey1[q] = key1[x]
        h.hkey2[q] = key2[x]
    for pos in range(n // 2 - 1, -1, -1):
        _sift_down(h, pos, off, n)


@jit(allocates=False, inline=True)
def _pop_unmarked(h, off, p, stamp, key1, key2, mark, bound, fresh):
    """Pop pool p's entries in key order until one not marked ``stamp``, or marked but
    ``fresh[x] == FRESH`` (None: no such array); return it, or -1 when the heap ran out or its
    least key is not before the key of ``bound`` (an expert outside the heap; -1: no bound). The
    marked ones popped are set aside, in key order. Stale stored keys at the top are refreshed
    and sifted down first."""
    u = ix(off)
    while h.count[p] > 0:
        top = h.items[u]
        if bound >= 0 and not _before(h.hkey1[u], h.hkey2[u], top,
                                      key1[ix(bound)], key2[ix(bound)], bound):
            return -1  # stored keys never run ahead: no entry is before the bound
        k1 = key1[ix(top)]
        k2 = key2[ix(top)]
        if k1 != h.hkey1[u] or k2 != h.hkey2[u]:
            h.hkey1[u] = k1
            h.hkey2[u] = k2
            _sift_down(h, 0, off, h.count[p])
            continue
        n = h.count[p] - 1
        h.count[p] = n
        if n > 0:
            last = ix(off + n)
            _place(h, off, h.items[last], h.hkey1[last], h.hkey2[last], off)
            _sift_down(h, 0, off, n)
        if mark[ix(top)] != stamp or (fresh is not None and fresh[ix(top)] == FRESH):
            return top
        h.aside[h.trim[0]] = top
        h.trim[0] += 1
    return -1


@jit(allocates=False)
def heap_victim(h, off, p, stamp, key1, key2, mark):
    """Remove and return pool p's victim in key order, residents marked ``stamp`` last.

    ``off``: the pool's segment start; ``key1[x]``, ``key2[x]``: each resident's current key. A
    stored key may lag behind (keys that only grow are refreshed lazily): a stale key at the top
    is refreshed and sifted down before the top is trusted. Marked residents are set aside (in
    key order), taken back as victims once the heap is empty, and the rest pushed back by
    :func:`heap_end_trim`.
    """
    x = _pop_unmarked(h, off, p, stamp, key1, key2, mark, -1, None)
    if x >= 0:
        return x
    x = h.aside[h.trim[1]]
    h.trim[1] += 1
    return x


@jit(allocates=False, inline=True)
def _sort_unmarked_first(held, off, n, key1, key2, mark, stamp, fresh):
    """Move the entries of ``held[off : off + n]`` not marked ``stamp`` (or marked but
    ``fresh[x] == FRESH``, where not None) to its front, in key order; return how many they are."""
    m = 0
    for i in range(n):
        y = ix(held[ix(off + i)])
        if mark[y] != stamp or (fresh is not None and fresh[y] == FRESH):
            held[ix(off + i)] = held[ix(off + m)]
            j = m
            k1, k2 = key1[y], key2[y]
            while j > 0:
                z = ix(held[ix(off + j - 1)])
                if not _before(k1, k2, y, key1[z], key2[z], z):
                    break
                held[ix(off + j)] = z
                j -= 1
            held[ix(off + j)] = y
            m += 1
    return m


@jit(allocates=False, inline=True)
def heap_victim_held(h, off, p, stamp, key1, key2, mark, held, n_held, fresh):
    """:func:`heap_victim` for a pool whose residents are in the heap or *held* out of it:
    ``held[off : off + n_held[p]]``, read with their current keys. The victim is the least key
    of the unmarked residents of both (the trim's first search sorts the unmarked held ones to
    the front); once none is left, the least of the set-aside and the held ones. ``fresh``:
    None, or ``core.fresh``, whose entries equal to ``state.FRESH`` count as unmarked (the
    step-marks kernel's arrivals not selected and not used in the step). Finish the trim with
    :func:`heap_end_trim_held`."""
    if h.trim[2] < 0:
        h.trim[2] = _sort_unmarked_first(held, off, n_held[p], key1, key2, mark, stamp, fresh)
    i = h.trim[3]
    y = held[ix(off + i)] if i < h.trim[2] else -1  # the least unmarked held one bounds the pop
    x = _pop_unmarked(h, off, p, stamp, key1, key2, mark, y, fresh)
    if x >= 0:
        return x
    if y >= 0:
        h.trim[3] = i + 1
        return y
    n = n_held[p]
    best = -1  # position in held of the least key (all marked)
    for j in range(i, n):
        y = held[off + j]
        if best < 0 or _before(key1[y], key2[y], y, key1[held[off + best]], key2[held[off + best]],
                               held[off + best]):
            best = j
    if h.trim[1] < h.trim[0]:
        x = h.aside[h.trim[1]]
        if best < 0 or _before(key1[x], key2[x], x, key1[held[off + best]], key2[held[off + best]],
                               held[off + best]):
            h.trim[1] += 1
            return x
    y = held[off + best]
    held[off + best] = held[off + n - 1]
    n_held[p] = n - 1
    return y


@jit(allocates=False)
def heap_end_trim(h, c, p, key1, key2):
    """Push back the residents a trim set aside and did not evict."""
    for i in range(h.trim[1], h.trim[0]):
        y = h.aside[i]
        heap_push(h, c, y, p, key1[ix(y)], key2[ix(y)])
    h.trim[0] = 0
    h.trim[1] = 0


# unmarked held residents a trim may leave held (the least keys, while before the heap's top)
KEEP_HELD = 4


@jit(allocates=False, inline=True)
def heap_end_trim_held(h, c, p, key1, key2, held, n_held):
    """:func:`heap_end_trim` after :func:`heap_victim_held`: drop the held victims from
    ``held`` and push the unmarked held ones into the heap, except up to ``KEEP_HELD`` of the
    least keys that are before the heap's least stored key (likely the next victims)."""
    heap_end_trim(h, c, p, key1, key2)
    off = c.pool_offset[p]
    taken = h.trim[3]
    unmarked = max(h.trim[2], 0)
    keep = unmarked  # held[off + taken : off + keep]: the surviving unmarked ones, in key order
    while keep > taken:
        y = ix(held[ix(off + keep - 1)])
        if keep - taken <= KEEP_HELD and heap_before_top(h, off, p, y, key1[y], key2[y]):
            break
        heap_push(h, c, y, p, key1[y], key2[y])
        keep -= 1
    m = 0
    for i in range(n_held[p]):
        if taken <= i < keep or i >= unmarked:
            held[ix(off + m)] = held[ix(off + i)]
            m += 1
    n_held[p] = m
    h.trim[2] = -1
    h.trim[3] = 0


@jit(allocates=False, inline=True)
def insert_ranked(out, n, top_p, x, score, offset):
    """Insert flat id ``x`` into ``out[:n]`` (sorted by ``score[y - offset]`` descending, ties by
    the lower id, at most ``top_p >= 1`` long); returns the new length."""
    s = score[x - offset]
    if n == top_p:
        y = out[n - 1]
        sy = score[y - offset]
        if s < sy or (s == sy and x > y):
            return n
        j = n - 1
    else:
        j = n
        n += 1
    while j > 0:
        y = out[j - 1]
        sy = score[y - offset]
        if sy > s or (sy == s and y < x):
            break
        out[j] = y
        j -= 1
    out[j] = x
    return n
