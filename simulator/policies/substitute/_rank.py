"""Ranking of a step's substitute candidates, shared by the score-based variants."""
from __future__ import annotations

from simulator.jit import jit


@jit(allocates=False, inline=True)
def rank_residents(core, layer, scores, m, stamp):
    return _rank(core.layer_res, core.layer_res_n, core.mark, core.scratch, layer, scores, m, stamp)


@jit(allocates=False)
def _rank(layer_res, layer_res_n, mark, out, layer, scores, m, stamp):
    """The up to ``m`` best candidates of a step, best first, into ``core.scratch``; how many.

    Candidates are the layer's residents not marked ``stamp``, by ``scores[e]`` (float[E])
    descending, ties by the lower id. One scan serves the whole step: during a step experts only
    ever leave the eligible set (a used substitute), so the order never changes.
    """
    E = scores.shape[0]
    base = layer * E
    n = 0
    for j in range(layer_res_n[layer]):
        y = layer_res[layer, j]
        if mark[y] == stamp:
            continue
        v = scores[y - base]
        if n == m:
            w = out[n - 1]
            vw = scores[w - base]
            if v < vw or (v == vw and y > w):
                continue
            n -= 1
        k = n
        while k > 0:
            w = out[k - 1]
            vw = scores[w - base]
            if vw > v or (vw == v and w < y):
                break
            out[k] = w
            k -= 1
        out[k] = y
        n += 1
    return n


@jit(allocates=False, inline=True)
def take_next(core, n_cand, next_cand):
    """The next ranked candidate (-1 when they are used up) and the advanced cursor."""
    if next_cand < n_cand:
        return core.scratch[next_cand], next_cand + 1
    return -1, next_cand


def best_scored(sim, layer: int, selected, substituted, scores) -> int:
    """Reference: the eligible resident of ``layer`` with the highest score, or -1."""
    E = sim.params.num_experts
    base = layer * E
    best, best_score = -1, 0.0
    for e in range(E):
        x = base + e
        if sim.resident[x] and x not in selected and x not in substituted:
            if best < 0 or scores[e] > best_score:
                best, best_score = x, scores[e]
    return best
