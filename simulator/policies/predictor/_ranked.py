"""The top-P list the score-based predictors fill: best first, ties by the lower id."""
from __future__ import annotations

from simulator.jit import jit


@jit(allocates=False, inline=True)
def insert_ranked(out, n, top_p, x, score, offset):
    """Insert flat id ``x`` into ``out[:n]`` (sorted by ``score[y - offset]`` descending, ties by
    the lower id, at most ``top_p >= 1`` long); returns the new length."""
    s = score[x - offset]
    if n == top_p:
        y = out[n - 1]
        sy = score[y - offset]
        if s < sy or (s == sy and x > y):
            return n
        j = n - 1
    else:
        j = n
        n += 1
    while j > 0:
        y = out[j - 1]
        sy = score[y - offset]
        if sy > s or (sy == s and y < x):
            break
        out[j] = y
        j -= 1
    out[j] = x
    return n


def ranked(scores: dict[int, float], top_p: int) -> list[int]:
    """Reference: the ``top_p`` keys of ``scores`` (flat id -> score) best first, ties by lower id."""
    return sorted(scores, key=lambda x: (-scores[x], x))[:top_p]
