"""Predictors (simulator/policies/predictor): hand-built traces pin each one's predictions, and
the kernel hooks equal the reference twins on random traces."""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import params as make_params
from predict_cases import lookahead_trace, random_lookahead_trace, twin_steps

from simulator.engine.layout import make_layout
from simulator.policies.predictor import REGISTRY
from simulator.policies.predictor import coactivation as coactivation_module
from traces.errors import InputError


def predictions(source, name, distances, top_ps, train_tokens=0, options=None) -> dict:
    """(row, layer, d, P) -> prediction as flat ids; the kernel and the twin must agree."""
    out = {}
    for a, layer, d, p, kernel, twin in twin_steps(source, name, distances, top_ps, train_tokens,
                                                    options):
        assert kernel == twin, (name, a, layer, d, p)
        out[a, layer, d, p] = kernel
    return out


def test_previous_predicts_the_token_before_and_nothing_after_a_prompt():
    E = 8
    # rows: 0-1 prompt, 2-4 decode (sequence 0); 5 prompt, 6-7 decode (sequence 1)
    experts = [[[i % E, (i + 3) % E], [(2 * i) % E, (2 * i + 1) % E], [7 - i % E, (i + 5) % E]]
               for i in range(8)]
    phase = [0, 0, 1, 1, 1, 0, 1, 1]
    source = lookahead_trace(experts, num_experts=E, phase=phase, seq=[0] * 5 + [1] * 3)
    got = predictions(source, "previous", [1, 2], [1, 2, 5])
    ex = np.asarray(experts)
    for p in (1, 2, 5):
        for layer, d in ((0, 1), (0, 2), (1, 1)):
            assert got[2, layer, d, p] == [] and got[6, layer, d, p] == []  # after a prompt
            for a in (3, 4, 7):
                t = layer + d
                assert got[a, layer, d, p] == [t * E + int(e) for e in ex[a - 1, t, :p]]


def test_frequency_names_the_most_selected_experts_ties_to_the_lower_id():
    E = 4
    layer1 = [3, 1, 3, 1, 2, 2, 2]  # layer 1's expert per token; layer 0 always selects 0
    experts = [[[0], [e]] for e in layer1]
    got = predictions(lookahead_trace(experts, num_experts=E), "frequency", [1], [1, 2, 3])
    assert got[0, 0, 1, 3] == []  # nothing selected at layer 1 yet
    assert got[1, 0, 1, 3] == [E + 3]
    assert got[4, 0, 1, 1] == [E + 1]  # 1 and 3 twice each: the lower id first
    assert got[4, 0, 1, 3] == [E + 1, E + 3]  # never-selected experts are not predicted
    assert got[6, 0, 1, 3] == [E + 1, E + 2, E + 3]  # 2 twice so far: ties with 1 and 3
    assert got[6, 0, 1, 1] == [E + 1]


# training tokens (layer 0, layer 1): expert 0 is always selected at layer 0, expert 1 once
TRAIN = [[[0, 1], [3, 0]], [[0, 2], [2, 1]], [[0, 2], [2, 1]], [[0, 3], [2, 0]]]


def test_coactivation_learns_the_conditional_table_and_sums_it():
    E = 4
    source = lookahead_trace(TRAIN + [[[0, 1], [1, 2]]], num_experts=E)
    # P(f at 1 | 0 at 0) = 2: 3/4, 0: 2/4, 1: 2/4, 3: 1/4; P(f | 1) = 0: 1, 3: 1. Scores:
    # 0: 1.5, 3: 1.25, 2: 0.75, 1: 0.5 (raw co-occurrence counts would tie 0 and 2 at 3)
    got = predictions(source, "coactivation", [1], [1, 2, 4], train_tokens=4)
    assert got[4, 0, 1, 2] == [E + 0, E + 3]
    assert got[4, 0, 1, 4] == [E + 0, E + 3, E + 2, E + 1]
    assert set(got) == {(4, 0, 1, p) for p in (1, 2, 4)}  # the training part is not predicted
    params = make_params(source.meta, options={"successors": 3})
    state = coactivation_module.make_state(params, make_layout(params, source.meta))
    state = coactivation_module.train(state, np.asarray(TRAIN), max_distance=3)
    assert state.successors.shape == (2, 1, E, 3)  # distances beyond L - 1 are not kept
    np.testing.assert_array_equal(state.successors[0, 0, 0], [2, 0, 1])  # ties: the lower id
    np.testing.assert_array_equal(state.weights[0, 0, 0], [0.75, 0.5, 0.5])
    np.testing.assert_array_equal(state.successors[0, 0, 1], [0, 3, -1])
    np.testing.assert_array_equal(state.successors[1], -1)  # no layer after the last


def test_coactivation_keeps_only_its_successors_and_an_untrained_one_predicts_nothing():
    E = 4
    source = lookahead_trace(TRAIN + [[[0, 1], [1, 2]]], num_experts=E)
    # one successor each: 0 -> 2 (0.75), 1 -> 0 (tied with 3: the lower id; 1.0)
    got = predictions(source, "coactivation", [1], [4], train_tokens=4, options={"successors": 1})
    assert got[4, 0, 1, 4] == [E + 0, E + 2]
    untrained = predictions(source, "coactivation", [1], [4], train_tokens=0)
    assert all(p == [] for p in untrained.values())


def test_lookahead_reads_the_stored_order_up_to_r_and_the_depth():
    E = 8
    experts = [[[0], [1], [2], [3]], [[4], [5], [6], [7]]]
    ids = np.zeros((2, 4, 2, 3), np.int16)
    ids[0, 0, 0], ids[0, 0, 1], ids[1, 1, 0] = [5, 2, 7], [1, 0, 4], [3, 6, 0]
    got = predictions(lookahead_trace(experts, ids, num_experts=E), "lookahead", [1, 2, 3],
                      [2, 5])
    assert got[0, 0, 1, 2] == [E + 5, E + 2]
    assert got[0, 0, 2, 5] == [2 * E + 1, 2 * E + 0, 2 * E + 4]  # at most the R = 3 stored
    assert got[1, 1, 1, 5] == [2 * E + 3, 2 * E + 6, 2 * E + 0]
    assert got[0, 0, 3, 5] == []  # beyond the stored depth D = 2


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("seed", range(12))
def test_kernel_hooks_equal_the_reference_twins_on_random_traces(name, seed):
    rng = np.random.default_rng(seed)
    source = random_lookahead_trace(rng)
    L, k = source.meta.num_layers, source.meta.top_k
    train = int(rng.integers(0, 20))
    options = {"successors": int(rng.integers(1, 6))}
    got = predictions(source, name, list(range(1, L)), list(range(1, k + 3)), train, options)
    assert got  # decode steps were compared
    if name != "none":
        assert any(got.values())  # and some predicted something


def test_options_have_help_and_their_bounds_are_checked():
    fields = {f.name: f for f, _ in REGISTRY.option_fields()}
    assert set(fields) == {"train_tokens", "successors"}
    assert all(f.metadata["help"].startswith("coactivation: ") for f in fields.values())
    assert REGISTRY.options_of("coactivation", {}) == {"train_tokens": 1024, "successors": 32}
    with pytest.raises(InputError, match=r"'prefetch.successors=0' must be >= 1"):
        REGISTRY.options_of("coactivation", {"successors": 0})
    for name in REGISTRY:
        module = REGISTRY[name]
        assert module.NEEDS_LOOKAHEAD == (name == "lookahead")
        assert (module.TRAIN_TOKENS is None) == (name != "coactivation")
