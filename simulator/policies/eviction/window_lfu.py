"""window_lfu: evict the resident selected least often in the last ``window_tokens`` tokens;
ties by least recently used, then the lower id.

Plain LFU keeps experts of an earlier topic for as long as their old counts last; a window
forgets them once they leave it. The count of an expert is the number of its router selections
among the most recent ``window_tokens`` tokens as of the end of the current group: at a group's
start the tokens that leave the window by its end expire (their selections are uncounted), and
the group's own selections count as they happen (a prefill group longer than the window counts
only its last ``window_tokens`` tokens). Kernel: an indexed min-heap per pool keyed (count,
last-use step), re-keyed eagerly whenever a resident's count or last use changes; a ring of the
window's selections (``window_tokens x L x k`` ids).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Heap,
    heap_push,
    heap_rekey,
    make_heap,
)
from simulator.jit import jit
from simulator.policies.eviction._base import ReferenceBase, heap_order_hooks, ignore_rescale

on_rescale = ignore_rescale
LAZY_KEYS = False  # re-keyed at every change
# State.cursor[] entries: the next group's first token, this group's first token, the chunk row
# of this group's first token, the first token of this group that counts
NEXT, FIRST, ROW, COUNT_FROM = range(4)


@dataclass(frozen=True)
class Options:
    window_tokens: int = field(default=256, metadata={
        "help": "window_lfu: tokens whose selections count (the most recent ones), >= 1",
        "min": 1})


class State(NamedTuple):
    heap: Heap
    counts: np.ndarray  # float64[X]: selections in the window (the heap's first key)
    last_use: np.ndarray  # int64[X]: step ordinal of the last use
    ring: np.ndarray  # int32[W, L, k]: the window's selections, token j in row j % W
    cursor: np.ndarray  # int64[4]: NEXT, FIRST, ROW, COUNT_FROM


def make_state(params, layout, first_use=None):
    L, E, K = params.num_layers, params.num_experts, params.top_k
    X = L * E
    window = int(params.options.get("window_tokens", Options.window_tokens))
    heap = make_heap(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0])
    return State(heap, np.zeros(X, np.float64), np.zeros(X, np.int64),
                 np.zeros((window, L, K), np.int32), np.zeros(4, np.int64))


@jit(allocates=False, inline=True)
def heap_keys(core, st):
    """The current heap key arrays (key1[x], key2[x]) of every expert."""
    return st.counts, st.last_use


@jit(allocates=False, inline=True)
def _changed(core, st, c, x):
    if core.resident[x]:
        heap_rekey(st.heap, c, x, c.pool_of_layer[x // c.num_experts], st.counts[x],
                   st.last_use[x])


@jit(allocates=False, inline=True)
def on_group(core, st, c, ch, a, b):
    W = st.ring.shape[0]
    L, K = st.ring.shape[1], st.ring.shape[2]
    n = b - a
    first = st.cursor[NEXT]
    for j in range(max(0, first - W), min(first, first + n - W)):  # leave the window
        for layer in range(L):
            for i in range(K):
                x = st.ring[j % W, layer, i]
                st.counts[x] -= 1.0
                _changed(core, st, c, x)
    st.cursor[NEXT] = first + n
    st.cursor[FIRST] = first
    st.cursor[ROW] = a
    st.cursor[COUNT_FROM] = first + n - W


@jit(allocates=False, inline=True)
def on_select(core, st, c, ch, t, layer, i, x, p, s):
    j = st.cursor[FIRST] + (t - st.cursor[ROW])
    if j >= st.cursor[COUNT_FROM]:
        st.ring[j % st.ring.shape[0], layer, i] = x
        st.counts[x] += 1.0
        _changed(core, st, c, x)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    st.last_use[x] = s
    heap_push(st.heap, c, x, p, st.counts[x], s)


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    st.last_use[x] = s
    heap_rekey(st.heap, c, x, p, st.counts[x], s)


victim, end_trim = heap_order_hooks(heap_keys)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self.window = int(sim.params.options.get("window_tokens", Options.window_tokens))
        self.counts: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.window_selections: dict[int, list[int]] = {}  # token index -> its selections
        self.next = self.first = self.count_from = 0

    def on_group(self, num_tokens):
        first, n, W = self.next, num_tokens, self.window
        for j in range(max(0, first - W), min(first, first + n - W)):
            for x in self.window_selections.pop(j, []):
                self.counts[x] -= 1
        self.first, self.next, self.count_from = first, first + n, first + n - W

    def on_select(self, x, layer, step, token, next_group):
        j = self.first + token
        if j >= self.count_from:
            self.window_selections.setdefault(j, []).append(x)
            self.counts[x] = self.counts.get(x, 0) + 1

    def on_insert(self, x, step):
        self.last_use[x] = step

    on_use = on_insert

    def victim(self, p, pinned):
        return min(self.candidates(p, pinned),
                   key=lambda y: (self.counts.get(y, 0), self.last_use[y], y))
