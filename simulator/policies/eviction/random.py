"""random: a uniform draw among the pool's residents with the project's splitmix64 generator.

One generator per run, state = ``seed``: slot ``j = output mod n`` of the pool's n residents,
scanning forward cyclically from slot j to the first resident not used in the step (if every
resident was used, slot j itself). Resident arrays append on insertion and swap-remove on
eviction in both engines, so both hold the same order.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import Slots, make_slots, slot_append
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ReferenceBase,
    ignore_end_trim,
    ignore_group,
    ignore_rescale,
    ignore_select,
)

on_select, on_group, on_rescale, end_trim = (ignore_select, ignore_group, ignore_rescale,
                                             ignore_end_trim)
_MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(state):
    """One step of the splitmix64 generator: ``(next_state, output)``, both unsigned 64-bit.

    Works on Python ints and, compiled, on ``np.uint64`` (where the masks are no-ops).
    """
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


_splitmix64 = jit(splitmix64, allocates=False)


class State(NamedTuple):
    slots: Slots
    rng: np.ndarray  # uint64[1]: the generator's state


def make_state(params, layout, first_use=None):
    X = params.num_layers * params.num_experts
    slots = make_slots(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0])
    return State(slots, np.array([int(params.seed) % 2**64], dtype=np.uint64))


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    slot_append(st.slots, c, x, p)


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    pass


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    return _draw(st.slots, st.rng, c.pool_offset[p], p, stamp, core.mark)


@jit(allocates=False)
def _draw(slots, rng, off, p, stamp, mark):
    n = slots.count[p]
    state, z = _splitmix64(rng[0])
    rng[0] = state
    j = np.int64(z % np.uint64(n))
    x = slots.items[off + j]
    for d in range(n):
        y = slots.items[off + (j + d) % n]
        if mark[y] != stamp:
            x = y
            break
    n -= 1
    last = slots.items[off + n]
    slots.items[off + slots.slot[x]] = last
    slots.slot[last] = slots.slot[x]
    slots.count[p] = n
    return x


class Reference(ReferenceBase):
    def __init__(self, sim):
        super().__init__(sim)
        self.rng_state = int(sim.params.seed) % 2**64

    def victim(self, p, pinned):
        members = self.sim.members[p]
        self.rng_state, z = splitmix64(self.rng_state)
        n = len(members)
        j = z % n
        for d in range(n):
            y = members[(j + d) % n]
            if y not in pinned:
                return y
        return members[j]
