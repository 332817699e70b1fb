"""lru's kernel hooks for small pools: each resident keyed by the ordinal of its last use, the
victim the least key of its pool (a scan the compiler vectorises).

The same victims as :mod:`simulator.policies.eviction.lru`'s linked lists: every use and
insertion takes the next ordinal (a run-wide counter), so the least key is the least recently
used resident, and a step's used residents, whose ordinals are the newest, come last, the
oldest of them first where the step used them all (as the list's head). ``lru`` chooses these
hooks (its ``kernel_hooks``) where they apply: nothing arrives in the background (an arrival's
trim keeps the step's selections, which a marked list tells and an ordinal does not), each pool
is one layer's and holds at most ``SCAN_MAX_RESIDENTS`` experts (``_base.scan_applies``), and
the keys fit 62 bits for the run's length (``num_tokens``): the ordinal (at most k uses a step,
T x L steps, and the warm-up's X inserts) above the expert's flat id x.

A use is one store (where the list moves an entry: a dozen loads and stores on the chain of
its neighbours) and a victim a pass over its pool, so the hooks pay where a step's uses
outnumber its victims: where the miss rule leaves misses to substitutes.
The keys are a ``structures.Packed`` pool.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Packed,
    make_packed,
    packed_insert,
    packed_store,
    packed_take,
)
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ignore_end_trim,
    ignore_group,
    ignore_rescale,
    ignore_select,
    scan_applies,
)

on_select, on_group, on_rescale, end_trim = ignore_select, ignore_group, ignore_rescale, ignore_end_trim


class State(NamedTuple):
    pool: Packed
    uses: np.ndarray  # int64[1]: ordinals taken so far
    id_bits: int


def id_bits_for(params, num_tokens: int) -> int | None:
    """The id's bits of the keys for a run of at most ``num_tokens`` tokens, or None where the
    keys would not fit 62 bits."""
    X = params.num_layers * params.num_experts
    id_bits = max(1, (X - 1).bit_length())
    uses = num_tokens * params.num_layers * params.top_k + X
    return id_bits if id_bits + uses.bit_length() <= 62 else None


def applies(params, layout, background: bool, num_tokens: int | None) -> bool:
    """Whether these hooks can run ``params`` (the module docstring's conditions)."""
    return (not background and scan_applies(params, layout, num_tokens)
            and id_bits_for(params, num_tokens) is not None)


def make_state(params, layout, num_tokens: int) -> State:
    X = params.num_layers * params.num_experts
    return State(make_packed(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0]),
                 np.zeros(1, np.int64), id_bits_for(params, num_tokens))


@jit(allocates=False, inline=True)
def _key(st, x):
    u = st.uses[0] + 1
    st.uses[0] = u
    return (u << st.id_bits) | np.int64(x)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    packed_insert(st.pool, c, x, p, _key(st, x))


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    packed_store(st.pool, x, _key(st, x))


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    return packed_take(st.pool, c, p, 0, st.id_bits, 0, -1)  # the least recently used: no flag
