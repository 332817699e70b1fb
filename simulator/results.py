"""Engine outputs -> summary.json, per_token.parquet and per_layer.parquet, written atomically.

Every field is defined once, in simulator/metrics.py (docs/metrics.md shows the tables), except
two that describe the run rather than count in it: summary.json's ``provenance`` object (what
produced the numbers: :func:`provenance`, read back by ``analysis.provenance``) and
per_token.parquet's ``domain_name`` (the trace's name for each token's ``domain`` index).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from simulator.metrics import (
    LAYER,
    MASS_BINS,
    PER_LAYER_DERIVED,
    RUN,
    TOKEN,
    TOKEN_IDS,
    SimResult,
    summary_fields,
)
from traces.atomic import atomic_output, atomic_write_bytes
from traces.format import PHASE_DECODE


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def mass_percentile(hist: np.ndarray, q: float) -> float | None:
    """The q-quantile (0..1) of per-token-layer mass from its histogram (upper bin edge)."""
    total = int(hist.sum())
    if total == 0:
        return None
    rank = int(np.ceil(q * total))
    idx = int(np.searchsorted(np.cumsum(hist), max(rank, 1)))
    return min(idx / MASS_BINS, 1.0) if idx else 0.0


def summarize(r: SimResult, *, engine: str, policy: str, substitute_by: str, sim_seconds: float) -> dict:
    """The run's headline numbers (simulator.metrics.summary_fields(), decode steps only unless
    a name says otherwise)."""
    decode = r.phase == PHASE_DECODE
    n_decode = int(decode.sum())
    calls = int(r.layer_calls.sum())
    t_ms = r.time_us[decode] / 1e3
    mass_sum = float(r.layer_mass.sum())
    ms_per_token = float(t_ms.mean()) if n_decode else None
    values = {f"layer_{m.name}": int(getattr(r, f"layer_{m.name}").sum()) for m in LAYER}
    totals = {m.summary: values[f"layer_{m.name}"] for m in LAYER if m.summary}
    totals.update({m.summary: int(getattr(r, m.name)) for m in RUN if m.summary})
    derived = {
        "tokens": int(r.phase.shape[0]),
        "decode_tokens": n_decode,
        "prefill_tokens": int(r.phase.shape[0]) - n_decode,
        "hit_rate": _ratio(totals["hits"], calls),
        "substitution_rate": _ratio(totals["substitutions"], calls),
        "mean_mass": _ratio(mass_sum, int(r.mass_hist.sum())),
        "mass_p50": mass_percentile(r.mass_hist, 0.50),
        "mass_p90": mass_percentile(r.mass_hist, 0.90),
        "mass_p99": mass_percentile(r.mass_hist, 0.99),
        "mass_per_token": _ratio(mass_sum, n_decode),
        "ms_per_token": ms_per_token,
        "ms_per_token_p50": float(np.percentile(t_ms, 50)) if n_decode else None,
        "ms_per_token_p99": float(np.percentile(t_ms, 99)) if n_decode else None,
        "tokens_per_s": 1e3 / ms_per_token if ms_per_token else None,
        "stall_ms_per_token": float(r.stall_us[decode].mean() / 1e3) if n_decode else None,
        "sim_seconds": float(sim_seconds),
        "engine": engine,
        "policy": policy,
        "substitute_by": substitute_by,
    }
    merged = {**totals, **derived}
    return {name: merged[name] for name in summary_fields()}


def per_token_table(r: SimResult) -> pa.Table:
    """One row per simulated token."""
    return pa.table({m.name: getattr(r, m.name) for m in (*TOKEN_IDS, *TOKEN)})


def per_token_output(r: SimResult, domains: Sequence[str]) -> pa.Table:
    """per_token.parquet: :func:`per_token_table` plus ``domain_name``, the trace's name of each
    token's domain (dictionary-encoded; null where a token has none)."""
    table = per_token_table(r)
    index = np.asarray(r.domain, dtype=np.int32)
    names = pa.DictionaryArray.from_arrays(
        pa.array(index, mask=index < 0), pa.array(list(domains), type=pa.string()))
    return table.add_column(table.schema.get_field_index("domain") + 1, "domain_name", names)


