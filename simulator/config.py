"""Structured configs of the moe-sim app: every field with its help text, registered with Hydra.

The YAML groups under ``conf/`` (``policy/``, ``cache/``, ``hardware/``, ``model/``, ``trace/``)
are named presets of these schemas; command-line overrides are the user interface, so the field
names here are stable. A policy variant's own settings come from its module's ``Options``
(``simulator.policies``) and appear in its family's section (eviction options under ``cache``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from simulator.policies.eviction import REGISTRY as EVICTIONS
from simulator.policies.predictor import REGISTRY as PREDICTORS
from simulator.policies.prefetch import REGISTRY as PREFETCHES


def opt(default, help: str, **extra):
    """A config field with its help text (``moe-sim --help`` prints it)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TraceConfig:
    path: str = opt("traces/samples/fixture.parquet", "trace file (Parquet, see traces/format.py)")
    max_tokens: int | None = opt(None, "simulate only the first N tokens; null = all")
    chunk_tokens: int | None = opt(None, "tokens decoded per chunk; null = sized to ~64 MiB")
    cache: bool = opt(False, "decode once into a memory-mapped copy keyed by the file's hash "
                      "($MOE_SIM_CACHE or ~/.cache/moe-offload-sim), re-used by later runs")


@dataclass
class PolicyConfig:
    name: str = opt("fetch_all", "label reported in results")
    protect_ranks: int = opt(0, "r: a miss with rank < r is always fetched")
    tau: float = opt(0.0, "a miss with normalised gate weight >= tau is fetched; .inf = never by weight")
    miss_action: str = opt("substitute", "what happens to a miss that is not fetched: substitute | cpu")
    substitute_by: str = opt("auto", "logit | frequency | auto (logit when the trace has logits)")


@dataclass
class _CacheFields:
    scope: str = opt("per_layer", "per_layer (capacity per layer) | global (one pool in bytes)")
    fraction: float = opt(0.25, "resident share of experts, in (0, 1]")
    budget_bytes: int | None = opt(None, "global scope only: pool size in bytes (overrides fraction)")
    eviction: str = opt("lru", f"eviction policy: {' | '.join(EVICTIONS)}")
    lfu_decay: float | None = opt(None, "frequency decay per token in (0, 1); null = none")
    init: str = opt("cold", "cold (empty) | frequency (warm from the first warmup_tokens tokens)")
    warmup_tokens: int = opt(256, "init=frequency: tokens used to warm; excluded from statistics")


def _with_options(name: str, base: type, *registries) -> type:
    """``base`` plus a field for every variant option of the ``registries`` (help text kept)."""
    extra = [(f.name, hint, field(default=f.default, metadata=f.metadata))
             for registry in registries for f, hint in registry.option_fields()]
    return dataclasses.make_dataclass(name, extra, bases=(base,))


CacheConfig = _with_options("CacheConfig", _CacheFields, EVICTIONS)


@dataclass
class _PrefetchFields:
    predictor: str = opt("none", f"what prefetch predicts from: {' | '.join(PREDICTORS)}; none = off")
    policy: str = opt("topp", f"how predictions become transfers: {' | '.join(PREFETCHES)}")


PrefetchConfig = _with_options("PrefetchConfig", _PrefetchFields, PREFETCHES, PREDICTORS)


@dataclass
class AdmissionConfig:
    beta: float | None = opt(None, "background admission threshold on substituted mass; null = off")


@dataclass
class MemoryConfig:
    check: bool = opt(True, "stop when dense weights + resident experts + reserve exceed the GPU's "
                      "memory (hardware.gpu.memory_bytes)")
    reserve_bytes: int = opt(2 * 2**30, "GPU memory kept for the KV cache, activations and the "
                             "runtime, bytes")


@dataclass
class SimulateConfig:
    trace: TraceConfig = field(default_factory=TraceConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hardware: Any = opt(None, "a hardware profile (conf/hardware/*.yaml), validated by simulator.hardware")
    model: Any = opt(None, 'model shapes and expert sizes (conf/model/*.yaml); "trace" = from the trace')
    engine: str = opt("numba", "numba | reference (plain Python, same semantics, slow)")
    seed: int = opt(0, "random eviction and anything else random")
    progress: bool | None = opt(None, "progress bar; null = only when stderr is a terminal")
    per_token: bool = opt(True, "write per_token.parquet")


def register_configs() -> None:
    """Register the schemas so YAML presets and overrides are type-checked."""
    cs = ConfigStore.instance()
    cs.store(name="simulate_schema", node=SimulateConfig)
