"""The moe-sim app: compose a config, replay a trace through a policy, write the results.

Configs -> :class:`SimParams` happens here and only here; the engines see plain arrays.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from simulator.engine.params import INITS, SCOPES, SimParams
from simulator.hardware import layer_times, validate_profile
from simulator.policies import registries
from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import TraceMeta
from traces.sources import LimitedSource

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def _choice(value: str, allowed, field: str) -> str:
    if value not in allowed:
        raise InputError(f"'{field}={value}' is not valid; choose one of: {', '.join(allowed)}")
    return value


def resolve_path(path: str) -> Path:
    """A user path: as given (relative to the working directory), else relative to the repo."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p


SHAPE_FIELDS = ("num_layers", "num_experts", "top_k")


def model_sizes(model: Mapping | None, meta: TraceMeta) -> tuple[str, np.ndarray, np.ndarray]:
    """(model name, expert bytes per trace layer, dense bytes per trace layer).

    ``model=trace`` takes the sizes the trace records. A named model must have the trace's
    routing shape (layers, experts, top-k); ``model.sizes_only=true`` takes only its byte sizes
    onto a trace of another shape (the summary says so). ``expert_bytes`` is one size for every
    layer or a list with one per layer.
    """
    model = model or {}
    L = meta.num_layers
    name = model.get("name") or "trace"
    if name != "trace" and not model.get("sizes_only"):
        differ = [f"{f} {model.get(f)} vs {getattr(meta, f)}" for f in SHAPE_FIELDS
                  if model.get(f) is not None and model.get(f) != getattr(meta, f)]
        if differ:
            raise InputError(
                f"model={name} has another routing shape than the trace ({', '.join(differ)}); "
                "use a trace of that model, model=trace, or model.sizes_only=true to take only "
                "its byte sizes"
            )
    expert = model.get("expert_bytes")
    dense = model.get("dense_bytes_per_layer")
    expert_bytes = np.asarray(meta.expert_bytes if expert is None else _per_layer(expert, L, "model.expert_bytes"),
                              dtype=np.int64)
    if dense is None:
        dense_bytes = np.asarray(meta.dense_bytes or [0] * L, dtype=np.int64)
    else:
        dense_bytes = np.asarray(_per_layer(dense, L, "model.dense_bytes_per_layer"), dtype=np.int64)
    if name == "trace":
        name = meta.model
    if expert_bytes.shape != (L,) or (expert_bytes <= 0).any():
        raise InputError(
            f"expert bytes must be > 0 for each of the trace's {L} layers; set model=<preset> "
            "or fix the trace metadata 'expert_bytes'"
        )
    if (dense_bytes < 0).any():
        raise InputError(f"'model.dense_bytes_per_layer' must be >= 0, got {dense}")
    return name, expert_bytes, dense_bytes


def _per_layer(value, num_layers: int, field: str) -> list[int]:
    """A size for every layer: one number, or a list of one per layer."""
    values = list(value) if isinstance(value, list | tuple) else [value] * num_layers
    if len(values) != num_layers:
        raise InputError(f"'{field}' lists {len(values)} sizes for the trace's {num_layers} layers; "
                         "give one number or one per layer")
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise InputError(f"'{field}={value}' must be a number of bytes (or one per layer)") from None


def check_gpu_memory(cfg: Mapping, expert_bytes_resident: int, dense_bytes: np.ndarray) -> None:
    """Stop when dense weights + resident experts + the reserve exceed the GPU's memory.

    ``hardware.gpu.memory_bytes`` (the profile) against ``model`` dense bytes (per layer, plus
    ``embedding_bytes``), the cache budget and ``memory.reserve_bytes`` (KV cache, activations);
    ``memory.check=false`` runs anyway. Profiles without the GPU's memory are not checked.
    """
    mem = cfg.get("memory") or {}
    gpu_bytes = (cfg["hardware"].get("gpu") or {}).get("memory_bytes")
    if not mem.get("check", True) or gpu_bytes is None:
        return
    model = cfg.get("model") or {}
    dense = int(dense_bytes.sum()) + int(model.get("embedding_bytes") or 0)
    reserve = int(mem.get("reserve_bytes") or 0)
    need = dense + expert_bytes_resident + reserve
    if need > gpu_bytes:
        gib = 2**30
        raise InputError(
            f"does not fit the GPU: dense weights {dense / gib:.2f} GiB + resident experts "
            f"{expert_bytes_resident / gib:.2f} GiB + reserve {reserve / gib:.2f} GiB = "
            f"{need / gib:.2f} GiB > {gpu_bytes / gib:.2f} GiB of hardware.gpu.memory_bytes; lower "
            "cache.fraction, use a smaller model quantisation, or memory.check=false to run anyway"
        )


