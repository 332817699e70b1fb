"""The decoded trace cache: identical chunks, re-used without Parquet, safe under concurrency."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from omegaconf import OmegaConf

import simulator.trace_cache as trace_cache
from simulator.engine import simulate
from simulator.run import build_params, compose
from simulator.trace_cache import cache_root, cached_source
from traces.format import open_trace, write_trace


@pytest.fixture
def trace_file(tiny_trace, tmp_path):
    source = tiny_trace(tokens=150, seed=4)
    path = tmp_path / "trace.parquet"
    write_trace(path, source.meta, source.chunk)
    return path


def assert_same_chunks(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if u is None or v is None:
                assert u is None and v is None, f.name
                continue
            assert u.dtype == v.dtype and u.shape == v.shape, f.name
            assert np.array_equal(u, v, equal_nan=True), f.name


@pytest.mark.parametrize("max_tokens", [None, 1, 7, 40, 1000])
def test_cached_chunks_equal_the_readers(trace_file, tmp_path, max_tokens):
    cached = cached_source(trace_file, tmp_path / "c")
    with open_trace(trace_file) as reader:
        assert cached.meta == reader.meta and cached.num_tokens == reader.num_tokens
        assert_same_chunks(cached.iter_chunks(max_tokens), reader.iter_chunks(max_tokens))
        assert_same_chunks(cached.iter_chunks_reversed(max_tokens),
                           reader.iter_chunks_reversed(max_tokens))


def test_second_open_reuses_the_copy_without_parquet(trace_file, tmp_path, monkeypatch):
    first = cached_source(trace_file, tmp_path / "c")
    assert first.built

    def no_parquet(path):
        raise AssertionError("the Parquet file was parsed again")

    monkeypatch.setattr(trace_cache, "open_trace", no_parquet)
    again = cached_source(trace_file, tmp_path / "c")
    assert not again.built and again.directory == first.directory
    assert_same_chunks(again.iter_chunks(), first.iter_chunks())


def test_the_key_is_the_content(trace_file, tmp_path, tiny_trace):
    a = cached_source(trace_file, tmp_path / "c")
    copy = tmp_path / "elsewhere.parquet"
    copy.write_bytes(trace_file.read_bytes())
    assert cached_source(copy, tmp_path / "c").directory == a.directory
    other = tiny_trace(tokens=150, seed=5)
    write_trace(trace_file, other.meta, other.chunk)  # new content at the same path
    b = cached_source(trace_file, tmp_path / "c")
    assert b.built and b.directory != a.directory


def test_concurrent_builds_leave_one_complete_copy(trace_file, tmp_path):
    with ThreadPoolExecutor(4) as pool:
        sources = list(pool.map(lambda _: cached_source(trace_file, tmp_path / "c"), range(4)))
    root = cache_root(tmp_path / "c")
    assert len({s.directory for s in sources}) == 1
    assert len(list(root.glob("[0-9a-f]*"))) == 1 and not list(root.glob(".build-*"))
    for s in sources[1:]:
        assert_same_chunks(s.iter_chunks(), sources[0].iter_chunks())


def test_cache_dir_from_environment(trace_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env" / "traces"
    assert cached_source(trace_file).directory.parent == tmp_path / "env" / "traces"


def test_simulating_from_the_cache_equals_the_reader(trace_file, tmp_path):
    cached = cached_source(trace_file, tmp_path / "c")
    for overrides in (["policy=quality_first"], ["policy=fetch_all", "cache.eviction=belady"]):
        cfg = OmegaConf.to_container(compose(overrides), resolve=True)
        params = build_params(cfg, cached.meta)[0]
        with open_trace(trace_file) as reader:
            a = simulate(reader, params, chunk_tokens=32)
        b = simulate(cached, params, chunk_tokens=32)
        assert np.array_equal(a.time_us, b.time_us) and np.array_equal(a.layer_hits, b.layer_hits)
