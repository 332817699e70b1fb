"""The one counter schema: every number the engines count or ``moe-sim`` reports, defined once.

From these tables come the engines' counter layout (the :class:`LayerCount` and
:class:`RunCount` indices both engines count into), the :class:`SimResult` fields, the
``summary.json`` fields (computed in :mod:`simulator.results`), the per-layer table, and the
tables of docs/metrics.md (``python -m simulator.metrics`` prints them; a test checks the file
holds them). Adding a counter means adding one :class:`Metric` here, plus the policy code that
increments it.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass

import numpy as np

MASS_BINS = 100_000  # histogram of per-token-layer substituted mass over [0, 1]


@dataclass(frozen=True)
class Metric:
    """One number: its name in code and outputs, unit, definition, and (engines) dtype."""

    name: str
    unit: str
    doc: str
    dtype: str = "int64"
    summary: str | None = None  # the summary.json field that totals it (None: not totalled)


# Per simulated token, in trace order (warm-up tokens excluded).
TOKEN_IDS = (
    Metric("seq", "", "sequence id", "int32"),
    Metric("pos", "", "token position within the sequence", "int32"),
    Metric("phase", "", "0 prefill, 1 decode", "int8"),
    Metric("domain", "", "index into the trace's domain names, -1 none", "int16"),
)
TOKEN = (
    Metric("time_us", "us", "decode: token latency; prefill: its batch's time divided by the "
           "batch's tokens", "float64"),
    Metric("stall_us", "us", "time waiting on synchronous fetches (same convention)", "float64"),
    Metric("mass", "gate mass", "substituted mass summed over layers", "float64"),
    Metric("hits", "calls", "resident calls of the token over all layers (a prefill batch's "
           "unique-expert lookups are all counted on its first token)", "int32"),
    Metric("fetches", "calls", "synchronously fetched calls (same convention)", "int32"),
    Metric("substitutions", "calls", "substituted calls", "int32"),
    Metric("cpu_calls", "calls", "calls computed on the CPU", "int32"),
)

# Per MoE layer, decode steps only (``layer_<name>`` in SimResult).
LAYER = (
    Metric("calls", "calls", "decode calls: `decode_tokens x layers x k`", summary="expert_calls"),
    Metric("hits", "calls", "calls whose expert was resident on the GPU", summary="hits"),
    Metric("fetches", "calls", "misses fetched synchronously over PCIe, forced fetches included",
           summary="fetches"),
    Metric("forced_fetches", "calls", "misses the rule would have substituted but no resident "
           "expert was eligible", summary="forced_fetches"),
    Metric("substitutions", "calls", "misses served by a resident substitute expert",
           summary="substitutions"),
    Metric("first_choice_substitutions", "calls", "substitutions of a rank-0 (first-choice) "
           "expert", summary="first_choice_substitutions"),
    Metric("cpu_calls", "calls", "misses computed on the CPU (`policy.miss_action=cpu`)",
           summary="cpu_calls"),
    Metric("background_admissions", "experts", "background transfers that completed and made "
           "their expert resident (by the admitted expert's layer, all phases)"),
)
LAYER_SUMS = (
    Metric("mass", "gate mass", "substituted gate mass summed over decode steps", "float64"),
)

# Whole run, all phases unless a name says otherwise.
RUN = (
    Metric("prefill_lookups", "lookups", "unique experts looked up by prefill batches",
           summary="prefill_lookups"),
    Metric("prefill_hits", "lookups", "prefill lookups whose expert was resident",
           summary="prefill_hits"),
    Metric("bytes_fetched", "bytes", "host-to-device bytes, synchronous and background",
           summary="bytes_fetched"),
    Metric("background_bytes", "bytes", "the background part of `bytes_fetched`",
           summary="background_bytes"),
    Metric("background_admissions", "experts", "background transfers that completed and made "
           "their expert resident", summary="background_admissions"),
    Metric("background_enqueued", "experts", "experts queued for background admission "
           "(`acc >= beta`)", summary="background_enqueued"),
    Metric("ssd_reads", "experts", "transfers whose expert first had to be read from the SSD "
           "(host RAM tier miss)", summary="ssd_reads"),
    Metric("evictions", "experts", "experts evicted from the GPU cache", summary="evictions"),
    Metric("wasted_admissions", "experts", "background admissions evicted before any use (hit or "
           "substitute use)", summary="wasted_admissions"),
    Metric("wasted_admission_bytes", "bytes", "copied bytes of admissions that served no use: "
           "evicted unused, or completed after the expert was resident anyway",
           summary="wasted_admission_bytes"),
    Metric("prefetches", "experts", "experts queued for a background transfer by prefetch",
           summary="prefetches"),
    Metric("prefetch_bytes", "bytes", "copied bytes of prefetches (part of `background_bytes`)",
           summary="prefetch_bytes"),
    Metric("useful_prefetches", "experts", "prefetched experts used (hit or substitute use) before "
           "their eviction", summary="useful_prefetches"),
    Metric("late_prefetches", "calls", "decode selections of an expert whose prefetch was still "
           "queued or in flight (the expert was missed)", summary="late_prefetches"),
    Metric("wasted_prefetch_bytes", "bytes", "copied bytes of prefetches that served no use: "
           "evicted unused, or completed after the expert was resident anyway",
           summary="wasted_prefetch_bytes"),
)

# summary.json fields computed from the counters (simulator.results.summarize); the totals of
# the counters above (their ``summary`` names) are summary fields too.
SUMMARY = (
    Metric("tokens", "tokens", "simulated tokens, prefill and decode"),
    Metric("decode_tokens", "tokens", "simulated decode tokens"),
    Metric("prefill_tokens", "tokens", "simulated prefill tokens"),
    Metric("hit_rate", "ratio", "`hits / expert_calls`"),
    Metric("substitution_rate", "ratio", "`substitutions / expert_calls`"),
    Metric("mean_mass", "gate mass", "mean substituted gate mass per decode token-layer"),
    Metric("mass_p50", "gate mass", "median substituted mass per decode token-layer (histogram of "
           "1e-5 bins, upper edge)"),
    Metric("mass_p90", "gate mass", "90th percentile of the same"),
    Metric("mass_p99", "gate mass", "99th percentile of the same"),
    Metric("mass_per_token", "gate mass", "substituted mass summed over layers, mean per decode "
           "token"),
    Metric("ms_per_token", "ms", "mean decode-token latency: from the start of its first layer "
           "to the end of its last"),
    Metric("ms_per_token_p50", "ms", "median decode-token latency"),
    Metric("ms_per_token_p99", "ms", "99th percentile of decode-token latency"),
    Metric("tokens_per_s", "tokens/s", "`1000 / ms_per_token`"),
    Metric("stall_ms_per_token", "ms", "mean time per decode token spent waiting on synchronous "
           "fetches"),
    Metric("sim_seconds", "s", "wall-clock time of the simulation itself (not of the modelled "
           "hardware)"),
    Metric("engine", "", "`numba` or `reference`", "str"),
    Metric("policy", "", "the policy preset's name (`policy.name`)", "str"),
    Metric("substitute_by", "", "`logit` (highest router logit among eligible residents) or "
           "`frequency` (most often selected eligible resident: the fallback for traces without "
           "logits)", "str"),
)

# per_layer.parquet columns derived from the layer counters
PER_LAYER_DERIVED = (
    Metric("hit_rate", "ratio", "`hits / calls`", "float64"),
    Metric("mass_sum", "gate mass", "summed substituted mass", "float64"),
    Metric("mean_mass", "gate mass", "`mass_sum / decode_tokens`", "float64"),
)

LayerCount = enum.IntEnum("LayerCount", [(m.name.upper(), i) for i, m in enumerate(LAYER)])
LayerSum = enum.IntEnum("LayerSum", [(m.name.upper(), i) for i, m in enumerate(LAYER_SUMS)])
RunCount = enum.IntEnum("RunCount", [(m.name.upper(), i) for i, m in enumerate(RUN)])


def summary_fields() -> list[str]:
    """Every summary.json field, in output order."""
    totals = [m.summary for m in (*LAYER, *RUN) if m.summary]
    return [m.name for m in SUMMARY[:3]] + totals + [m.name for m in SUMMARY[3:]]


def _result_fields() -> list[tuple]:
    def array(dtype):
        return dataclasses.field(default_factory=lambda: np.zeros(0, dtype))

    fields = [(m.name, np.ndarray, array(m.dtype)) for m in (*TOKEN_IDS, *TOKEN)]
    fields += [(f"layer_{m.name}", np.ndarray, array(m.dtype)) for m in (*LAYER, *LAYER_SUMS)]
    fields += [(m.name, int, dataclasses.field(default=0)) for m in RUN]
    fields += [
        ("mass_hist", np.ndarray,
         dataclasses.field(default_factory=lambda: np.zeros(MASS_BINS + 1, np.int64))),
        ("sim_end_us", float, dataclasses.field(default=0.0)),
    ]
    return fields


SimResult = dataclasses.make_dataclass("SimResult", _result_fields())
SimResult.__module__ = __name__  # (make_dataclass takes module= only from Python 3.12)
SimResult.__doc__ = """Raw engine outputs; :mod:`simulator.results` turns them into summary and tables.

