"""Pieces several eviction policies share: no-op hooks and the reference twins' common parts."""
from __future__ import annotations

import numpy as np

from simulator.engine.structures import heap_end_trim, heap_victim, make_lists
from simulator.jit import jit

# the most residents a pool may hold for the packed-key hooks (its budget in experts of its
# layer's size): the largest pool measured (eviction/_lfu_scan.py)
SCAN_MAX_RESIDENTS = 384


def scan_applies(params, layout, num_tokens: int | None) -> bool:
    """Whether hooks that scan a pool of packed keys per victim (``kernel_hooks``) can run
    ``params``: the run's length is known (the keys' widths), and each pool is one layer's and
    holds at most SCAN_MAX_RESIDENTS experts (a victim costs a pass over its pool)."""
    if num_tokens is None or params.scope != "per_layer":
        return False
    sizes = np.maximum(np.asarray(params.expert_bytes, np.int64), 1)  # a pool per layer
    return bool((layout.pool_budget_bytes // sizes).max() <= SCAN_MAX_RESIDENTS)


def make_pool_lists(params, layout, first_use=None):
    """One linked list per pool over every expert (the state of list-ordered policies)."""
    return make_lists(params.num_layers * params.num_experts, layout.pool_budget_bytes.shape[0])


@jit(allocates=False, inline=True)
def ignore_select(core, st, c, chunk, t, layer, i, x, p, s):
    pass


@jit(allocates=False, inline=True)
def ignore_group(core, st, c, ch, a, b):
    pass


@jit(allocates=False, inline=True)
def ignore_rescale(core, st, c):
    pass


@jit(allocates=False, inline=True)
def ignore_end_trim(core, st, c, p):
    pass


def heap_order_hooks(heap_keys):
    """``victim`` and ``end_trim`` of a policy whose pools are indexed heaps keyed by
    ``heap_keys(core, st) -> (key1[X], key2[X])`` (the state's ``heap``)."""

    @jit(allocates=False, inline=True)
    def victim(core, st, c, p, stamp):
        key1, key2 = heap_keys(core, st)
        return heap_victim(st.heap, c.pool_offset[p], p, stamp, key1, key2, core.mark)

    @jit(allocates=False, inline=True)
    def end_trim(core, st, c, p):
        key1, key2 = heap_keys(core, st)
        heap_end_trim(st.heap, c, p, key1, key2)

    return victim, end_trim


class ReferenceBase:
    """Default twin hooks (nothing to do), and the candidates of a victim search."""

    def __init__(self, sim):
        self.sim = sim

    def on_insert(self, x: int, step: int) -> None:
        pass

    def on_use(self, x: int, step: int) -> None:
        pass

    def on_select(self, x: int, layer: int, step: int, token: int, next_group) -> None:
        pass

    def on_group(self, num_tokens: int) -> None:
        pass

    def on_rescale(self) -> None:
        pass

    def on_evict(self, x: int) -> None:
        pass

    def candidates(self, p: int, pinned: set[int]) -> list[int]:
        """Pool p's residents not pinned (used in the step), else all of them."""
        members = self.sim.members[p]
        return [y for y in members if y not in pinned] or members
