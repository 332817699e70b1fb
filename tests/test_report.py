"""moe-report on fabricated sweep directories with known values (no simulation needed)."""
from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from report_cases import fixed_settings, markdown_table

from analysis.collect import (
    FAILED,
    MISSING,
    OK,
    collect_sweep,
    make_view,
    read_sweep,
    speedup_table,
)
from analysis.plots import pareto_front, plot_mass_over_tokens, plot_time_vs_mass
from analysis.report import column_formatter, main

# The paper's presets as the contract describes them; quality_first/speed_first bring their
# own eviction, as presets may.
PRESETS = {
    "fetch_all": {"protect_ranks": 0, "tau": 0.0, "eviction": "lru", "beta": None},
    "rule015": {"protect_ranks": 1, "tau": 0.15, "eviction": "lru", "beta": None},
    "first_choice": {"protect_ranks": 1, "tau": math.inf, "eviction": "lru", "beta": None},
    "quality_first": {"protect_ranks": 1, "tau": 0.15, "eviction": "lfu", "beta": 0.5},
    "speed_first": {"protect_ranks": 1, "tau": math.inf, "eviction": "lfu", "beta": 0.5},
}
# share of misses substituted, miss-rate factor from admission, gate weight per substitution,
# tokens a switch takes to settle (background admission settles sooner)
BEHAVIOUR = {
    "fetch_all": (0.0, 1.0, 0.0, 60.0),
    "rule015": (0.45, 1.0, 0.05, 90.0),
    "first_choice": (0.8, 1.0, 0.07, 90.0),
    "quality_first": (0.42, 0.9, 0.05, 25.0),
    "speed_first": (0.78, 0.9, 0.07, 25.0),
}
LAYERS, TOP_K = 48, 10
FETCH_MS, BASE_MS = 0.25, 4.0


def job_config(policy: str, fraction: float, *, hardware: str = "rtx3090",
               beta: float | None = None) -> dict:
    """A composed config as moe-sim would save it to .hydra/config.yaml."""
    preset = PRESETS[policy]
    return {
        "trace": {"path": "traces/samples/synthetic.parquet"},
        "policy": {"name": policy, "protect_ranks": preset["protect_ranks"],
                   "tau": preset["tau"], "miss_action": "substitute",
                   "substitute_by": "logit"},
        "cache": {"scope": "per_layer", "fraction": fraction, "budget_bytes": None,
                  "eviction": preset["eviction"], "init": "cold"},
        "admission": {"beta": preset["beta"] if beta is None else beta},
        "hardware": {"name": hardware, "pcie_gbps": 25.0 if hardware == "rtx3090" else 54.0},
        "model": {"name": "qwen3-next-80b-a3b", "expert_bytes": [6291456] * 2},
        "engine": "numba",
        "seed": 0,
    }


