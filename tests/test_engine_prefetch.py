"""Prefetch (docs/semantics.md, Prefetch): hand-built traces with look-ahead routing and known
times, on both engines; random traces with prefetch on agree bit for bit.

An expert of 90 bytes copies in 10 us (tests/engine_cases.py); one GPU expert call 1 us.
"""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import BYTES, params, random_params, random_trace, run_both

from simulator.engine import simulate
from traces.format import ArraySource, TraceMeta, make_chunk

A, B, C, D = 0, 1, 2, 3


def ahead_trace(experts, predicted, num_experts=8) -> ArraySource:
    """Decode tokens of one sequence with experts [T, L, k] and, per token and layer, the
    experts the look-ahead routers rank first for the next layer ([T, L, R], best first)."""
    experts = np.asarray(experts, np.int16)
    T, L, k = experts.shape
    predicted = np.asarray(predicted, np.int16)
    R = predicted.shape[-1]
    ids = np.full((T, L, 1, R), -1, np.int16)
    logits = np.full((T, L, 1, R), -np.inf, np.float16)
    ids[:, : L - 1, 0] = predicted[:, : L - 1]
    logits[:, : L - 1, 0] = -np.arange(R, dtype=np.float16)  # descending
    meta = TraceMeta(model="hand", num_layers=L, num_experts=num_experts, top_k=k,
                     expert_bytes=[BYTES] * L, lookahead_depth=1, lookahead_top_r=R,
                     lookahead_source="moe_input")
    chunk = make_chunk(meta, seq=np.zeros(T, np.int32), pos=np.arange(T), phase=np.ones(T, np.int8),
                       experts=experts, weights=np.full((T, L, k), 1.0 / k),
                       lookahead_logits=logits, lookahead_ids=ids)
    return ArraySource(meta, chunk)


def prefetching(meta, **options):
    p = params(meta, budget_experts=1, predictor="lookahead", prefetch="topp")
    p.options.update(options)
    return p


def test_a_prefetch_in_time_is_a_hit():
    """Layer 0 fetches A (20-30 us) and prefetches B; B's copy runs 30-40 us, before layer 1's
    expert phase (51 us), so B is a hit there: the token takes 20 + 10 + 1 + 20 + 1 us."""
    source = ahead_trace([[[A], [B]]], [[[B], [A]]])
    p = prefetching(source.meta, top_p=1)
    p.nonexpert_us = np.full(2, 20.0)
    r = run_both(source, p)
    assert (r.prefetches, r.useful_prefetches, r.late_prefetches) == (1, 1, 0)
    assert r.prefetch_bytes == BYTES and r.background_bytes == BYTES
    assert r.layer_hits.tolist() == [0, 1] and r.time_us.tolist() == [52.0]
    p.predictor = "none"
    assert run_both(source, p).time_us.tolist() == [62.0]  # without prefetch B stalls 10 us


def test_a_late_prefetch_is_fetched_again_and_wasted():
    """With 5 us of non-expert compute B's prefetch (15-25 us) lands after layer 1's expert
    phase began (21 us): B is missed (late) and fetched again after it (25-35 us); the
    prefetched copy, applied at the next token's first expert phase, served nothing."""
    source = ahead_trace([[[A], [B]], [[A], [B]]], [[[B], [A]]] * 2)
    r = run_both(source, prefetching(source.meta, top_p=1))
    assert (r.prefetches, r.useful_prefetches, r.late_prefetches) == (1, 0, 1)
    assert r.wasted_prefetch_bytes == BYTES
    assert r.stall_us.tolist()[0] == 10.0 + 14.0  # A 5-15; B waits for the prefetch's copy


@pytest.mark.parametrize("cancel, copied", [(True, BYTES), (False, 2 * BYTES)])
def test_stale_prefetches_are_dropped(cancel, copied):
    """Layer 0 fetches A and C (5-25 us) and prefetches B and D. At layer 1 (expert phase at 32
    us) B's copy is on the link (25-35 us), D waits; layer 1 selects B (missed: late) and A, not
    D. When the next token's first expert phase (62 us) advances the queue, D's target step has
    passed: with cancel_stale it is dropped unplaced, else its copy runs (55-65 us)."""
    source = ahead_trace([[[A, C], [B, A]], [[A, C], [B, A]]], [[[B, D], [A, C]], [[B, A], [A, C]]])
    p = prefetching(source.meta, top_p=2, cancel_stale=cancel)
    p.pool_budget_bytes = np.full(2, 2 * BYTES)
    r = run_both(source, p)
    assert (r.prefetches, r.late_prefetches) == (2, 1)
    assert r.prefetch_bytes == copied


