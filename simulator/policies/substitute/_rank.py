"""Ranking of a step's substitute candidates, shared by the score-based variants."""
from __future__ import annotations

from simulator.engine.structures import insert_ranked
from simulator.jit import jit


@jit(allocates=False, inline=True)
def rank_residents(core, layer, scores, m, stamp):
    """The step's best candidates from the layer's resident list (``LIST_RESIDENTS``)."""
    return _rank(core.layer_res, core.layer_res_n, core.mark, core.scratch, layer, scores, m, stamp)


@jit(allocates=False, inline=True)
def rank_layer(core, layer, scores, m, stamp):
    """The same from every expert of the layer (for variants that scan rarely and keep no list)."""
    return _rank_all(core.resident, core.mark, core.scratch, layer, scores, m, stamp)


@jit(allocates=False)
def _rank(layer_res, layer_res_n, mark, out, layer, scores, m, stamp):
    """The up to ``m`` best candidates of a step, best first, into ``core.scratch``; how many.

    Candidates are the layer's residents not marked ``stamp``, by ``scores[e]`` (float[E])
    descending, ties by the lower id (a total order: the scan's order does not matter). One scan
    serves the whole step: during a step experts only ever leave the eligible set (a used
    substitute), so the order never changes.
    """
    base = layer * scores.shape[0]
    n = 0
    for j in range(layer_res_n[layer]):
        y = layer_res[layer, j]
        if mark[y] != stamp:
            n = insert_ranked(out, n, m, y, scores, base)
    return n


@jit(allocates=False)
def _rank_all(resident, mark, out, layer, scores, m, stamp):
    """:func:`_rank` over every expert of the layer, residents found by ``resident``."""
    E = scores.shape[0]
    base = layer * E
    n = 0
    for y in range(base, base + E):
        if resident[y] and mark[y] != stamp:
            n = insert_ranked(out, n, m, y, scores, base)
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
