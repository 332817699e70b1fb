"""none: no prefetch."""
from __future__ import annotations

from simulator.jit import jit
from simulator.policies.prefetch._base import state


def make_state(params):
    return state(params, active=False)


@jit(allocates=False, inline=True)
def issue(core, st, c, link, n, t1, step):
    pass


class Reference:
    def __init__(self, sim):
        pass

    def issue(self, xs, t1, step):
        pass