def build_params(cfg: Mapping, meta: TraceMeta) -> tuple[SimParams, str]:
    """Validate the composed config against the trace and resolve it into engine inputs."""
    policy, cache, hw = cfg["policy"], cfg["cache"], cfg["hardware"]
    validate_profile(hw, origin=f"hardware profile '{(hw or {}).get('name', '?')}'")
    L, E, k = meta.num_layers, meta.num_experts, meta.top_k
    model_name, expert_bytes, dense_bytes = model_sizes(cfg.get("model"), meta)

    scope = _choice(cache["scope"], SCOPES, "cache.scope")
    fraction = float(cache["fraction"])
    if not (0.0 < fraction <= 1.0):
        raise InputError(f"'cache.fraction={fraction}' must be in (0, 1], e.g. cache.fraction=0.25")
    budget = cache.get("budget_bytes")
    if scope == "per_layer":
        if budget is not None:
            raise InputError("'cache.budget_bytes' needs cache.scope=global; per_layer uses cache.fraction")
        per_layer = math.floor(fraction * E)
        if per_layer < 1:
            raise InputError(
                f"'cache.fraction={fraction}' leaves no expert per layer ({E} experts); "
                f"use cache.fraction>={1 / E:.4g}"
            )
        pool_budget = per_layer * expert_bytes
    else:
        total = int(expert_bytes.sum()) * E
        budget = int(budget) if budget is not None else math.floor(fraction * total)
        if budget < int(expert_bytes.max()):
            raise InputError(
                f"'cache.budget_bytes={budget}' is smaller than one expert ({int(expert_bytes.max())} "
                "bytes); raise cache.budget_bytes or cache.fraction"
            )
        pool_budget = np.array([budget], dtype=np.int64)

    protect = int(policy["protect_ranks"])
    tau = float(policy["tau"])
    if protect < 0 or math.isnan(tau) or tau < 0:
        raise InputError("'policy.protect_ranks' must be >= 0 and 'policy.tau' >= 0 (or .inf)")
    substitute_by = policy.get("substitute_by", "auto")
    if substitute_by == "auto":
        substitute_by = "logit" if meta.has_logits else "frequency"
    if substitute_by == "logit" and not meta.has_logits:
        raise InputError(
            "'policy.substitute_by=logit' needs a trace with full router logits; this trace has "
            "none: use policy.substitute_by=frequency (or auto)"
        )
    beta = cfg["admission"].get("beta")
    if beta is not None and (math.isnan(float(beta)) or float(beta) <= 0):
        raise InputError(f"'admission.beta={beta}' must be > 0 (or null to turn admission off)")
    decay = cache.get("lfu_decay")
    if decay is not None and not (0.0 < float(decay) <= 1.0):
        raise InputError(f"'cache.lfu_decay={decay}' must be in (0, 1] (or null for none)")
    warmup = int(cache.get("warmup_tokens", 0))
    init = _choice(cache["init"], INITS, "cache.init")
    if init == "frequency" and warmup < 1:
        raise InputError("'cache.init=frequency' needs cache.warmup_tokens >= 1")

    check_gpu_memory(cfg, int(np.sum(pool_budget)), dense_bytes)
    reg = registries()
    times = layer_times(hw, model_name, expert_bytes, dense_bytes)
    ram, pinned = hw.get("host_ram_bytes"), hw.get("host_pinned_bytes")
    pcie, gpu = hw["pcie"], hw["gpu"]
    params = SimParams(
        num_layers=L,
        num_experts=E,
        top_k=k,
        scope=scope,
        pool_budget_bytes=np.asarray(pool_budget, dtype=np.int64),
        expert_bytes=expert_bytes,
        eviction=_choice(cache["eviction"], reg["eviction"], "cache.eviction"),
        lfu_decay=float(decay) if decay is not None else 1.0,
        init=init,
        warmup_tokens=warmup if init == "frequency" else 0,
        protect_ranks=protect,
        tau=tau,
        miss_action=_choice(policy["miss_action"], reg["miss_action"], "policy.miss_action"),
        substitute_by=_choice(substitute_by, reg["substitute"], "policy.substitute_by"),
        beta=float(beta) if beta is not None else math.inf,
        pcie_latency_us=float(hw["pcie"]["latency_us"]),
        pcie_bytes_per_us=float(hw["pcie"]["bandwidth_gbps"]) * 1e3,
        ssd_latency_us=float(hw["ssd"]["latency_us"]),
        ssd_bytes_per_us=float(hw["ssd"]["bandwidth_gbps"]) * 1e3,
        host_ram_budget_bytes=int(ram) if ram is not None else -1,
        gpu_expert_us=times.gpu_expert_us,
        nonexpert_us=times.nonexpert_us,
        cpu_expert_us=times.cpu_expert_us,
        seed=int(cfg.get("seed", 0)),
        options=reg["eviction"].options_of(cache["eviction"], cache),
        pcie_idle_latency_us=float(pcie.get("idle_latency_us") or pcie["latency_us"]),
        pcie_pageable_bytes_per_us=float(pcie.get("pageable_bandwidth_gbps") or pcie["bandwidth_gbps"]) * 1e3,
        host_pinned_budget_bytes=int(pinned) if pinned is not None else -1,
        token_fixed_us=float(gpu.get("token_fixed_us") or 0.0),
        step_fixed_us=float(gpu.get("step_fixed_us") or 0.0),
    )
    return params, substitute_by


