"""belady: evict the resident whose next selection is furthest in the future (never again =
infinitely far); ties by the lower id.

Needs the future: a reverse pre-pass (simulator.engine.nextuse) gives every selection the group
of the same expert's next selection. An expert's next use advances at the start of each step
that selects it. Kernel: an indexed min-heap per pool keyed (0, -next-use step), re-keyed
eagerly at every selection of a resident (one sift toward the top: a next use only moves later);
small per-layer pools run the same order from packed keys, scanned
(:mod:`simulator.policies.eviction._belady_scan`, chosen by :func:`kernel_hooks`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.nextuse import NEVER_GROUP
from simulator.engine.structures import (
    Heap,
    heap_push,
    heap_rekey_before,
    make_heap,
)
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    heap_order_hooks,
    ignore_group,
    ignore_rescale,
)

on_group, on_rescale = ignore_group, ignore_rescale
NEEDS_NEXT_USE = True  # the engines run the reverse pre-pass for this policy
NEVER_STEP = 2**63 - 1  # next-use step ordinal of an expert that is never selected again


def next_use_step(next_group, layer, num_layers):
    """Step ordinal of an expert's next selection, from the group ordinal of a next-use row."""
    if next_group == NEVER_GROUP:
        return NEVER_STEP
    return next_group * num_layers + layer


_next_use_step = jit(next_use_step, allocates=False)


def kernel_hooks(params, layout, needs, num_tokens, first_use=None):
    """The packed keys of :mod:`simulator.policies.eviction._belady_scan` and their state where
    they apply (small per-layer pools, nothing in the background, a run short enough for the
    keys); None: this module's heap."""
    from simulator.policies.eviction import _belady_scan

    if not _belady_scan.applies(params, layout, needs.background, num_tokens):
        return None
    return _belady_scan, _belady_scan.make_state(params, layout, num_tokens, first_use)


class State(NamedTuple):
    heap: Heap
    zeros: np.ndarray  # float64[X]: the first key, the same for all
    neg_next: np.ndarray  # int64[X]: minus the step ordinal of the next selection


def make_state(params, layout, first_use=None):
    L, E = params.num_layers, params.num_experts
    X = L * E
    neg_next = np.full(X, -NEVER_STEP, np.int64)
    if first_use is not None:  # next_use_step of every expert, at once
        first = np.asarray(first_use, np.int64)
        seen = first != NEVER_GROUP
        neg_next[seen] = -(first[seen] * L + np.arange(X, dtype=np.int64)[seen] // E)
    heap = make_heap(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0])
    return State(heap, np.zeros(X, np.float64), neg_next)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    heap_push(st.heap, c, x, p, 0.0, st.neg_next[x])


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    pass


@jit(allocates=False, inline=True)
def on_select(core, st, c, chunk, t, layer, i, x, p, s):
    L = chunk.experts.shape[1]
    st.neg_next[x] = -_next_use_step(chunk.next_use[t, layer, i], layer, L)
    if core.resident[x]:
        heap_rekey_before(st.heap, c, x, p, 0.0, st.neg_next[x])  # a next use only moves later


LAZY_KEYS = False  # re-keyed at every selection


@jit(allocates=False, inline=True)
def heap_keys(core, st):
    """The current heap key arrays (key1[x], key2[x]) of every expert."""
    return st.zeros, st.neg_next


victim, end_trim = heap_order_hooks(heap_keys)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        L, E = sim.params.num_layers, sim.params.num_experts
        first_use = sim.first_use
        self.next_step = [NEVER_STEP] * (L * E)
        if first_use is not None:
            for x in range(L * E):
                self.next_step[x] = next_use_step(int(first_use[x]), x // E, L)

    def on_select(self, x, layer, step, token, next_group):
        if next_group is None:
            raise ValueError("eviction=belady needs next-use rows for every step")
        self.next_step[x] = next_use_step(int(next_group), layer, self.sim.params.num_layers)

    def victim(self, p, pinned):
        return min(self.candidates(p, pinned), key=lambda y: (-self.next_step[y], y))
