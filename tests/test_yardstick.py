"""The bench's minimal kernels give fetch_all + per-layer LRU's and LFU's hits, and rule015 +
LRU's hits, substitutions and fetches, exactly (random traces)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import params, run_both, trace

from simulator.yardstick import lfu_hits, lru_hits, rule_counts


@pytest.mark.parametrize("seed", range(6))
def test_minimal_kernel_hits_equal_the_engines(seed):
    rng = np.random.default_rng(seed)
    T, L, E = int(rng.integers(5, 60)), int(rng.integers(1, 4)), int(rng.integers(4, 24))
    k = int(rng.integers(1, min(E, 5) + 1))
    skew = rng.power(0.4, size=E) + 1e-3  # a few popular experts, so there are hits
    experts = np.stack([[rng.choice(E, size=k, replace=False, p=skew / skew.sum()) for _ in range(L)]
                        for _ in range(T)])
    source = trace(experts, num_experts=E)
    for capacity in sorted({k, min(E, k + 1), min(E, 2 * k + 1), E}):
        r = run_both(source, params(source.meta, budget_experts=capacity))
        hits = lru_hits(experts, E, capacity)
        assert hits.tolist() == r.layer_hits.tolist(), capacity
        assert 0 < hits.sum() or capacity < E


@pytest.mark.parametrize("seed", range(6))
def test_minimal_lfu_kernel_hits_equal_the_engines(seed):
    """Skewed routing, so counts tie often and the ties (least recently used, then the lower id)
    decide victims."""
    rng = np.random.default_rng(200 + seed)
    T, L, E = int(rng.integers(20, 80)), int(rng.integers(1, 4)), int(rng.integers(4, 24))
    k = int(rng.integers(1, min(E, 5) + 1))
    skew = rng.power(0.4, size=E) + 1e-3
    experts = np.stack([[rng.choice(E, size=k, replace=False, p=skew / skew.sum()) for _ in range(L)]
                        for _ in range(T)])
    source = trace(experts, num_experts=E)
    for capacity in sorted({k, min(E, k + 1), min(E, 2 * k + 1), max(k, E - 1)}):
        r = run_both(source, params(source.meta, budget_experts=capacity, eviction="lfu"))
        assert lfu_hits(experts, E, capacity).tolist() == r.layer_hits.tolist(), capacity


def test_minimal_kernel_needs_room_for_a_step():
    for minimal in (lru_hits, lfu_hits):
        with pytest.raises(ValueError, match="below top-k"):
            minimal(np.zeros((1, 1, 2), np.int32) + np.arange(2), 4, 1)


@pytest.mark.parametrize("seed", range(6))
def test_minimal_rule_kernel_counts_equal_the_engines(seed):
    """Walk and exact scan against the engines at R = 0 (always the scan), 1, 4 and 64, on logits
    with ties (a few distinct values) and gates on both sides of tau."""
    rng = np.random.default_rng(100 + seed)
    T, L, E = int(rng.integers(20, 60)), int(rng.integers(1, 4)), int(rng.integers(6, 24))
    k = int(rng.integers(2, min(E - 2, 5) + 1))
    skew = rng.power(0.4, size=E) + 1e-3
    experts = np.stack([[rng.choice(E, size=k, replace=False, p=skew / skew.sum()) for _ in range(L)]
                        for _ in range(T)])
    gates = rng.random((T, L, k)) ** 2  # about 39 % below 0.15
    logits = (np.round(rng.normal(size=(T, L, E)) * 2) / 2).astype(np.float16)  # ties
    source = trace(experts, gates, logits, num_experts=E)
    stored_gates = np.concatenate([c.gates for c in source.iter_chunks()])  # as the engines read them
    substituted = 0
    for R in (0, 1, 4, 64):
        chunks = list(source.iter_chunks(order_r=R))
        order = (np.concatenate([c.logit_order for c in chunks]) if R
                 else np.zeros((T, L, 0), np.int16))
        for capacity in sorted({k, k + 1, min(E, 2 * k + 1)}):
            p = params(source.meta, budget_experts=capacity, rule="rule015", substitute_by="logit",
                       options={"top_r": R})
            r = run_both(source, p)
            counts = rule_counts(experts, stored_gates, order, logits, E, capacity,
                                 p.protect_ranks, p.tau)
            assert counts[:, 0].tolist() == r.layer_hits.tolist(), (R, capacity)
            assert counts[:, 1].tolist() == r.layer_substitutions.tolist(), (R, capacity)
            assert counts[:, 2].tolist() == r.layer_fetches.tolist(), (R, capacity)
            substituted += int(counts[:, 1].sum())
    assert substituted > 0


def test_minimal_rule_kernel_needs_full_logits():
    experts = np.zeros((1, 1, 2), np.int16) + np.arange(2, dtype=np.int16)
    with pytest.raises(ValueError, match="full logits"):
        rule_counts(experts, np.ones((1, 1, 2), np.float32), np.zeros((1, 1, 0), np.int16),
                    np.zeros((1, 1, 3), np.float16), 4, 2, 1, 0.15)
