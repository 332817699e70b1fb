"""mass: substituted gate mass accumulates per expert; at ``beta`` the expert is queued.

``acc[x] += g`` on each substitution of x; at ``acc[x] >= beta`` x is queued for a background
transfer with enqueue time t1 and ``acc[x]`` resets to 0 (also when x is already queued or in
flight; it is then not queued again).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.link import enqueue
from simulator.engine.state import ADMISSION
from simulator.jit import jit


class State(NamedTuple):
    beta: float
    acc: np.ndarray  # float64[X]: substituted mass since the last admission of each expert


def make_state(params) -> State:
    return State(float(params.beta), np.zeros(params.num_layers * params.num_experts))


def accumulate(acc, gate, beta):
    """``(new_acc, admit)`` after one substitution of weight ``gate``."""
    acc = acc + gate
    if acc >= beta:
        return 0.0, True
    return acc, False


_accumulate = jit(accumulate, allocates=False, inline=True)


@jit(allocates=False, inline=True)
def on_substitute(core, st, c, link, x, gate, t1):
    new_acc, admit = _accumulate(st.acc[x], gate, st.beta)
    st.acc[x] = new_acc
    if admit:
        enqueue(core.run_counts, link, x, t1, ADMISSION, -1)


class Reference:
    def __init__(self, sim):
        self.sim = sim
        self.beta = float(sim.params.beta)
        self.acc = [0.0] * (sim.params.num_layers * sim.params.num_experts)

    def on_substitute(self, x: int, gate: float, t1: float) -> None:
        self.acc[x], admit = accumulate(self.acc[x], gate, self.beta)
        if admit:
            self.sim.link.enqueue(x, t1, ADMISSION)
