"""Discrete-event simulator of MoE expert offloading driven by router traces.

The Python API (docs/api.md), loaded on first use so that ``import simulator`` stays cheap::

    from simulator import simulate, sweep, read_sweep
    result = simulate("traces/samples/fixture.parquet", policy="quality_first",
                      **{"cache.fraction": 0.25})
"""
from __future__ import annotations

import importlib

__all__ = ["Result", "read_sweep", "simulate", "sweep"]


def __getattr__(name: str):
    if name == "sweep":  # the module simulator.sweep is callable as the API's sweep()
        return importlib.import_module("simulator.sweep")
    if name in __all__:
        return getattr(importlib.import_module("simulator.api"), name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
