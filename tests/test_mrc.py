"""One-pass miss-ratio curves equal per-size runs of the engine (fetch_all + LRU, cold)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from omegaconf import OmegaConf

from simulator.engine import simulate
from simulator.mrc import mrc
from simulator.run import build_params, compose
from traces.errors import InputError


@pytest.fixture(scope="module")
def fetch_all_lru():
    """``params(meta, **cache)``: SimParams of fetch_all + LRU with these cache fields."""
    base = OmegaConf.to_container(compose(["policy=fetch_all", "cache.eviction=lru"]), resolve=True)

    def params(meta, **cache):
        cfg = copy.deepcopy(base)
        cfg["cache"].update(cache)
        return build_params(cfg, meta)[0]

    return params


TRACES = {
    "decode": dict(tokens=300, layers=3, experts=16, top_k=4, prompt_share=0.0),
    "prefill": dict(tokens=300, layers=3, experts=16, top_k=4, prompt_share=0.8),
    "top2-of-8": dict(tokens=400, layers=2, experts=8, top_k=2, prompt_share=0.3, seed=3),
}


@pytest.mark.parametrize("name", TRACES)
def test_per_layer_curve_equals_engine_at_every_size(name, tiny_trace, fetch_all_lru):
    source = tiny_trace(logits="none", **TRACES[name])
    E = source.meta.num_experts
    curve = mrc(source, "per_layer", chunk_tokens=37)  # chunks cut groups' neighbours apart
    for size in range(1, E + 1):
        r = simulate(source, fetch_all_lru(source.meta, fraction=min(1.0, (size + 0.5) / E)))
        assert curve.decode_lookups == int(r.layer_calls.sum())
        assert int(curve.decode_hits[size]) == int(r.layer_hits.sum()), size
        assert curve.prefill_lookups == r.prefill_lookups
        assert int(curve.prefill_hits[size]) == r.prefill_hits, size
    rate = curve.hit_rate
    assert rate[0] == 0.0 and np.all(np.diff(rate) >= 0)


@pytest.mark.parametrize("expert_bytes", [None, [300, 100, 200]])
def test_global_curve_equals_engine_at_budgets(expert_bytes, tiny_trace, fetch_all_lru):
    source = tiny_trace(logits="none", **TRACES["prefill"])
    if expert_bytes is not None:  # unequal layers: sizes count gcd units of bytes
        source.meta.expert_bytes = expert_bytes
    curve = mrc(source, "global")
    unit = max(source.meta.expert_bytes)
    for budget in (unit, 3 * unit, 7 * unit + 50, 12 * unit, 40 * unit):
        r = simulate(source, fetch_all_lru(source.meta, scope="global", budget_bytes=budget))
        size = curve.size_of(budget_bytes=budget)
        assert int(curve.decode_hits[size]) == int(r.layer_hits.sum()), budget
        assert int(curve.prefill_hits[size]) == r.prefill_hits, budget


def test_size_of_matches_the_app_rounding(tiny_trace):
    source = tiny_trace(logits="none")
    per_layer = mrc(source, "per_layer")
    assert per_layer.size_of(fraction=0.25, num_experts=16) == 4
    whole = mrc(source, "global")
    assert whole.unit_bytes == source.meta.expert_bytes[0]
    assert whole.size_of(fraction=0.5, num_experts=16, expert_bytes=source.meta.expert_bytes) == 24
    assert whole.decode_hits[whole.max_size] + whole.decode_cold == whole.decode_lookups


def test_bad_scope_is_an_input_error(tiny_trace):
    with pytest.raises(InputError, match="scope"):
        mrc(tiny_trace(), "per_pool")
