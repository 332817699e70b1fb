"""lfu: evict the least frequently selected resident first; ties by least recently used, then
the lower id.

Frequency counts router selections (hit or miss) and decays with ``cache.lfu_decay``
(docs/semantics.md). Kernel: an indexed min-heap per pool keyed (frequency, last-use step);
keys only grow between renormalisations, so a stored key may lag and is refreshed at trim.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Heap,
    heap_push,
    heap_rebuild,
    make_heap,
)
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    heap_order_hooks,
    ignore_group,
    ignore_select,
)

on_select, on_group = ignore_select, ignore_group
READS_FREQUENCY = True  # core.freq orders the heap


class State(NamedTuple):
    heap: Heap
    last_use: np.ndarray  # int64[X]: step ordinal of the last use


def make_state(params, layout, first_use=None):
    X = params.num_layers * params.num_experts
    heap = make_heap(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0])
    return State(heap, np.zeros(X, np.int64))


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    st.last_use[x] = s
    heap_push(st.heap, c, x, p, core.freq[x], s)


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


victim, end_trim = heap_order_hooks(heap_keys)


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
