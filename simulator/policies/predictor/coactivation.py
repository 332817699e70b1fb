"""coactivation: the experts of layer l + d that followed this token's layer-l experts in training.

A transition table is learned on the trace's first ``train_tokens`` tokens (which are then not
scored or simulated): for each layer l, distance d and expert e, the ``successors`` experts of
layer l + d selected most often by the tokens that selected e at layer l (ties: the lower id),
each with the weight ``P(e' at l + d | e at l) = count(e at l, e' at l + d) / count(e at l)``.
A token's score of e' is the sum of those weights over the experts it selected at layer l (in
rank order); the ``top_p`` best scores (ties: the lower id) are the prediction.

Why the conditional and not the raw co-occurrence count: each selected expert casts one vote,
spread over its observed successors. With raw counts an expert selected often at layer l would
outweigh the others' evidence, and the prediction would drift toward layer l + d's overall
frequency ranking, which the ``frequency`` predictor already covers (docs/PREDICT.md compares
the two on the fixture).

Memory is bounded by the table, ``L x D x E x successors`` ids and weights (48 x 512 experts,
distance 1, 32 successors: 9.4 MB), whatever the number of training tokens; training holds one
E x E count matrix at a time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from simulator.engine.structures import insert_ranked
from simulator.jit import jit
from simulator.policies.predictor._base import StatelessReference, no_observe
from simulator.policies.predictor._ranked import ranked

NEEDS_LOOKAHEAD = False
TRAIN_TOKENS = "train_tokens"
NO_SUCCESSOR = -1
observe = no_observe  # the table is fixed once trained


@dataclass(frozen=True)
class Options:
    train_tokens: int = field(default=1024, metadata={
        "help": "coactivation: leading tokens of the trace its table is learned on (not "
                "simulated or scored), >= 1", "min": 1})
    successors: int = field(default=32, metadata={
        "help": "coactivation: successors kept per (layer, expert, distance), the table's memory "
                "bound, >= 1", "min": 1})


class State(NamedTuple):
    successors: np.ndarray  # int32[L, D, E, M]: by count descending, NO_SUCCESSOR after the last
    weights: np.ndarray  # float64[L, D, E, M]: P(successor at l + d | e at l)
    score: np.ndarray  # float64[E]: scratch, all zero between calls
    touched: np.ndarray  # int32[E]: scratch, the experts a prediction scored


def _successors(params) -> int:
    return min(int(params.options.get("successors", Options.successors)), params.num_experts)


def make_state(params, layout) -> State:
    """An untrained state (depth 0: predicts nothing until :func:`train`)."""
    L, E = params.num_layers, params.num_experts
    M = _successors(params)
    return State(np.full((L, 0, E, M), NO_SUCCESSOR, np.int32), np.zeros((L, 0, E, M)),
                 np.zeros(E), np.zeros(E, np.int32))


def train(st: State, experts: np.ndarray, max_distance: int) -> State:
    """The state learned from ``experts`` (int[N, L, k]: the training tokens' selections) for
    distances 1 .. ``max_distance`` (at most L - 1)."""
    experts = np.asarray(experts, dtype=np.int64)
    L, _, E, M = st.successors.shape
    D = min(int(max_distance), L - 1)
    successors = np.full((L, D, E, M), NO_SUCCESSOR, np.int32)
    weights = np.zeros((L, D, E, M))
    for layer in range(L - 1):
        selected = np.maximum(np.bincount(experts[:, layer].ravel(), minlength=E), 1)
        for d in range(1, min(D, L - 1 - layer) + 1):
            pairs = experts[:, layer, :, None] * E + experts[:, layer + d, None, :]
            counts = np.bincount(pairs.ravel(), minlength=E * E).reshape(E, E)
            order = np.argsort(-counts, axis=1, kind="stable")[:, :M]  # ties: the lower id
            top = np.take_along_axis(counts, order, axis=1)
            kept = top > 0
            successors[layer, d - 1] = np.where(kept, order, NO_SUCCESSOR)
            weights[layer, d - 1] = np.where(kept, top / selected[:, None], 0.0)
    return st._replace(successors=successors, weights=weights)


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    if d > st.successors.shape[1]:
        return 0
    base = (layer + d) * c.num_experts
    touched = 0
    for i in range(ch.experts.shape[2]):
        e = ch.experts[a, layer, i]
        for j in range(st.successors.shape[3]):
            f = st.successors[layer, d - 1, e, j]
            if f == NO_SUCCESSOR:
                break
            if st.score[f] == 0.0:
                st.touched[touched] = f
                touched += 1
            st.score[f] += st.weights[layer, d - 1, e, j]
    n = 0
    for j in range(touched):
        n = insert_ranked(out, n, top_p, base + st.touched[j], st.score, base)
    for j in range(touched):
        st.score[st.touched[j]] = 0.0
    return n


class Reference(StatelessReference):
    def __init__(self, sim):
        super().__init__(sim)
        self.successors = _successors(sim.params)
        self.table: dict[tuple[int, int, int], list[tuple[int, float]]] = {}  # (l, d, e) -> ranked

    def train(self, experts, max_distance):
        tokens = [[[int(e) for e in row] for row in token] for token in experts]
        L = len(tokens[0]) if tokens else 0
        self.table = {}
        for layer in range(L - 1):
            selected = Counter(e for token in tokens for e in token[layer])
            for d in range(1, min(max_distance, L - 1 - layer) + 1):
                counts: dict[int, Counter] = {}
                for token in tokens:
                    for e in token[layer]:
                        counts.setdefault(e, Counter()).update(token[layer + d])
                for e, following in counts.items():
                    best = sorted(following.items(), key=lambda kv: (-kv[1], kv[0]))
                    self.table[layer, d, e] = [(f, n / selected[e])
                                               for f, n in best[:self.successors]]

    def predict(self, chunk, a, layer, d, top_p):
        base = (layer + d) * self.num_experts
        scores: dict[int, float] = {}
        for e in chunk.experts[a, layer]:
            for f, weight in self.table.get((layer, d, int(e)), []):
                scores[base + f] = scores.get(base + f, 0.0) + weight
        return ranked(scores, top_p)
