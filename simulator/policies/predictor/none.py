"""none: predicts nothing (prefetch off)."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState, no_state

NEEDS_LOOKAHEAD = False
TRAIN_TOKENS = None
State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    return 0


@jit(allocates=False, inline=True)
def observe(core, st, c, ch, a, layer):
    pass


class Reference:
    def __init__(self, sim):
        pass

    def predict(self, chunk, a, layer, d, top_p):
        return []

    def observe(self, chunk, a, layer):
        pass
