"""lfu's kernel hooks for small pools: each resident's whole key packed in one integer, the
victim the least of the pool's keys (a scan the compiler vectorises).

The same order as :mod:`simulator.policies.eviction.lfu` (fewer selections first, then used
longer ago, then the lower id; the residents used in the step last) and so the same victims:
the engines' equivalence tests run both against the one reference. ``lfu`` chooses these hooks
(its ``kernel_hooks``) where they apply:

- the frequencies do not decay (``lfu_decay`` 1: each is a count of selections, and a key that
  is stored stays right until the resident's next use: a selected resident is a hit, or, before
  a step's first background arrival, used by the kernel for its selections; a use stores the key);
- each pool is one layer's (``scope=per_layer``) and holds at most ``SCAN_MAX_RESIDENTS``
  experts (``_base.scan_applies``): a victim costs a pass over its pool, where the heap's costs a
  few sifts or less (most of its victims are recent admissions held out of it). Measured on
  4,096 tokens of the Qwen3-Next shape (fetch_all + LFU, CPU time of the whole run, medians of
  9): per layer at 10, 26, 51, 128, 256 and 384 residents the scan took 35.0, 31.5, 33.0, 22.6,
  13.5 and 8.0 ms against the heap's 38.1, 40.6, 35.8, 29.4, 19.3 and 12.5; one pool for all
  layers at 64, 128 and 245 residents, 51.3, 59.8 and 78.4 ms against 36.9, 36.9 and 39.8;
- the keys fit 62 bits for the run's length (``num_tokens``): the count (at most one selection
  per token and expert), the step of the last use (``step + X``: the warm-up's inserts are
  stored at steps -1 .. -X), the expert's flat id x, and a bit for a background arrival left
  fresh, most significant first.

A key is stored at every insertion and use (``structures.Packed``). The trim's pass reads the
keys whose step is the trim's own with bit 62 set (used in the step: after every other key, and
in the same order among themselves when all are used), so no flag is ever stored or cleared;
except on a background arrival that its own trim kept and that the step did not select
(``state.FRESH``, which counts as unused): ``on_fresh`` sets its bit 0, with which the pass
does not read the key as the step's, and a use stores the key without it. Below the id, the bit
never decides an order.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.structures import (
    Packed,
    make_packed,
    packed_flag,
    packed_insert,
    packed_store,
    packed_take,
)
from simulator.jit import jit
from simulator.policies.eviction._base import (
    ignore_end_trim,
    ignore_group,
    ignore_select,
    scan_applies,
)

on_select, on_group, end_trim = ignore_select, ignore_group, ignore_end_trim
KEY_BITS = 62  # bit 62 flags the step's used residents during a trim (structures.PACKED_FLAG)


class State(NamedTuple):
    pool: Packed
    id_bits: int  # the id's bits, from bit 1 (bit 0: fresh)
    step_shift: int  # the step's start: id bits + 1
    freq_shift: int  # the count's start: step shift + step bits
    step_offset: int  # X: a stored step is step + X >= 0
    used_field: int  # the step's bits and the fresh bit of a key


def key_widths(num_experts_total: int, num_layers: int, num_tokens: int) -> tuple[int, int] | None:
    """(id bits, step bits) of the packed keys for a run of at most ``num_tokens`` tokens over
    X = ``num_experts_total`` experts of ``num_layers`` layers, or None where the fields do not
    fit 62 bits."""
    X = num_experts_total
    id_bits = max(1, (X - 1).bit_length())
    step_bits = (num_tokens * num_layers + X).bit_length()  # steps < T x L, stored + X
    freq_bits = max(1, num_tokens.bit_length())  # a count <= T
    return (id_bits, step_bits) if id_bits + 1 + step_bits + freq_bits <= KEY_BITS else None


def applies(params, layout, background: bool, num_tokens: int | None) -> bool:
    """Whether these hooks can run ``params`` (the module docstring's conditions)."""
    return (params.lfu_decay == 1.0 and scan_applies(params, layout, num_tokens)
            and key_widths(params.num_layers * params.num_experts, params.num_layers, num_tokens) is not None)


def make_state(params, layout, num_tokens: int) -> State:
    X = params.num_layers * params.num_experts
    id_bits, step_bits = key_widths(X, params.num_layers, num_tokens)
    step_shift = id_bits + 1
    return State(make_packed(int(layout.pool_capacity.sum()), X, layout.pool_budget_bytes.shape[0]),
                 id_bits, step_shift, step_shift + step_bits, X,
                 (((1 << step_bits) - 1) << step_shift) | 1)


@jit(allocates=False, inline=True)
def _key(core, st, x, s):
    return ((np.int64(core.freq[x]) << st.freq_shift) | ((s + st.step_offset) << st.step_shift)
            | (np.int64(x) << 1))


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    packed_insert(st.pool, c, x, p, _key(core, st, x, s))


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    # before a background arrival the kernel uses every selection, resident or not: a
    # non-resident's key goes to the pool's spare entry
    packed_store(st.pool, x, _key(core, st, x, s))


@jit(allocates=False, inline=True)
def on_fresh(core, st, c, x, p):
    """x, a background arrival its own trim kept, is not used in the step (state.FRESH)."""
    packed_flag(st.pool, x, np.int64(1))


@jit(allocates=False, inline=True)
def on_rescale(core, st, c):
    pass  # never called: the frequencies do not decay


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    # the kernel passes state.step_stamp(s) = -2 - s (MARKS_BY_LAST_USE)
    return packed_take(st.pool, c, p, 1, st.id_bits, st.used_field, (-2 - stamp + st.step_offset) << st.step_shift)