def test_inflight_cap():
    """A cap of one expert's bytes lets one of two predicted experts be queued."""
    source = ahead_trace([[[A, C], [B, D]]], [[[B, D], [A, C]]])
    p = prefetching(source.meta, top_p=2, max_inflight_bytes=BYTES)
    p.pool_budget_bytes = np.full(2, 2 * BYTES)
    assert run_both(source, p).prefetches == 1


def test_predictions_need_look_ahead_routing():
    source = random_trace(np.random.default_rng(0))
    p = params(source.meta, predictor="lookahead", prefetch="topp")
    with pytest.raises(Exception, match="look-ahead"):
        simulate(source, p)


PREDICTORS = ("lookahead", "previous", "frequency", "coactivation")


def random_ahead_trace(rng):
    """A random trace with 4 look-ahead ids per token-layer, or None where it has one layer."""
    base = random_trace(rng)
    T, L, k = base.chunk.experts.shape
    E = base.meta.num_experts
    if L < 2:
        return None
    order = np.argsort(-rng.gumbel(size=(T, L, E)), axis=-1)[..., :4].astype(np.int16)
    return ahead_trace(base.chunk.experts, order, num_experts=E)


@pytest.mark.parametrize("seed", range(16))
def test_engines_agree_with_prefetch(seed):
    """Every predictor in turn, with random prefetch options, against the reference."""
    rng = np.random.default_rng(12 * 10**6 + seed)
    source = random_ahead_trace(rng)
    if source is None:
        return
    L = source.meta.num_layers
    p = random_params(rng, source.meta)
    p.predictor = PREDICTORS[seed % len(PREDICTORS)]
    p.prefetch = "topp"
    p.options.update(top_p=int(rng.integers(1, 5)), max_inflight_bytes=int(rng.choice([-1, 200, 600])),
                     cancel_stale=bool(rng.integers(2)),
                     distance=1 if p.predictor == "lookahead" else int(rng.integers(1, L)),  # depth 1 stored
                     train_tokens=int(rng.integers(1, 12)), successors=int(rng.integers(1, 5)))
    p.substitute_by = "frequency"
    run_both(source, p, chunk_tokens=int(rng.choice([1, 4, 1000])))


def test_lfu_with_background_arrivals_agrees():
    """LFU tells a step's used residents by their last use also where experts arrive in the
    background (an arrival not selected stays fresh): prefetches and admissions in the same runs,
    against the reference; the runs reach selected arrivals (useful prefetches) and unselected
    ones evicted unused (wasted admissions and prefetch bytes). One predictor: each other one would
    compile every kernel again (tens of seconds each), and the predictors have tests of their own."""
    useful = wasted = 0
    for seed in range(12):
        rng = np.random.default_rng(13 * 10**6 + seed)
        source = random_ahead_trace(rng)
        if source is None:
            continue
        # fetch_all: the step's selections counted at its first arrival; rule015: before it
        p = random_params(rng, source.meta, eviction="lfu", rule=str(rng.choice(["rule015", "fetch_all"])))
        rng.choice(["lookahead", "previous"])  # drawn as before, so that each seed's other choices stay
        p.predictor, p.prefetch = "previous", "topp"
        p.options.update(top_p=int(rng.integers(1, 5)), max_inflight_bytes=-1, cancel_stale=bool(rng.integers(2)),
                         distance=1, train_tokens=int(rng.integers(1, 12)), successors=2)
        p.beta = float(rng.choice([0.0, 0.3]))
        r = run_both(source, p, chunk_tokens=int(rng.choice([1, 4, 1000])))
        useful += r.useful_prefetches
        wasted += r.wasted_admissions + r.wasted_prefetch_bytes
    assert useful > 0 and wasted > 0


def test_coactivation_trains_on_the_first_tokens_and_simulates_the_rest():
    """Its training tokens are not simulated; trained, it prefetches (untrained it could not)."""
    rng = np.random.default_rng(77)
    base = random_trace(rng)
    while base.meta.num_layers < 2 or base.chunk.num_tokens < 30:
        base = random_trace(rng)
    T = base.chunk.num_tokens
    p = random_params(rng, base.meta, rule="fetch_all")
    p.init, p.warmup_tokens = "cold", 0
    p.predictor, p.prefetch = "coactivation", "topp"
    p.options.update(top_p=base.meta.top_k, train_tokens=10, successors=4, distance=1,
                     max_inflight_bytes=-1, cancel_stale=False)
    r = run_both(base, p)
    trained = int(np.searchsorted(base.chunk.group, base.chunk.group[9], side="right"))
    assert r.phase.shape[0] == T - trained
    assert r.prefetches > 0
