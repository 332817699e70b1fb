"""cpu: compute the missing expert on the CPU (llama.cpp-style offload, Fiddler); nothing is
fetched or substituted. CPU calls run concurrently with the step's GPU experts."""
from __future__ import annotations

from simulator.engine.params import CPU
from simulator.jit import jit
from simulator.policies import NoState, no_state

USES_SUBSTITUTES = False
State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def serve(st, rank, gate):
    return CPU


class Reference:
    def __init__(self, sim):
        pass

    def serve(self, rank: int, gate: float) -> int:
        return CPU
