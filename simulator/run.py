"""The moe-sim app: compose a config, replay a trace through a policy, write the results.

Configs -> :class:`SimParams` happens here and only here; the engines see plain arrays.

Every input error, Hydra's included (an unknown preset or key, a value of the wrong type), ends
the app with one line ``moe-sim: error: ...`` and exit code 2: overrides are checked against the
structured configs before Hydra composes (:func:`simulator.config.check_overrides`), and Hydra's
own exceptions are caught around its app in :func:`main`. In a sweep, a job that fails writes
``error.txt`` and the sweep goes on; the sweep then exits 2 (1 when no job failed on its input).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.config import CONF_DIR, INT64_MAX, REPO_ROOT, field_default, schema_fields
from simulator.engine.params import INITS, SCOPES, SimParams
from simulator.hardware import PROFILE_CHOICES, PROFILE_FIELDS, layer_times, validate_profile
from simulator.policies import registries
from traces.atomic import atomic_write_text, output_errors
from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import MAX_LAYER_BYTES, TraceMeta
from traces.sources import LimitedSource

__all__ = ["CONF_DIR", "REPO_ROOT", "build_params", "compose", "main", "model_sizes",
           "open_source", "resolve_path", "simulate_config", "simulate_overrides"]


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
    """A size for every layer: one number, or a list of one per layer (each at most the cap)."""
    values = list(value) if isinstance(value, list | tuple) else [value] * num_layers
    if len(values) != num_layers:
        raise InputError(f"'{field}' lists {len(values)} sizes for the trace's {num_layers} layers; "
                         "give one number or one per layer")
    try:
        sizes = [int(v) for v in values]
    except (TypeError, ValueError):
        raise InputError(f"'{field}={value}' must be a number of bytes (or one per layer)") from None
    too_big = next((s for s in sizes if s > MAX_LAYER_BYTES), None)
    if too_big is not None:
        raise InputError(f"'{field}={too_big}' is above the sanity cap of {MAX_LAYER_BYTES} bytes "
                         "(2^40) per layer; give the size in bytes")
    return sizes


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
    dense = int(dense_bytes.sum()) + _bytes(model.get("embedding_bytes"), "model.embedding_bytes")
    reserve = _bytes(mem.get("reserve_bytes"), "memory.reserve_bytes")
    need = dense + expert_bytes_resident + reserve
    if need > gpu_bytes:
        gib = 2**30
        raise InputError(
            f"does not fit the GPU: dense weights {dense / gib:.2f} GiB + resident experts "
            f"{expert_bytes_resident / gib:.2f} GiB + reserve {reserve / gib:.2f} GiB = "
            f"{need / gib:.2f} GiB > {gpu_bytes / gib:.2f} GiB of hardware.gpu.memory_bytes; lower "
            "cache.fraction, use a smaller model quantisation, or memory.check=false to run anyway"
        )


def _bytes(value, field: str) -> int:
    """A byte count of the config (null = 0), within [0, int64]."""
    try:
        count = int(value or 0)
    except (TypeError, ValueError):
        raise InputError(f"'{field}={value}' must be a number of bytes") from None
    if not 0 <= count <= INT64_MAX:
        raise InputError(f"'{field}={value}' must be >= 0 and within int64")
    return count


# Profile sections only some runs read: the run that reads one, in words.
READ_WHEN = {"cpu": "policy.miss_action=cpu", "ssd": "a host RAM limit (hardware.host_ram_bytes)"}


def profile_sections_unread(cfg: Mapping) -> set[str]:
    """The optional profile sections (``cpu``, ``ssd``) this run never reads."""
    hw = cfg["hardware"] or {}
    read = {"cpu": cfg["policy"].get("miss_action") == "cpu",
            "ssd": isinstance(hw, Mapping) and hw.get("host_ram_bytes") is not None}
    return {section for section, reads in read.items() if not reads}


def check_profile(cfg: Mapping) -> set[str]:
    """Validate the hardware profile for this run (every problem in one line); return the sections
    it lacks and need not have (their times become NaN, which no step of this run reads)."""
    hw = cfg["hardware"]
    name = cfg.get("hardware_file") or (hw.get("name") if isinstance(hw, Mapping) else None)
    origin = f"hardware profile '{name or '?'}'"
    if not isinstance(hw, Mapping):
        validate_profile(hw, origin=origin)
    unread = profile_sections_unread(cfg)
    absent = {s for s in unread if hw.get(s) is None}
    # an absent unread section stands in with valid numbers, so validation names only real problems
    stand_in = {s: {f: 1.0 for f, (required, _, _) in PROFILE_FIELDS[s].items() if required}
                for s in absent}
    try:
        validate_profile({**hw, **stand_in}, origin=origin)
    except InputError as exc:
        why = "; ".join(f"'hardware.{s}' is read with {when}" for s, when in READ_WHEN.items()
                        if s not in unread and hw.get(s) is None)
        raise InputError(f"{exc} ({why})" if why else str(exc)) from None
    return absent


def build_params(cfg: Mapping, meta: TraceMeta) -> tuple[SimParams, str]:
    """Validate the composed config against the trace and resolve it into engine inputs."""
    policy, cache, hw = cfg["policy"], cfg["cache"], cfg["hardware"]
    prefetch = cfg.get("prefetch") or {"predictor": "none", "policy": "topp"}
    absent = check_profile(cfg)
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
        budget = _bytes(budget, "cache.budget_bytes") if budget is not None else math.floor(fraction * total)
        if budget < int(expert_bytes.max()):
            raise InputError(
                f"'cache.budget_bytes={budget}' is smaller than one expert ({int(expert_bytes.max())} "
                "bytes); raise cache.budget_bytes or cache.fraction"
            )
        pool_budget = np.array([budget], dtype=np.int64)

    protect = int(policy["protect_ranks"])
    tau = float(policy["tau"])
    if protect < 0 or math.isnan(tau) or tau < 0:
        raise InputError("'policy.protect_ranks' must be >= 0 and 'policy.tau' >= 0 (or inf)")
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
    times = layer_times({**hw, **{s: {"expert_fixed_us": math.nan, "memory_bandwidth_gbps": 1.0}
                                  for s in absent & {"cpu"}}},
                        model_name, expert_bytes, dense_bytes)
    ssd = hw["ssd"] if "ssd" not in absent else {"latency_us": math.nan, "bandwidth_gbps": math.nan}
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
        pcie_latency_us=float(pcie["latency_us"]),
        pcie_bytes_per_us=float(pcie["bandwidth_gbps"]) * 1e3,
        ssd_latency_us=float(ssd["latency_us"]),
        ssd_bytes_per_us=float(ssd["bandwidth_gbps"]) * 1e3,
        host_ram_budget_bytes=int(ram) if ram is not None else -1,
        gpu_expert_us=times.gpu_expert_us,
        nonexpert_us=times.nonexpert_us,
        cpu_expert_us=times.cpu_expert_us,
        seed=int(cfg.get("seed", 0)),
        predictor=_choice(prefetch["predictor"], reg["predictor"], "prefetch.predictor"),
        prefetch=_choice(prefetch["policy"], reg["prefetch"], "prefetch.policy"),
        options={**reg["eviction"].options_of(cache["eviction"], cache),
                 **reg["substitute"].options_of(substitute_by, policy),
                 **(reg["prefetch"].options_of(prefetch["policy"], prefetch)  # predictor none: off
                    if prefetch["predictor"] != "none" else {}),
                 **reg["predictor"].options_of(prefetch["predictor"], prefetch)},
        pcie_idle_latency_us=float(pcie.get("idle_latency_us") or pcie["latency_us"]),
        pcie_pageable_bytes_per_us=float(pcie.get("pageable_bandwidth_gbps") or pcie["bandwidth_gbps"]) * 1e3,
        host_pinned_budget_bytes=int(pinned) if pinned is not None else -1,
        token_fixed_us=float(gpu.get("token_fixed_us") or 0.0),
        step_fixed_us=float(gpu.get("step_fixed_us") or 0.0),
        pcie_copy_order=str(pcie.get("copy_order") or PROFILE_CHOICES["pcie"]["copy_order"][0]),
    )
    return params, substitute_by


def ignored_settings(cfg: Mapping, params: SimParams) -> list[str]:
    """One line for each setting given a non-default value that this run never reads."""
    defaults = {key: field_default(f) for key, f, _ in schema_fields()}

    def given(key: str):
        section, name = key.split(".")
        value = (cfg.get(section) or {}).get(name)
        return None if value == defaults.get(key) else value

    reg = registries()
    rule = reg["miss_rule"][params.miss_rule]
    leaves = rule.can_leave_misses(rule.make_state(params), params.top_k)
    substitutes = leaves and reg["miss_action"][params.miss_action].USES_SUBSTITUTES
    never = ("this policy fetches every miss" if not leaves
             else "misses are computed on the CPU, never substituted")
    lines = []
    if given("admission.beta") is not None and not substitutes:
        lines.append(f"'admission.beta={given('admission.beta')}' has no effect: background "
                     f"admission follows substitutions, and {never}")
    if given("policy.substitute_by") is not None and not substitutes:
        lines.append(f"'policy.substitute_by={given('policy.substitute_by')}' has no effect: {never}")
    frequency_substitutes = substitutes and params.substitute_by == "frequency"
    if given("cache.lfu_decay") is not None and params.eviction != "lfu" and not frequency_substitutes:
        lines.append(f"'cache.lfu_decay={given('cache.lfu_decay')}' has no effect: it decays the "
                     f"frequencies of cache.eviction=lfu and of substitutes chosen by frequency; "
                     f"this run evicts by {params.eviction}"
                     + (f" and substitutes by {params.substitute_by}" if substitutes else ""))
    if given("cache.warmup_tokens") is not None and params.init != "frequency":
        lines.append(f"'cache.warmup_tokens={given('cache.warmup_tokens')}' has no effect: it "
                     "sizes the warm start of cache.init=frequency; this run starts cold")
    if (given("cache.fraction") is not None and params.scope == "global"
            and cfg["cache"].get("budget_bytes") is not None):
        lines.append(f"'cache.fraction={given('cache.fraction')}' has no effect: "
                     "cache.budget_bytes sets the pool size")
    eviction = reg["eviction"]
    for name in eviction:
        options = getattr(eviction[name], "Options", None)
        for f in dataclasses.fields(options) if options and name != params.eviction else ():
            value = (cfg.get("cache") or {}).get(f.name)
            if value is not None and value != f.default:
                lines.append(f"'cache.{f.name}={value}' has no effect: it is an option of "
                             f"cache.eviction={name}; this run evicts by {params.eviction}")
    for f, _ in reg["substitute"].option_fields():
        value = (cfg.get("policy") or {}).get(f.name)
        if value is not None and value != f.default and not (substitutes and params.substitute_by == "logit"):
            lines.append(f"'policy.{f.name}={value}' has no effect: it shapes the search of "
                         "substitutes by logit, and this run "
                         + (f"substitutes by {params.substitute_by}" if substitutes else f"never does ({never})"))
    if params.predictor == "none":
        for registry in (reg["prefetch"], reg["predictor"]):
            for f, _ in registry.option_fields():
                value = (cfg.get("prefetch") or {}).get(f.name)
                if value is not None and value != f.default:
                    lines.append(f"'prefetch.{f.name}={value}' has no effect: prefetch is off "
                                 "(prefetch.predictor=none)")
    return lines


def open_source(trace_cfg: Mapping, opened=None):
    """The trace a config names, as a chunk source (through the trace cache with trace.cache);
    ``opened``: that trace already opened (a sweep's shared decoded copy, simulator/launcher.py)."""
    path = resolve_path(str(trace_cfg["path"]))
    chunk = trace_cfg.get("chunk_tokens")
    if chunk is not None and int(chunk) < 1:
        raise InputError(f"'trace.chunk_tokens={chunk}' must be >= 1 (or null for ~64 MiB chunks)")
    if opened is not None:
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


def source_path(source) -> Path | None:
    """The trace file behind a chunk source (None for one in memory)."""
    while isinstance(source, LimitedSource):
        source = source.source
    path = getattr(source, "path", None)
    return Path(path) if path is not None else None


def simulated_tokens(source) -> int:
    """Tokens a source yields: the trace's, or a token limit's if smaller."""
    return min(source.max_tokens, _trace_tokens(source)) if isinstance(source, LimitedSource) \
        else _trace_tokens(source)


def _trace_tokens(source) -> int:
    while isinstance(source, LimitedSource):
        source = source.source
    return int(source.num_tokens)


def with_hardware_file(cfg: dict) -> dict:
    """``cfg`` with ``hardware`` loaded from ``hardware_file`` when one is given; ``hardware.*``
    overrides given with it apply on top of the file."""
    path = cfg.get("hardware_file")
    if not path:
        return cfg
    profile = load_profile(resolve_path(str(path)))
    if isinstance(profile, dict) and isinstance(cfg.get("hardware"), Mapping):
        profile = _merged(profile, cfg["hardware"])
    return {**cfg, "hardware": profile}


def _merged(base: dict, over: Mapping) -> dict:
    """``base`` with ``over``'s values in place, mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merged(out[key], value) if both else value
    return out


def load_profile(path: Path) -> dict:
    """A hardware profile file (YAML) as a mapping; its name defaults to the file's stem. A file
    that is not YAML, or holds tags beyond plain YAML (``!!python/...``), is one InputError; the
    fields are checked by :func:`check_profile`."""
    import yaml

    from traces.format import regular_file

    path = regular_file(path, "hardware profile file")
    try:
        profile = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise InputError(f"hardware profile {path}: not a plain YAML mapping{line}: {problem}; "
                         "write it as conf/hardware/TEMPLATE.yaml shows") from None
    if isinstance(profile, dict):
        profile.setdefault("name", path.stem)
    return profile


@dataclass
class Prepared:
    """One configuration made ready to run: its source, engine inputs and provenance."""

    cfg: dict
    source: object
    params: SimParams
    substitute_by: str
    engine: str
    provenance: dict


def prepare(cfg: Mapping, opened=None) -> Prepared:
    """Open the trace (``opened``: as :func:`open_source`), validate ``cfg`` against it
    (InputError) and warn about ignored settings."""
    from simulator.results import provenance
    from simulator.trace_cache import trace_key

    cfg = with_hardware_file(dict(cfg))
    source = open_source(cfg["trace"], opened)
    params, substitute_by = build_params(cfg, source.meta)
    engine = cfg.get("engine", "numba")
    if engine not in ("numba", "reference"):
        raise InputError(f"'engine={engine}' is not valid; choose numba or reference")
    tokens = simulated_tokens(source)
    if params.init == "frequency" and params.warmup_tokens >= tokens:
        raise InputError(
            f"'cache.warmup_tokens={params.warmup_tokens}' leaves none of the {tokens:,} tokens to "
            "simulate (the warm-up is excluded); lower cache.warmup_tokens or use cache.init=cold")
    option = getattr(registries()["predictor"][params.predictor], "TRAIN_TOKENS", None)
    if option is not None and params.prefetch != "none" and params.options.get(option, 0) >= tokens:
        raise InputError(
            f"'prefetch.{option}={params.options[option]}' leaves none of the {tokens:,} tokens to "
            f"simulate (they train prefetch.predictor={params.predictor} and are not simulated); "
            f"lower prefetch.{option}")
    for line in ignored_settings(cfg, params):
        print(f"moe-sim: warning: {line}", file=sys.stderr)
    path = source_path(source)
    facts = provenance(cfg, path, source.meta, _trace_tokens(source),
                       trace_key(path).removeprefix("file-") if path is not None else None,
                       model_sizes(cfg.get("model"), source.meta), substitute_by)
    return Prepared(cfg, source, params, substitute_by, engine, facts)


def finish(prepared: Prepared, result, sim_seconds: float) -> dict:
    """The summary (with provenance) of a finished run; InputError if no decode token was
    simulated (an all-null summary would read as a result)."""
    from simulator.results import summarize

    summary = summarize(result, engine=prepared.engine, policy=prepared.cfg["policy"]["name"],
                        substitute_by=prepared.substitute_by, sim_seconds=sim_seconds)
    if not summary["decode_tokens"]:
        raise InputError(
            f"no decode token was simulated ({summary['tokens']:,} tokens, all prefill or warm-up); "
            "give a trace with decode tokens, raise trace.max_tokens or lower cache.warmup_tokens")
    summary["provenance"] = prepared.provenance
    return summary


def simulate_config(cfg: Mapping, progress: bool = False, opened=None) -> tuple[dict, object]:
    """Run one configuration (a plain mapping or DictConfig); return (summary dict, SimResult).

    ``opened``: trace.path already opened (a sweep's shared decoded copy)."""
    return run_prepared(prepare(cfg, opened), progress)


def run_prepared(prepared: Prepared, progress: bool = False) -> tuple[dict, object]:
    """Simulate a configuration :func:`prepare` checked; return (summary dict, SimResult)."""
    from simulator.engine import simulate

    bar = _progress_bar(prepared.source, progress)
    t0 = time.perf_counter()
    try:
        result = simulate(prepared.source, prepared.params, engine=prepared.engine,
                          progress=(lambda done: bar.update(done - bar.n)) if bar else None,
                          chunk_tokens=prepared.cfg["trace"].get("chunk_tokens"))
    finally:
        if bar:
            bar.close()
    return finish(prepared, result, time.perf_counter() - t0), result


def _progress_bar(source, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=simulated_tokens(source), unit="tok", desc="simulate", file=sys.stderr,
                dynamic_ncols=True)


# --- overrides ---------------------------------------------------------------------------------

PROFILE_SUFFIXES = (".yaml", ".yml")


def resolve_overrides(overrides: Sequence[str]) -> list[str]:
    """Overrides as Hydra composes them, checked (InputError): ``hardware=PATH.yaml`` (a sweep may
    list several files) becomes ``~hardware hardware_file=ABSOLUTE_PATH``, since a Hydra group
    takes only preset names; ``hardware.x=v`` given with a file becomes ``+hardware.x=v`` (it
    applies on top of the file)."""
    from simulator.config import check_overrides

    out, from_file = [], False
    for text in overrides:
        key, sep, value = text.partition("=")
        items = [v.strip("'\"") for v in value.split(",")]
        files = [v for v in items if v.endswith(PROFILE_SUFFIXES) or os.sep in v]
        if key != "hardware" or not sep or not files:
            out.append(text)
            continue
        if len(files) != len(items):
            raise InputError(f"'{text}' mixes presets and profile files; sweep over presets "
                             "(hardware=a,b) or files (hardware=a.yaml,b.yaml), not both at once")
        paths = []
        for item in items:
            path = resolve_path(item)
            if not path.is_file():
                raise InputError(f"'hardware={item}': no such profile file; give a YAML profile "
                                 "(conf/hardware/TEMPLATE.yaml explains one) or a preset name")
            paths.append("'" + str(path.resolve()).replace("\\", "\\\\").replace("'", "\\'") + "'")
        out += ["~hardware", f"hardware_file={','.join(paths)}"]
        from_file = True
    if from_file:
        out = [f"+{o}" if o.startswith("hardware.") else o for o in out]
    check_overrides(out)
    return out


def hydra_error_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf exception as one line (what it says, without its config dump)."""
    noise = ("full_key:", "reference_type", "object_type", "Config search path", "provider=",
             "Set the environment variable", "See https://")
    lines = [ln.strip() for ln in str(exc).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith(noise)]
    key = next((ln.removeprefix("full_key:").strip() for ln in lines if ln.startswith("full_key:")), "")
    text = "; ".join(kept) or type(exc).__name__
    return f"{text}{f' at {key}' if key else ''} (moe-sim --help lists every setting)"


def compose(overrides: list[str] | None = None):
    """The composed moe-sim config for these overrides (no run directory, no side effects).

    The overrides are checked first (:func:`resolve_overrides`); a Hydra error becomes one
    InputError.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from simulator.config import register_configs

    overrides = resolve_overrides(list(overrides or []))
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="simulate", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise InputError(hydra_error_line(exc)) from None


def simulate_overrides(overrides: list[str]) -> dict:
    """Summary of one run given moe-sim command-line overrides (for scripts and validation)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(overrides), resolve=True)
    return simulate_config(cfg)[0]


# --- the Hydra app -----------------------------------------------------------------------------


def _task(cfg) -> dict | object:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from simulator.launcher import prepared_simulation
    from simulator.results import write_outputs

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        plain = _resolved(cfg)
        show = plain.get("progress")
        show = sys.stderr.isatty() if show is None else bool(show)
        summary, result = prepared_simulation(plain) or simulate_config(plain, progress=show)
        with output_errors(run_dir):
            write_outputs(run_dir, summary, result, per_token=bool(plain.get("per_token", True)),
                          domains=summary["provenance"]["trace"].get("domains") or ())
    except Exception as exc:  # noqa: BLE001 - every failure of a sweep job is recorded
        if multirun:
            return _failed_job(run_dir, int(hc.job.num), exc)
        if not isinstance(exc, InputError):
            raise
        _remove_run_dir(run_dir)
        _exit_with(str(exc))  # here, not in main(): Hydra would add a line of its own
    print(_one_line(summary, run_dir))
    return summary


def _resolved(cfg) -> dict:
    """The job's config as plain values; an interpolation that cannot resolve is an InputError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise InputError(hydra_error_line(exc)) from None


def _failed_job(run_dir: Path, job_num: int, exc: Exception):
    """Record a sweep job's failure in its ``error.txt`` (the report shows it) and go on."""
    from simulator.sweep import JobFailed

    input_error = isinstance(exc, InputError)
    text = str(exc) if input_error else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    if input_error:
        print(f"moe-sim: error: job {job_num}: {text}", file=sys.stderr)
    else:  # a fault of the program, not of the input: its traceback helps whoever fixes it
        traceback.print_exc()
    try:
        atomic_write_text(run_dir / "error.txt", text + "\n")
    except OSError as err:
        print(f"moe-sim: error: job {job_num}: {run_dir / 'error.txt'}: cannot be written "
              f"({err.strerror})", file=sys.stderr)
    return JobFailed(text, input_error)


def _remove_run_dir(run_dir: Path) -> None:
    """Leave nothing behind for a run that failed on its input (only Hydra's own files are there)."""
    allowed = {".hydra", "simulate.log", "run.log"}
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= allowed:
        shutil.rmtree(run_dir, ignore_errors=True)


def _one_line(s: dict, run_dir: Path) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    trace = s["provenance"]["trace"]
    return (
        f"{s['policy']}: {f(s['ms_per_token'], '.3f')} ms/token, hit rate {f(s['hit_rate'], '.3f')}, "
        f"substitution rate {f(s['substitution_rate'], '.3f')}, mean mass {f(s['mean_mass'], '.4f')} "
        f"[{Path(trace['path']).name}: {s['tokens']:,} tokens ({s['decode_tokens']:,} decode) x "
        f"{trace['num_layers']} MoE layers x {trace['num_experts']} experts, top-{trace['top_k']}; "
        f"{s['sim_seconds']:.2f} s] -> {run_dir}"
    )


def main() -> None:
    """The moe-sim console script: ``--help`` from the configs, else Hydra's app, every input
    error as one line and exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = sys.argv[1:]
    if "--help" in args or "-h" in args:
        from simulator.config import help_text

        sys.stdout.write(help_text())
        return
    overrides = [a for a in args if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    try:
        resolved = iter(resolve_overrides(overrides))
        # Hydra reports its own errors only as text unless asked to raise them
        os.environ["HYDRA_FULL_ERROR"] = "1"
        sys.argv = [sys.argv[0], *_replace(args, overrides, resolved)]
        _hydra_app()
    except InputError as exc:
        _exit_with(str(exc))
    except OSError as exc:
        cause = " ".join((exc.strerror or str(exc)).split())
        _exit_with(f"{exc.filename or '?'}: {cause}; check the path, free disk space and permissions")
    except (HydraException, OmegaConfBaseException) as exc:
        _exit_with(hydra_error_line(exc))
    from simulator.sweep import take_outcome

    outcome = take_outcome()
    if outcome is not None and outcome.failed:
        print(f"moe-sim: error: {outcome.failed} of {outcome.finished} jobs failed "
              f"({outcome.failed_input} on their input); each failed job's error.txt says why, "
              f"the other jobs' results are complete: {outcome.sweep_dir}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR if outcome.failed_input else 1)


def _replace(args: list[str], overrides: list[str], resolved) -> list[str]:
    """``args`` with the overrides replaced by their resolved form (flags kept in place)."""
    out = [a for a in args if a not in overrides]
    return out + list(resolved)


def _exit_with(line: str) -> None:
    print(f"moe-sim: error: {' '.join(line.split())}", file=sys.stderr)
    sys.exit(EXIT_INPUT_ERROR)


def _hydra_app() -> None:
    import hydra

    from simulator.config import register_configs

    register_configs()
    hydra.main(config_path=str(CONF_DIR), config_name="simulate", version_base=None)(_task)()


if __name__ == "__main__":
    main()
