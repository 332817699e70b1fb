"""frequency: the experts of layer l + d the router has selected most often so far.

Frequencies are the engine's (``core.freq``: every selection of every earlier token, prompt
tokens included, decayed with ``cache.lfu_decay``; docs/semantics.md); ties go to the lower id.
Experts never selected are not predicted, so early in a trace it names fewer than ``top_p``.
"""
from __future__ import annotations

from simulator.engine.structures import insert_ranked
from simulator.jit import jit
from simulator.policies import NoState
from simulator.policies.predictor._base import StatelessReference, no_observe, no_state
from simulator.policies.predictor._ranked import ranked

NEEDS_LOOKAHEAD = False
READS_FREQUENCY = True  # core.freq ranks the predictions
TRAIN_TOKENS = None
State, make_state, observe = NoState, no_state, no_observe


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    base = (layer + d) * c.num_experts
    n = 0
    for x in range(base, base + c.num_experts):
        if core.freq[x] > 0.0:
            n = insert_ranked(out, n, top_p, x, core.freq, 0)
    return n


class Reference(StatelessReference):
    def predict(self, chunk, a, layer, d, top_p):
        E = self.num_experts
        base = (layer + d) * E
        freq = self.sim.freq
        return ranked({x: freq[x] for x in range(base, base + E) if freq[x] > 0.0}, top_p)
