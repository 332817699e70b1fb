"""logit: the eligible resident with the highest router logit (needs a trace with logits).

With top-R logits (``meta.logits_top_r``) the experts outside the R read as ``-inf``, so they
rank below every expert inside them and tie among themselves (the lower id wins).
"""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState, no_state
from simulator.policies.substitute._rank import best_scored, rank_residents, take_next

NEEDS_LOGITS = True


State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def choose(core, st, c, chunk, a, layer, want, stamp, n_cand, next_cand):
    if n_cand < 0:
        n_cand = rank_residents(core, layer, chunk.logits[a, layer], want, stamp)
    y, next_cand = take_next(core, n_cand, next_cand)
    return y, n_cand, next_cand


class Reference:
    def __init__(self, sim):
        self.sim = sim

    def choose(self, layer, selected, substituted, logits) -> int:
        if logits is None:
            raise ValueError("substitute_by=logit needs the step's router logits")
        return best_scored(self.sim, layer, selected, substituted, [float(v) for v in logits])