def fake_results(policy: str, fraction: float, hardware: str = "rtx3090",
                 beta: float | None = None, tokens: int = 2400,
                 segment: int = 300) -> tuple[dict, pl.DataFrame, pl.DataFrame]:
    """summary.json, per_token and per_layer tables with plausible, deterministic numbers;
    the domain switches every ``segment`` tokens."""
    substituted, miss_factor, weight, settle = BEHAVIOUR[policy]
    if beta is not None:  # a lower beta admits sooner: fewer misses, faster settling
        miss_factor, settle = 1 - 0.05 / beta, 12.5 / beta
    rng = np.random.default_rng(zlib.crc32(repr((policy, fraction, hardware, beta)).encode()))
    fetch_ms = FETCH_MS * (1.0 if hardware == "rtx3090" else 0.5)
    miss_rate = 0.3 * (1 - fraction) ** 2 * miss_factor
    calls = tokens * LAYERS * TOP_K
    substitution_rate = miss_rate * substituted
    fetch_rate = miss_rate - substitution_rate
    # per token: a burst of misses after each domain switch that decays over `settle` tokens
    since = np.arange(tokens) % segment
    burst = 1 + 2.0 * np.exp(-since / settle)
    burst /= burst.mean()
    mass = substitution_rate * TOP_K * weight * LAYERS * burst * rng.gamma(4, 0.25, tokens)
    ms = BASE_MS + fetch_rate * LAYERS * TOP_K * fetch_ms * burst * rng.gamma(8, 0.125, tokens)
    per_token = pl.DataFrame({
        "seq": (np.arange(tokens) // (2 * segment)).astype(np.int32),
        "pos": (np.arange(tokens) % (2 * segment)).astype(np.int32),
        "phase": np.ones(tokens, np.int8),
        "domain": ((np.arange(tokens) // segment) % 4).astype(np.int16),
        "time_us": ms * 1000, "stall_us": (ms - BASE_MS) * 1000, "mass": mass,
        "hits": np.full(tokens, round((1 - miss_rate) * LAYERS * TOP_K), np.int32),
        "fetches": np.full(tokens, round(fetch_rate * LAYERS * TOP_K), np.int32),
        "substitutions": np.full(tokens, round(substitution_rate * LAYERS * TOP_K), np.int32),
        "cpu_calls": np.zeros(tokens, np.int32),
    })
    depth = np.linspace(-1, 1, LAYERS)  # early layers route flatter: more misses
    layer_miss = np.clip(miss_rate * (1 - 0.6 * depth) + rng.normal(0, 0.01, LAYERS), 0, 1)
    layer_calls = tokens * TOP_K
    per_layer = pl.DataFrame({
        "layer": np.arange(LAYERS, dtype=np.int32), "calls": np.full(LAYERS, layer_calls),
        "hits": np.round((1 - layer_miss) * layer_calls).astype(np.int64),
        "hit_rate": 1 - layer_miss,
        "fetches": np.round(layer_miss * (1 - substituted) * layer_calls).astype(np.int64),
        "forced_fetches": np.zeros(LAYERS, np.int64),
        "substitutions": np.round(layer_miss * substituted * layer_calls).astype(np.int64),
        "first_choice_substitutions": np.zeros(LAYERS, np.int64),
        "cpu_calls": np.zeros(LAYERS, np.int64),
        "mass_sum": layer_miss * substituted * TOP_K * weight * tokens,
        "mean_mass": layer_miss * substituted * TOP_K * weight,
        "background_admissions": np.zeros(LAYERS, np.int64),
    })
    summary = {
        "tokens": tokens, "decode_tokens": tokens, "expert_calls": calls,
        "hits": round((1 - miss_rate) * calls), "hit_rate": 1 - miss_rate,
        "fetches": round(fetch_rate * calls), "forced_fetches": 0,
        "background_admissions": 0 if PRESETS[policy]["beta"] is None else 1234,
        "substitutions": round(substitution_rate * calls),
        "substitution_rate": substitution_rate,
        "first_choice_substitutions": 0 if policy != "first_choice" else 17,
        "mean_mass": float(mass.mean() / LAYERS), "mass_p50": 0.0, "mass_p90": 0.1,
        "mass_p99": 0.3, "bytes_fetched": round(fetch_rate * calls) * 6291456,
        "ms_per_token": float(ms.mean()), "ms_per_token_p50": float(np.median(ms)),
        "ms_per_token_p99": float(np.quantile(ms, 0.99)),
        "tokens_per_s": float(1000 / ms.mean()), "stall_ms_per_token": float(ms.mean() - BASE_MS),
        "sim_seconds": 0.5, "engine": "numba", "policy": policy, "substitute_by": "logit",
    }
    return summary, per_token, per_layer


def write_sweep(root: Path, axes: dict[str, list], *, failed: dict[int, str] | None = None,
                missing: tuple[int, ...] = (), tables: bool = True,
                **results) -> dict[int, dict]:
    """A Hydra multirun directory over ``axes`` (override key -> values), job by job.

    Jobs in ``failed`` get error.txt instead of results, jobs in ``missing`` no directory;
    ``results`` go to fake_results (``tokens``, ``segment``).
    Returns {job number: {"config": ..., "summary": ...}} for the jobs written.
    """
    failed = failed or {}
    root.mkdir(parents=True, exist_ok=True)
    keys = list(axes)
    task = [f"{k}={','.join(str(v) for v in values)}" for k, values in axes.items()]
    multirun = {"hydra": {"sweeper": {
        "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
        "max_batch_size": None, "params": None}, "overrides": {"task": task}}}
    (root / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    jobs = {}
    for num, values in enumerate(itertools.product(*axes.values())):
        if num in missing:
            continue
        choice = dict(zip(keys, values, strict=True))
        args = {"policy": choice["policy"], "fraction": choice.get("cache.fraction", 0.25),
                "hardware": choice.get("hardware", "rtx3090"), "beta": choice.get("admission.beta")}
        config = job_config(args["policy"], args["fraction"], hardware=args["hardware"],
                            beta=args["beta"])
        run = root / str(num)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        overrides = [f"{k}={v}" for k, v in choice.items()]
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {
            "num": num, "override_dirname": ",".join(overrides)}}}))
        jobs[num] = {"config": config, "summary": None}
        if num in failed:
            (run / "error.txt").write_text(failed[num] + "\n")
            continue
        summary, per_token, per_layer = fake_results(**args, **results)
        (run / "summary.json").write_text(json.dumps(summary))
        if tables:
            per_token.write_parquet(run / "per_token.parquet")
            per_layer.write_parquet(run / "per_layer.parquet")
        jobs[num]["summary"] = summary
    return jobs


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, separators=(",", ":")) if isinstance(
                value, list) else value
    return out


