"""lfu's kernel hooks for small pools: each resident's whole key packed in one integer, the
victim the least of the pool's keys (a scan the compiler vectorises).

The same order as :mod:`simulator.policies.eviction.lfu` (fewer selections first, then used
longer ago, then the lower id; the residents used in the step last) and so the same victims:
the engines' equivalence tests run both against the one reference. ``lfu`` chooses these hooks
(its ``kernel_hooks``) where they apply:

- the frequencies do not decay (``lfu_decay`` 1: each is a count of selections, and a key that
  is stored stays right until the resident's next use: between two uses a resident's count
  cannot rise, since a selected resident is a hit, and a hit is a use);
- nothing arrives in the background (each step's used residents are then exactly those whose
  last use is the step);
- each pool is one layer's (``scope=per_layer``) and holds at most ``SCAN_MAX_RESIDENTS``
  experts: a victim costs a pass over its pool, where the heap's costs a few sifts or less (most
  of its victims are recent admissions held out of it). Measured on 4,096 tokens of the
  Qwen3-Next shape (fetch_all + LFU, CPU time of the whole run, medians of 9): per layer at
  10, 26, 51, 128, 256 and 384 residents the scan took 35.0, 31.5, 33.0, 22.6, 13.5 and 8.0 ms
  against the heap's 38.1, 40.6, 35.8, 29.4, 19.3 and 12.5; one pool for all layers at 64, 128
  and 245 residents, 51.3, 59.8 and 78.4 ms against 36.9, 36.9 and 39.8;
- the keys fit 62 bits for the run's length (``num_tokens``): the count (at most one selection
  per token and expert), the step of the last use (``step + X``: the warm-up's inserts are
  stored at steps -1 .. -X) and the expert's flat id x, most significant first.

A key is stored at every insertion and use; the trim's pass sets bit 62 on the keys whose step
is the trim's own (used in the step: above every other key, and in the same order among
themselves when all are used), so no flag is ever cleared. Per pool p its residents' keys lie in
``keys[pool_offset[p] : pool_offset[p] + count[p]]``, ``slot[x]`` is x's position in ``keys``;
a victim is swap-removed.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.jit import ix, jit
from simulator.policies.eviction._base import ignore_end_trim, ignore_group, ignore_select

on_select, on_group, end_trim = ignore_select, ignore_group, ignore_end_trim
READS_FREQUENCY = True
MARKS_BY_LAST_USE = True

# the most residents a pool may hold for the scan (its budget in experts of the pool's smallest
# size): the largest pool measured (above)
SCAN_MAX_RESIDENTS = 384
KEY_BITS = 62  # bit 62 flags the step's used residents during a trim
USED = np.int64(1 << KEY_BITS)
NO_KEY = np.int64(2**63 - 1)


class State(NamedTuple):
    keys: np.ndarray  # int64[capacity]: per pool (its segment) the residents' packed keys
    slot: np.ndarray  # int32[X]: a resident's position in keys
    count: np.ndarray  # int64[P]
    id_bits: int  # the id's bits (the step's start above them)
    freq_shift: int  # the count's start: id bits + step bits
    step_offset: int  # X: a stored step is step + X >= 0
    step_mask: int  # (1 << step bits) - 1


def key_widths(num_experts_total: int, num_layers: int, num_tokens: int) -> tuple[int, int] | None:
    """(id bits, step bits) of the packed keys for a run of at most ``num_tokens`` tokens over
    X = ``num_experts_total`` experts of ``num_layers`` layers, or None where the three fields
    do not fit 62 bits."""
    X = num_experts_total
    id_bits = max(1, (X - 1).bit_length())
    step_bits = (num_tokens * num_layers + X).bit_length()  # steps < T x L, stored + X
    freq_bits = max(1, num_tokens.bit_length())  # a count <= T
    return (id_bits, step_bits) if id_bits + step_bits + freq_bits <= KEY_BITS else None


def applies(params, layout, background: bool, num_tokens: int | None) -> bool:
    """Whether these hooks can run ``params`` (the module docstring's conditions)."""
    if num_tokens is None or background or params.lfu_decay != 1.0 or params.scope != "per_layer":
        return False
    smallest = np.array([min(int(params.expert_bytes[lay]) for lay in np.flatnonzero(layout.pool_of_layer == p))
                         for p in range(layout.pool_budget_bytes.shape[0])], np.int64)
    if (layout.pool_budget_bytes // np.maximum(smallest, 1)).max() > SCAN_MAX_RESIDENTS:
        return False
    return key_widths(params.num_layers * params.num_experts, params.num_layers, num_tokens) is not None


def make_state(params, layout, num_tokens: int) -> State:
    X = params.num_layers * params.num_experts
    id_bits, step_bits = key_widths(X, params.num_layers, num_tokens)
    return State(np.zeros(int(layout.pool_capacity.sum()), np.int64), np.zeros(X, np.int32),
                 np.zeros(layout.pool_budget_bytes.shape[0], np.int64), id_bits, id_bits + step_bits, X,
                 (1 << step_bits) - 1)


@jit(allocates=False, inline=True)
def _key(core, st, x, s):
    return ((np.int64(core.freq[x]) << st.freq_shift) | ((s + st.step_offset) << st.id_bits)
            | np.int64(x))


@jit(allocates=False, inline=True)
def on_insert(core, st, c, x, p, s):
    n = st.count[p]
    j = c.pool_offset[p] + n
    st.keys[ix(j)] = _key(core, st, x, s)
    st.slot[x] = j
    st.count[p] = n + 1


@jit(allocates=False, inline=True)
def on_use(core, st, c, x, p, s):
    st.keys[ix(st.slot[x])] = _key(core, st, x, s)


@jit(allocates=False, inline=True)
def on_rescale(core, st, c):
    pass  # never called: the frequencies do not decay


@jit(allocates=False)
def _least(keys, off, n, id_bits, step_field, step):
    """The least of ``keys[off : off + n]``, bit 62 set on those whose step field is ``step``."""
    pool = keys[off:off + n]  # indexed from 0: no index can wrap, so the loop is vectorised
    best = NO_KEY
    for j in range(pool.shape[0]):
        k = pool[j]
        best = min(best, k | (USED if (k & step_field) == step else 0))
    return best


@jit(allocates=False, inline=True)
def victim(core, st, c, p, stamp):
    # the kernel passes state.step_stamp(s) = -2 - s (MARKS_BY_LAST_USE)
    step = -2 - stamp + st.step_offset
    off = c.pool_offset[p]
    n = st.count[p]
    keys = st.keys
    x = _least(keys, off, n, st.id_bits, st.step_mask << st.id_bits, step << st.id_bits) \
        & ((np.int64(1) << st.id_bits) - 1)
    j = st.slot[x]
    n -= 1
    last = keys[ix(off + n)]
    keys[ix(j)] = last
    st.slot[last & ((np.int64(1) << st.id_bits) - 1)] = j
    st.count[p] = n
    return x
