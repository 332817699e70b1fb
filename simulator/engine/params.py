"""Plain-value inputs shared by the Numba kernel and the reference engine.

The engines never see Hydra configs: ``simulator.run`` resolves configs, trace metadata and a
hardware profile into one :class:`SimParams`; both engines return a
:class:`simulator.metrics.SimResult`. Policies are named by their variant in each family's
registry (``simulator.policies``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCOPES = ("per_layer", "global")
INITS = ("cold", "frequency")

# Per-rank decision codes of a step (the reference engine's StepDecision, replay, emulate).
HIT, FETCH, FORCED_FETCH, SUBSTITUTE, CPU = 0, 1, 2, 3, 4


@dataclass
class SimParams:
    """Everything an engine needs, as names, numbers and arrays. Times in microseconds, sizes
    in bytes; policy names are keys of the registries in :mod:`simulator.policies`."""

    num_layers: int
    num_experts: int
    top_k: int
    # cache
    scope: str  # SCOPES
    pool_budget_bytes: np.ndarray  # int64[P]; P = num_layers (per_layer) or 1 (global)
    expert_bytes: np.ndarray  # int64[L]
    eviction: str  # simulator.policies.eviction
    lfu_decay: float  # multiplicative decay of selection frequency per group; 1.0 = none
    init: str  # INITS
    warmup_tokens: int  # tokens used to warm the cache when init = frequency (then skipped)
    # miss handling
    protect_ranks: int  # r: a miss with rank < r is always fetched
    tau: float  # a miss with g >= tau is fetched (0 = fetch all, inf = never by weight)
    miss_action: str  # simulator.policies.miss_action: what happens to a miss that is not fetched
    substitute_by: str  # simulator.policies.substitute: logit (needs logits) or frequency
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
    miss_rule: str = "threshold"  # simulator.policies.miss_rule
    predictor: str = "none"  # simulator.policies.predictor: what prefetch predicts from
    prefetch: str = "topp"  # simulator.policies.prefetch (inactive while the predictor is none)
    options: dict = field(default_factory=dict)  # the chosen variants' own options, by name
    # hardware terms with neutral defaults (profiles without them model nothing extra)
    pcie_idle_latency_us: float | None = None  # a copy starting on an idle link; None: as pcie
    pcie_pageable_bytes_per_us: float | None = None  # copies from pageable RAM; None: as pcie
    host_pinned_budget_bytes: int = -1  # of host RAM, the most recently used bytes pinned; -1 all
    token_fixed_us: float = 0.0  # once per group (a token's host synchronisation)
    step_fixed_us: float = 0.0  # once per step, with the non-expert compute
    pcie_copy_order: str = "priority"  # or "submission" (simulator/engine/link.py)

    def __post_init__(self):
        if self.pcie_idle_latency_us is None:
            self.pcie_idle_latency_us = self.pcie_latency_us
        if self.pcie_pageable_bytes_per_us is None:
            self.pcie_pageable_bytes_per_us = self.pcie_bytes_per_us