PAPER_AXES = {"policy": list(PRESETS), "cache.fraction": [0.1, 0.25, 0.5]}


@pytest.fixture(scope="module")
def paper_sweep(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    root = tmp_path_factory.mktemp("sweep")
    # job 2 is fetch_all at cache.fraction 0.5: the runs at 0.5 lose their baseline
    return root, write_sweep(root, PAPER_AXES, failed={2: "InputError: trace.path: no such file "
                                                         "'missing.parquet'"})


@pytest.fixture(scope="module")
def paper_report(paper_sweep) -> Path:
    root, _ = paper_sweep
    assert main([str(root)]) == 0
    return root / "report"


def test_one_row_per_job_with_its_config_and_summary(paper_sweep):
    root, jobs = paper_sweep
    table = collect_sweep(root)
    assert table.height == len(jobs) == 15
    assert table["job_num"].to_list() == sorted(jobs)
    for row in table.rows(named=True):
        job = jobs[row["job_num"]]
        assert row["job"] == str(row["job_num"])
        for key, value in flat(job["config"]).items():
            assert row[key] == value, key
        if job["summary"] is None:
            continue
        assert row["status"] == OK and row["error"] is None
        for key, value in job["summary"].items():
            column = "result.engine" if key == "engine" else key  # "engine" is a config column
            assert row[column] == value, key
    assert table.schema["policy.tau"] == pl.Float64
    assert table.filter(pl.col("policy.name") == "first_choice")["policy.tau"][0] == math.inf
    assert table.filter(pl.col("job_num") == 3)["overrides"][0] == \
        "policy=rule015 cache.fraction=0.1"


def test_failed_and_missing_jobs_are_rows_and_others_intact(tmp_path):
    jobs = write_sweep(tmp_path, {"policy": ["fetch_all", "rule015"],
                                  "cache.fraction": [0.1, 0.25]},
                       failed={1: "trace.path: no such file 'nope.parquet'"}, missing=(3,))
    table = collect_sweep(tmp_path)
    assert table["job_num"].to_list() == [0, 1, 2, 3]
    assert table["status"].to_list() == [OK, FAILED, OK, MISSING]
    failed = table.row(1, named=True)
    assert failed["error"] == "trace.path: no such file 'nope.parquet'"
    assert failed["ms_per_token"] is None and failed["policy.name"] == "fetch_all"
    missing = table.row(3, named=True)
    assert missing["overrides"] == "policy=rule015 cache.fraction=0.25"
    assert missing["policy.name"] is None and missing["ms_per_token"] is None
    for num in (0, 2):
        row = table.row(num, named=True)
        assert row["ms_per_token"] == jobs[num]["summary"]["ms_per_token"]
        assert row["cache.fraction"] == jobs[num]["config"]["cache"]["fraction"]


def test_unfinished_job_and_unreadable_config_fail_alone(tmp_path):
    write_sweep(tmp_path, {"policy": ["fetch_all", "rule015", "first_choice"]})
    (tmp_path / "1" / "summary.json").unlink()
    (tmp_path / "2" / ".hydra" / "config.yaml").write_text("policy: {name: [")
    table = collect_sweep(tmp_path)
    assert table["status"].to_list() == [OK, FAILED, FAILED]
    assert "interrupted" in table["error"][1]
    assert table["error"][2].startswith("unreadable .hydra/config.yaml")


def _edit_summary(path: Path, **values) -> None:
    summary = json.loads(path.read_text())
    summary.update(values)
    path.write_text(json.dumps(summary))


# A damaged input of job 1 of a two-job sweep -> the words the one error line must contain.
DAMAGE = {
    "text_for_a_number": (lambda job: _edit_summary(job / "summary.json", ms_per_token="fast"),
                          "summary.json: 'ms_per_token' is 'fast', expected a number"),
    "malformed_json": (lambda job: (job / "summary.json").write_text('{"tokens": 12'),
                       "summary.json: not readable as JSON"),
    "not_an_object": (lambda job: (job / "summary.json").write_text("[1, 2]"),
                      "summary.json: holds a JSON list, not an object"),
    "text_where_other_jobs_have_a_number": (
        lambda job: _edit_summary(job / "summary.json", mass_p90="high"),
        "summary.json: 'mass_p90' is 'high', but a number in other jobs"),
    "text_for_a_number_in_the_config": (
        lambda job: (job / ".hydra" / "config.yaml").write_text(
            (job / ".hydra" / "config.yaml").read_text().replace("fraction: 0.25",
                                                                 "fraction: quarter")),
        "config.yaml: 'cache.fraction' is 'quarter', expected a number"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_input_exits_2_with_one_line_and_no_report(tmp_path, capsys, damage):
    sweep, out = tmp_path / "sweep", tmp_path / "out"
    write_sweep(sweep, {"policy": ["fetch_all", "rule015"]})
    apply, words = DAMAGE[damage]
    apply(sweep / "1")
    assert main([str(sweep), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-report: error: "), err
    assert words in err and str(sweep / "1") in err and "job 1" in err, err
    assert not out.exists()


def test_moe_report_command_on_a_damaged_summary_prints_no_traceback(tmp_path):
    write_sweep(tmp_path, {"policy": ["fetch_all", "rule015"]})
    _edit_summary(tmp_path / "0" / "summary.json", hit_rate="n/a")
    proc = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("moe-report: error: ") and proc.stderr.count("\n") == 1
    assert "'hit_rate' is 'n/a'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "report").exists()


def test_speedup_table_matches_fetch_all_with_same_settings(paper_sweep):
    root, jobs = paper_sweep
    sweep = read_sweep(root)
    view = make_view(sweep)
    # quality_first's preset eviction (lfu) differs from fetch_all's (lru): part of the strategy
    assert "cache.eviction" in view.strategy_columns
    assert view.setting_columns == ("cache.fraction",)
    assert view.reference == {"cache.fraction": 0.25}
    table = speedup_table(sweep, view)
    assert table.height == 14  # every successful run
    by_setting = {}
    for job in jobs.values():
        if job["summary"] is not None:
            by_setting[(job["config"]["policy"]["name"], job["config"]["cache"]["fraction"])] = \
                job["summary"]["ms_per_token"]
    for row in table.rows(named=True):
        fraction = row["cache.fraction"]
        base = by_setting.get(("fetch_all", fraction))
        mine = by_setting[(row["strategy"], fraction)]
        if base is None:
            assert fraction == 0.5 and row["speedup"] is None
        else:
            assert row["speedup"] == pytest.approx(base / mine, rel=1e-12)
    assert table.filter(pl.col("strategy") == "fetch_all")["speedup"].to_list() == [1.0] * 2
    assert table["speedup"].null_count() == 4
    assert table["strategy"].to_list()[:5] == ["fetch_all", "rule015", "first_choice",
                                               "quality_first", "speed_first"]


def test_speedup_without_baseline_says_so(tmp_path):
    write_sweep(tmp_path, {"policy": ["rule015", "quality_first"]})
    sweep = read_sweep(tmp_path)
    assert speedup_table(sweep)["speedup"].null_count() == 2
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "No fetch_all run in this sweep" in (tmp_path / "out" / "report.md").read_text()


def test_fetch_all_with_admission_is_not_used_as_the_baseline(tmp_path):
    # fetch_all's fabricated results here depend on beta: no run is the unmodified fetch_all
    write_sweep(tmp_path, {"policy": ["fetch_all", "quality_first"],
                           "admission.beta": [0.25, 1.0]})
    table = speedup_table(read_sweep(tmp_path))
    assert table["baseline_job"].null_count() == table["speedup"].null_count() == 4
    assert main([str(tmp_path)]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "No unmodified fetch_all run in this sweep, so the speedup column is empty" in md
    for beta in ("0.25", "1"):
        assert (f"fetch_all (beta={beta}) is not the unmodified fetch_all "
                f"(admission.beta={beta}), so it is not used as a baseline.") in md
    rows = markdown_table(md, "strategy")
    assert [row["speedup vs fetch_all"] for row in rows] == ["–"] * 4


def test_speedup_uses_the_unmodified_fetch_all_of_the_same_setting(tmp_path):
    jobs = write_sweep(tmp_path, {"policy": ["fetch_all", "quality_first"],
                                  "admission.beta": [None, 0.5],
                                  "cache.fraction": [0.25, 0.5]})
    table = speedup_table(read_sweep(tmp_path))
    fetch_all = {job["config"]["cache"]["fraction"]: str(num) for num, job in jobs.items()
                 if job["config"]["policy"]["name"] == "fetch_all"
                 and job["config"]["admission"]["beta"] is None}
    ms = {str(num): job["summary"]["ms_per_token"] for num, job in jobs.items()}
    for row in table.rows(named=True):
        base = fetch_all[row["cache.fraction"]]
        assert row["baseline_job"] == base
        assert row["speedup"] == pytest.approx(ms[base] / ms[row["job"]], rel=1e-12)


def test_hardware_gets_own_panels_and_a_real_reference(tmp_path):
    write_sweep(tmp_path, {"policy": ["fetch_all", "rule015"], "cache.fraction": [0.1, 0.5],
                           "hardware": ["rtx3090", "h200"]})
    view = make_view(read_sweep(tmp_path))
    # hardware.pcie_gbps follows hardware.name, so it is folded into it (not a setting of its
    # own); the reference is a setting some run has
    assert view.setting_columns == ("cache.fraction", "hardware.name")
    assert view.reference == {"cache.fraction": 0.1, "hardware.name": "rtx3090"}
    assert view.at_reference()["strategy"].to_list() == ["fetch_all", "rule015"]
    table = speedup_table(read_sweep(tmp_path), view)
    assert table["speedup"].null_count() == 0


def test_strategy_label_shows_what_varies_within_a_policy(tmp_path):
    write_sweep(tmp_path, {"policy": ["fetch_all", "quality_first"],
                           "admission.beta": [0.25, 1.0]})
    view = make_view(read_sweep(tmp_path))
    assert view.strategies() == ["fetch_all (beta=0.25)", "fetch_all (beta=1)",
                                 "quality_first (beta=0.25)", "quality_first (beta=1)"]


PLOTS = ("time_vs_mass", "cache_fraction", "layer_heatmap", "mass_over_tokens")


def _decimals(cell: str) -> int:
    number = re.match(r"[-\d.]+", cell).group(0)
    return len(number.split(".")[1]) if "." in number else 0


def test_each_table_column_has_one_format(paper_report):
    rows = markdown_table((paper_report / "report.md").read_text(), "strategy")
    assert len(rows) == 14
    for column, significant in (("time/token (ms)", 4), ("mean mass/token-layer", 4),
                                ("substituted calls", 3), ("hit rate", 3),
                                ("speedup vs fetch_all", None)):
        cells = [row[column] for row in rows if row[column] != "–"]
        decimals = {_decimals(cell) for cell in cells}
        assert len(decimals) == 1, (column, cells)
        if significant is not None:  # the largest value shows `significant` digits
            largest = max(float(re.match(r"[-\d.]+", c).group(0)) for c in cells)
            assert len(str(int(largest)).lstrip("0")) + decimals.pop() == significant, column


def test_column_formatter_gives_a_column_one_number_of_decimals():
    times = [3.784, 2.97, 0.5, None]
    assert list(map(column_formatter(times, "number"), times)) == ["3.784", "2.970", "0.500", "–"]
    times = [12.5, 2.97]
    assert list(map(column_formatter(times, "number"), times)) == ["12.50", "2.97"]
    rates = [0.642, 0.0, 0.05]
    assert list(map(column_formatter(rates, "percent"), rates)) == ["64.2 %", "0.0 %", "5.0 %"]
    rates = [0.004, 0.0002]
    assert list(map(column_formatter(rates, "percent"), rates)) == ["0.400 %", "0.020 %"]
    speedups = [1.0, 12.345, None]
    assert list(map(column_formatter(speedups, "speedup"), speedups)) == [
        "1.00 ×", "12.35 ×", "–"]


def test_pareto_front_per_cache_fraction(paper_sweep):
    root, _ = paper_sweep
    sweep = read_sweep(root)
    view = make_view(sweep)
    plot = plot_time_vs_mass(sweep, view)
    ax = plot.figure.axes[0]
    assert len(ax.lines) == 3  # one front per fraction, in fraction order
    for line, fraction in zip(ax.lines, (0.1, 0.25, 0.5), strict=True):
        runs = view.ok.filter(pl.col("cache.fraction") == fraction)
        x, y = runs["mean_mass"].to_numpy(), runs["ms_per_token"].to_numpy()
        front = pareto_front(x, y)
        assert sorted(line.get_xdata()) == sorted(x[front])
        assert sorted(line.get_ydata()) == sorted(y[front])
    labels = [t.get_text() for t in plot.figure.legends[0].get_texts()]
    assert [label for label in labels if label.startswith("Pareto")] == [
        "Pareto front, cache 10 %", "Pareto front, cache 25 %", "Pareto front, cache 50 %"]
    markers = {line.get_marker() for line in plot.figure.legends[0].get_lines()[-3:]}
    assert len(markers) == 3


def _switch_marks(ax) -> tuple[list, list]:
    """(full-height vertical lines, segments of short vertical ticks) on an axis."""
    lines = [line for line in ax.lines if len(line.get_xdata()) == 2
             and line.get_xdata()[0] == line.get_xdata()[1]]
    ticks = [segment for collection in ax.collections for segment in collection.get_segments()]
    return lines, ticks


@pytest.mark.parametrize("tokens, segment", [(2400, 300), (30_000, 20)])
def test_switches_are_lines_on_short_traces_and_ticks_on_long_ones(tmp_path, tokens, segment):
    write_sweep(tmp_path, {"policy": ["fetch_all", "rule015"]}, tokens=tokens, segment=segment)
    sweep = read_sweep(tmp_path)
    plot = plot_mass_over_tokens(sweep, make_view(sweep))
    domain = pl.read_parquet(tmp_path / "0" / "per_token.parquet")["domain"].to_numpy()
    switches = int((domain[1:] != domain[:-1]).sum())
    lines, ticks = _switch_marks(plot.figure.axes[0])
    if switches <= 40:
        assert switches == 7 and len(lines) == switches and not ticks
    else:
        assert switches == tokens // segment - 1 and not lines
        assert len(ticks) == switches
        assert all(max(s[:, 1]) - min(s[:, 1]) <= 0.05 for s in ticks)  # in axes height
        assert f"{switches:,} domain switches" in plot.figure.axes[0].get_title()


def test_report_files_plots_and_html(paper_report):
    out = paper_report
    for name in ("report.parquet", "report.csv", "report.md", "report.html"):
        assert (out / name).is_file(), name
    assert not list(out.glob(".*.tmp"))
    for name in PLOTS:
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000, name
        assert f"]({name}.png)" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(PLOTS)
    assert "<table>" in page
    table = pl.read_parquet(out / "report.parquet")
    assert table.height == 15
    assert pl.read_csv(out / "report.csv").height == 15
    assert {"strategy", "speedup_vs_fetch_all"} <= set(table.columns)
    md = (out / "report.md").read_text()
    assert "## Failed jobs" in md and "no such file 'missing.parquet'" in md
    # each policy runs at one beta: no beta plot
    assert not (out / "beta.png").exists()
    assert "Skipped: no policy runs at more than one admission.beta" in md


def test_fixed_settings_say_unknown_for_a_trace_that_is_gone(paper_report):
    settings = fixed_settings(paper_report)
    assert settings["trace"].startswith("`synthetic.parquet`: shape unknown; sha256 `unknown`")
    assert settings["model"].startswith("qwen3-next-80b-a3b (sizes from the preset): 6 MiB")
    assert settings["hardware"] == "rtx3090 (unknown)"
    assert settings["cache"].startswith("per_layer, cache.fraction varies")
    assert settings["policy"].startswith("varies: fetch_all, rule015, first_choice")
    assert settings["command"] == ("`moe-sim -m policy=fetch_all,rule015,first_choice,"
                                   "quality_first,speed_first cache.fraction=0.1,0.25,0.5`")


def test_provenance_recorded_in_the_summary_wins(tmp_path):
    write_sweep(tmp_path, {"policy": ["fetch_all", "rule015"]})
    recorded = {
        "trace": {"path": "/data/qwen3-next.parquet", "content_hash": "feedfacecafe" + "0" * 52,
                  "model": "Qwen/Qwen3-Next-80B-A3B-Instruct", "source": "capture",
                  "num_layers": 48, "num_experts": 512, "top_k": 10, "tokens": 1_000_000},
        "model": {"name": "qwen3_next_80b_a3b", "sizes_from": "trace",
                  "expert_bytes": [3 << 20] * 48, "dense_bytes_per_layer": 70 << 20},
        "hardware": {"name": "h200_measured", "source": "measured"},
        "policy": {"name": "ignored"}, "cache": {}, "admission": {},
    }
    for job in ("0", "1"):
        _edit_summary(tmp_path / job / "summary.json", provenance=recorded)
    table = collect_sweep(tmp_path)
    assert table["provenance.trace.tokens"].to_list() == [1_000_000] * 2
    assert table["provenance.model.expert_bytes"].to_list() == [3 << 20] * 2
    assert not [c for c in table.columns if c.startswith("provenance.policy")]
    assert main([str(tmp_path)]) == 0
    settings = fixed_settings(tmp_path / "report")
    assert settings["trace"].startswith(
        "`qwen3-next.parquet`: 1,000,000 tokens, 48 MoE layers × 512 experts, top-10; "
        "sha256 `feedfacecafe`; recorded from Qwen/Qwen3-Next-80B-A3B-Instruct (source capture)")
    assert settings["model"] == ("qwen3_next_80b_a3b (sizes from the trace): 3 MiB per expert, "
                                 "70 MiB dense weights per layer")
    assert settings["hardware"] == "h200_measured (measured)"


def test_plots_needing_more_are_skipped_with_a_note(tmp_path):
    write_sweep(tmp_path, {"policy": ["first_choice", "speed_first"]}, tables=False)
    assert main([str(tmp_path)]) == 0
    out = tmp_path / "report"
    assert (out / "time_vs_mass.png").is_file()
    for name in ("cache_fraction", "layer_heatmap", "mass_over_tokens"):
        assert not (out / f"{name}.png").exists(), name
    md = (out / "report.md").read_text()
    assert "Skipped: the sweep has one cache.fraction value only" in md
    assert "Skipped: no per_token.parquet in job(s) 0, 1" in md
    assert "Skipped: no per_layer.parquet in job(s) 0, 1" in md


def test_single_run_directory_reads_as_one_row(tmp_path):
    write_sweep(tmp_path, {"policy": ["rule015"]})
    table = collect_sweep(tmp_path / "0")
    assert table.height == 1 and table["job"][0] == "."


@pytest.mark.parametrize("kind", ["absent", "empty", "no_runs"])
def test_missing_or_empty_sweep_dir_exits_2_writing_nothing(tmp_path, capsys, kind):
    sweep = tmp_path / "sweep"
    if kind != "absent":
        sweep.mkdir()
    if kind == "no_runs":
        (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert main([str(sweep), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-report: error:")
    assert not (tmp_path / "out").exists()
    assert not (sweep / "report").exists()


def test_pareto_front_minimises_both():
    x = np.array([0.0, 0.1, 0.1, 0.2, 0.05])
    y = np.array([10.0, 5.0, 6.0, 5.0, 12.0])
    assert pareto_front(x, y).tolist() == [True, True, False, False, False]
