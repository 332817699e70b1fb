"""logit: the eligible resident with the highest router logit (needs a trace with logits).

With top-R logits (``meta.logits_top_r``) the experts outside the R read as ``-inf``, so they
rank below every expert inside them and tie among themselves (the lower id wins).

The kernel walks the token-layer's ``top_r`` highest logit ids among the experts it did not
select (``chunk.logit_order``, built once when the trace is decoded and kept in the trace cache)
until it meets an eligible resident, and scans the layer's experts only when none of the
``top_r`` is eligible. A step's selected experts are never eligible, so leaving them out changes
no choice; the rest is the full ranking's prefix (logit descending, ties by the lower id), so
walk and scan give the same expert at every ``top_r``; ``top_r=0`` always scans. The walk never
meets a selected expert, so the variant needs neither the step's selections marked before its
lookups nor the layers' resident lists: the scan, which is rare at the default ``top_r``, marks
the step's selections itself (as the marking pass would have) and tests residency per expert.
Nor does the walk meet a substitute the step used: its position only moves on, past each one it
returned, so it tests residency alone, two candidates at a time (one branch for both, where a
branch per candidate is taken at random).
A step's first walk asks the CPU to load the next two steps' order rows (:func:`simulator.jit.prefetch`):
the rows are read once each, in trace order, and waiting for them was most of the walk's cost.

Logits may come as stored, float16 (``chunk.logit_bits``: the kernel reads no other logit than
the walk's order): the exact scan then converts the token-layer's row once, through a lookup
table, into the variant's own row buffer, so it ranks the same float32 values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from simulator.jit import ix, jit, prefetch
from simulator.policies.substitute._rank import best_scored, rank_layer, take_next

NEEDS_LOGITS = True
READS_SELECTION_MARKS = False  # the scan marks the step's selections itself
SCANS_LAYER_RESIDENTS = False  # the scan tests every expert of the layer


@dataclass(frozen=True)
class Options:
    top_r: int = field(default=64, metadata={
        "help": "substitute_by=logit: walk the R highest logit ids a token-layer did not select "
                "before scanning the residents (same choices at every R; 0 = always scan)", "min": 0})


class State(NamedTuple):
    f16: np.ndarray  # float32[65536]: the float32 value of each float16 bit pattern
    row: np.ndarray  # float32[E]: a token-layer's logits, converted for the exact scan


def make_state(params) -> State:
    from traces.format import F16_TO_F32

    return State(F16_TO_F32.copy(), np.zeros(params.num_experts, np.float32))


@jit(allocates=False, inline=True)
def _scan(core, st, chunk, a, layer, want, stamp):
    base = layer * st.row.shape[0]
    for i in range(chunk.experts.shape[2]):  # later ranks' selections are not eligible either
        core.mark[base + chunk.experts[a, layer, i]] = stamp
    if chunk.logit_bits.shape[0] == 0:
        return rank_layer(core, layer, chunk.logits[a, layer], want, stamp)
    bits, row, f16 = chunk.logit_bits[a, layer], st.row, st.f16
    for e in range(row.shape[0]):
        row[e] = f16[bits[e]]
    return rank_layer(core, layer, row, want, stamp)


@jit(allocates=False, inline=True)
def choose(core, st, c, chunk, a, layer, want, stamp, n_cand, next_cand):
    order = chunk.logit_order
    if n_cand < 0 and order.shape[0] > 0:  # walking the top R: next_cand is the position
        base = layer * c.num_experts
        j = next_cand
        R = order.shape[2]
        if j == 0:  # the step's first substitute: start loading the next steps' rows
            row = (a * order.shape[1] + layer) * R
            prefetch(order, row + R)
            prefetch(order, row + 2 * R)
        if j + 1 < R:  # the next two candidates tested together: one branch, not one each
            y0 = ix(base + order[a, layer, j])
            y1 = ix(base + order[a, layer, j + 1])
            ok0 = core.resident[y0] != 0
            if ok0 | (core.resident[y1] != 0):
                return (y0, n_cand, j + 1) if ok0 else (y1, n_cand, j + 2)
            j += 2
        while j < R:
            y = ix(base + order[a, layer, j])
            j += 1
            if core.resident[y]:
                return y, n_cand, j
        n_cand, next_cand = -1, 0  # none of the R is eligible: the exact scan from here on
    if n_cand < 0:
        n_cand = _scan(core, st, chunk, a, layer, want, stamp)
    y, next_cand = take_next(core, n_cand, next_cand)
    return y, n_cand, next_cand


class Reference:
    def __init__(self, sim):
        self.sim = sim

    def choose(self, layer, selected, substituted, logits) -> int:
        if logits is None:
            raise ValueError("substitute_by=logit needs the step's router logits")
        return best_scored(self.sim, layer, selected, substituted, [float(v) for v in logits])