Per-token arrays (``TOKEN_IDS``, ``TOKEN``) cover every simulated token in trace order;
``layer_<name>`` arrays are the per-layer counters (``LAYER``, ``LAYER_SUMS``) over decode
steps; run counters (``RUN``) are ints; ``mass_hist`` counts decode token-layers by substituted
mass (``MASS_BINS`` bins); ``sim_end_us`` is the simulated clock at the end."""


def build_result(tokens: dict[str, np.ndarray], layer_counts: np.ndarray, layer_sums: np.ndarray,
                 run_counts: np.ndarray, mass_hist: np.ndarray, sim_end_us: float,
                 own_mass_hist: bool = False) -> SimResult:
    """A SimResult from an engine's counters (``layer_counts`` int64[L, len(LAYER)],
    ``layer_sums`` float64[L, len(LAYER_SUMS)], ``run_counts`` int64[len(RUN)]).

    The per-token arrays are taken as they are where their type is right (an engine passes
    arrays of its own); ``own_mass_hist``: the histogram too (0.8 MB), else it is copied."""
    values = {m.name: np.asarray(tokens[m.name], dtype=m.dtype) for m in (*TOKEN_IDS, *TOKEN)}
    for i, m in enumerate(LAYER):
        values[f"layer_{m.name}"] = np.array(layer_counts[:, i], dtype=np.int64)
    for i, m in enumerate(LAYER_SUMS):
        values[f"layer_{m.name}"] = np.array(layer_sums[:, i], dtype=np.float64)
    for i, m in enumerate(RUN):
        values[m.name] = int(run_counts[i])
    values["mass_hist"] = np.array(mass_hist, dtype=np.int64, copy=None if own_mass_hist else True)
    values["sim_end_us"] = float(sim_end_us)
    return SimResult(**values)


def _table(rows: tuple[Metric, ...], name=lambda m: m.name) -> str:
    lines = ["| field | unit | definition |", "|---|---|---|"]
    lines += [f"| `{name(m)}` | {m.unit} | {m.doc} |" for m in rows]
    return "\n".join(lines)


def glossary_tables() -> str:
    """The generated part of docs/metrics.md."""
    totals = tuple(dataclasses.replace(m, name=m.summary) for m in (*LAYER, *RUN) if m.summary)
    summary = SUMMARY[:3] + totals + SUMMARY[3:]
    per_layer = (*LAYER, *PER_LAYER_DERIVED)
    return "\n\n".join([
        "### summary.json\n\n" + _table(summary),
        "### per_token.parquet (one row per simulated token)\n\n" + _table((*TOKEN_IDS, *TOKEN)),
        "### per_layer.parquet (one row per MoE layer, decode steps)\n\n"
        + _table((Metric("layer", "", "MoE layer ordinal"), *per_layer)),
    ])


if __name__ == "__main__":
    sys.stdout.write(glossary_tables() + "\n")
