"""threshold: fetch a miss if its rank is below ``protect_ranks`` or its gate weight is at least
``tau``.

fetch-every-miss: ``tau = 0``; the 0.15 rule: ``protect_ranks = 1, tau = 0.15``; first-choice:
``protect_ranks = 1, tau = inf``; substitute-every-miss: ``protect_ranks = 0, tau = inf``.
"""
from __future__ import annotations

from typing import NamedTuple

from simulator.jit import jit


class State(NamedTuple):
    protect_ranks: int  # r: a miss with rank < r is always fetched
    tau: float  # a miss with g >= tau is fetched (0 = fetch all, inf = never by weight)


def make_state(params) -> State:
    return State(int(params.protect_ranks), float(params.tau))


def fetch_on_miss(rank, gate, protect_ranks, tau):
    """True if a miss at ``rank`` with normalised gate weight ``gate`` is fetched synchronously."""
    return rank < protect_ranks or gate >= tau


_fetch_on_miss = jit(fetch_on_miss, allocates=False)


@jit(allocates=False, inline=True)
def fetch(rule, rank, gate):
    return _fetch_on_miss(rank, gate, rule.protect_ranks, rule.tau)


def can_leave_misses(rule: State, top_k: int) -> bool:
    return rule.protect_ranks < top_k and rule.tau > 0.0


class Reference:
    def __init__(self, sim):
        self.rule = make_state(sim.params)

    def fetch(self, rank: int, gate: float) -> bool:
        return fetch_on_miss(rank, gate, self.rule.protect_ranks, self.rule.tau)
