"""belady's kernel hooks for small pools: each resident's whole key packed in one integer, the
victim the least of the pool's keys (a scan the compiler vectorises).

The same order as :mod:`simulator.policies.eviction.belady`'s heap (the furthest next selection
first, never again first of all, then the lower id; the residents used in the step last) and so
the same victims: the engines' equivalence tests run both against the one reference. A key holds,
most significant first:

- how far the expert's next selection is, as ``T x L - next step`` (0: never again), so the
  least key is the furthest;
- the expert's flat id x (ties to the lower id);
- the step of its last use in this pool (``s + X``: the warm-up's inserts are stored at steps -1
  .. -X), which no order reads: a trim's pass reads the keys whose step is the trim's own with
  bit 62 set (used in the step: after every other key), so no flag is ever stored or cleared.

A selection stores the key (its next use moves, and it is used in the step), as do an insertion
and a substitute's use; and the step it stores, in ``step[0]``, is the step of every trim after
it: the kernel calls ``on_select`` for each of a step's selections before the step's lookups
(belady reads its selections: ``KernelNeeds.selections``) and trims nothing before them where
nothing arrives in the background. ``belady`` chooses these hooks (its ``kernel_hooks``) where
they apply: nothing arrives in the background, each pool is one layer's and holds at most
``SCAN_MAX_RESIDENTS`` experts (``_base.scan_applies``), and the keys fit 62 bits for the run's
length (``num_tokens``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.nextuse import NEVER_GROUP
from simulator.engine.structures import (
    Packed,
    make_packed,
    packed_insert,
    packed_store,
    packed_take,
)
from simulator.jit import ix, jit
from simulator.policies.eviction._base import (
    ignore_end_trim,
    ignore_group,
    ignore_rescale,
    scan_applies,
)

on_group, on_rescale, end_trim = ignore_group, ignore_rescale, ignore_end_trim
KEY_BITS = 62  # bit 62 flags the step's used residents during a trim (structures.PACKED_FLAG)


class State(NamedTuple):
    pool: Packed
    far: np.ndarray  # int64[X]: the key's field of how far x's next selection is (0: never)
    step: np.ndarray  # int64[1]: the step of the last selection (every trim's)
    horizon: int  # T x L: a next step is below it
    id_shift: int  # the id's start: the step's bits
    far_shift: int  # the far field's start: step bits + id bits
    id_bits: int
    step_offset: int  # X: a stored step is s + X >= 0
    step_field: int  # the step's bits of a key


def key_widths(num_experts_total: int, num_layers: int, num_tokens: int) -> tuple[int, int, int] | None:
    """(far bits, id bits, step bits) of the packed keys for a run of at most ``num_tokens``
    tokens over X = ``num_experts_total`` experts of ``num_layers`` layers, or None where they
    do not fit 62 bits."""
    X = num_experts_total
    id_bits = max(1, (X - 1).bit_length())
    far_bits = (num_tokens * num_layers).bit_length()  # far <= T x L
    step_bits = (num_tokens * num_layers + X).bit_length()  # steps < T x L, stored + X
    return (far_bits, id_bits, step_bits) if far_bits + id_bits + step_bits <= KEY_BITS else None


def applies(params, layout, background: bool, num_tokens: int | None) -> bool:
    """Whether these hooks can run ``params`` (the module docstring's conditions)."""
    return (not background and scan_applies(params, layout, num_tokens)
            and key_widths(params.num_layers * params.num_experts, params.num_layers, num_tokens) is not None)


def make_state(params, layout, num_tokens: int, first_use=None) -> State:
    L, E = params.num_layers, params.num_experts
    X = L * E
    _, id_bits, step_bits = key_widths(X, L, num_tokens)
    horizon = num_tokens * L
    far = np.zeros(X, np.int64)
    if first_use is not None:  # belady.next_use_step of every expert, at once
        first = np.asarray(first_use, np.int64)
        seen = first != NEVER_GROUP
        far[seen] = horizon - (first[seen] * L + np.arange(X, dtype=np.int64)[seen] // E)
    return State(make_packed(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0]),
                 far, np.full(1, -X - 1, np.int64), horizon, step_bits, step_bits + id_bits, id_bits, X,
                 (1 << step_bits) - 1)


@jit(allocates=False, inline=True)
def _key(st, x, s):
    return (st.far[x] << st.far_shift) | (np.int64(x) << st.id_shift) | (s + st.step_offset)


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    packed_insert(st.pool, c, x, p, _key(st, x, s))


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    packed_store(st.pool, x, _key(st, x, s))  # a hit's key is stored already: the same


@jit(allocates=False, inline=True)
def on_select(core, st, c, chunk, t, layer, i, x, p, s):
    g = chunk.next_use[ix(t), layer, i]
    L = chunk.experts.shape[1]
    st.far[x] = 0 if g == NEVER_GROUP else st.horizon - (np.int64(g) * L + layer)
    st.step[0] = s
    packed_store(st.pool, x, _key(st, x, s))  # where x is not a member, into the spare entry


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    return packed_take(st.pool, c, p, st.id_shift, st.id_bits, st.step_field, st.step[0] + st.step_offset)
