"""lookahead: the routers of later layers applied at this layer ("stale gate", pre-attention).

Reads the trace's look-ahead routing (``meta.lookahead_depth``, captured by ``moe-capture
lookahead.enabled=true``): ``lookahead_ids[a, layer, d - 1]`` are layer + d's experts by their
look-ahead logit, best first; the top ``top_p`` (at most the R stored) are the prediction. A
distance beyond the depth stored, or a chunk without look-ahead, predicts nothing (the engine
refuses such a run before it starts: ``NEEDS_LOOKAHEAD``; the kernel reads no memory outside the
arrays either way).
"""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState
from simulator.policies.predictor._base import StatelessReference, no_observe, no_state

NEEDS_LOOKAHEAD = True
TRAIN_TOKENS = None
State, make_state, observe = NoState, no_state, no_observe


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    ids = ch.lookahead_ids
    if a >= ids.shape[0] or d > ids.shape[2]:
        return 0
    base = (layer + d) * c.num_experts
    n = min(top_p, ids.shape[3])
    for j in range(n):
        out[j] = base + ids[a, layer, d - 1, j]
    return n


class Reference(StatelessReference):
    def predict(self, chunk, a, layer, d, top_p):
        ids = chunk.lookahead_ids
        if ids is None or d > ids.shape[2]:
            return []
        return [(layer + d) * self.num_experts + int(e) for e in ids[a, layer, d - 1, :top_p]]
