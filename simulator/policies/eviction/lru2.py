"""lru2: LRU-K with K = 2 (O'Neil, O'Neil and Weikum, SIGMOD 1993): evict the resident whose
second most recent use is oldest; a resident used only once has no second use and goes first;
ties by the most recent use (least recent first), then the lower id.

A use is a hit, a fetch, a substitute's use or an admission. An expert's use history survives
its eviction (LRU-K's retained history, here unbounded: it costs two numbers per expert), so an
expert fetched back after a short absence keeps the credit of its earlier uses, while one that
is used once and then not again is the first to go. Kernel: an indexed min-heap per pool keyed
(second last use, last use); both only grow, so stored keys are refreshed lazily at trim.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import Heap, heap_push, make_heap
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    heap_order_hooks,
    ignore_group,
    ignore_rescale,
    ignore_select,
)

on_select, on_group, on_rescale = ignore_select, ignore_group, ignore_rescale
LAZY_KEYS = True  # stored heap keys may lag behind (they only grow); trim refreshes them
NO_USE = -np.inf  # the second last use of an expert used at most once


class State(NamedTuple):
    heap: Heap
    second_last: np.ndarray  # float64[X]: step of the second most recent use, NO_USE if none
    last: np.ndarray  # int64[X]: step of the most recent use
    used: np.ndarray  # int8[X]: 1 once the expert has been used


def make_state(params, layout, first_use=None):
    X = params.num_layers * params.num_experts
    heap = make_heap(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0])
    return State(heap, np.full(X, NO_USE), np.zeros(X, np.int64), np.zeros(X, np.int8))


@jit(allocates=False, inline=True)
def heap_keys(core, st):
    """The current heap key arrays (key1[x], key2[x]) of every expert."""
    return st.second_last, st.last


@jit(allocates=False, inline=True)
def _use(st, x, s):
    if st.used[x]:
        st.second_last[x] = st.last[x]
    st.used[x] = 1
    st.last[x] = s


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    _use(st, x, s)
    heap_push(st.heap, c, x, p, st.second_last[x], st.last[x])


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    _use(st, x, s)  # the heap key is refreshed lazily


victim, end_trim = heap_order_hooks(heap_keys)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self.history: dict[int, list[int]] = {}  # x -> its last two use steps, oldest first

    def on_insert(self, x, step):
        self.history[x] = (self.history.get(x, []) + [step])[-2:]

    on_use = on_insert

    def victim(self, p, pinned):
        def key(y):
            h = self.history[y]
            return (h[0] if len(h) == 2 else float("-inf"), h[-1], y)

        return min(self.candidates(p, pinned), key=key)
