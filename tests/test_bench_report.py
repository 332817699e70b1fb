"""docs/BENCHMARKS.md is what the committed figures render (`make bench` writes both)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

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


def test_unreadable_figures_stop_with_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "page.md"
    bad = tmp_path / "bad.json"
    for text, said in (("{not json", "is not JSON"), ("[1, 2]", "no figures object"),
                       ('{"repeats": 3}', "figures lack")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            main(["--from-json", str(bad), "--out", str(out)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1 and str(bad) in err
    with pytest.raises(SystemExit):
        main(["--from-json", str(tmp_path / "missing.json"), "--out", str(out)])
    assert "cannot be read" in capsys.readouterr().err
    assert not out.exists()


def test_the_first_run_target_takes_the_run_at_its_size_where_there_is_one():
    """The first-run target row is the run at FIRST_RUN_TARGET_TOKENS where the figures have it;
    older figures (without it) still render, from the shape's own trace, and say so."""
    figures = json.loads((DOCS / "benchmarks.json").read_text())
    t = figures["first_run_target"]
    row = next(line for line in render(figures).splitlines() if "of a first run's CPU" in line)
    share = statistics.median(t["cache_cpu_s"]) / statistics.median(t["parquet_cpu_s"])
    assert f"{t['tokens']:,} tokens)" in row and f"| {share:.0%} |" in row
    del figures["first_run_target"]
    page = render(figures)
    row = next(line for line in page.splitlines() if "of a first run's CPU" in line)
    lead = figures["shapes"]["Qwen3-Next-80B-A3B"]
    assert f"{lead['shape']['tokens']:,} tokens)" in row and "At the target's size" not in page
