"""analysis.prefetch: the prefetch comparison's table and plot from a sweep's report."""
from __future__ import annotations

import polars as pl
import pytest

from analysis import prefetch

MIB = 2**20


def report(tmp_path, rows):
    base = dict(status="ok", decode_tokens=100, prefetches=0, useful_prefetches=0, late_prefetches=0,
                prefetch_bytes=0, wasted_prefetch_bytes=0, mean_mass=0.0, hit_rate=0.5)
    df = pl.DataFrame([{**base, **r} for r in rows])
    path = tmp_path / "sweep" / "report" / "report.parquet"
    path.parent.mkdir(parents=True)
    df.write_parquet(path)
    return tmp_path / "sweep"


def run(policy, predictor, host, fraction, ms, **more):
    return {"policy.name": policy, "prefetch.predictor": predictor, "hardware.name": host,
            "cache.fraction": fraction, "ms_per_token": ms, **more}


def test_the_table_labels_prefetch_runs_and_gives_their_shares_per_token(tmp_path):
    sweep = report(tmp_path, [
        run("fetch_all", "none", "a", 0.25, 3.0),
        run("fetch_all", "lookahead", "a", 0.25, 2.5, prefetches=400, useful_prefetches=100,
            late_prefetches=300, wasted_prefetch_bytes=50 * MIB),
        run("fetch_all", "none", "b", 0.25, 9.0, status="failed"),
        run("fetch_all", "none", "b", 0.5, 4.0),
    ])
    md_path, png_path = prefetch.write(sweep)
    md = md_path.read_text()
    assert "| 25 % | fetch_all + prefetch (lookahead) | 2.50 | 0.000 | 50.0 % | 4.0 | 25 % | 75 % | 0.50 |" in md
    assert "| 25 % | fetch_all | 3.00 |" in md
    assert "9.00" not in md  # the failed run is left out
    assert md.index("### a") < md.index("### b")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_without_prefetch_settings_is_one_clear_error(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    (sweep / "report").mkdir(parents=True)
    pl.DataFrame({"policy.name": ["fetch_all"], "ms_per_token": [1.0]}).write_parquet(
        sweep / "report" / "report.parquet")
    assert prefetch.main([str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefetch.predictor" in err
    assert not (sweep / "report" / "prefetch.md").exists()


def test_a_sweep_without_a_report_names_the_fix(tmp_path):
    with pytest.raises(prefetch.InputError, match="run moe-report"):
        prefetch.write(tmp_path)
