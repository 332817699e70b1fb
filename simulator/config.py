"""Structured configs of the moe-sim app: every field with its help text, registered with Hydra.

The YAML groups under ``conf/`` (``policy/``, ``cache/``, ``hardware/``, ``model/``, ``trace/``)
are named presets of these schemas; command-line overrides are the user interface, so the field
names here are stable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class TraceConfig:
    path: str = "traces/samples/fixture.parquet"  # trace file (Parquet, see traces/format.py)
    max_tokens: int | None = None  # simulate only the first N tokens; null = all
    chunk_tokens: int | None = None  # tokens decoded per chunk; null = sized to ~64 MiB
    cache: bool = False  # decode once into a memory-mapped copy keyed by the file's hash
    # ($MOE_SIM_CACHE or ~/.cache/moe-offload-sim), re-used by every later run and sweep job


@dataclass
class PolicyConfig:
    name: str = "fetch_all"  # label reported in results
    protect_ranks: int = 0  # r: a miss with rank < r is always fetched
    tau: float = 0.0  # a miss with normalised gate weight >= tau is fetched; .inf = never by weight
    miss_action: str = "substitute"  # what happens to a miss that is not fetched: substitute | cpu
    substitute_by: str = "auto"  # logit | frequency | auto (logit when the trace has logits)


@dataclass
class CacheConfig:
    scope: str = "per_layer"  # per_layer (capacity per layer) | global (one pool in bytes)
    fraction: float = 0.25  # resident share of experts, in (0, 1]
    budget_bytes: int | None = None  # global scope only: pool size in bytes (overrides fraction)
    eviction: str = "lru"  # lru | lfu | fifo | random | belady
    lfu_decay: float | None = None  # lfu: frequency decay per token in (0, 1); null = none
    init: str = "cold"  # cold (empty) | frequency (warm from the first warmup_tokens tokens)
    warmup_tokens: int = 256  # init=frequency: tokens used to warm; excluded from statistics


@dataclass
class AdmissionConfig:
    beta: float | None = None  # background admission threshold on substituted mass; null = off


@dataclass
class SimulateConfig:
    trace: TraceConfig = field(default_factory=TraceConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    hardware: Any = None  # a hardware profile (conf/hardware/*.yaml), validated by simulator.hardware
    model: Any = None  # model shapes and expert sizes (conf/model/*.yaml); "trace" = from the trace
    engine: str = "numba"  # numba | reference (plain Python, same semantics, slow)
    seed: int = 0  # random eviction and anything else random
    progress: bool | None = None  # progress bar; null = only when stderr is a terminal
    per_token: bool = True  # write per_token.parquet


def register_configs() -> None:
    """Register the schemas so YAML presets and overrides are type-checked."""
    cs = ConfigStore.instance()
    cs.store(name="simulate_schema", node=SimulateConfig)
