"""The reference side of the top-P list the score-based predictors fill (the kernel side is
simulator.engine.structures.insert_ranked): best first, ties by the lower id."""
from __future__ import annotations


def ranked(scores: dict[int, float], top_p: int) -> list[int]:
    """Reference: the ``top_p`` keys of ``scores`` (flat id -> score) best first, ties by lower id."""
    return sorted(scores, key=lambda x: (-scores[x], x))[:top_p]