def open_source(trace_cfg: Mapping, opened=None):
    path = resolve_path(str(trace_cfg["path"]))
    if opened is not None:  # the sweep's decoded copy of trace.path (simulator/launcher.py)
        source = opened
    elif not path.exists():
        raise InputError(f"'trace.path={trace_cfg['path']}' does not exist; give an existing trace file")
    elif trace_cfg.get("cache"):
        from simulator.trace_cache import cached_source

        source = cached_source(path)
    else:
        from traces.format import open_trace

        source = open_trace(path)
    if trace_cfg.get("max_tokens") is not None:
        if int(trace_cfg["max_tokens"]) < 1:
            raise InputError("'trace.max_tokens' must be >= 1 (or null for the whole trace)")
        source = LimitedSource(source, int(trace_cfg["max_tokens"]))
    return source


def simulate_config(cfg: Mapping, progress: bool = False, opened=None) -> tuple[dict, object]:
    """Run one configuration (a plain mapping or DictConfig); return (summary dict, SimResult).

    ``opened``: trace.path already opened (a sweep's shared decoded copy)."""
    from simulator.engine import simulate
    from simulator.results import summarize

    source = open_source(cfg["trace"], opened)
    params, substitute_by = build_params(cfg, source.meta)
    engine = cfg.get("engine", "numba")
    if engine not in ("numba", "reference"):
        raise InputError(f"'engine={engine}' is not valid; choose numba or reference")
    bar = _progress_bar(source, progress)
    t0 = time.perf_counter()
    try:
        result = simulate(source, params, engine=engine,
                          progress=(lambda done: bar.update(done - bar.n)) if bar else None,
                          chunk_tokens=cfg["trace"].get("chunk_tokens"))
    finally:
        if bar:
            bar.close()
    summary = summarize(
        result,
        engine=engine,
        policy=cfg["policy"]["name"],
        substitute_by=substitute_by,
        sim_seconds=time.perf_counter() - t0,
    )
    return summary, result


def _progress_bar(source, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    total = getattr(source, "num_tokens", None)
    if isinstance(source, LimitedSource):
        total = source.max_tokens
    return tqdm(total=total, unit="tok", desc="simulate", file=sys.stderr, dynamic_ncols=True)


def compose(overrides: list[str] | None = None):
    """The composed moe-sim config for these overrides (no run directory, no side effects)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from simulator.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="simulate", overrides=list(overrides or []))


def simulate_overrides(overrides: list[str]) -> dict:
    """Summary of one run given moe-sim command-line overrides (for scripts and validation)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(overrides), resolve=True)
    return simulate_config(cfg)[0]


def _task(cfg) -> dict | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from simulator.launcher import prepared_simulation
    from simulator.results import write_outputs
    from traces.atomic import atomic_write_bytes

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    plain = OmegaConf.to_container(cfg, resolve=True)
    show = plain.get("progress")
    show = sys.stderr.isatty() if show is None else bool(show)
    try:
        summary, result = prepared_simulation(plain) or simulate_config(plain, progress=show)
        write_outputs(run_dir, summary, result, per_token=bool(plain.get("per_token", True)))
    except InputError as e:
        print(f"moe-sim: error: {e}", file=sys.stderr)
        if multirun:  # keep the sweep going; the report lists this job as failed
            atomic_write_bytes(run_dir / "error.txt", (str(e) + "\n").encode())
            raise
        _remove_run_dir(run_dir)
        sys.exit(EXIT_INPUT_ERROR)
    print(_one_line(summary, run_dir))
    return summary


def _remove_run_dir(run_dir: Path) -> None:
    """Leave nothing behind for a run that failed on its input (only Hydra's own files are there)."""
    allowed = {".hydra", "simulate.log", "run.log"}
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= allowed:
        shutil.rmtree(run_dir, ignore_errors=True)


def _one_line(s: dict, run_dir: Path) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    return (
        f"{s['policy']}: {f(s['ms_per_token'], '.3f')} ms/token, hit rate {f(s['hit_rate'], '.3f')}, "
        f"substitution rate {f(s['substitution_rate'], '.3f')}, mean mass {f(s['mean_mass'], '.4f')} "
        f"[{s['decode_tokens']} decode tokens, {s['sim_seconds']:.2f} s] -> {run_dir}"
    )


def main() -> None:
    import hydra

    from simulator.config import register_configs

    register_configs()
    app = hydra.main(config_path=str(CONF_DIR), config_name="simulate", version_base=None)(_task)
    app()


if __name__ == "__main__":
    main()
