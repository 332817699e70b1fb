"""none: substitutions queue nothing (admission off)."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState, no_state

State, make_state = NoState, no_state


@jit(allocates=False, inline=True)
def on_substitute(core, st, c, link, x, gate, t1):
    pass


class Reference:
    def __init__(self, sim):
        pass

    def on_substitute(self, x: int, gate: float, t1: float) -> None:
        pass
