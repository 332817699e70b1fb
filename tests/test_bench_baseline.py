"""make bench's side-by-side run against the commit the targets were set on (simulator/bench_baseline.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator import bench_baseline
from simulator.bench import POLICIES, SHAPES, _baseline_section, sim_params
from simulator.engine import simulate
from simulator.trace_cache import cached_source

ROOT = Path(__file__).resolve().parent.parent


def _figures(baseline_s, ours_s, hits=(100, 100), kernel=True):
    """Figures of a side-by-side run whose rounds took these CPU seconds."""
    rounds = [{"baseline": {"whole_s": b, "kernel_s": b * 0.9 if kernel else None, "hits": hits[0]},
               "ours": {"whole_s": o, "kernel_s": o * 0.9 if kernel else None, "hits": hits[1]}}
              for b, o in zip(baseline_s, ours_s, strict=True)]
    return {"commit": "abc1234", "set_ns": 13.4, "target_ns": 9.0, "tokens": 10, "lookups": 1000,
            "calls": 3, "rounds": rounds}


def test_the_verdict_is_the_speedup_the_target_asks_for():
    needed = 13.4 / 9.0
    met = bench_baseline.summary(_figures([2.0, 1.7, 1.7], [1.0, 1.0, 1.1]))
    assert met["speedup"] == pytest.approx(1.7) and met["needed"] == pytest.approx(needed)
    assert met["met"] and met["scaled_ns"] == pytest.approx(13.4 / 1.7)
    assert met["ours_ns"] == pytest.approx(1.0 / 1000 * 1e9)
    assert met["kernel_speedup"] == pytest.approx(1.7)
    short = bench_baseline.summary(_figures([1.4, 1.45, 1.3], [1.0, 1.0, 1.0]))
    assert short["speedup"] == pytest.approx(1.4) and not short["met"]
    differ = bench_baseline.summary(_figures([3.0], [1.0], hits=(100, 101)))
    assert not differ["hits_equal"] and not differ["met"]
    unhooked = bench_baseline.summary(_figures([3.0], [1.0], kernel=False))
    assert unhooked["kernel_speedup"] is None and unhooked["ours_kernel_ns"] is None and unhooked["met"]


def test_the_report_gives_the_row_or_says_why_not():
    skipped = {"commit": "abc1234", "skipped": "commit abc1234 is not in this checkout's history (x)"}
    assert _baseline_section(skipped)[-2] == f"Not measured: {skipped['skipped']}."
    assert _baseline_section(None) == []
    lines = "\n".join(_baseline_section(_figures([2.0], [1.0])))
    assert "**2.00x** for the whole call" in lines and "1.49x" in lines
    lines = "\n".join(_baseline_section(_figures([2.0], [1.0], hits=(1, 2))))
    assert "**differ**" in lines


def test_a_commit_outside_the_history_is_reported_not_raised(tmp_path):
    why = bench_baseline.checkout("0" * 40, tmp_path / "tree", repo=ROOT)
    assert why and "not in this checkout's history" in why
    assert not (tmp_path / "tree").exists() or not any((tmp_path / "tree").iterdir())
    assert "checkout" in bench_baseline.measure(ROOT, tmp_path, SHAPES[0].__dict__, SHAPES[0].model, 1,
                                                commit="0" * 40)["skipped"]


def test_checkout_extracts_the_commits_files(tmp_path):
    if bench_baseline.checkout("HEAD", tmp_path, repo=ROOT):
        pytest.skip("no git history here")
    assert (tmp_path / "pyproject.toml").is_file() and (tmp_path / "simulator" / "engine").is_dir()


def test_each_tree_runs_in_its_own_process_and_measures_what_simulate_gives(tmp_path):
    shape = dict(SHAPES[0].__dict__, tokens=48)
    out = bench_baseline.measure(ROOT, tmp_path, shape, SHAPES[0].model, 2, calls=2, baseline=ROOT)
    assert [list(r) for r in out["rounds"]] == [["baseline", "ours"], ["ours", "baseline"]]
    assert out["lookups"] == 48 * shape["layers"] * shape["top_k"]
    source = cached_source(tmp_path / "baseline-ours.parquet", tmp_path / "baseline-cache-ours")
    hits = int(simulate(source, sim_params(source.meta, POLICIES["fetch_all+lru"]
                                           + [f"model={SHAPES[0].model}"])).layer_hits.sum())
    for r in out["rounds"]:
        for tree in r.values():
            assert tree["hits"] == hits
            assert 0 < tree["kernel_s"] < tree["whole_s"]
    summary = bench_baseline.summary(out)
    assert summary["hits_equal"] and summary["hits"] == hits
    assert json.loads(json.dumps(out)) == out  # kept in the bench's JSON as they stand


def test_the_command_alone_gives_one_line_and_a_nonzero_exit_when_it_cannot_measure(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_baseline.main(["--commit", "0" * 40])
    out, err = capsys.readouterr()
    assert stop.value.code == 1 and out == ""
    assert err.count("\n") == 1 and "not in this checkout's history" in err
    with pytest.raises(SystemExit) as stop:
        bench_baseline.main(["--rounds", "0"])
    assert stop.value.code == 2 and "--rounds and --tokens must be at least 1" in capsys.readouterr().err
