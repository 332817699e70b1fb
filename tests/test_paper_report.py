"""analysis.paper: the paper-setting table, row by row against the paper's figures."""
from __future__ import annotations

import polars as pl
import pytest

from analysis import paper


def sweep(tmp_path, runs, **same):
    base = dict(status="ok", decode_tokens=10, fetches=0, ssd_reads=0, background_admissions=0,
                substitution_rate=0.0, mean_mass=0.0, **{"hardware.name": "h", "cache.fraction": 0.25})
    path = tmp_path / "s" / "report" / "report.parquet"
    path.parent.mkdir(parents=True)
    pl.DataFrame([{**base, **same, **r} for r in runs]).write_parquet(path)
    return tmp_path / "s"


def run(policy, ms, stall, **more):
    return {"policy.name": policy, "ms_per_token": ms, "stall_ms_per_token": stall, **more}


def test_rows_say_where_the_speedups_land_and_why(tmp_path):
    s = sweep(tmp_path, [run("fetch_all", 12.0, 8.0, fetches=300),
                         run("quality_first", 6.0, 2.0, fetches=40, ssd_reads=20),
                         run("speed_first", 4.5, 0.5), run("rule015", 5.0, 1.0)])
    text = paper.write(s).read_text()
    qf = next(line for line in text.splitlines() if line.startswith("| quality_first"))
    assert "| 2.00x | below 2.5-3x |" in qf and "33% of its time is still stall" in qf
    assert "4.0 experts per token and 2.0 SSD reads" in qf and "would give 3.00x" in qf
    sf = next(line for line in text.splitlines() if line.startswith("| speed_first"))
    assert "| 2.67x | within 2.5-3x |" in sf
    r015 = next(line for line in text.splitlines() if line.startswith("| rule015"))
    assert r015.endswith("| 2.40x |  |  |")  # no paper figure for it
    assert text.index("| fetch_all") < text.index("| quality_first") < text.index("| speed_first")


@pytest.mark.parametrize(("runs", "words"), [
    ([run("quality_first", 6.0, 2.0)], "no fetch_all run"),
    ([run("fetch_all", 6.0, 2.0), run("fetch_all", 6.0, 2.0, **{"cache.fraction": 0.5})],
     "cache.fraction varies"),
])
def test_a_sweep_it_cannot_compare_is_one_line(tmp_path, capsys, runs, words):
    s = sweep(tmp_path, runs)
    assert paper.main([str(s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
    assert not (s / "report" / "paper.md").exists()
