"""lru2 (LRU-K, K = 2): victims pinned on hand-built traces, history kept across evictions,
both engines equal on random traces."""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import params, random_params, random_trace, residents_after, run_both, trace

A, B, C, D, F = 1, 2, 3, 4, 5


def test_an_expert_used_once_goes_first():
    """B A A C B, then D into a full cache of three: B and A were used twice, C once, so C goes
    (lru would evict A, the least recently used)."""
    source = trace([[[B]], [[A]], [[A]], [[C]], [[B]], [[D]]])
    assert residents_after(source, params(source.meta, eviction="lru2"), 6) == {A, B, D}
    assert residents_after(source, params(source.meta, eviction="lru"), 6) == {B, C, D}
    run_both(source, params(source.meta, eviction="lru2"))


def test_the_oldest_second_use_goes_among_twice_used():
    """A A B B C C, then D: second last uses A 0, B 2, C 4, so A goes."""
    source = trace([[[A]], [[A]], [[B]], [[B]], [[C]], [[C]], [[D]]])
    assert residents_after(source, params(source.meta, eviction="lru2"), 7) == {B, C, D}


def test_history_survives_eviction():
    """Cache of two: A A B C D B F. B, C and D are each evicted after one use; B comes back at
    token 5 with its history (second last use 2), so at F's step A (second last use 0) goes.
    Without the retained history B would count as used once and go instead."""
    source = trace([[[A]], [[A]], [[B]], [[C]], [[D]], [[B]], [[F]]])
    p = params(source.meta, budget_experts=2, eviction="lru2")
    assert residents_after(source, p, 7) == {B, F}
    run_both(source, p)


@pytest.mark.parametrize("seed", range(12))
def test_engines_agree(seed):
    rng = np.random.default_rng(11 * 10**6 + seed)
    source = random_trace(rng)
    run_both(source, random_params(rng, source.meta, eviction="lru2"),
             chunk_tokens=int(rng.choice([1, 4, 1000])))
