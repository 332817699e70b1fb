"""Miss rule: which misses are fetched synchronously.

fetch-every-miss: ``tau = 0``; the 0.15 rule: ``protect_ranks = 1, tau = 0.15``; first-choice:
``protect_ranks = 1, tau = inf``; substitute-every-miss: ``protect_ranks = 0, tau = inf``.
"""
from __future__ import annotations


def fetch_on_miss(rank, gate, protect_ranks, tau):
    """True if a miss at ``rank`` with normalised gate weight ``gate`` is fetched synchronously."""
    return rank < protect_ranks or gate >= tau


def can_leave_misses(protect_ranks: int, tau: float, top_k: int) -> bool:
    """True if the rule leaves some miss unfetched (so the miss action can happen at all)."""
    return protect_ranks < top_k and tau > 0.0
