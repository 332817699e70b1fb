"""Plain-value inputs and outputs shared by the Numba kernel and the reference engine.

The engines never see Hydra configs: ``simulator.run`` resolves configs, trace metadata and a
hardware profile into one :class:`SimParams`, and both engines return a :class:`SimResult`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Integer codes used inside the kernels. Names are the config values.
SCOPES = {"per_layer": 0, "global": 1}
EVICTIONS = {"lru": 0, "lfu": 1, "fifo": 2, "random": 3, "belady": 4}
MISS_ACTIONS = {"substitute": 0, "cpu": 1}
SUBSTITUTE_BY = {"logit": 0, "frequency": 1}
INITS = {"cold": 0, "frequency": 1}

# Per-rank decision codes (reference engine's step() and the emulator use them).
HIT, FETCH, FORCED_FETCH, SUBSTITUTE, CPU = 0, 1, 2, 3, 4

MASS_BINS = 100_000  # histogram of per-token-layer substituted mass over [0, 1]


@dataclass
class SimParams:
    """Everything an engine needs, as numbers and arrays. Times in microseconds, sizes in bytes."""

    num_layers: int
    num_experts: int
    top_k: int
    # cache
    scope: int  # SCOPES
    pool_budget_bytes: np.ndarray  # int64[P]; P = num_layers (per_layer) or 1 (global)
    expert_bytes: np.ndarray  # int64[L]
    eviction: int  # EVICTIONS
    lfu_decay: float  # multiplicative decay of selection frequency per group; 1.0 = none
    init: int  # INITS
    warmup_tokens: int  # tokens used to warm the cache when init = frequency (then skipped)
    # miss handling
    protect_ranks: int  # r: a miss with rank < r is always fetched
    tau: float  # a miss with g >= tau is fetched (0 = fetch all, inf = never by weight)
    miss_action: int  # MISS_ACTIONS: what happens to a miss that is not fetched
    substitute_by: int  # SUBSTITUTE_BY: logit (needs logits) or frequency fallback
    beta: float  # background admission threshold on accumulated substituted mass; inf = off
    # hardware
    pcie_latency_us: float
    pcie_bytes_per_us: float
    ssd_latency_us: float
    ssd_bytes_per_us: float
    host_ram_budget_bytes: int  # experts host RAM can hold; -1 = all (no SSD reads)
    gpu_expert_us: np.ndarray  # float64[L]: one expert call on the GPU, batch 1
    nonexpert_us: np.ndarray  # float64[L]: attention, router, shared expert of one layer
    cpu_expert_us: np.ndarray  # float64[L]: one expert call on the CPU (miss action cpu)
    seed: int = 0


@dataclass
class SimResult:
    """Raw engine outputs; ``simulator.results`` turns them into summary and tables.

    Per-token arrays cover every simulated token (warm-up tokens excluded), in trace order.
    Counters with a ``decode_`` meaning count decode steps only; prefill lookups are counted
    apart.
    """

    # per token (N simulated tokens)
    seq: np.ndarray  # int32[N]
    pos: np.ndarray  # int32[N]
    phase: np.ndarray  # int8[N]
    domain: np.ndarray  # int16[N]
    time_us: np.ndarray  # float64[N]: decode token latency; prefill: group time / group size
    stall_us: np.ndarray  # float64[N]: time waiting on synchronous fetches (same convention)
    mass: np.ndarray  # float64[N]: substituted mass summed over layers
    hits: np.ndarray  # int32[N]
    fetches: np.ndarray  # int32[N]: synchronous fetches incl. forced
    substitutions: np.ndarray  # int32[N]
    cpu_calls: np.ndarray  # int32[N]
    # per layer, decode steps (int64[L] unless noted)
    layer_calls: np.ndarray
    layer_hits: np.ndarray
    layer_fetches: np.ndarray  # incl. forced
    layer_forced_fetches: np.ndarray
    layer_substitutions: np.ndarray
    layer_first_choice_substitutions: np.ndarray
    layer_cpu_calls: np.ndarray
    layer_mass: np.ndarray  # float64[L]: summed substituted mass
    layer_background_admissions: np.ndarray
    # whole run
    prefill_lookups: int = 0
    prefill_hits: int = 0
    bytes_fetched: int = 0  # synchronous + background, host-to-device
    background_bytes: int = 0
    background_admissions: int = 0  # completed background transfers that became resident
    background_enqueued: int = 0
    ssd_reads: int = 0
    evictions: int = 0
    mass_hist: np.ndarray = field(default_factory=lambda: np.zeros(MASS_BINS + 1, np.int64))
    sim_end_us: float = 0.0
