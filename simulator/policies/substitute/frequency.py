"""frequency: the eligible resident the router selected most often (the fallback for traces
without logits; frequencies as in docs/semantics.md, decayed with ``cache.lfu_decay``)."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState, no_state
from simulator.policies.substitute._rank import best_scored, rank_residents, take_next

NEEDS_LOGITS = False
READS_FREQUENCY = True  # core.freq ranks the candidates
READS_SELECTION_MARKS = True  # eligibility: the step's selections are marked before its lookups
SCANS_LAYER_RESIDENTS = True  # every substituting step ranks the layer's resident list


State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def choose(core, st, c, chunk, a, layer, want, stamp, n_cand, next_cand):
    if n_cand < 0:
        base = layer * c.num_experts
        n_cand = rank_residents(core, layer, core.freq[base : base + c.num_experts], want, stamp)
    y, next_cand = take_next(core, n_cand, next_cand)
    return y, n_cand, next_cand


class Reference:
    def __init__(self, sim):
        self.sim = sim

    def choose(self, layer, selected, substituted, logits) -> int:
        E = self.sim.params.num_experts
        return best_scored(self.sim, layer, selected, substituted,
                           self.sim.freq[layer * E : (layer + 1) * E])
