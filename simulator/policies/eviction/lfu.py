"""lfu: evict the least frequently selected resident first; ties by least recently used, then
the lower id.

Frequency counts router selections (hit or miss) and decays with ``cache.lfu_decay``
(docs/semantics.md). Kernel: an indexed min-heap per pool keyed (frequency, last-use step);
keys only grow between renormalisations, so a stored key may lag and is refreshed at trim.
An admitted expert is *held* out of the heap: admitted experts have low frequencies and most
are evicted within a step or two, so in the heap each would cost a sift to its top and one back
down. A trim sorts the unmarked held ones (a handful) and takes victims from them or the heap,
whichever key is less; at its end it pushes the survivors into the heap but a few of the least
keys that are still before the heap's top (structures.heap_end_trim_held).

Every use and insertion stores its step in ``last_use``, so the residents used in a step are
those last used in it, less the background arrivals inserted in it and not used (``core.fresh``):
the kernel marks no lookup and passes the trim the step (``simulator.engine.state.step_stamp``;
KernelNeeds.step_marks), and the victim search reads ``last_use`` (already one of its keys) and,
for those last used in the step, ``fresh``, instead of the marks.

Small per-layer pools without decay run the same order from packed keys, scanned
(:mod:`simulator.policies.eviction._lfu_scan`, chosen by :func:`kernel_hooks`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Heap,
    heap_end_trim_held,
    heap_rebuild,
    heap_victim_held,
    make_heap,
)
from simulator.jit import ix, jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    ignore_group,
    ignore_select,
)

on_select, on_group = ignore_select, ignore_group
READS_FREQUENCY = True  # core.freq orders the heap
MARKS_BY_LAST_USE = True  # a step's used residents are those whose last use is the step


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


def kernel_hooks(params, layout, needs, num_tokens, first_use=None):
    """Another module of these hooks with the same victims, and its state, where it runs
    ``params`` faster (``needs``: simulator.policies.KernelNeeds; ``num_tokens``: at most the
    run's tokens, None if not known); None: this module's."""
    from simulator.policies.eviction import _lfu_scan

    if not _lfu_scan.applies(params, layout, needs.background, num_tokens):
        return None
    return _lfu_scan, _lfu_scan.make_state(params, layout, num_tokens)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    st.last_use[x] = s
    off = c.pool_offset[p]
    n = st.n_held[p]
    st.held[ix(off + n)] = x
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
    # MARKS_BY_LAST_USE: the kernel passes step_stamp(s), and the residents used in step s are
    # those last used in it, less the arrivals still state.FRESH
    return heap_victim_held(st.heap, c.pool_offset[p], p, -2 - stamp, core.freq, st.last_use,
                            st.last_use, st.held, st.n_held, core.fresh)


@jit(allocates=False, inline=True)
def end_trim(core, st, c, p):
    heap_end_trim_held(st.heap, c, p, core.freq, st.last_use, st.held, st.n_held)


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
