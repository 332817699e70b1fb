"""docs/BENCHMARKS.md is what the committed figures render (`make bench` writes both)."""
from __future__ import annotations

import json
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