def per_layer_table(r: SimResult) -> pa.Table:
    """One row per MoE layer, decode steps."""
    calls = r.layer_calls.astype(np.float64)
    decode_tokens = int((r.phase == PHASE_DECODE).sum())
    derived = {
        "hit_rate": np.where(calls > 0, r.layer_hits / np.maximum(calls, 1), np.nan),
        "mass_sum": r.layer_mass,
        "mean_mass": (r.layer_mass / decode_tokens if decode_tokens
                      else np.full_like(r.layer_mass, np.nan)),
    }
    columns = {"layer": np.arange(r.layer_calls.shape[0], dtype=np.int32)}
    columns.update({m.name: getattr(r, f"layer_{m.name}") for m in LAYER})
    columns.update({m.name: derived[m.name] for m in PER_LAYER_DERIVED})
    return pa.table(columns)


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    """Write a Parquet table to ``path`` atomically (zstd)."""
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_outputs(run_dir: Path, summary: dict, r: SimResult, per_token: bool = True,
                  domains: Sequence[str] = ()) -> None:
    """summary.json last, so its presence marks a complete run. ``domains``: the trace's domain
    names (``meta.domains``)."""
    run_dir = Path(run_dir)
    if per_token:
        atomic_write_parquet(run_dir / "per_token.parquet", per_token_output(r, domains))
    atomic_write_parquet(run_dir / "per_layer.parquet", per_layer_table(r))
    atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def _one_or_list(values: np.ndarray) -> int | list[int]:
    """A per-layer size as one number when every layer has it, else the list."""
    values = [int(v) for v in values]
    return values[0] if values and all(v == values[0] for v in values) else values


def sizes_from(model: Mapping | None) -> str:
    """Where a run's expert sizes come from: ``trace``, ``preset``, ``preset, sizes only`` (a
    preset's sizes on a trace of another shape) or ``override`` (sizes set on ``model=trace``)."""
    model = model or {}
    if (model.get("name") or "trace") == "trace":
        given = model.get("expert_bytes") is not None or model.get("dense_bytes_per_layer") is not None
        return "override" if given else "trace"
    return "preset, sizes only" if model.get("sizes_only") else "preset"


def provenance(cfg: Mapping, trace_path: Path | None, meta, trace_tokens: int,
               content_hash: str | None, sizes: tuple[str, np.ndarray, np.ndarray],
               substitute_by: str) -> dict:
    """summary.json's ``provenance``: what produced the run, in the shape analysis/provenance.py
    reads (``trace``, ``model``, ``hardware``), plus the ``policy``, ``cache`` and ``admission``
    sections as run and the whole resolved ``config``.

    ``trace_tokens``: the trace file's tokens; ``sizes``: (model name, expert bytes, dense bytes
    per layer) as the run used them (``simulator.run.model_sizes``).
    """
    hw = cfg.get("hardware") or {}
    model_name, expert_bytes, dense_bytes = sizes
    return {
        "trace": {"path": str(trace_path.resolve()) if trace_path is not None else None,
                  "content_hash": content_hash, "model": meta.model, "source": meta.source or None,
                  "num_layers": meta.num_layers, "num_experts": meta.num_experts,
                  "top_k": meta.top_k, "tokens": int(trace_tokens),
                  "domains": list(meta.domains)},
        "model": {"name": model_name, "sizes_from": sizes_from(cfg.get("model")),
                  "expert_bytes": _one_or_list(expert_bytes),
                  "dense_bytes_per_layer": _one_or_list(dense_bytes)},
        "hardware": {"name": hw.get("name"), "source": hw.get("source"),
                     "file": cfg.get("hardware_file")},
        "policy": {**cfg.get("policy", {}), "substitute_by": substitute_by},
        "cache": dict(cfg.get("cache", {})),
        "admission": dict(cfg.get("admission", {})),
        "config": dict(cfg),
    }
