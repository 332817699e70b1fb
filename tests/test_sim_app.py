"""The moe-sim app end to end: outputs, engines, bad input, sweeps, the real route trace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from simulator.run import simulate_overrides
from traces.format import write_trace
from traces.synth import synth_trace

REPO = Path(__file__).resolve().parent.parent
SHARED_ROUTE = REPO.parent / "shared" / "traces" / "qwen3-30b-a3b.route.csv"
SUMMARY_KEYS = (
    "tokens decode_tokens expert_calls hits hit_rate fetches forced_fetches background_admissions "
    "substitutions substitution_rate first_choice_substitutions mean_mass mass_p50 mass_p90 mass_p99 "
    "bytes_fetched ms_per_token ms_per_token_p50 ms_per_token_p99 tokens_per_s stall_ms_per_token "
    "sim_seconds engine policy"
).split()


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "synth.parquet"
    meta, chunk = synth_trace(tokens=300, layers=4, experts=32, top_k=4, seed=3, logits="full", prompt_tokens=32)
    write_trace(path, meta, chunk)
    return path


def moe_sim(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "simulator.run", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def test_single_run_writes_complete_consistent_outputs(trace, tmp_path):
    out = tmp_path / "run"
    proc = moe_sim(f"trace.path={trace}", "policy=quality_first", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary, key
    calls = summary["expert_calls"]
    assert summary["decode_tokens"] > 100 and summary["prefill_tokens"] > 0
    assert calls == summary["decode_tokens"] * 4 * 4
    assert summary["hits"] + summary["fetches"] + summary["substitutions"] + summary["cpu_calls"] == calls
    assert summary["policy"] == "quality_first" and summary["substitute_by"] == "logit"
    per_token = pq.read_table(out / "per_token.parquet")
    assert per_token.num_rows == summary["tokens"]
    assert sum(per_token.column("substitutions").to_pylist()) == summary["substitutions"]
    per_layer = pq.read_table(out / "per_layer.parquet")
    assert per_layer.num_rows == 4
    assert sum(per_layer.column("hits").to_pylist()) == summary["hits"]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_engines_agree_through_the_app(trace):
    for policy in ("fetch_all", "quality_first", "cpu_offload"):
        common = [f"trace.path={trace}", f"policy={policy}", "cache.fraction=0.3"]
        a = simulate_overrides([*common, "engine=numba"])
        b = simulate_overrides([*common, "engine=reference"])
        for key in ("hits", "fetches", "substitutions", "cpu_calls", "background_admissions", "mean_mass"):
            assert a[key] == b[key], (policy, key)
        assert a["ms_per_token"] == pytest.approx(b["ms_per_token"], rel=1e-9)


def test_substitution_policies_trade_time_for_mass(trace):
    runs = {p: simulate_overrides([f"trace.path={trace}", f"policy={p}", "cache.fraction=0.25"])
            for p in ("fetch_all", "rule015", "substitute_all")}
    assert runs["fetch_all"]["substitutions"] == 0 and runs["fetch_all"]["mean_mass"] == 0
    assert runs["substitute_all"]["ms_per_token"] < runs["rule015"]["ms_per_token"] < runs["fetch_all"]["ms_per_token"]
    assert runs["substitute_all"]["mean_mass"] > runs["rule015"]["mean_mass"] > 0


def _one_error_line(proc: subprocess.CompletedProcess, field: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-sim: error:") and field in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["cache.fraction=0"], "cache.fraction"),
        (["cache.fraction=1.5"], "cache.fraction"),
        (["cache=global", "cache.budget_bytes=10"], "cache.budget_bytes"),
    ],
)
def test_bad_config_exits_2_with_one_line_and_no_output(trace, tmp_path, overrides, field):
    out = tmp_path / "run"
    proc = moe_sim(f"trace.path={trace}", *overrides, f"hydra.run.dir={out}")
    _one_error_line(proc, field)
    assert not out.exists()


def test_bad_traces_exit_2_with_one_line_and_no_output(trace, tmp_path):
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(trace.read_bytes()[: trace.stat().st_size // 2])
    for path, field in ((tmp_path / "missing.parquet", "trace.path"), (truncated, "Parquet")):
        out = tmp_path / f"run_{path.stem}"
        proc = moe_sim(f"trace.path={path}", f"hydra.run.dir={out}")
        _one_error_line(proc, field)
        assert not out.exists()


def test_multirun_keeps_other_jobs_when_one_fails(trace, tmp_path):
    sweep = tmp_path / "sweep"
    proc = moe_sim(
        "-m", f"trace.path={trace},{tmp_path / 'missing.parquet'}", "policy=fetch_all,rule015",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode != 0  # the sweep reports its failure...
    done = sorted(p.parent.name for p in sweep.glob("*/summary.json"))
    failed = sorted(p.parent.name for p in sweep.glob("*/error.txt"))
    assert len(done) == 2 and len(failed) == 2  # ...but the good jobs' results are all there
    assert "trace.path" in (sweep / failed[0] / "error.txt").read_text()


@pytest.mark.skipif(not SHARED_ROUTE.exists(), reason="the shared route trace is not beside the repo")
def test_route_trace_replay_reproduces_recorded_hit_rate(tmp_path):
    """Global LRU, 4000 MiB budget, cold: the engine that recorded the trace saw 80.3 %."""
    from traces.importers.route_csv import import_route_csv

    parquet = tmp_path / "route.parquet"
    import_route_csv(SHARED_ROUTE, parquet)
    summary = simulate_overrides([
        f"trace.path={parquet}", "policy=fetch_all", "cache=global", "cache.eviction=lru",
        "cache.init=cold", f"cache.budget_bytes={4000 * 2**20}",
    ])
    assert summary["expert_calls"] == 36_864
    assert abs(summary["hit_rate"] - 29_597 / 36_864) <= 0.015, summary["hit_rate"]


@pytest.mark.parametrize(
    "case", ["schema_version", "expert_too_large", "duplicate_expert", "weight_nan", "logit_nan"]
)
def test_malformed_traces_stop_moe_sim_with_one_line(case, tmp_path):
    """The reader's checks reach the app: exit 2, one line naming the field, no run directory."""
    from test_format import BAD_FILES, make_arrays, make_meta

    from traces.format import TraceWriter

    good = tmp_path / "good.parquet"
    with TraceWriter(good, make_meta()) as writer:
        writer.write(**make_arrays())
    make, words = BAD_FILES[case]
    bad = make(good, tmp_path / f"{case}.parquet")
    out = tmp_path / "run"
    # rule015 substitutes by logit, so the run reads the logits (a run that reads none decodes none)
    proc = moe_sim(f"trace.path={bad}", "cache.fraction=0.5", "policy=rule015", f"hydra.run.dir={out}")
    _one_error_line(proc, words[0])
    assert not out.exists()


