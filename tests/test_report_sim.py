"""moe-report on sweeps made by the real moe-sim on a tiny trace: provenance, baselines,
identical runs, the plots a sweep's axes call for."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from report_cases import fixed_settings, markdown_table

from analysis.collect import make_view, read_sweep, speedup_table
from analysis.plots import all_plots
from analysis.report import main
from traces.format import recorded_content_hash, write_trace
from traces.synth import synth_trace

REPO = Path(__file__).resolve().parent.parent
HARDWARE = "h200_pcie5"
TOKENS, LAYERS, EXPERTS, TOP_K = 600, 3, 16, 2


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "tiny.parquet"
    meta, chunk = synth_trace(tokens=TOKENS, layers=LAYERS, experts=EXPERTS, top_k=TOP_K,
                              seed=3, logits="full", prompt_share=0.0, seq_tokens=100,
                              model="tiny-moe")
    write_trace(path, meta, chunk)
    return path


def multirun(sweep: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "simulator.run", "-m", *args, f"hardware={HARDWARE}",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def beta_sweep(trace, tmp_path_factory) -> Path:
    """fetch_all and speed_first, admission off and at beta 0.5, at two cache fractions."""
    sweep = tmp_path_factory.mktemp("beta") / "sweep"
    multirun(sweep, f"trace.path={trace}", "policy=fetch_all,speed_first",
             "admission.beta=null,0.5", "cache.fraction=0.25,0.5")
    assert main([str(sweep)]) == 0
    return sweep


@pytest.fixture(scope="module")
def tau_sweep(trace, tmp_path_factory) -> Path:
    """fetch_all and rule015 at policy.tau 0 and 0.2: fetch_all at tau 0.2 substitutes."""
    sweep = tmp_path_factory.mktemp("tau") / "sweep"
    multirun(sweep, f"trace.path={trace}", "policy=fetch_all,rule015", "policy.tau=0.0,0.2")
    return sweep


def test_fixed_settings_name_trace_shape_hash_model_hardware_and_cache(beta_sweep, trace):
    settings = fixed_settings(beta_sweep / "report")
    recorded = recorded_content_hash(trace)  # the trace's content hash; the file's for old ones
    digest = recorded.removeprefix("sha256:") if recorded else hashlib.sha256(trace.read_bytes()).hexdigest()
    assert settings["trace"] == (
        f"`tiny.parquet`: {TOKENS} tokens, {LAYERS} MoE layers × {EXPERTS} experts, "
        f"top-{TOP_K}; sha256 `{digest[:12]}`; recorded from tiny-moe (source synth); "
        f"path `{trace}`")
    assert settings["model"].startswith("tiny-moe (sizes from the trace): ")
    profile = yaml.safe_load((REPO / "conf" / "hardware" / f"{HARDWARE}.yaml").read_text())
    assert settings["hardware"] == f"{HARDWARE} ({profile['source']})"
    assert settings["cache"].startswith("per_layer, cache.fraction varies: 0.25, 0.5")
    assert settings["policy"] == "varies: fetch_all, speed_first (one row per strategy)"
    assert settings["admission"].startswith("admission.beta varies: null, 0.5")
    assert settings["command"].startswith(f"`moe-sim -m trace.path={trace} ")


def test_first_screen_is_the_fixed_settings_then_the_table(beta_sweep):
    page = (beta_sweep / "report" / "report.html").read_text()
    settings = page.index("<table class='settings'>")
    assert settings < page.index("<table>") < page.index("<img")
    assert page.index("tiny.parquet") < page.index("<table>")


def test_plot_titles_name_trace_shape_model_and_hardware(beta_sweep):
    sweep = read_sweep(beta_sweep)
    plots = [plot for plot in all_plots(sweep, make_view(sweep)) if plot.figure is not None]
    assert {plot.name for plot in plots} == {"time_vs_mass", "cache_fraction", "beta",
                                             "layer_heatmap", "mass_over_tokens"}
    for plot in plots:
        title = plot.figure.get_suptitle()
        for words in ("tiny.parquet", f"{TOKENS} tok, {LAYERS} L × {EXPERTS} E, top-{TOP_K}",
                      "model tiny-moe (sizes from the trace)", f"hardware {HARDWARE}"):
            assert words in title, (plot.name, title)


def test_fetch_all_at_every_beta_is_one_row_against_itself(beta_sweep):
    sweep = read_sweep(beta_sweep)
    view = make_view(sweep)
    assert view.inert == {"fetch_all": ("admission.beta",)}
    ok = view.ok
    fetch_all = ok.filter(pl.col("policy.name") == "fetch_all")
    # the claim behind the collapse: fetch_all never substitutes, so beta changes nothing
    assert fetch_all.group_by("cache.fraction").agg(
        pl.col("ms_per_token").n_unique())["ms_per_token"].to_list() == [1, 1]
    md = (beta_sweep / "report" / "report.md").read_text()
    rows = markdown_table(md, "strategy")
    assert [r["strategy"] for r in rows] == ["fetch_all", "speed_first (beta=0.5)",
                                             "speed_first (beta=null)"] * 2
    for row in rows[::3]:
        jobs = row["job"].split(", ")
        assert len(jobs) == 2 and row["speedup vs fetch_all"] == "1.00 ×"
        betas = ok.filter(pl.col("job").is_in(jobs))["admission.beta"].to_list()
        assert betas[0] is None and betas[1] == 0.5  # the unmodified run stands first
    assert ("fetch_all gave identical results at every `admission.beta` = null, 0.5, so its "
            "runs are shown as one row") in md
    assert "rule015" not in md  # captions speak only of strategies in the sweep


def test_speedup_is_against_the_fetch_all_without_admission(beta_sweep):
    sweep = read_sweep(beta_sweep)
    table = speedup_table(sweep)
    ok = sweep.table.filter(pl.col("status") == "ok")
    for row in table.rows(named=True):
        base = ok.filter((pl.col("policy.name") == "fetch_all")
                         & pl.col("admission.beta").is_null()
                         & (pl.col("cache.fraction") == row["cache.fraction"]))
        assert row["baseline_job"] == base["job"].item()
        assert row["speedup"] == pytest.approx(base["ms_per_token"].item()
                                               / row["ms_per_token"], rel=1e-12)


def test_fetch_all_swept_over_tau_is_not_a_baseline(tau_sweep):
    assert main([str(tau_sweep)]) == 0
    sweep = read_sweep(tau_sweep)
    ok = sweep.table.filter(pl.col("status") == "ok")
    real = ok.filter((pl.col("policy.name") == "fetch_all") & (pl.col("policy.tau") == 0))
    modified = ok.filter((pl.col("policy.name") == "fetch_all") & (pl.col("policy.tau") > 0))
    assert modified["substitutions"].item() > 0  # a substituting policy under fetch_all's name
    assert set(speedup_table(sweep)["baseline_job"]) == {real["job"].item()}
    md = (tau_sweep / "report" / "report.md").read_text()
    assert f"Baseline: job {real['job'].item()}." in md
    assert ("fetch_all (tau=0.2) is not the unmodified fetch_all (policy.tau=0.2), so it is "
            "not used as a baseline.") in md


def test_without_the_unmodified_fetch_all_the_speedup_is_empty_and_says_why(tau_sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(tau_sweep, copy, ignore=shutil.ignore_patterns("report"))
    real = read_sweep(copy).table.filter((pl.col("policy.name") == "fetch_all")
                                         & (pl.col("policy.tau") == 0))["job"].item()
    shutil.rmtree(copy / real)  # the job never ran
    assert main([str(copy)]) == 0
    md = (copy / "report" / "report.md").read_text()
    assert "No unmodified fetch_all run in this sweep, so the speedup column is empty" in md
    rows = markdown_table(md, "strategy")
    assert {r["speedup vs fetch_all"] for r in rows} == {"–"} and len(rows) == 3
