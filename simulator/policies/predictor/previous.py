"""previous: the experts the previous decode token selected at layer l + d, in their rank order.

The baseline every cache already exploits (consecutive tokens share experts). The previous token
counts only if it is the token right before this one, a decode token (the group before): after a
prompt, and at the first token of a trace, it predicts nothing. The kernel's chunk does not name
sequences, so a sequence that starts with a decode token right after another sequence's decode
token inherits that token's experts (docs/PREDICT.md).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.jit import jit

NEEDS_LOOKAHEAD = False
TRAIN_TOKENS = None
NO_GROUP = -2  # last_group before any observation: never the group before another


class State(NamedTuple):
    last: np.ndarray  # int32[L, k]: the last observed decode token's selections per layer
    last_group: np.ndarray  # int64[L]: that token's group ordinal, NO_GROUP for none


def make_state(params, layout) -> State:
    L, K = params.num_layers, params.top_k
    return State(np.zeros((L, K), np.int32), np.full(L, NO_GROUP, np.int64))


@jit(allocates=False, inline=True)
def predict(core, st, c, ch, a, layer, d, top_p, out):
    target = layer + d
    if st.last_group[target] != ch.group[a] - 1:
        return 0
    base = target * c.num_experts
    n = min(top_p, st.last.shape[1])
    for j in range(n):
        out[j] = base + st.last[target, j]
    return n


@jit(allocates=False, inline=True)
def observe(core, st, c, ch, a, layer):
    for i in range(st.last.shape[1]):
        st.last[layer, i] = ch.experts[a, layer, i]
    st.last_group[layer] = ch.group[a]


class Reference:
    def __init__(self, sim):
        self.num_experts = sim.params.num_experts
        self.last: dict[int, tuple[int, list[int]]] = {}  # layer -> (group, experts)

    def predict(self, chunk, a, layer, d, top_p):
        group, experts = self.last.get(layer + d, (NO_GROUP, []))
        if group != int(chunk.group[a]) - 1:
            return []
        return [(layer + d) * self.num_experts + e for e in experts[:top_p]]

    def observe(self, chunk, a, layer):
        self.last[layer] = (int(chunk.group[a]), [int(e) for e in chunk.experts[a, layer]])