def test_a_run_that_reads_no_logits_is_not_stopped_by_bad_ones_that_verify_finds(tmp_path):
    """fetch_all never reads logits: NaN logits do not change its result, and moe-trace info
    --verify, which decodes every column, still refuses the file."""
    from test_format import BAD_FILES, make_arrays, make_meta

    from traces.format import TraceWriter

    good = tmp_path / "good.parquet"
    with TraceWriter(good, make_meta()) as writer:
        writer.write(**make_arrays())
    make, words = BAD_FILES["logit_nan"]
    bad = make(good, tmp_path / "bad.parquet")
    runs = [moe_sim(f"trace.path={t}", "cache.fraction=0.5", "policy=fetch_all", f"hydra.run.dir={tmp_path / t.stem}")
            for t in (good, bad)]
    assert [r.returncode for r in runs] == [0, 0]
    same = [json.loads((tmp_path / t / "summary.json").read_text()) for t in ("good", "bad")]
    assert same[0]["hit_rate"] == same[1]["hit_rate"] and same[0]["ms_per_token"] == same[1]["ms_per_token"]
    verify = subprocess.run([sys.executable, "-m", "traces.cli", "info", str(bad), "--verify"],
                            capture_output=True, text=True)
    assert verify.returncode == 2 and words[0] in verify.stderr


def test_trace_cache_gives_the_same_results(trace, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "cache"))
    common = [f"trace.path={trace}", "policy=quality_first"]
    plain = simulate_overrides(common)
    cached = [simulate_overrides([*common, "trace.cache=true"]) for _ in range(2)]  # build, re-use
    assert len(list((tmp_path / "cache").iterdir())) == 1
    for summary in cached:
        for key in ("hits", "substitutions", "mean_mass", "ms_per_token", "tokens"):
            assert summary[key] == plain[key], key
    chunked = simulate_overrides([*common, "trace.chunk_tokens=7"])
    assert chunked["substitutions"] == plain["substitutions"] and chunked["ms_per_token"] == plain["ms_per_token"]
