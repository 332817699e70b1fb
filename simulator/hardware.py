"""The hardware model: a profile (conf/hardware/*.yaml) turned into transfer and compute times.

The simulator only reads profiles; ``moe-calibrate`` measures and writes them. Units: times in
microseconds, bandwidths in GB/s (1e9 bytes per second), sizes in bytes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from traces.errors import InputError

# sanity caps, named in the messages: a value beyond one is a typo or a unit mistake
MAX_LATENCY_US = 1e6  # one second per transfer or call
MAX_LINK_GBPS = 1e4  # PCIe, SSD: 10 TB/s
MAX_MEMORY_GBPS = 1e5  # GPU or CPU memory: 100 TB/s
MAX_HOST_RAM_BYTES = 2**50  # 1 PiB

# section -> field -> (required, may be 0, cap)
PROFILE_FIELDS: dict[str, dict[str, tuple[bool, bool, float]]] = {
    "pcie": {"latency_us": (True, True, MAX_LATENCY_US), "bandwidth_gbps": (True, False, MAX_LINK_GBPS),
             "pageable_bandwidth_gbps": (False, False, MAX_LINK_GBPS),
             "idle_latency_us": (False, True, MAX_LATENCY_US)},
    "ssd": {"latency_us": (True, True, MAX_LATENCY_US), "bandwidth_gbps": (True, False, MAX_LINK_GBPS)},
    "gpu": {"expert_fixed_us": (True, True, MAX_LATENCY_US),
            "memory_bandwidth_gbps": (True, False, MAX_MEMORY_GBPS),
            "layer_fixed_us": (True, True, MAX_LATENCY_US),
            "memory_bytes": (False, False, MAX_HOST_RAM_BYTES),
            "token_fixed_us": (False, True, MAX_LATENCY_US),
            "step_fixed_us": (False, True, MAX_LATENCY_US)},
    "cpu": {"expert_fixed_us": (True, True, MAX_LATENCY_US),
            "memory_bandwidth_gbps": (True, False, MAX_MEMORY_GBPS)},
}
# section -> field -> its choices (the first: what a profile without the field models)
PROFILE_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "pcie": {"copy_order": ("priority", "submission")},
}
TOP_LEVEL = {"name", "source", "host", "host_ram_bytes", "host_pinned_bytes", "compute", "samples",
             *PROFILE_FIELDS}
COMPUTE_FIELDS = ("gpu_expert_us", "nonexpert_layer_us", "cpu_expert_us")
SOURCES = ("measured", "datasheet")


def validate_profile(profile: Mapping, origin: str = "hardware profile") -> None:
    """Check a profile's fields, types, signs and sanity caps; raise one InputError listing every
    bad or missing field, joined with "; "."""
    if not isinstance(profile, Mapping):
        raise InputError(f"{origin}: expected a mapping of sections (pcie, ssd, gpu, cpu, ...), got "
                         f"{type(profile).__name__}; write the profile as YAML keys and values")
    problems = [f"unknown field 'hardware.{name}' (allowed: {', '.join(sorted(TOP_LEVEL))})"
                for name in sorted(set(map(str, profile)) - TOP_LEVEL)]
    if profile.get("source") not in SOURCES:
        problems.append(f"'hardware.source' must be one of {', '.join(SOURCES)}, got "
                        f"{profile.get('source')!r}")
    for section, fields in PROFILE_FIELDS.items():
        block = profile.get(section)
        if not isinstance(block, Mapping):
            problems.append(f"missing section 'hardware.{section}' ({', '.join(fields)})" if block is None
                            else f"'hardware.{section}' must map {', '.join(fields)} to numbers")
            continue
        choices = PROFILE_CHOICES.get(section, {})
        allowed = [*fields, *choices]
        problems += [f"unknown field 'hardware.{section}.{name}' (units are in the field name, "
                     f"allowed: {', '.join(allowed)})" for name in sorted(set(map(str, block)) - set(allowed))]
        problems += [f"'hardware.{section}.{name}' must be one of {', '.join(options)}, got {block[name]!r}"
                     for name, options in choices.items()
                     if block.get(name) is not None and block[name] not in options]
        for name, (required, zero, cap) in fields.items():
            value = block.get(name)
            if value is None:
                if required:
                    problems.append(f"missing field 'hardware.{section}.{name}'")
                continue
            problems += _number_problems(value, f"hardware.{section}.{name}", zero, cap)
    for name in ("host_ram_bytes", "host_pinned_bytes"):
        if profile.get(name) is not None:
            problems += _number_problems(profile[name], f"hardware.{name}", True, MAX_HOST_RAM_BYTES)
    compute = profile.get("compute") or {}
    if not isinstance(compute, Mapping):
        problems.append("'hardware.compute' must map model names to measured times")
        compute = {}
    for model, times in compute.items():
        if not isinstance(times, Mapping):
            problems.append(f"'hardware.compute.{model}' must map {', '.join(COMPUTE_FIELDS)} to times")
            continue
        for name, value in times.items():
            if name not in COMPUTE_FIELDS:
                problems.append(f"unknown field 'hardware.compute.{model}.{name}' "
                                f"(allowed: {', '.join(COMPUTE_FIELDS)})")
            else:
                problems += _number_problems(value, f"hardware.compute.{model}.{name}", False,
                                             MAX_LATENCY_US)
    if problems:
        raise InputError(f"{origin}: {'; '.join(problems)}")


def _number_problems(value, field: str, zero: bool, cap: float) -> list[str]:
    """What is wrong with one number of a profile (nothing: an empty list)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return [f"'{field}' must be a number (units are in the name), got {value!r}"]
    low = ">= 0" if zero else "> 0"
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        return [f"'{field}' must be finite and {low}, got {value!r}"]
    if value > cap:
        return [f"'{field}' is {value:g}, above the sanity cap {cap:g} (check the unit in the name)"]
    return []


@dataclass(frozen=True)
class LayerTimes:
    """Per-layer times of one model on one host, in microseconds (float64[L] each)."""

    gpu_expert_us: np.ndarray
    nonexpert_us: np.ndarray
    cpu_expert_us: np.ndarray


def layer_times(
    profile: Mapping, model_name: str, expert_bytes: np.ndarray, dense_bytes: np.ndarray
) -> LayerTimes:
    """Expert and non-expert compute times per layer.

    A measured entry ``compute[model_name]`` wins; otherwise a roofline of a fixed cost plus the
    weight bytes streamed at the profile's effective memory bandwidth.
    """
    measured = (profile.get("compute") or {}).get(model_name) or {}
    gpu, cpu = profile["gpu"], profile["cpu"]
    expert_bytes = np.asarray(expert_bytes, dtype=np.float64)
    dense_bytes = np.asarray(dense_bytes, dtype=np.float64)

    def pick(key: str, fixed_us: float, nbytes: np.ndarray, gbps: float) -> np.ndarray:
        if key in measured:
            return np.full(nbytes.shape, float(measured[key]))
        return fixed_us + nbytes / (gbps * 1e3)

    return LayerTimes(
        gpu_expert_us=pick("gpu_expert_us", gpu["expert_fixed_us"], expert_bytes, gpu["memory_bandwidth_gbps"]),
        nonexpert_us=pick("nonexpert_layer_us", gpu["layer_fixed_us"], dense_bytes, gpu["memory_bandwidth_gbps"]),
        cpu_expert_us=pick("cpu_expert_us", cpu["expert_fixed_us"], expert_bytes, cpu["memory_bandwidth_gbps"]),
    )

