"""window_lfu: frequency over the last W tokens; victims pinned on hand-built traces, both
engines equal on random traces at windows that expire within them."""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import params, random_params, random_trace, residents_after, run_both, trace

from simulator.run import build_params, compose
from traces.errors import InputError

# B A A C B, then D arrives into a full cache of three (as tests/test_engine_rules.py)
A, B, C, D = 1, 2, 3, 4
EXPERTS = [[[B]], [[A]], [[A]], [[C]], [[B]], [[D]], [[C]], [[A]], [[B]]]


@pytest.mark.parametrize("window, victim", [
    (2, A),  # tokens 4-5 count: B and D once, A and C never; A is the less recent
    (3, A),  # tokens 3-5: C, B, D once each, A not at all
    (5, C),  # tokens 1-5: A twice, B, C, D once; of B and C, C was used longer ago
    (64, C),  # the whole trace: plain lfu's choice (A and B twice, C once)
])
def test_the_window_decides_the_victim(window, victim):
    source = trace(EXPERTS)
    p = params(source.meta, eviction="window_lfu", options={"window_tokens": window})
    assert residents_after(source, p, 6) == {A, B, C, D} - {victim}
    run_both(source, p)


def test_a_prefill_longer_than_the_window_counts_its_last_tokens():
    """A 4-token prompt [A], [A], [A], [B] with W = 2 leaves A once and B once in the window;
    then C and D arrive: with counts A 1, B 1, C 1 at D's step, A (least recent) goes."""
    source = trace([[[A]], [[A]], [[A]], [[B]], [[C]], [[D]]], phase=[0, 0, 0, 0, 1, 1])
    p = params(source.meta, eviction="window_lfu", options={"window_tokens": 2})
    assert residents_after(source, p, 6) == {B, C, D}
    run_both(source, p)


@pytest.mark.parametrize("seed", range(12))
def test_engines_agree_with_short_windows(seed):
    rng = np.random.default_rng(9 * 10**6 + seed)
    source = random_trace(rng)
    p = random_params(rng, source.meta, eviction="window_lfu")
    p.options = {"window_tokens": int(rng.choice([1, 2, 5, 17]))}
    run_both(source, p, chunk_tokens=int(rng.choice([1, 4, 1000])))


def test_the_window_is_a_cache_option():
    c = compose(["cache.eviction=window_lfu", "cache.window_tokens=32"])
    source = trace(EXPERTS)
    p, _ = build_params(c, source.meta)
    assert p.eviction == "window_lfu" and p.options == {"window_tokens": 32}
    with pytest.raises(InputError, match="cache.window_tokens=0"):
        build_params(compose(["cache.eviction=window_lfu", "cache.window_tokens=0"]), source.meta)
