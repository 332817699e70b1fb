"""Builders shared by the engine tests: hand-made traces, parameters, exact result comparison.

Hardware numbers are chosen so every time is an exact small number: one expert of BYTES bytes
crosses PCIe in PCIE_US = 1 + 90 / 10 us and reads from the SSD in SSD_US = 2 + 90 / 3 us.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from simulator.engine import simulate, warmup_counts
from simulator.engine.kernel import KernelSimulator
from simulator.engine.nextuse import NextUseFile, after_group
from simulator.engine.params import SCOPES, SimParams
from simulator.engine.reference import ReferenceSimulator
from simulator.metrics import SimResult
from simulator.policies.eviction import REGISTRY as EVICTIONS
from traces.format import PHASE_DECODE, ArraySource, TraceMeta, make_chunk, slice_chunk

BYTES = 90
PCIE_US = 10.0
SSD_US = 32.0
NONEXPERT_US = 5.0
GPU_US = 1.0
CPU_US = 7.0

# miss rules as (protect_ranks, tau)
RULES = {
    "fetch_all": (0, 0.0),
    "rule015": (1, 0.15),
    "first_choice": (1, math.inf),
    "substitute_all": (0, math.inf),
}


def trace(experts, gates=None, logits=None, *, num_experts=8, phase=None, seq=None,
          expert_bytes=None) -> ArraySource:
    """An in-memory trace from experts [T, L, k] (gates default to 1/k; all decode tokens of
    sequence 0 unless ``phase`` / ``seq`` say otherwise)."""
    experts = np.asarray(experts, dtype=np.int16)
    T, L, k = experts.shape
    gates = np.full((T, L, k), 1.0 / k) if gates is None else np.asarray(gates)
    phase = np.full(T, PHASE_DECODE) if phase is None else np.asarray(phase)
    seq = np.zeros(T, np.int32) if seq is None else np.asarray(seq)
    meta = TraceMeta(
        model="hand",
        num_layers=L,
        num_experts=num_experts,
        top_k=k,
        expert_bytes=list(expert_bytes or [BYTES] * L),
        has_logits=logits is not None,
    )
    chunk = make_chunk(meta, seq=seq, pos=np.arange(T), phase=phase, experts=experts,
                       weights=gates, logits=None if logits is None else np.asarray(logits))
    return ArraySource(meta, chunk)


def params(meta: TraceMeta, *, budget_experts: int = 3, budget_bytes=None,
           scope: str = "per_layer", eviction: str = "lru", rule: str = "fetch_all",
           miss_action: str = "substitute", substitute_by: str | None = None,
           init: str = "cold", **overrides) -> SimParams:
    """SimParams for ``meta`` with the test hardware; budgets in experts of layer 0's size
    unless ``budget_bytes`` (int[P]) is given."""
    L = meta.num_layers
    expert_bytes = np.asarray(meta.expert_bytes, dtype=np.int64)
    if budget_bytes is None:
        pools = L if scope == "per_layer" else 1
        budget_bytes = np.full(pools, budget_experts * int(expert_bytes[0]), np.int64)
    if substitute_by is None:
        substitute_by = "logit" if meta.has_logits else "frequency"
    protect_ranks, tau = RULES[rule]
    values = dict(
        num_layers=L,
        num_experts=meta.num_experts,
        top_k=meta.top_k,
        scope=scope,
        pool_budget_bytes=np.asarray(budget_bytes, dtype=np.int64),
        expert_bytes=expert_bytes,
        eviction=eviction,
        lfu_decay=1.0,
        init=init,
        warmup_tokens=0,
        protect_ranks=protect_ranks,
        tau=tau,
        miss_action=miss_action,
        substitute_by=substitute_by,
        beta=math.inf,
        pcie_latency_us=1.0,
        pcie_bytes_per_us=10.0,
        ssd_latency_us=2.0,
        ssd_bytes_per_us=3.0,
        host_ram_budget_bytes=-1,
        gpu_expert_us=np.full(L, GPU_US),
        nonexpert_us=np.full(L, NONEXPERT_US),
        cpu_expert_us=np.full(L, CPU_US),
        seed=0,
    )
    values.update(overrides)
    return SimParams(**values)


def random_trace(rng: np.random.Generator, logits: bool | None = None) -> ArraySource:
    """A small trace with skewed routing, random gates, prompts and decode tokens."""
    L = int(rng.integers(1, 4))
    E = int(rng.choice([4, 8, 16]))
    k = int(rng.integers(1, min(4, E) + 1))
    has_logits = bool(rng.integers(2)) if logits is None else logits
    # sequences: an optional prompt, then decode tokens
    seq, phase = [], []
    while len(seq) < 48:
        s = len(set(seq))
        if rng.random() < 0.5:
            n = int(rng.integers(1, 6))
            seq += [s] * n
            phase += [0] * n
        n = int(rng.integers(1, 12))
        seq += [s] * n
        phase += [1] * n
    T = len(seq)
    popularity = rng.zipf(1.5, size=(L, E)).astype(float)
    scores = np.log(popularity)[None] + rng.gumbel(size=(T, L, E))
    experts = np.argsort(-scores, axis=-1)[..., :k]
    weights = rng.random((T, L, k)) ** 3 + 1e-3
    meta = TraceMeta(
        model="random",
        num_layers=L,
        num_experts=E,
        top_k=k,
        expert_bytes=[int(b) for b in rng.integers(50, 400, size=L)],
        has_logits=has_logits,
        domains=["a", "b", "c"],
    )
    chunk = make_chunk(
        meta,
        seq=np.array(seq),
        pos=np.arange(T),
        phase=np.array(phase),
        experts=experts,
        weights=weights,
        logits=scores.astype(np.float32) if has_logits else None,
        domain=np.array(seq) % 3,
    )
    return ArraySource(meta, chunk)


def random_params(rng: np.random.Generator, meta: TraceMeta, eviction=None, rule=None,
                  scope=None):
    """Random policies and hardware for ``meta`` (unset axes drawn at random)."""
    L, E = meta.num_layers, meta.num_experts
    eviction = eviction or str(rng.choice(list(EVICTIONS)))
    scope = scope or str(rng.choice(list(SCOPES)))
    expert_bytes = np.asarray(meta.expert_bytes)
    fraction = rng.choice([0.0, 0.25, 0.5, 0.8])
    if scope == "per_layer":
        budget = np.floor(fraction * E).astype(np.int64) * expert_bytes
    else:
        budget = np.array([int(fraction * E * expert_bytes.sum())])
    if rule is None:
        rule = rng.choice(list(RULES) + ["random"])
    if rule == "random":
        protect_ranks, tau = int(rng.integers(0, 3)), float(rng.choice([0.1, 0.3, 0.5]))
    else:
        protect_ranks, tau = RULES[rule]
    substitute_by = "logit" if meta.has_logits and rng.random() < 0.7 else "frequency"
    return params(
        meta,
        scope=scope,
        budget_bytes=budget,
        eviction=eviction,
        substitute_by=substitute_by,
        miss_action=str(rng.choice(["substitute", "substitute", "cpu"])),
        init=str(rng.choice(["cold", "frequency"])),
        warmup_tokens=int(rng.integers(0, 12)),
        protect_ranks=protect_ranks,
        tau=tau,
        lfu_decay=float(rng.choice([1.0, 0.9, 1e-4])),  # 1e-4 renormalises within the trace
        beta=float(rng.choice([math.inf, 0.0, 0.3, 1.0])),
        host_ram_budget_bytes=int(rng.choice([-1, 0, int(expert_bytes.max()) * int(E)])),
        host_pinned_budget_bytes=int(rng.choice([-1, 0, int(expert_bytes.max()) * 2])),
        pcie_idle_latency_us=float(rng.uniform(0.5, 6.0)),
        pcie_pageable_bytes_per_us=float(rng.uniform(2.0, 20.0)),
        pcie_copy_order=str(rng.choice(["priority", "submission"])),
        token_fixed_us=float(rng.choice([0.0, 3.5])),
        step_fixed_us=float(rng.choice([0.0, 1.25])),
        pcie_latency_us=float(rng.uniform(0.5, 3.0)),
        pcie_bytes_per_us=float(rng.uniform(5.0, 50.0)),
        ssd_latency_us=float(rng.uniform(1.0, 10.0)),
        ssd_bytes_per_us=float(rng.uniform(1.0, 5.0)),
        gpu_expert_us=rng.uniform(0.2, 3.0, size=L),
        nonexpert_us=rng.uniform(1.0, 10.0, size=L),
        cpu_expert_us=rng.uniform(1.0, 20.0, size=L),
        seed=int(rng.integers(0, 2**63)),
        options={"top_r": int(rng.choice([0, 1, 4, 64]))},  # the substitute walk's R
    )


def assert_same(a: SimResult, b: SimResult) -> None:
    """Every field of two results equal, floats bit for bit."""
    for f in dataclasses.fields(SimResult):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert np.array_equal(x, y), f"{f.name}: {x} != {y}"
        else:
            assert x == y, f"{f.name}: {x} != {y}"


def run_both(source, p: SimParams, **kwargs) -> SimResult:
    """The numba result, after checking the reference engine gives exactly the same."""
    fast = simulate(source, p, "numba", **kwargs)
    assert_same(fast, simulate(source, p, "reference", **kwargs))
    return fast


def decide(source, p: SimParams):
    """Drive the reference engine step by step over a trace of decode tokens.

    Returns the simulator and its decisions [token][layer] (warm-up tokens excluded).
    """
    chunk = source.chunk
    sim = ReferenceSimulator(p, source.meta)
    if p.init == "frequency":
        counts, last_warmup_group = warmup_counts(source, p)
        sim.warm(counts)
        chunk = after_group(chunk, last_warmup_group)
    has_logits = chunk.logits.shape[0] > 0
    out = []
    for t in range(chunk.num_tokens):
        assert chunk.phase[t] == PHASE_DECODE
        sim.begin_group(PHASE_DECODE, 1, int(chunk.group[t]))
        out.append([
            sim.decode_step(layer, chunk.experts[t, layer], chunk.gates[t, layer],
                            chunk.logits[t, layer] if has_logits else None)
            for layer in range(source.meta.num_layers)
        ])
        sim.end_group()
    return sim, out


def residents_after(source, p: SimParams, tokens: int) -> set[int]:
    """Flat ids of the residents after the first ``tokens`` tokens, the same in both engines
    (belady sees the whole trace's future)."""
    found = []
    for engine in (KernelSimulator, ReferenceSimulator):
        with contextlib.ExitStack() as stack:
            next_use = None
            if p.eviction == "belady":
                next_use = stack.enter_context(NextUseFile(source))
            sim = engine(p, source.meta, None if next_use is None else next_use.first_use)
            sim.run_chunk(slice_chunk(source.chunk, 0, tokens),
                          None if next_use is None else next_use.rows(0, tokens))
            found.append({x for x in range(len(sim.resident)) if sim.resident[x]})
    assert found[0] == found[1]
    return found[0]
