"""Hooks shared by the predictors that remember nothing between steps."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies import NoState


def no_state(params, layout) -> NoState:
    """``make_state`` of a predictor that keeps nothing."""
    return NoState()


@jit(allocates=False, inline=True)
def no_observe(core, st, c, ch, a, layer):
    """``observe`` of a predictor that remembers nothing."""


class StatelessReference:
    """Reference twin base of such a predictor: ``observe`` does nothing."""

    def __init__(self, sim):
        self.sim = sim
        self.num_experts = sim.params.num_experts

    def observe(self, chunk, a, layer):
        pass
