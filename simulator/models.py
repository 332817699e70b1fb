"""The one model registry: the presets under conf/model/, read as plain YAML.

moe-sim composes them through Hydra (``model=<name>``); the GPU-host tools, which run where
Hydra is not installed, read the same files here: routing shape (layers, experts, top-k), byte
sizes, and for the presets that carry an ``attention`` block the decoder-layer shapes the
calibration and replay kernels are built from.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

from traces.errors import InputError

MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"


def preset_names() -> list[str]:
    """Every model preset, ``trace`` (sizes from the trace) excluded."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml") if p.stem != "trace")


@cache
def preset(name: str) -> dict:
    """The preset ``conf/model/<name>.yaml`` as a dict."""
    path = MODEL_DIR / f"{name}.yaml"
    if not path.is_file():
        raise InputError(f"model '{name}' has no preset; known: {', '.join(preset_names())}")
    with open(path) as f:
        return yaml.safe_load(f)


def with_attention_shapes() -> list[str]:
    """The presets the GPU tools can build decoder layers for."""
    return [n for n in preset_names() if "attention" in preset(n)]
