"""Per-layer constants both engines derive from :class:`SimParams` in the same way.

Deriving them once keeps the engines' float arithmetic identical (docs/semantics.md, Link).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.engine.params import SimParams
from traces.errors import InputError
from traces.format import TraceMeta


@dataclass(frozen=True)
class Layout:
    """Pools and per-layer SSD read times. Times in microseconds, shapes noted per field."""

    pool_of_layer: np.ndarray  # int32[L]: the pool an expert of layer l lives in
    pool_budget_bytes: np.ndarray  # int64[P]
    pool_capacity: np.ndarray  # int64[P]: experts a pool can ever hold (all of its layers)
    pool_offset: np.ndarray  # int64[P]: start of the pool's segment in per-pool slot arrays
    pool_expert_bytes: np.ndarray  # int64[P]: the size of every expert the pool holds; 0 where its layers' sizes differ
    pool_largest_bytes: np.ndarray  # int64[P]: the largest expert size among the pool's layers
    ssd_us: np.ndarray  # float64[L]: ssd_latency_us + bytes / ssd_bytes_per_us
    layer_of: np.ndarray  # int32[L*E]: the layer of expert x (x // E: a load where a division costs more)


def make_layout(params: SimParams, meta: TraceMeta) -> Layout:
    """Check ``params`` against the trace's ``meta`` and derive the engines' constants."""
    L, E = params.num_layers, params.num_experts
    for name in ("num_layers", "num_experts", "top_k"):
        if getattr(params, name) != getattr(meta, name):
            raise InputError(
                f"params.{name} = {getattr(params, name)} but the trace has {getattr(meta, name)}"
            )
    per_layer = params.scope == "per_layer"
    num_pools = L if per_layer else 1
    budget = np.asarray(params.pool_budget_bytes, dtype=np.int64).reshape(-1)
    if budget.shape != (num_pools,):
        raise InputError(
            f"pool_budget_bytes has {budget.shape[0]} entries; scope needs {num_pools}"
        )
    if budget.min() < 0:
        raise InputError("pool_budget_bytes must be >= 0")
    expert_bytes = np.asarray(params.expert_bytes, dtype=np.int64)
    if expert_bytes.shape != (L,):
        raise InputError(f"expert_bytes has shape {expert_bytes.shape}; needs ({L},)")
    for name in ("gpu_expert_us", "nonexpert_us", "cpu_expert_us"):
        if np.asarray(getattr(params, name)).shape != (L,):
            raise InputError(f"{name} needs one value per MoE layer ({L})")
    pool_of_layer = np.arange(L, dtype=np.int32) if per_layer else np.zeros(L, np.int32)
    per_pool = E if per_layer else L * E
    capacity = np.full(num_pools, per_pool, dtype=np.int64)
    offset = np.arange(num_pools, dtype=np.int64) * per_pool
    eb = expert_bytes.astype(np.float64)
    if per_layer:
        uniform = largest = expert_bytes
    else:
        largest = expert_bytes.max(keepdims=True)
        uniform = largest if expert_bytes.min() == largest[0] else np.zeros(1, np.int64)
    return Layout(
        pool_of_layer=pool_of_layer,
        pool_budget_bytes=budget,
        pool_capacity=capacity,
        pool_offset=offset,
        pool_expert_bytes=uniform,
        pool_largest_bytes=largest,
        ssd_us=params.ssd_latency_us + eb / params.ssd_bytes_per_us,
        layer_of=np.repeat(np.arange(L, dtype=np.int32), E),
    )


def frequency_fill(counts: np.ndarray, params: SimParams, layout: Layout) -> list[np.ndarray]:
    """Per pool, the flat expert ids a warm cache holds (init=frequency), in fill order.

    ``counts``: int64[L*E] selection counts of the warm-up tokens. Each pool takes its experts in
    descending count (ties: lower x first) while the next one fits its budget.
    """
    L, E = params.num_layers, params.num_experts
    expert_bytes = np.asarray(params.expert_bytes, dtype=np.int64)
    fills = []
    for p, budget in enumerate(layout.pool_budget_bytes):
        xs = np.flatnonzero(layout.pool_of_layer[np.arange(L * E) // E] == p)
        order = xs[np.argsort(-counts[xs], kind="stable")]
        used = np.cumsum(expert_bytes[order // E])
        fits = int(np.searchsorted(used, budget, side="right"))  # used is non-decreasing
        fills.append(order[:fits].astype(np.int64))
    return fills
