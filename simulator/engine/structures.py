"""Order structures the kernel's policies and tiers are built from, O(1) / O(log n) per change.

- :class:`Lists`: doubly linked lists, one per pool (``link[PREV|NEXT, x]``, ``ends[HEAD|TAIL,
  p]``); the head is the oldest end.
- :class:`Heap`: indexed binary min-heaps of ``(key1, key2, x)``, one per pool in the pool's
  segment of ``items`` (``consts.pool_offset``); ``slot[x]`` is x's position in its heap.
- :class:`Slots`: each pool's members in its segment of ``items``, swap-removed.

All functions work in the arrays they are given and allocate nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.state import drop, over_budget
from simulator.jit import jit

# rows of Lists.link and Lists.ends
PREV, NEXT = 0, 1
HEAD, TAIL = 0, 1


class Lists(NamedTuple):
    link: np.ndarray  # int32[2, X]
    ends: np.ndarray  # int32[2, P]


def make_lists(num_items: int, num_lists: int) -> Lists:
    return Lists(np.full((2, num_items), -1, np.int32), np.full((2, num_lists), -1, np.int32))


@jit(allocates=False)
def list_unlink(lists, x, p):
    link, ends = lists.link, lists.ends
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
def list_append(lists, x, p):
    link, ends = lists.link, lists.ends
    t = ends[TAIL, p]
    link[PREV, x] = t
    link[NEXT, x] = -1
    if t >= 0:
        link[NEXT, t] = x
    else:
        ends[HEAD, p] = x
    ends[TAIL, p] = x


@jit(allocates=False)
def list_trim(core, c, lists, p, stamp):
    """Evict from pool p's head until the pool fits its budget, residents marked ``stamp`` last."""
    x = lists.ends[HEAD, p]
    while x >= 0 and over_budget(core, p):
        nxt = lists.link[NEXT, x]
        if core.mark[x] != stamp:
            list_unlink(lists, x, p)
            drop(core, c, x, p)
        x = nxt
    while over_budget(core, p):  # only marked residents are left
        x = lists.ends[HEAD, p]
        list_unlink(lists, x, p)
        drop(core, c, x, p)


class Slots(NamedTuple):
    items: np.ndarray  # int32[capacity]: pool segments
    slot: np.ndarray  # int32[X]
    count: np.ndarray  # int64[P]


def make_slots(capacity: int, num_items: int, num_pools: int) -> Slots:
    return Slots(np.zeros(capacity, np.int32), np.zeros(num_items, np.int32),
                 np.zeros(num_pools, np.int64))


@jit(allocates=False)
def slot_append(s, c, x, p):
    n = s.count[p]
    s.items[c.pool_offset[p] + n] = x
    s.slot[x] = n
    s.count[p] = n + 1


@jit(allocates=False)
def slot_swap_remove(s, c, x, p):
    off = c.pool_offset[p]
    n = s.count[p] - 1
    last = s.items[off + n]
    j = s.slot[x]
    s.items[off + j] = last
    s.slot[last] = j
    s.count[p] = n


class Heap(NamedTuple):
    items: np.ndarray  # int32[capacity]
    hkey1: np.ndarray  # float64[capacity]: stored keys beside each entry
    hkey2: np.ndarray  # int64[capacity]
    slot: np.ndarray  # int32[X]
    count: np.ndarray  # int64[P]


def make_heap(capacity: int, num_items: int, num_pools: int) -> Heap:
    return Heap(np.zeros(capacity, np.int32), np.zeros(capacity, np.float64),
                np.zeros(capacity, np.int64), np.zeros(num_items, np.int32),
                np.zeros(num_pools, np.int64))


@jit(allocates=False)
def _before(a1, a2, ax, b1, b2, bx):
    if a1 != b1:
        return a1 < b1
    if a2 != b2:
        return a2 < b2
    return ax < bx


@jit(allocates=False)
def _place(h, q, x, k1, k2, off):
    h.items[q] = x
    h.hkey1[q] = k1
    h.hkey2[q] = k2
    h.slot[x] = q - off


@jit(allocates=False)
def _sift_up(h, pos, off):
    q = off + pos
    x = h.items[q]
    k1 = h.hkey1[q]
    k2 = h.hkey2[q]
    while pos > 0:
        parent = (pos - 1) >> 1
        r = off + parent
        if not _before(k1, k2, x, h.hkey1[r], h.hkey2[r], h.items[r]):
            break
        _place(h, off + pos, h.items[r], h.hkey1[r], h.hkey2[r], off)
        pos = parent
    _place(h, off + pos, x, k1, k2, off)


@jit(allocates=False)
def _sift_down(h, pos, off, n):
    q = off + pos
    x = h.items[q]
    k1 = h.hkey1[q]
    k2 = h.hkey2[q]
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        r = off + child
        if child + 1 < n and _before(h.hkey1[r + 1], h.hkey2[r + 1], h.items[r + 1],
                                     h.hkey1[r], h.hkey2[r], h.items[r]):
            child += 1
            r += 1
        if not _before(h.hkey1[r], h.hkey2[r], h.items[r], k1, k2, x):
            break
        _place(h, off + pos, h.items[r], h.hkey1[r], h.hkey2[r], off)
        pos = child
    _place(h, off + pos, x, k1, k2, off)


@jit(allocates=False)
def heap_push(h, c, x, p, k1, k2):
    off = c.pool_offset[p]
    n = h.count[p]
    _place(h, off + n, x, k1, k2, off)
    h.count[p] = n + 1
    _sift_up(h, n, off)


@jit(allocates=False)
def heap_rekey(h, c, x, p, k1, k2):
    """Store x's new key and restore the heap order."""
    off = c.pool_offset[p]
    q = off + h.slot[x]
    h.hkey1[q] = k1
    h.hkey2[q] = k2
    _sift_up(h, h.slot[x], off)
    _sift_down(h, h.slot[x], off, h.count[p])


@jit(allocates=False)
def heap_pop(h, c, p):
    """Remove and return the top of pool p's heap."""
    off = c.pool_offset[p]
    n = h.count[p] - 1
    x = h.items[off]
    h.count[p] = n
    if n > 0:
        _place(h, off, h.items[off + n], h.hkey1[off + n], h.hkey2[off + n], off)
        _sift_down(h, 0, off, n)
    return x


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


@jit(allocates=False)
def heap_trim(core, c, h, p, stamp, key1, key2):
    """Evict from pool p down to its budget in key order, residents marked ``stamp`` last.

    ``key1[x]``, ``key2[x]``: each resident's current key. A stored key may lag behind (keys
    that only grow are refreshed lazily): a stale key at the top is refreshed and sifted down
    before the top is trusted. Marked residents are set aside (in key order) and pushed back.
    """
    off = c.pool_offset[p]
    aside = 0
    taken = 0
    while over_budget(core, p):
        if h.count[p] > 0:
            victim = h.items[off]
            k1 = key1[victim]
            k2 = key2[victim]
            if k1 != h.hkey1[off] or k2 != h.hkey2[off]:
                h.hkey1[off] = k1
                h.hkey2[off] = k2
                _sift_down(h, 0, off, h.count[p])
                continue
            heap_pop(h, c, p)
            if core.mark[victim] == stamp:
                core.scratch[aside] = victim
                aside += 1
                continue
        else:
            victim = core.scratch[taken]
            taken += 1
        drop(core, c, victim, p)
    for i in range(taken, aside):
        y = core.scratch[i]
        heap_push(h, c, y, p, key1[y], key2[y])
