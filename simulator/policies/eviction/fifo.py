"""fifo: evict the resident inserted first (uses do not reorder).

Kernel: a doubly linked list per pool in insertion order, victim end at the head.
"""
from __future__ import annotations

import itertools

from simulator.engine.structures import list_append, list_victim
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


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    list_append(st, x, p)


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    pass


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    return list_victim(st, core.mark, p, stamp)


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self._ticks = itertools.count(1)
        self.inserted = {}

    def on_insert(self, x, step):
        self.inserted[x] = next(self._ticks)

    def victim(self, p, pinned):
        return min(self.candidates(p, pinned), key=self.inserted.__getitem__)
