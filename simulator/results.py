"""Engine outputs -> summary.json, per_token.parquet and per_layer.parquet, written atomically.

Every field is defined once in docs/metrics.md; the names here are those names.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from simulator.engine.params import MASS_BINS, SimResult
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
    """The run's headline numbers (decode steps only unless a name says otherwise)."""
    decode = r.phase == PHASE_DECODE
    n_decode = int(decode.sum())
    calls = int(r.layer_calls.sum())
    subs = int(r.layer_substitutions.sum())
    t_ms = r.time_us[decode] / 1e3
    mass_sum = float(r.layer_mass.sum())
    token_layers = int(r.mass_hist.sum())
    ms_per_token = float(t_ms.mean()) if n_decode else None
    return {
        "tokens": int(r.phase.shape[0]),
        "decode_tokens": n_decode,
        "prefill_tokens": int(r.phase.shape[0]) - n_decode,
        "expert_calls": calls,
        "hits": int(r.layer_hits.sum()),
        "hit_rate": _ratio(r.layer_hits.sum(), calls),
        "fetches": int(r.layer_fetches.sum()),
        "forced_fetches": int(r.layer_forced_fetches.sum()),
        "background_admissions": int(r.background_admissions),
        "background_enqueued": int(r.background_enqueued),
        "substitutions": subs,
        "substitution_rate": _ratio(subs, calls),
        "first_choice_substitutions": int(r.layer_first_choice_substitutions.sum()),
        "cpu_calls": int(r.layer_cpu_calls.sum()),
        "mean_mass": _ratio(mass_sum, token_layers),
        "mass_p50": mass_percentile(r.mass_hist, 0.50),
        "mass_p90": mass_percentile(r.mass_hist, 0.90),
        "mass_p99": mass_percentile(r.mass_hist, 0.99),
        "mass_per_token": _ratio(mass_sum, n_decode),
        "prefill_lookups": int(r.prefill_lookups),
        "prefill_hits": int(r.prefill_hits),
        "evictions": int(r.evictions),
        "ssd_reads": int(r.ssd_reads),
        "bytes_fetched": int(r.bytes_fetched),
        "background_bytes": int(r.background_bytes),
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


def per_token_table(r: SimResult) -> pa.Table:
    """One row per simulated token."""
    return pa.table(
        {
            "seq": r.seq,
            "pos": r.pos,
            "phase": r.phase,
            "domain": r.domain,
            "time_us": r.time_us,
            "stall_us": r.stall_us,
            "mass": r.mass,
            "hits": r.hits,
            "fetches": r.fetches,
            "substitutions": r.substitutions,
            "cpu_calls": r.cpu_calls,
        }
    )


def per_layer_table(r: SimResult) -> pa.Table:
    """One row per MoE layer, decode steps."""
    calls = r.layer_calls.astype(np.float64)
    hit_rate = np.where(calls > 0, r.layer_hits / np.maximum(calls, 1), np.nan)
    decode_tokens = int((r.phase == PHASE_DECODE).sum())
    mean_mass = r.layer_mass / decode_tokens if decode_tokens else np.full_like(r.layer_mass, np.nan)
    return pa.table(
        {
            "layer": np.arange(r.layer_calls.shape[0], dtype=np.int32),
            "calls": r.layer_calls,
            "hits": r.layer_hits,
            "hit_rate": hit_rate,
            "fetches": r.layer_fetches,
            "forced_fetches": r.layer_forced_fetches,
            "substitutions": r.layer_substitutions,
            "first_choice_substitutions": r.layer_first_choice_substitutions,
            "cpu_calls": r.layer_cpu_calls,
            "mass_sum": r.layer_mass,
            "mean_mass": mean_mass,
            "background_admissions": r.layer_background_admissions,
        }
    )


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    """Write a Parquet table to ``path`` atomically (zstd)."""
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_outputs(run_dir: Path, summary: dict, r: SimResult, per_token: bool = True) -> None:
    """summary.json last, so its presence marks a complete run."""
    run_dir = Path(run_dir)
    if per_token:
        atomic_write_parquet(run_dir / "per_token.parquet", per_token_table(r))
    atomic_write_parquet(run_dir / "per_layer.parquet", per_layer_table(r))
    atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
