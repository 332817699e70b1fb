"""What produced a run: the trace, the model sizes and the hardware profile behind its numbers.

``summary.json`` may carry a ``provenance`` object written by moe-sim; for runs written before
it did, the same facts are derived from the run's ``.hydra/config.yaml`` and the trace file's
metadata. :func:`run_provenance` is the one place that chooses between the two, field by field.

The facts are ``{group: {field: value}}`` with the groups and fields of :data:`FIELDS`; a fact
that cannot be known (the trace file has moved, an old summary) is None and reads "unknown".
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

FIELDS = {
    "trace": ("path", "content_hash", "model", "source", "num_layers", "num_experts", "top_k",
              "tokens"),
    "model": ("name", "sizes_from", "expert_bytes", "dense_bytes_per_layer"),
    "hardware": ("name", "source"),
}
PREFIX = "provenance."
UNKNOWN = "unknown"
SEPARATOR = " · "  # between the parts of a context line
HASH_SHOWN = 12  # hex digits of the content hash a report shows: enough to tell files apart
MIB = 1 << 20


def column(group: str, name: str) -> str:
    """The table column of one fact: ``provenance.trace.content_hash``."""
    return f"{PREFIX}{group}.{name}"


def columns() -> tuple[str, ...]:
    """Every provenance column, in :data:`FIELDS` order."""
    return tuple(column(g, n) for g, names in FIELDS.items() for n in names)


def run_provenance(config: Mapping[str, Any], recorded: Any,
                   cwd: str | None) -> dict[str, dict[str, Any]]:
    """The facts of one run: ``recorded`` (summary.json's ``provenance``) where it has them,
    else derived from ``config`` (the run's flattened ``.hydra/config.yaml``) and the trace.

    ``cwd`` is the directory moe-sim ran in (``hydra.runtime.cwd``): a relative
    ``trace.path`` is found from there.
    """
    recorded = recorded if isinstance(recorded, Mapping) else {}
    facts: dict[str, dict[str, Any]] = {}
    derived: dict[str, dict[str, Any]] | None = None
    for group, names in FIELDS.items():
        given = recorded.get(group) if isinstance(recorded.get(group), Mapping) else {}
        facts[group] = {}
        for name in names:
            if given.get(name) is not None:
                facts[group][name] = _scalar(given[name])
                continue
            if derived is None:  # opening and hashing the trace only when something is missing
                derived = _derived(config, cwd)
            facts[group][name] = derived[group][name]
    return facts


def _derived(config: Mapping[str, Any], cwd: str | None) -> dict[str, dict[str, Any]]:
    path = config.get("trace.path")
    trace = _trace_facts(_locate(str(path), cwd)) if path is not None else {}
    preset_expert = config.get("model.expert_bytes")
    model_name = config.get("model.name")
    if model_name in (None, "trace"):  # model=trace: the model the trace was recorded from
        model_name = trace.get("model")
    return {
        "trace": {"path": path, **{n: trace.get(n) for n in FIELDS["trace"][1:]}},
        "model": {
            "name": model_name,
            "sizes_from": "trace" if preset_expert is None else "preset",
            "expert_bytes": trace.get("expert_bytes") if preset_expert is None else preset_expert,
            "dense_bytes_per_layer": (trace.get("dense_bytes")
                                      if config.get("model.dense_bytes_per_layer") is None
                                      else config.get("model.dense_bytes_per_layer")),
        },
        "hardware": {"name": config.get("hardware.name"), "source": config.get("hardware.source")},
    }


def _locate(path: str, cwd: str | None) -> Path:
    given = Path(path).expanduser()
    if not given.is_absolute() and cwd:
        in_cwd = Path(cwd) / given
        if in_cwd.exists():
            return in_cwd
    return given


def _trace_facts(path: Path) -> dict[str, Any]:
    try:
        st = path.stat()
    except OSError:
        return {}
    return _read_trace_facts(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_trace_facts(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    """Metadata and content hash of one trace file, read once per report (size and mtime
    are part of the key so that a rewritten file is read again)."""
    from simulator.trace_cache import trace_key
    from traces.format import open_trace

    try:
        with open_trace(path) as reader:
            meta, tokens = reader.meta, reader.num_tokens
        digest = trace_key(path).removeprefix("file-")  # the recorded content hash, else the file's
    except Exception:  # an unreadable trace costs its facts ("unknown"), never the report
        return {}
    return {"content_hash": digest, "model": meta.model, "source": meta.source or None,
            "num_layers": meta.num_layers, "num_experts": meta.num_experts,
            "top_k": meta.top_k, "tokens": tokens,
            "expert_bytes": _scalar(list(meta.expert_bytes)),
            "dense_bytes": _scalar(list(meta.dense_bytes)) if meta.dense_bytes else 0}


def _scalar(value: Any) -> Any:
    """A per-layer list whose layers agree as its one value; other lists as compact JSON."""
    if isinstance(value, list | tuple):
        if value and all(v == value[0] for v in value):
            return value[0]
        return json.dumps(list(value), separators=(",", ":"))
    return value


# --- words for the facts ---------------------------------------------------------------------


def _known(value: Any) -> str:
    return UNKNOWN if value is None else str(value)


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else UNKNOWN


def trace_name(trace: Mapping[str, Any]) -> str:
    """The trace's file name (its path as configured when that has no name)."""
    path = trace.get("path")
    if path is None:
        return UNKNOWN
    return os.path.basename(str(path)) or str(path)


def trace_shape(trace: Mapping[str, Any], *, short: bool = False) -> str:
    """``20,000 tokens, 6 MoE layers x 64 experts, top-4`` (``short``: ``20,000 tok, 6 L x 64 E,
    top-4``); "shape unknown" when the trace could not be read."""
    if all(trace.get(n) is None for n in ("tokens", "num_layers", "num_experts", "top_k")):
        return "shape unknown"
    words = ("tok", "L", "E") if short else ("tokens", "MoE layers", "experts")
    return (f"{_count(trace.get('tokens'))} {words[0]}, {_count(trace.get('num_layers'))} "
            f"{words[1]} × {_count(trace.get('num_experts'))} {words[2]}, "
            f"top-{_known(trace.get('top_k'))}")


def content_hash_prefix(trace: Mapping[str, Any]) -> str:
    """The first :data:`HASH_SHOWN` hex digits of the trace's SHA-256 ("unknown" without)."""
    digest = trace.get("content_hash")
    return str(digest)[:HASH_SHOWN] if digest else UNKNOWN


def bytes_text(value: Any) -> str:
    """Bytes as MiB with three significant digits; a per-layer JSON list as its range."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
        if isinstance(value, list) and value:
            return f"{bytes_text(min(value))}-{bytes_text(max(value))}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value / MIB:.3g} MiB"
    return UNKNOWN


def model_text(model: Mapping[str, Any]) -> str:
    """``qwen3_next_80b_a3b (sizes from the preset)``."""
    sizes = model.get("sizes_from")
    where = {"preset": "sizes from the preset", "trace": "sizes from the trace"}.get(
        sizes, f"sizes from {_known(sizes)}")
    return f"{_known(model.get('name'))} ({where})"


def hardware_text(hardware: Mapping[str, Any]) -> str:
    """``h200_measured (measured)``."""
    return f"{_known(hardware.get('name'))} ({_known(hardware.get('source'))})"


# --- what a sweep holds fixed ----------------------------------------------------------------


def distinct(rows: pl.DataFrame, name: str) -> list[Any]:
    """The distinct values of one column among ``rows``, in row order ([] without the column)."""
    if name not in rows.columns:
        return []
    return rows[name].unique(maintain_order=True).to_list()


def fixed_group(rows: pl.DataFrame, group: str) -> dict[str, Any] | None:
    """The facts of ``group`` when the rows agree on what it is (trace path, model or
    hardware name), else None; a field the rows disagree on reads as unknown."""
    key = "path" if group == "trace" else "name"
    if len(distinct(rows, column(group, key))) != 1:
        return None
    facts = {}
    for name in FIELDS[group]:
        values = distinct(rows, column(group, name))
        facts[name] = values[0] if len(values) == 1 else None
    return facts


def cache_text(rows: pl.DataFrame) -> str | None:
    """``per_layer, 25 % resident`` when the rows share one cache scope and size, else None."""
    scopes, fractions = distinct(rows, "cache.scope"), distinct(rows, "cache.fraction")
    budgets = distinct(rows, "cache.budget_bytes")
    if len(scopes) != 1 or len(budgets) > 1 or (budgets in ([], [None]) and len(fractions) != 1):
        return None
    if budgets and budgets[0] is not None:
        size = f"budget {bytes_text(budgets[0])}"
    else:
        size = f"{100 * fractions[0]:.3g} % resident" if _is_fraction(fractions[0]) \
            else f"cache.fraction={fractions[0]}"
    return f"{scopes[0]}, {size}"


def _is_fraction(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def context_line(rows: pl.DataFrame) -> str:
    """One line naming what ``rows`` share: trace and its shape, model, hardware, cache
    (``trace fixture.parquet (20,000 tok, 6 L × 64 E, top-4) · model ... · hardware ...``);
    what varies is left to panel titles and legends."""
    parts = []
    trace = fixed_group(rows, "trace")
    if trace is not None:
        parts.append(f"trace {trace_name(trace)} ({trace_shape(trace, short=True)})")
    model = fixed_group(rows, "model")
    if model is not None:
        parts.append(f"model {model_text(model)}")
    hardware = fixed_group(rows, "hardware")
    if hardware is not None:
        parts.append(f"hardware {hardware_text(hardware)}")
    cache = cache_text(rows)
    if cache is not None:
        parts.append(f"cache {cache}")
    return SEPARATOR.join(parts)
