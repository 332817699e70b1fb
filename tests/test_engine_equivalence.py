"""The Numba kernel and the reference engine agree exactly on random traces and policies, and
results do not depend on how the trace is cut into chunks."""
from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pytest
from engine_cases import RULES, assert_same, random_params, random_trace, run_both

from simulator.engine import read_options, simulate
from simulator.engine.nextuse import NEVER_GROUP, NextUseFile
from simulator.engine.params import SCOPES
from simulator.jit import jit
from simulator.policies.eviction import REGISTRY as EVICTIONS
from simulator.policies.eviction.random import splitmix64
from traces.format import open_trace, write_trace

CORE_AXES = list(itertools.product(EVICTIONS, RULES, SCOPES))


@pytest.mark.parametrize("eviction, rule, scope", CORE_AXES)
def test_engines_agree_on_every_policy(eviction, rule, scope):
    """Each eviction x miss rule x scope, with the other axes drawn at random, six traces."""
    base = CORE_AXES.index((eviction, rule, scope)) * 1000
    for case in range(6):
        rng = np.random.default_rng(base + case)
        source = random_trace(rng)
        p = random_params(rng, source.meta, eviction=eviction, rule=rule, scope=scope)
        chunk_tokens = int(rng.choice([1, 5, 1000]))
        run_both(source, p, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("seed", range(80))
def test_engines_agree_on_random_cases(seed):
    rng = np.random.default_rng(10**6 + seed)
    source = random_trace(rng)
    p = random_params(rng, source.meta)
    fast = simulate(source, p, "numba", chunk_tokens=int(rng.integers(1, 20)))
    assert_same(fast, simulate(source, p, "reference", chunk_tokens=int(rng.integers(1, 20))))


@pytest.mark.parametrize("seed", range(8))
def test_results_do_not_depend_on_chunk_size(seed):
    rng = np.random.default_rng(2 * 10**6 + seed)
    source = random_trace(rng)
    p = random_params(rng, source.meta, eviction=["belady", "lfu", "random", "lru"][seed % 4])
    whole = simulate(source, p)
    for chunk_tokens in (1, 2, 7):
        assert_same(whole, simulate(source, p, chunk_tokens=chunk_tokens))


def test_engines_agree_through_the_parquet_reader(tmp_path):
    """A written trace read back in chunks (belady walks it with iter_chunks_reversed)."""
    rng = np.random.default_rng(7)
    source = random_trace(rng, logits=True)
    path = tmp_path / "t.parquet"
    write_trace(path, source.meta, source.chunk)
    for eviction in ("belady", "lfu"):
        p = random_params(rng, source.meta, eviction=eviction, rule="rule015")
        with open_trace(path) as reader:
            fast = simulate(reader, p, chunk_tokens=5)
            assert_same(fast, simulate(reader, p, "reference", chunk_tokens=3))


@pytest.mark.parametrize("in_memory_tokens", [None, 0, 9])
def test_next_use_rows_match_a_direct_search(in_memory_tokens, monkeypatch):
    """In memory, in a file from the first chunk, or spilled to one after a few chunks."""
    import simulator.engine.nextuse as nextuse

    rng = np.random.default_rng(3)
    source = random_trace(rng)
    c = source.chunk
    L, E, K = source.meta.num_layers, source.meta.num_experts, source.meta.top_k
    if in_memory_tokens is not None:
        monkeypatch.setattr(nextuse, "IN_MEMORY_BYTES", in_memory_tokens * L * K * 4)
    with NextUseFile(source, chunk_tokens=4) as next_use:
        assert (next_use._dir is None) == (in_memory_tokens is None)
        rows = next_use.rows(0, c.num_tokens)
        assert np.array_equal(next_use.rows(5, 11), rows[5:11])
        first_use = next_use.first_use.copy()
        folder = next_use._dir.name if next_use._dir is not None else None
    assert folder is None or not os.path.exists(folder)
    for t in range(c.num_tokens):
        for layer in range(L):
            for i, e in enumerate(c.experts[t, layer]):
                later = [u for u in range(c.num_tokens)
                         if c.group[u] > c.group[t] and e in c.experts[u, layer]]
                assert rows[t, layer, i] == (c.group[later[0]] if later else NEVER_GROUP)
    for x in range(L * E):
        seen = [u for u in range(c.num_tokens) if x % E in c.experts[u, x // E]]
        assert first_use[x] == (c.group[seen[0]] if seen else NEVER_GROUP)


def test_splitmix64_is_one_generator():
    """The reference values of splitmix64 (seed 0), and the compiled function gives the same."""
    state, outputs = 0, []
    for _ in range(3):
        state, z = splitmix64(state)
        outputs.append(z)
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    compiled = jit(splitmix64)
    state = py_state = 2**64 - 12345
    for _ in range(5):
        state, z = compiled(np.uint64(state))
        py_state, py_z = splitmix64(py_state)
        assert (int(state), int(z)) == (py_state, py_z)


@pytest.mark.parametrize("top_r", [1, 4, 64])
@pytest.mark.parametrize("seed", range(6))
def test_the_top_r_walk_chooses_what_the_exact_scan_chooses(seed, top_r):
    """Logits rounded so that ties are common; the walk (top_r) against the scan (top_r=0) in
    the kernel and the reference's search over every resident: identical results."""
    rng = np.random.default_rng(3 * 10**6 + seed)
    source = random_trace(rng, logits=True)
    source.chunk.logits[:] = np.round(source.chunk.logits * 2) / 2
    source.keeps_logit_order = True  # walk as from the trace cache (ranked once, kept)
    for rule in ("rule015", "first_choice", "substitute_all"):
        p = random_params(rng, source.meta, rule=rule)
        p = dataclasses.replace(p, substitute_by="logit", miss_action="substitute",
                                options={**p.options, "top_r": top_r})
        walked = run_both(source, p, chunk_tokens=int(rng.integers(1, 20)))
        scanned = simulate(source, dataclasses.replace(p, options={**p.options, "top_r": 0}))
        assert_same(walked, scanned)


def test_the_walk_reads_the_order_and_a_policy_without_logit_substitutes_reads_no_logits():
    rng = np.random.default_rng(5)
    source = random_trace(rng, logits=True)
    while source.meta.top_k < 2:  # rule015 fetches rank 0: with k = 1 it never substitutes
        source = random_trace(rng, logits=True)
    p = random_params(rng, source.meta, rule="rule015")
    by_logit = dataclasses.replace(p, substitute_by="logit", miss_action="substitute",
                                   options={"top_r": 4})
    assert read_options(by_logit) == {"logits": "float16", "order_r": 4}
    assert read_options(dataclasses.replace(by_logit, substitute_by="frequency")) == \
        {"logits": False, "order_r": 0}
    assert read_options(dataclasses.replace(by_logit, protect_ranks=0, tau=0.0)) == \
        {"logits": False, "order_r": 0}  # fetch_all never substitutes
    assert read_options(dataclasses.replace(by_logit, miss_action="cpu")) == {"logits": False, "order_r": 0}
    # the order only from a source that keeps it: a plain pass ranks every logit for nothing
    assert read_options(by_logit, source) == {"logits": "float16", "order_r": 0}
    source.keeps_logit_order = True
    assert read_options(by_logit, source) == {"logits": "float16", "order_r": 4}


def test_top_r_stored_logits_walk_the_same_through_the_parquet_reader(tmp_path):
    """A trace that stores its top-k logits (the rest -inf, tied): the walk past the stored R and
    the scan agree, from Parquet and through the reference."""
    rng = np.random.default_rng(11)
    source = random_trace(rng, logits=True)
    while source.meta.num_experts < source.meta.top_k + 2:  # room for ids outside the stored R
        source = random_trace(rng, logits=True)
    R = source.meta.top_k  # the fewest a trace may store
    path = tmp_path / "t.parquet"
    write_trace(path, dataclasses.replace(source.meta, logits_top_r=R), source.chunk)
    for top_r in (1, R + 1, 64):
        p = random_params(rng, source.meta, rule="rule015")
        p = dataclasses.replace(p, substitute_by="logit", miss_action="substitute", options={"top_r": top_r})
        with open_trace(path) as reader:
            assert reader.meta.logits_top_r == R
            reader.keeps_logit_order = True  # walk as from the trace cache
            walked = run_both(reader, p, chunk_tokens=7)
            assert_same(walked, simulate(reader, dataclasses.replace(p, options={"top_r": 0})))


def test_runs_from_the_trace_cache_walk_and_give_what_the_parquet_pass_gives(tmp_path):
    from simulator.trace_cache import cached_source

    rng = np.random.default_rng(12)
    source = random_trace(rng, logits=True)
    while source.meta.top_k < 2 or source.meta.num_experts < source.meta.top_k + 2:  # R = 2 fits
        source = random_trace(rng, logits=True)
    path = tmp_path / "t.parquet"
    write_trace(path, source.meta, source.chunk)
    p = random_params(rng, source.meta, rule="rule015")
    p = dataclasses.replace(p, substitute_by="logit", miss_action="substitute", options={"top_r": 2})
    cached = cached_source(path, tmp_path / "cache")
    assert read_options(p, cached)["order_r"] == 2
    with open_trace(path) as reader:
        assert read_options(p, reader)["order_r"] == 0
        assert_same(simulate(reader, p), simulate(cached, p))
    assert any(cached.directory.glob("candidate_order_2.npy"))  # kept for the next run


def test_the_mass_histogram_counted_in_batches_equals_the_references():
    """More substituting decode steps in one chunk than the kernel buffers before it bins them
    (state.MASS_BUFFER): the histogram and the per-token masses still equal the reference's."""
    from engine_cases import params, trace

    from simulator.engine.state import MASS_BUFFER

    rng = np.random.default_rng(7)
    T, L, k, E = 700, 8, 2, 8
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T * L)]).reshape(T, L, k)
    gates = rng.dirichlet([1.0] * k, size=(T, L))
    logits = rng.normal(size=(T, L, E)).astype(np.float32)
    source = trace(experts, gates, logits, num_experts=E)
    p = params(source.meta, budget_experts=4, rule="substitute_all")
    fast = run_both(source, p, chunk_tokens=T)  # one chunk
    assert (fast.mass_hist[1:].sum() > MASS_BUFFER) and fast.mass_hist[1:].sum() + fast.mass_hist[0] == T * L


def test_prefetch_emits_a_prefetch_and_changes_no_value():
    """simulator.jit.prefetch (the top-R walk starts loading the next steps' order rows with it)
    compiles to the CPU's prefetch instruction, also past the array's end, and reads nothing."""
    import numba

    from simulator.jit import prefetch

    @numba.njit
    def walk(order, row):
        prefetch(order, row + order.shape[2])
        prefetch(order, order.size + 1000)  # out of range: a prefetch never faults
        return order[0, 0, 0]

    order = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    assert walk(order, 0) == 0
    assert "prefetch" in walk.inspect_asm(walk.signatures[0])
