"""lookahead: the routers of later layers applied at this layer ("stale gate", pre-attention).

Reads the trace's look-ahead routing (``meta.lookahead_depth``, captured by ``moe-capture
lookahead.enabled=true``): ``lookahead_ids[a, layer, d - 1]`` are layer + d's experts by their
look-ahead logit, best first; the top ``top_p`` (at most the R stored) are the prediction.
"""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState, no_state

NEEDS_LOOKAHEAD = True
TRAIN_TOKENS = None
State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    ids = ch.lookahead_ids
    base = (layer + d) * c.num_experts
    n = min(top_p, ids.shape[3])
    for j in range(n):
        out[j] = base + ids[a, layer, d - 1, j]
    return n


@jit(allocates=False, inline=True)
def observe(core, st, c, ch, a, layer):
    pass


class Reference:
    def __init__(self, sim):
        self.num_experts = sim.params.num_experts

    def predict(self, chunk, a, layer, d, top_p):
        ids = chunk.lookahead_ids[a, layer, d - 1, :top_p]
        return [(layer + d) * self.num_experts + int(e) for e in ids]

    def observe(self, chunk, a, layer):
        pass
