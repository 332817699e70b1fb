"""lru: evict the least recently used resident first.

A use is a hit, a fetch, a substitute's use or an admission; within a step, uses are applied in
processing order (rank 0 first, a substitute's use right after the miss it replaces). Kernel: a
doubly linked list per pool, victim end at the head; a use moves the entry to the tail.
"""
from __future__ import annotations

import itertools

from simulator.engine.structures import list_append, list_to_tail, list_victim
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    ignore_end_trim,
    ignore_group,
    ignore_rescale,
    ignore_select,
    make_pool_lists,
)

on_select, on_group, on_rescale, end_trim = (ignore_select, ignore_group, ignore_rescale,
                                             ignore_end_trim)
make_state = make_pool_lists
# A use moves x to the far end of the victim order, so a step's used residents are the last
# victims: where every pool holds at least k experts a trim never reaches one, and the kernel
# need not mark a decode step's lookups for it (simulator.policies.kernel_needs).
STEP_USES_LAST = True


def kernel_hooks(params, layout, needs, num_tokens, first_use=None):
    """The ordinal-keyed scan of :mod:`simulator.policies.eviction._lru_scan` and its state where
    it applies and pays (a miss rule that leaves misses: more uses than victims a step); None:
    this module's lists."""
    from simulator.policies.eviction import _lru_scan

    if not needs.leaves_misses or not _lru_scan.applies(params, layout, needs.background, num_tokens):
        return None
    return _lru_scan, _lru_scan.make_state(params, layout, num_tokens)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    list_append(st, x, p)


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    list_to_tail(st, x, p)


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    return list_victim(st, core.mark, p, stamp)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self._ticks = itertools.count(1)
        self.used = {}

    def on_insert(self, x, step):
        self.used[x] = next(self._ticks)

    on_use = on_insert

    def victim(self, p, pinned):
        return min(self.candidates(p, pinned), key=self.used.__getitem__)
