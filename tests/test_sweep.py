"""Sweeps through Hydra's launchers, collected by moe-report: one row per job, values intact."""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from analysis.collect import collect_sweep
from simulator.sweep import PROGRESS_DIR, SweepProgress, claim_finish_number, sweep_size
from traces.format import write_trace
from traces.synth import synth_trace

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("fetch_all", "quality_first")
FRACTIONS = (0.25, 0.5)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "synth.parquet"
    meta, chunk = synth_trace(tokens=300, layers=3, experts=16, top_k=2, seed=5, logits="full", prompt_share=0.0, seq_tokens=100)
    write_trace(path, meta, chunk)
    return path


def multirun(sweep: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simulator.run", "-m", *args, f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=900,
    )


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local"])
def test_sweep_report_has_one_row_per_job_equal_to_its_summary(trace, tmp_path, launcher):
    sweep = tmp_path / launcher
    extra = [] if launcher == "basic" else [f"hydra/launcher={launcher}"]
    if launcher == "joblib":
        extra.append("hydra.launcher.n_jobs=2")
    proc = multirun(sweep, f"trace.path={trace}", f"policy={','.join(POLICIES)}",
                    f"cache.fraction={','.join(map(str, FRACTIONS))}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = collect_sweep(sweep)
    assert table.height == len(POLICIES) * len(FRACTIONS)
    assert set(table["status"]) == {"ok"}
    assert table["ms_per_token"].null_count() == 0
    seen = set()
    for row in table.iter_rows(named=True):
        seen.add((row["policy.name"], row["cache.fraction"]))
        summary = json.loads((sweep / str(row["job_num"]) / "summary.json").read_text())
        for key in ("hits", "substitutions", "ms_per_token", "mean_mass", "hit_rate"):
            assert row[key] == summary[key], (key, row[key], summary[key])
        assert row["cache.eviction"] == ("lfu" if row["policy.name"] == "quality_first" else "lru")
    assert seen == {(p, f) for p in POLICIES for f in FRACTIONS}
    assert not (sweep / PROGRESS_DIR).exists()
    if launcher != "submitit_local":  # submitit keeps the jobs' stderr in its own logs
        assert_one_progress_line_per_job(proc.stderr, jobs=4)


PROGRESS_LINE = re.compile(r"\[sweep\] (\d+)/(\d+) jobs finished \(job (\d+): completed\)")


def assert_one_progress_line_per_job(stderr: str, jobs: int) -> None:
    """Each job printed one whole line, and the counts run 1..jobs once each."""
    lines = [line for line in stderr.splitlines() if "[sweep]" in line]
    matches = [PROGRESS_LINE.fullmatch(line) for line in lines]
    assert len(lines) == jobs and all(matches), lines
    assert sorted(int(m[1]) for m in matches) == list(range(1, jobs + 1)), lines
    assert {int(m[2]) for m in matches} == {jobs}
    assert sorted(int(m[3]) for m in matches) == list(range(jobs)), lines


def _job_config(sweep: Path, num: int):
    return OmegaConf.create({"hydra": {"mode": "RunMode.MULTIRUN", "sweep": {"dir": str(sweep)},
                                       "job": {"num": num}}})


def test_jobs_finishing_together_print_distinct_counts(tmp_path, capfd):
    # Both jobs have written their outputs before either reports: counting the finished jobs
    # on disk would print 2/2 twice.
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"overrides": {"task": ["policy=fetch_all,rule015"]}}}))
    for num in (0, 1):
        (tmp_path / str(num)).mkdir()
        (tmp_path / str(num) / "summary.json").write_text("{}")
    callback = SweepProgress()
    callback.on_multirun_start(_job_config(tmp_path, 0))
    for num in (1, 0):
        callback.on_job_end(_job_config(tmp_path, num), job_return=None)
    err = capfd.readouterr().err
    assert err.splitlines() == ["[sweep] 1/2 jobs finished (job 1: done)",
                                "[sweep] 2/2 jobs finished (job 0: done)"]
    callback.on_multirun_end(_job_config(tmp_path, 0))
    assert not (tmp_path / PROGRESS_DIR).exists()


def _claim_many(progress_dir: str, count: int) -> list[int]:
    return [claim_finish_number(Path(progress_dir)) for _ in range(count)]


def test_concurrent_claims_get_distinct_numbers(tmp_path):
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=4, mp_context=context) as pool:
        claims = pool.map(_claim_many, [str(tmp_path)] * 4, [25] * 4)
        numbers = [n for claimed in claims for n in claimed]
    assert sorted(numbers) == list(range(1, 101))


def test_broken_job_is_reported_failed_and_others_intact(trace, tmp_path):
    sweep = tmp_path / "broken"
    missing = tmp_path / "no-such-trace.parquet"
    multirun(sweep, f"trace.path={trace},{missing}", "policy=fetch_all,rule015")
    table = collect_sweep(sweep)
    assert table.height == 4
    failed = table.filter(table["status"] == "failed")
    assert failed.height == 2
    assert all("trace.path" in e for e in failed["error"])
    ok = table.filter(table["status"] == "ok")
    assert ok.height == 2 and ok["ms_per_token"].null_count() == 0


def test_sweep_size_counts_the_cartesian_product():
    assert sweep_size(["policy=a,b,c", "cache.fraction=0.1,0.2", "seed=1"]) == 6
    assert sweep_size(["seed=1"]) == 1
    assert sweep_size(["seed=range(0,5)"]) == 5


def test_slurm_preset_composes():
    proc = subprocess.run(
        [sys.executable, "-m", "simulator.run", "hydra/launcher=slurm", "--cfg", "hydra", "--package", "hydra.launcher"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "SlurmLauncher" in proc.stdout and "cpus_per_task: 1" in proc.stdout
