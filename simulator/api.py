"""The Python API: moe-sim from a notebook or a script (docs/api.md).

    from simulator import simulate, sweep, read_sweep

    r = simulate("traces/samples/fixture.parquet", policy="quality_first", **{"cache.fraction": 0.25})
    r.summary["ms_per_token"], r.per_token, r.per_layer, r.config
    table = sweep("traces/samples/fixture.parquet",
                  {"policy": ["fetch_all", "quality_first"], "cache.fraction": [0.1, 0.25]})
    runs = read_sweep("multirun/2026-01-01/12-00-00")   # a moe-sim -m sweep

Overrides are the command line's, by the same names (``policy``, ``cache.fraction``,
``hardware=PATH.yaml`` ...), with Python values: ``None`` is ``null``, ``math.inf`` is ``inf``,
lists and dicts as Hydra writes them; a dict for a section (``cache={"fraction": 0.25}``) sets
its fields. Bad input raises :class:`traces.errors.InputError` with the one line moe-sim prints.
"""
from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from traces.errors import InputError

__all__ = ["Result", "read_sweep", "simulate", "sweep", "to_overrides"]


@dataclass(frozen=True)
class Result:
    """One run: ``summary`` (summary.json as a dict, ``provenance`` included), ``per_token`` and
    ``per_layer`` (the tables of per_token.parquet and per_layer.parquet; docs/metrics.md) and
    ``config`` (the resolved configuration, as .hydra/config.yaml would hold it)."""

    summary: dict
    per_token: pl.DataFrame
    per_layer: pl.DataFrame
    config: dict


def simulate(trace_path: str | os.PathLike, **overrides: Any) -> Result:
    """Run one configuration over the trace at ``trace_path``; ``overrides`` as moe-sim's
    (``simulate(p, policy="quality_first", **{"cache.fraction": 0.25})``)."""
    from simulator.results import per_layer_table, per_token_output
    from simulator.run import simulate_config

    cfg = _config(trace_path, overrides)
    summary, result = simulate_config(cfg)
    domains = summary["provenance"]["trace"]["domains"]
    return Result(summary, pl.from_arrow(per_token_output(result, domains)),
                  pl.from_arrow(per_layer_table(result)), cfg)


def sweep(trace_path: str | os.PathLike, grid: Mapping[str, Sequence[Any]], workers: int | None = None,
          **overrides: Any) -> pl.DataFrame:
    """Every combination of ``grid`` (override name -> values) over one trace, as one table.

    One row per configuration, in the order of the product of ``grid``'s values: a column per
    grid name with its value, then every summary.json number (docs/metrics.md).
    ``overrides`` apply to every configuration. The trace is decoded once and shared (for a
    Parquet file, through the trace cache: ``trace.cache``); runs proceed on ``workers`` threads
    (default: the usable cores). ``sim_seconds`` is the wall time of the runs that shared one
    decode, divided among them.
    """
    from simulator.engine.many import simulate_many
    from simulator.run import finish, prepare

    if not grid or any(isinstance(v, str) or not isinstance(v, Iterable) for v in grid.values()):
        raise InputError("sweep grid must map override names to lists of values, e.g. "
                         "{'policy': ['fetch_all', 'quality_first']}")
    names = list(grid)
    combos = list(itertools.product(*(list(grid[n]) for n in names)))
    prepared = [prepare(_config(trace_path, {**overrides, **dict(zip(names, c, strict=True))}))
                for c in combos]
    summaries: list[dict | None] = [None] * len(prepared)
    for key, members in _shared_decodes(prepared).items():
        first = prepared[members[0]]
        t0 = time.perf_counter()
        results = simulate_many(first.source, [prepared[i].params for i in members],
                                engine=key[1], workers=workers,
                                chunk_tokens=first.cfg["trace"].get("chunk_tokens"))
        seconds = (time.perf_counter() - t0) / len(members)
        for i, result in zip(members, results, strict=True):
            summaries[i] = finish(prepared[i], result, seconds)
    rows = []
    for combo, summary in zip(combos, summaries, strict=True):
        numbers = {k: v for k, v in summary.items() if not isinstance(v, dict)}
        rows.append({**dict(zip(names, combo, strict=True)), **numbers})
    return pl.DataFrame(rows)


def read_sweep(sweep_dir: str | os.PathLike) -> pl.DataFrame:
    """A ``moe-sim -m`` sweep directory (or one run directory) as one table: a row per job with
    its status and error, every config field (``policy.tau``), every summary.json number and the
    provenance columns (analysis/collect.py, docs/REPORTS.md)."""
    from analysis.collect import collect_sweep

    return collect_sweep(sweep_dir)


def _shared_decodes(prepared: list) -> dict[tuple[str, str], list[int]]:
    """Configurations that read the same trace the same way, with the same engine, by index."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(prepared):
        trace = p.cfg["trace"]
        key = (repr(sorted((k, trace.get(k)) for k in ("path", "max_tokens", "chunk_tokens"))), p.engine)
        groups.setdefault(key, []).append(i)
    return groups


def _config(trace_path: str | os.PathLike, overrides: Mapping[str, Any]) -> dict:
    from omegaconf import OmegaConf

    from simulator.run import compose

    strings = [f"trace.path={_value(os.fspath(trace_path))}", *to_overrides(overrides)]
    return OmegaConf.to_container(compose(strings), resolve=True)


def to_overrides(overrides: Mapping[str, Any]) -> list[str]:
    """``{"cache.fraction": 0.25, "policy": "rule015"}`` -> ``["cache.fraction=0.25",
    "policy=rule015"]``; a dict value sets the fields of its section."""
    out = []
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            out += to_overrides({f"{key}.{k}": v for k, v in value.items()})
        else:
            out.append(f"{key}={_value(value)}")
    return out


SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./+:@")


def _value(value: Any) -> str:
    """A Python value in Hydra's override syntax."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if text and set(text) <= SAFE:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
