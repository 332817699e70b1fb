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

# section -> field -> required
PROFILE_FIELDS: dict[str, dict[str, bool]] = {
    "pcie": {"latency_us": True, "bandwidth_gbps": True, "pageable_bandwidth_gbps": False},
    "ssd": {"latency_us": True, "bandwidth_gbps": True},
    "gpu": {"expert_fixed_us": True, "memory_bandwidth_gbps": True, "layer_fixed_us": True},
    "cpu": {"expert_fixed_us": True, "memory_bandwidth_gbps": True},
}
TOP_LEVEL = {"name", "source", "host", "host_ram_bytes", "compute", "samples", *PROFILE_FIELDS}
COMPUTE_FIELDS = ("gpu_expert_us", "nonexpert_layer_us", "cpu_expert_us")
SOURCES = ("measured", "datasheet")


def validate_profile(profile: Mapping, origin: str = "hardware profile") -> None:
    """Check a profile's fields, types and signs; raise InputError naming the first bad field."""
    if not isinstance(profile, Mapping):
        raise InputError(f"{origin}: expected a mapping of sections, got {type(profile).__name__}")
    unknown = sorted(set(profile) - TOP_LEVEL)
    if unknown:
        raise InputError(
            f"{origin}: unknown field 'hardware.{unknown[0]}'; allowed: {', '.join(sorted(TOP_LEVEL))}"
        )
    if profile.get("source") not in SOURCES:
        raise InputError(
            f"{origin}: 'hardware.source' must be one of {SOURCES}, got {profile.get('source')!r}"
        )
    for section, fields in PROFILE_FIELDS.items():
        block = profile.get(section)
        if not isinstance(block, Mapping):
            raise InputError(f"{origin}: missing section 'hardware.{section}' ({', '.join(fields)})")
        extra = sorted(set(block) - set(fields))
        if extra:
            raise InputError(
                f"{origin}: unknown field 'hardware.{section}.{extra[0]}' (units are in the "
                f"field name; allowed: {', '.join(fields)})"
            )
        for name, required in fields.items():
            value = block.get(name)
            if value is None:
                if required:
                    raise InputError(f"{origin}: missing field 'hardware.{section}.{name}'")
                continue
            _check_number(value, f"hardware.{section}.{name}", origin, positive=name.endswith("gbps"))
    ram = profile.get("host_ram_bytes")
    if ram is not None:
        _check_number(ram, "hardware.host_ram_bytes", origin, positive=True)
    compute = profile.get("compute") or {}
    if not isinstance(compute, Mapping):
        raise InputError(f"{origin}: 'hardware.compute' must map model names to measured times")
    for model, times in compute.items():
        if not isinstance(times, Mapping):
            raise InputError(f"{origin}: 'hardware.compute.{model}' must be a mapping")
        for name, value in times.items():
            if name not in COMPUTE_FIELDS:
                raise InputError(
                    f"{origin}: unknown field 'hardware.compute.{model}.{name}'; "
                    f"allowed: {', '.join(COMPUTE_FIELDS)}"
                )
            _check_number(value, f"hardware.compute.{model}.{name}", origin, positive=True)


def _check_number(value, field: str, origin: str, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(
            f"{origin}: '{field}' must be a number (units are in the name), got {value!r}"
        )
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise InputError(f"{origin}: '{field}' must be finite and {need}, got {value!r}")


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

