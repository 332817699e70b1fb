"""The bench's minimal kernel gives fetch_all + per-layer LRU's hits exactly (random traces)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import params, run_both, trace

from simulator.yardstick import lru_hits


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


def test_minimal_kernel_needs_room_for_a_step():
    with pytest.raises(ValueError, match="below top-k"):
        lru_hits(np.zeros((1, 1, 2), np.int32) + np.arange(2), 4, 1)
