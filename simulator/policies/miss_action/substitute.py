"""substitute: run a resident expert in place of the missing one, with the missing expert's gate
weight (the substitute family chooses which); a forced fetch when no resident is eligible."""
from __future__ import annotations

from simulator.engine.params import SUBSTITUTE
from simulator.jit import jit
from simulator.policies import NoState, no_state

USES_SUBSTITUTES = True
State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def serve(st, rank, gate):
    return SUBSTITUTE


class Reference:
    def __init__(self, sim):
        pass

    def serve(self, rank: int, gate: float) -> int:
        return SUBSTITUTE
