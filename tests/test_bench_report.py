"""docs/BENCHMARKS.md is what the committed figures render (`make bench` writes both)."""
from __future__ import annotations

import json
from pathlib import Path

from simulator.bench import main, render

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_benchmark_page_is_its_figures_rendered():
    figures = json.loads((DOCS / "benchmarks.json").read_text())
    assert render(figures) == (DOCS / "BENCHMARKS.md").read_text(), (
        "docs/BENCHMARKS.md differs from its figures: run `python -m simulator.bench "
        "--from-json docs/benchmarks.json --out docs/BENCHMARKS.md` (or `make bench`)")


def test_from_json_measures_nothing_and_writes_the_page(tmp_path, capsys):
    out = tmp_path / "page.md"
    main(["--from-json", str(DOCS / "benchmarks.json"), "--out", str(out)])
    assert out.read_text() == (DOCS / "BENCHMARKS.md").read_text()
    assert "## Targets" in capsys.readouterr().out
