"""none: predicts nothing (prefetch off)."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState
from simulator.policies.predictor._base import StatelessReference, no_observe, no_state

NEEDS_LOOKAHEAD = False
TRAIN_TOKENS = None
State, make_state, observe = NoState, no_state, no_observe


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    return 0


class Reference(StatelessReference):
    def predict(self, chunk, a, layer, d, top_p):
        return []
