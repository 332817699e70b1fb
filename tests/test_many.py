"""simulate_many: many configurations over one trace equal separate runs, in list order."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from omegaconf import OmegaConf

from simulator.engine import simulate
from simulator.engine.many import simulate_many
from simulator.run import build_params, compose
from traces.format import open_trace, write_trace
from traces.sources import LimitedSource

CONFIGS = [
    ["policy=fetch_all", "cache.eviction=lru"],
    ["policy=rule015", "cache.eviction=lfu"],
    ["policy=quality_first"],
    ["policy=speed_first", "cache.fraction=0.5"],
    ["policy=fetch_all", "cache.eviction=belady"],
    ["policy=substitute_all", "cache.eviction=random", "seed=7"],
    ["policy=cpu_offload", "cache.warmup_tokens=20"],
]


def params_list(meta):
    return [build_params(OmegaConf.to_container(compose(ov), resolve=True), meta)[0]
            for ov in CONFIGS]


def assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_many_equals_separate_runs(workers, tiny_trace):
    source = tiny_trace(tokens=200)
    params = params_list(source.meta)
    many = simulate_many(source, params, workers=workers, chunk_tokens=50)
    assert len(many) == len(params)
    for p, r in zip(params, many, strict=True):
        assert_same(r, simulate(source, copy.deepcopy(p)))


def test_a_parquet_trace_is_decoded_once_into_the_cache(tiny_trace, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "cache"))
    source = tiny_trace(tokens=120)
    path = tmp_path / "t.parquet"
    write_trace(path, source.meta, source.chunk)
    params = params_list(source.meta)[:3]
    with open_trace(path) as reader:
        many = simulate_many(reader, params, workers=2)
        first = simulate_many(LimitedSource(reader, 50), params, workers=2)
    assert len(list((tmp_path / "cache" / "traces").glob("[0-9a-f]*"))) == 1
    for p, r, f in zip(params, many, first, strict=True):
        assert_same(r, simulate(source, p))
        assert_same(f, simulate(LimitedSource(source, 50), p))
