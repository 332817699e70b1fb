"""lfu: evict the least frequently selected resident first; ties by least recently used, then
the lower id.

Frequency counts router selections (hit or miss) and decays with ``cache.lfu_decay``
(docs/semantics.md). Kernel: an indexed min-heap per pool keyed (frequency, last-use step);
keys only grow between renormalisations, so a stored key may lag and is refreshed at trim.
An expert admitted in a step is *held* out of the heap until a victim search sees it unmarked:
while the step that admitted it runs it cannot be a victim unless every other resident is used
in the step too, and admitted experts have low frequencies, so in the heap they would sit at
its top and be set aside and pushed back at every trim of the step.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Heap,
    heap_end_trim,
    heap_push,
    heap_rebuild,
    heap_victim_held,
    make_heap,
)
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    ignore_group,
    ignore_select,
)

on_select, on_group = ignore_select, ignore_group
READS_FREQUENCY = True  # core.freq orders the heap


class State(NamedTuple):
    heap: Heap
    last_use: np.ndarray  # int64[X]: step ordinal of the last use
    held: np.ndarray  # int32[capacity]: per pool (the heap's segments) residents held out of the heap
    n_held: np.ndarray  # int64[P]


def make_state(params, layout, first_use=None):
    X = params.num_layers * params.num_experts
    capacity, pools = int(layout.pool_capacity.sum()), layout.pool_budget_bytes.shape[0]
    return State(make_heap(capacity, X, pools), np.zeros(X, np.int64), np.zeros(capacity, np.int32),
                 np.zeros(pools, np.int64))


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    st.last_use[x] = s
    off = c.pool_offset[p]
    n = st.n_held[p]
    st.held[off + n] = x
    st.n_held[p] = n + 1


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    st.last_use[x] = s  # the heap key is refreshed lazily


@jit(allocates=False, inline=True)
def on_rescale(core, st, c):
    for p in range(c.pool_offset.shape[0]):
        heap_rebuild(st.heap, c, p, core.freq, st.last_use)


LAZY_KEYS = True  # stored heap keys may lag behind (they only grow); trim refreshes them


@jit(allocates=False, inline=True)
def heap_keys(core, st):
    """The current heap key arrays (key1[x], key2[x]) of every expert."""
    return core.freq, st.last_use


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    """Push the held residents no longer marked ``stamp``, then the heap's victim."""
    off = c.pool_offset[p]
    n = st.n_held[p]
    i = 0
    while i < n:
        y = st.held[off + i]
        if core.mark[y] != stamp:
            heap_push(st.heap, c, y, p, core.freq[y], st.last_use[y])
            n -= 1
            st.held[off + i] = st.held[off + n]
        else:
            i += 1
    st.n_held[p] = n
    return heap_victim_held(st.heap, off, p, stamp, core.freq, st.last_use, core.mark, st.held, st.n_held)


@jit(allocates=False, inline=True)
def end_trim(core, st, c, p):
    heap_end_trim(st.heap, c, p, core.freq, st.last_use)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self.last_use = {}

    def on_insert(self, x, step):
        self.last_use[x] = step

    on_use = on_insert

    def victim(self, p, pinned):
        freq = self.sim.freq
        return min(self.candidates(p, pinned), key=lambda y: (freq[y], self.last_use[y], y))
