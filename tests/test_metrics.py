"""The counter schema is the one source: docs/metrics.md holds its tables, summary.json and the
per-layer table carry exactly its fields, and both engines count into its layout."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from engine_cases import params, trace

from simulator.engine import simulate
from simulator.metrics import (
    LAYER,
    RUN,
    TOKEN,
    TOKEN_IDS,
    SimResult,
    glossary_tables,
    summary_fields,
)
from simulator.results import per_layer_table, per_token_table, summarize

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def test_docs_hold_the_generated_tables():
    text = DOCS.read_text()
    found = re.search(r"<!-- generated: python -m simulator.metrics -->\n(.*)\n<!-- end of generated tables -->",
                      text, re.S)
    assert found, "docs/metrics.md lost its generated block"
    assert found.group(1) == glossary_tables(), "regenerate with: python -m simulator.metrics"


def test_outputs_carry_exactly_the_schema_fields():
    source = trace([[[0, 1]], [[2, 3]], [[0, 2]]], num_experts=4)
    r = simulate(source, params(source.meta, budget_experts=2, rule="rule015"))
    summary = summarize(r, engine="numba", policy="x", substitute_by="frequency", sim_seconds=0.0)
    assert list(summary) == summary_fields()
    assert per_token_table(r).column_names == [m.name for m in (*TOKEN_IDS, *TOKEN)]
    assert set(per_layer_table(r).column_names) >= {"layer", *(m.name for m in LAYER)}
    names = {f.name for f in dataclasses.fields(SimResult)}
    assert {f"layer_{m.name}" for m in LAYER} <= names and {m.name for m in RUN} <= names
    # the per-token sums equal the per-layer and run totals they are counted apart from
    assert int(r.hits.sum()) == summary["hits"] + summary["prefill_hits"]
