"""Our LRU and FIFO against libCacheSim on the identical request stream (exact miss counts)."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from simulator.bench import (
    libcachesim_misses,
    request_stream,
    stream_source,
    write_oracle_general,
)
from simulator.engine import simulate
from simulator.mrc import mrc
from simulator.run import build_params, compose
from traces.format import ArraySource, TraceMeta, make_chunk

pytest.importorskip("libcachesim")

EXPERT_BYTES = 1000


def misses(source, eviction, capacity):
    cfg = OmegaConf.to_container(compose([
        "policy=fetch_all", f"cache.eviction={eviction}", "cache=global",
        f"cache.budget_bytes={capacity * EXPERT_BYTES}", "model=trace",
    ]), resolve=True)
    return int(simulate(source, build_params(cfg, source.meta)[0]).layer_fetches.sum())


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
@pytest.mark.parametrize("capacity", [4, 9, 16, 30])
def test_request_stream_misses_match_libcachesim(eviction, capacity, tiny_trace, tmp_path):
    trace = tiny_trace(tokens=400, layers=4, experts=16, top_k=4, prompt_share=0.0,
                       logits="none", expert_bytes=EXPERT_BYTES)
    keys = request_stream(trace)
    assert keys.shape == (400 * 4 * 4,)
    path = tmp_path / "stream.oracleGeneral.bin"
    write_oracle_general(keys, path)
    theirs, _ = libcachesim_misses(path, eviction, capacity, keys.shape[0])
    assert misses(stream_source(keys, EXPERT_BYTES), eviction, capacity) == theirs


def test_request_stream_lru_curve_matches_libcachesim_at_every_capacity(tiny_trace, tmp_path):
    trace = tiny_trace(tokens=300, layers=3, experts=16, top_k=4, prompt_share=0.0,
                       logits="none", expert_bytes=EXPERT_BYTES)
    keys = request_stream(trace)
    path = tmp_path / "stream.oracleGeneral.bin"
    write_oracle_general(keys, path)
    curve = mrc(stream_source(keys, EXPERT_BYTES), "global")
    for capacity in (1, 2, 5, 13, 30, 48):
        theirs, _ = libcachesim_misses(path, "lru", capacity, keys.shape[0])
        assert keys.shape[0] - int(curve.decode_hits[capacity]) == theirs, capacity


def test_token_layer_steps_keep_the_pool_through_the_step(tmp_path):
    """The documented difference: steps [A, B], [C, A] with capacity 2 (one layer)."""
    meta = TraceMeta(model="x", num_layers=1, num_experts=3, top_k=2, expert_bytes=[EXPERT_BYTES])
    experts = np.array([[[0, 1]], [[2, 0]]], np.int16)
    chunk = make_chunk(meta, seq=np.zeros(2, np.int32), pos=np.arange(2, dtype=np.int32),
                       phase=np.ones(2, np.int8), experts=experts,
                       weights=np.full((2, 1, 2), 0.5, np.float32))
    steps = ArraySource(meta, chunk)
    keys = request_stream(steps)
    path = tmp_path / "ab-ca.bin"
    write_oracle_general(keys, path)
    assert libcachesim_misses(path, "lru", 2, 4)[0] == 4
    assert misses(stream_source(keys, EXPERT_BYTES), "lru", 2) == 4
    assert misses(steps, "lru", 2) == 3


def test_request_stream_refuses_prefill(tiny_trace):
    with pytest.raises(ValueError, match="decode-only"):
        request_stream(tiny_trace(prompt_share=1.0))
