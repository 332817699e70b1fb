"""Synthetic traces (parametric and fitted): deterministic, skewed like real routing, logits
consistent with the top-k."""
from __future__ import annotations

import math

import numpy as np
import pytest

from traces.errors import InputError
from traces.fit import reshape_fit
from traces.format import PHASE_DECODE, PHASE_PREFILL, read_trace
from traces.synth import (
    BLOCK_TOKENS,
    RoutingFit,
    fitted_trace,
    load_preset,
    synth_trace,
    write_fitted_trace,
    write_synth_trace,
)

SHAPE = dict(tokens=2500, layers=8, experts=64, top_k=4)  # crosses block boundaries


@pytest.fixture(scope="module")
def trace():
    return synth_trace(**SHAPE, seed=7, logits="full")


def top_share(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer: share of calls taken by the top 10 % of experts."""
    top = math.ceil(0.1 * num_experts)
    shares = []
    for layer in range(experts.shape[1]):
        counts = np.sort(np.bincount(experts[:, layer].ravel(), minlength=num_experts))[::-1]
        shares.append(counts[:top].sum() / counts.sum())
    return np.array(shares)


def test_same_seed_same_trace_other_seed_other_trace(trace):
    meta, chunk = trace
    meta2, again = synth_trace(**SHAPE, seed=7, logits="full")
    assert meta == meta2
    for name in ("seq", "pos", "phase", "domain", "experts", "gates", "logits"):
        np.testing.assert_array_equal(getattr(again, name), getattr(chunk, name))
    _, other = synth_trace(**SHAPE, seed=8, logits="full")
    assert not np.array_equal(other.experts, chunk.experts)


def test_without_logits_the_same_experts_and_weights(trace):
    _, chunk = trace
    meta, plain = synth_trace(**SHAPE, seed=7, logits="none")
    assert not meta.has_logits and plain.logits.shape == (0, 8, 64)
    np.testing.assert_array_equal(plain.experts, chunk.experts)
    np.testing.assert_array_equal(plain.gates, chunk.gates)


def test_logits_top_k_are_the_experts_in_rank_order_and_weights_their_softmax(trace):
    meta, chunk = trace
    order = np.argsort(-chunk.logits, axis=-1, kind="stable")
    np.testing.assert_array_equal(order[..., : meta.top_k], chunk.experts)
    top = np.take_along_axis(chunk.logits, chunk.experts.astype(np.int64), axis=-1)
    assert (np.diff(top, axis=-1) < 0).all()  # strictly ordered, no ties
    masked = chunk.logits.copy()
    np.put_along_axis(masked, chunk.experts.astype(np.int64), -np.inf, axis=-1)
    assert (masked.max(axis=-1) < top[..., -1]).all()
    softmax = np.exp(top - top[..., :1])
    softmax /= softmax.sum(-1, keepdims=True)
    np.testing.assert_allclose(chunk.gates, softmax, rtol=1e-5, atol=1e-7)
    assert (np.diff(chunk.gates, axis=-1) <= 0).all()


def test_popularity_is_skewed_and_flatter_in_early_layers(trace):
    meta, chunk = trace
    share = top_share(chunk.experts, meta.num_experts)
    assert share.min() > 0.2, share  # the top 10 % take clearly more than 10 % of calls
    assert share[:2].mean() + 0.05 < share[-2:].mean(), share


def test_structure_sequences_prompts_domains_and_reuse(trace):
    meta, chunk = trace
    decode = chunk.phase == PHASE_DECODE
    assert (chunk.phase == PHASE_PREFILL).any() and decode.any()
    assert np.unique(chunk.seq).size >= 3
    assert len(meta.domains) == 4 and np.unique(chunk.domain).size >= 2
    for s in np.unique(chunk.seq):  # a prompt comes first, then decode
        phases = chunk.phase[chunk.seq == s]
        assert (np.diff(phases) >= 0).all()
        assert (chunk.pos[chunk.seq == s] == np.arange(phases.size)).all()
    # temporal reuse: consecutive decode tokens share more experts than distant ones do
    t = np.flatnonzero(decode[1:] & decode[:-1] & (chunk.seq[1:] == chunk.seq[:-1])) + 1

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        return float((chunk.experts[a][..., :, None] == chunk.experts[b][..., None, :]).any(-1).mean())

    far = np.random.default_rng(0).permutation(t)
    same_domain = chunk.domain[t] == chunk.domain[far]
    assert overlap(t, t - 1) > overlap(t[same_domain], far[same_domain]) + 0.1


def test_streamed_file_equals_the_in_memory_trace(trace, tmp_path):
    meta, chunk = trace
    path = tmp_path / "synth.parquet"
    assert SHAPE["tokens"] > 2 * BLOCK_TOKENS
    write_synth_trace(path, **SHAPE, seed=7, logits="full")
    meta2, read = read_trace(path)
    assert meta2 == meta
    for name in ("seq", "pos", "phase", "domain", "experts", "group"):
        np.testing.assert_array_equal(getattr(read, name), getattr(chunk, name))
    np.testing.assert_allclose(read.gates, chunk.gates, rtol=1e-6)
    np.testing.assert_array_equal(read.logits, chunk.logits)  # already float16 values


def test_expert_bytes_default_and_override():
    meta, _ = synth_trace(tokens=10, layers=2, experts=8, top_k=2, seed=0, logits="none")
    assert meta.expert_bytes == [2048 * 512 * 3 * 2] * 2
    meta, _ = synth_trace(tokens=10, layers=2, experts=8, top_k=2, seed=0, logits="none", expert_bytes=123)
    assert meta.expert_bytes == [123, 123] and meta.extra["synth"]["seed"] == 0


def test_top_k_equal_to_experts_and_heavy_skew_terminate():
    _, chunk = synth_trace(tokens=50, layers=2, experts=6, top_k=6, seed=1, skew_first=6, skew_last=6,
                           logits="full")
    assert (np.sort(chunk.experts, axis=-1) == np.arange(6)).all()


@pytest.mark.parametrize("option, value, words", [
    ("top_k", 9, "'top_k' (--top-k)"),
    ("reuse", 1.0, "'reuse' (--reuse)"),
    ("logits", "some", "'logits'"),
    ("tokens", 0, "'tokens'"),
])
def test_bad_options_name_the_option(option, value, words):
    args = dict(tokens=10, layers=2, experts=8, top_k=2, seed=0, logits="none")
    args[option] = value
    with pytest.raises(InputError) as caught:
        synth_trace(**args)
    assert words in str(caught.value) and "\n" not in str(caught.value)


# The fitted model (RoutingFit): drawn from the bundled fit of the public Qwen3-30B trace, cut
# down to a small shape so that the tests stay fast.
@pytest.fixture(scope="module")
def small_fit():
    base = load_preset("qwen3_30b_a3b_route")
    fit = reshape_fit(base, 32, 4, model="small", expert_bytes=1000, sequences=[[20, 300, -1], [0, 500, -1]])
    return fit


def test_fitted_logits_top_k_are_the_experts_and_gates_their_softmax(small_fit):
    meta, chunk = fitted_trace(small_fit, 1500, seed=2, logits="full")
    order = np.argsort(-chunk.logits, axis=-1, kind="stable")
    np.testing.assert_array_equal(order[..., :4], chunk.experts)
    top = np.take_along_axis(chunk.logits, chunk.experts.astype(np.int64), axis=-1)
    assert (np.diff(top, axis=-1) < 0).all()
    softmax = np.exp(top - top[..., :1])
    softmax /= softmax.sum(-1, keepdims=True)
    np.testing.assert_allclose(chunk.gates, softmax, rtol=1e-5, atol=1e-7)
    assert meta.extra["fit"]["experts"] == 32 and meta.source == "synth"
    _, plain = fitted_trace(small_fit, 1500, seed=2, logits="none")
    np.testing.assert_array_equal(plain.experts, chunk.experts)
    np.testing.assert_array_equal(plain.gates, chunk.gates)


def test_fitted_top_r_logits_keep_the_r_highest(small_fit):
    meta, full = fitted_trace(small_fit, 600, seed=4, logits="full")
    meta_r, top = fitted_trace(small_fit, 600, seed=4, logits="top:6")
    assert meta_r.logits_top_r == 6 and not meta.logits_top_r
    kept = np.isfinite(top.logits)
    assert (kept.sum(axis=-1) == 6).all()
    np.testing.assert_array_equal(top.logits[kept], full.logits[kept])
    sixth = np.sort(full.logits, axis=-1)[..., -6]
    assert (full.logits[~kept] <= np.repeat(sixth[..., None], 32, axis=-1)[~kept]).all()


def test_fitted_trace_file_reads_back_and_repeats_byte_for_byte(small_fit, tmp_path):
    a, b, c = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.parquet"
    write_fitted_trace(a, small_fit, 2500, seed=5, logits="full")
    write_fitted_trace(b, small_fit, 2500, seed=5, logits="full")
    write_fitted_trace(c, small_fit, 2500, seed=6, logits="full")
    assert a.read_bytes() == b.read_bytes()
    meta, read = read_trace(a)  # the reader validates schema, metadata and every value
    assert RoutingFit.from_dict(meta.extra["fit"], "a") == small_fit
    _, memory = fitted_trace(small_fit, 2500, seed=5, logits="full")
    for name in ("seq", "pos", "phase", "experts", "group"):
        np.testing.assert_array_equal(getattr(read, name), getattr(memory, name))
    np.testing.assert_array_equal(read.logits, memory.logits)
    assert not np.array_equal(read_trace(c)[1].experts, read.experts)


def test_fitted_trace_prefix_is_the_shorter_trace_and_layout_repeats(small_fit):
    _, long = fitted_trace(small_fit, 2 * BLOCK_TOKENS + 100, seed=1, logits="full")
    _, short = fitted_trace(small_fit, 700, seed=1, logits="full")
    np.testing.assert_array_equal(long.experts[:700], short.experts)
    np.testing.assert_array_equal(long.logits[:700], short.logits)
    starts = np.flatnonzero(np.diff(long.seq, prepend=-1))
    lengths = np.diff(np.append(starts, long.seq.size))
    assert lengths[:4].tolist() == [300, 500, 300, 500]
    assert (long.phase[starts[0]:starts[0] + 20] == PHASE_PREFILL).all()
    assert (long.phase[starts[1]:starts[2]] == PHASE_DECODE).all()


@pytest.mark.parametrize("value", ["top:3", "top:x", "top:65", "half"])
def test_bad_logits_option_names_it(value):
    with pytest.raises(InputError) as caught:
        synth_trace(tokens=10, layers=2, experts=64, top_k=4, seed=0, logits=value)
    assert "'logits' (--logits)" in str(caught.value) and "top:R" in str(caught.value)


def test_parametric_top_r_logits():
    meta, chunk = synth_trace(tokens=300, layers=2, experts=16, top_k=2, seed=1, logits="top:5")
    assert meta.logits_top_r == 5 and (np.isfinite(chunk.logits).sum(axis=-1) == 5).all()


def test_fitted_top_k_equal_to_experts_and_steep_weights_terminate():
    fit = reshape_fit(load_preset("qwen3_30b_a3b_route"), 6, 6, model="all", expert_bytes=10,
                      sequences=[[3, 40, -1]], popularity_scale=5.0, recency_scale=5.0)
    _, chunk = fitted_trace(fit, 100, seed=0, logits="full")
    assert (np.sort(chunk.experts, axis=-1) == np.arange(6)).all()
    np.testing.assert_array_equal(np.argsort(-chunk.logits, axis=-1, kind="stable"), chunk.experts)
