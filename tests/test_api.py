"""The Python API (docs/api.md): simulate, sweep and read_sweep agree with the command line, and
the example in examples/ runs and gives the results it shows."""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_app import small_trace

from simulator.api import to_overrides
from simulator.run import simulate_overrides
from traces.errors import InputError

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "api_tour.py"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return small_trace(tmp_path_factory.mktemp("trace"))


def test_simulate_returns_the_summary_tables_and_config_of_the_run(trace):
    from simulator import simulate

    r = simulate(trace, policy="quality_first", **{"cache.fraction": 0.25})
    cli = simulate_overrides([f"trace.path={trace}", "policy=quality_first", "cache.fraction=0.25"])
    for key in ("ms_per_token", "hits", "substitutions", "mean_mass", "tokens"):
        assert r.summary[key] == cli[key], key
    assert r.config["policy"]["name"] == "quality_first" and r.config["cache"]["fraction"] == 0.25
    assert r.summary["provenance"]["config"] == r.config
    assert isinstance(r.per_token, pl.DataFrame) and r.per_token.height == r.summary["tokens"]
    assert int(r.per_token["substitutions"].sum()) == r.summary["substitutions"]
    assert r.per_layer.height == 4 and int(r.per_layer["hits"].sum()) == r.summary["hits"]
    names = r.summary["provenance"]["trace"]["domains"]
    assert r.per_token["domain_name"].cast(pl.String).to_list() == [names[d] for d in r.per_token["domain"]]


def test_section_dicts_and_python_values_become_overrides(trace):
    from simulator import simulate

    assert to_overrides({"cache": {"fraction": 0.5, "eviction": "lfu"}, "admission.beta": None,
                         "policy.tau": math.inf, "trace.cache": False, "trace.path": Path("a b.parquet"),
                         "model.expert_bytes": [1, 2]}) == [
        "cache.fraction=0.5", "cache.eviction=lfu", "admission.beta=null", "policy.tau=inf",
        "trace.cache=false", "trace.path='a b.parquet'", "model.expert_bytes=[1,2]"]
    a = simulate(trace, cache={"fraction": 0.5, "eviction": "lfu"}, **{"policy.tau": math.inf})
    b = simulate_overrides([f"trace.path={trace}", "cache.fraction=0.5", "cache.eviction=lfu",
                            "policy.tau=inf"])
    assert a.summary["substitutions"] == b["substitutions"] > 0


def test_bad_settings_raise_the_one_line_moe_sim_prints(trace):
    from simulator import simulate

    with pytest.raises(InputError, match="did you mean cache.fraction") as err:
        simulate(trace, **{"cache.fractoin": 0.5})
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="'policy=nope' is not a policy preset"):
        simulate(trace, policy="nope")
    with pytest.raises(InputError, match="sweep grid must map"):
        import simulator

        simulator.sweep(trace, {"policy": "fetch_all"})


def test_sweep_gives_one_row_per_configuration_equal_to_separate_runs(trace):
    from simulator import simulate, sweep

    grid = {"policy": ["fetch_all", "rule015", "quality_first"], "cache.fraction": [0.25, 0.5]}
    table = sweep(trace, grid, workers=2, **{"cache.lfu_decay": 0.99})
    assert table.height == 6
    assert table.select("policy", "cache.fraction").rows() == [
        (p, f) for p in grid["policy"] for f in grid["cache.fraction"]]
    for row in table.iter_rows(named=True):
        alone = simulate(trace, policy=row["policy"], **{"cache.fraction": row["cache.fraction"],
                                                          "cache.lfu_decay": 0.99}).summary
        for key in ("ms_per_token", "hits", "fetches", "substitutions", "mean_mass", "hit_rate"):
            assert row[key] == alone[key], (row["policy"], key)
    assert "provenance" not in table.columns and table["sim_seconds"].min() > 0


def test_sweep_groups_configurations_that_read_the_trace_differently(trace):
    from simulator import sweep

    table = sweep(trace, {"trace.max_tokens": [100, 300], "engine": ["numba", "reference"]},
                  policy="rule015")
    assert table.select("trace.max_tokens", "engine").rows() == [
        (100, "numba"), (100, "reference"), (300, "numba"), (300, "reference")]
    by = {(r["trace.max_tokens"], r["engine"]): r for r in table.iter_rows(named=True)}
    for tokens in (100, 300):
        assert by[(tokens, "numba")]["substitutions"] == by[(tokens, "reference")]["substitutions"]
    assert by[(100, "numba")]["tokens"] < by[(300, "numba")]["tokens"]


def test_read_sweep_reads_a_moe_sim_sweep(trace, tmp_path):
    from simulator import read_sweep, sweep

    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "simulator.run", "-m", f"trace.path={trace}",
                           "policy=fetch_all,rule015", f"hydra.sweep.dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = read_sweep(out)
    assert runs["status"].to_list() == ["ok", "ok"]
    same = sweep(trace, {"policy": ["fetch_all", "rule015"]})
    assert runs["ms_per_token"].to_list() == same["ms_per_token"].to_list()
    assert runs["provenance.trace.num_experts"].to_list() == [32, 32]


def test_import_simulator_is_cheap_and_sweep_is_the_function_in_any_import_order():
    program = ("import sys; import simulator\n"
               "assert not {'hydra', 'numba', 'polars'} & set(sys.modules), sorted(sys.modules)\n"
               "import simulator.sweep as progress\n"
               "from simulator import sweep, simulate, read_sweep, Result\n"
               "from simulator.sweep import SweepProgress\n"
               "assert callable(sweep) and callable(simulate) and callable(read_sweep)\n"
               "assert sweep.__call__.__doc__.startswith(\"The Python API's sweep()\")\n")
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def _load_example():
    spec = importlib.util.spec_from_file_location("api_tour", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_runs_and_gives_what_it_shows(tmp_path, capsys):
    tour = _load_example()
    out = tour.main(tmp_path)
    one, table, speedups, runs = out["one"], out["table"], out["speedups"], out["runs"]
    assert one.summary["policy"] == "quality_first" and one.summary["tokens"] == 4000
    names = one.summary["provenance"]["trace"]["domains"]
    assert set(out["by_domain"]["domain_name"].cast(pl.String)) <= set(names)
    assert out["by_domain"]["tokens"].sum() == one.summary["decode_tokens"]
    assert table.height == len(tour.POLICIES) * len(tour.FRACTIONS)
    fetch_all = speedups.filter(pl.col("policy") == "fetch_all")
    assert fetch_all["speedup"].to_list() == [1.0] * 3 and fetch_all["mean_mass"].to_list() == [0.0] * 3
    substituting = speedups.filter(pl.col("policy") != "fetch_all")
    assert (substituting["speedup"] > 1).all() and (substituting["mean_mass"] > 0).all()
    for policy in tour.POLICIES:  # more resident experts: more hits, less time
        rows = speedups.filter(pl.col("policy") == policy).sort("cache.fraction")
        assert np.all(np.diff(rows["hit_rate"].to_numpy()) > 0)
        assert np.all(np.diff(rows["ms_per_token"].to_numpy()) < 0)
    # the command-line sweep gives the API's numbers
    assert runs["status"].to_list() == ["ok", "ok"]
    at_quarter = table.filter(pl.col("cache.fraction") == 0.25)
    for row in runs.iter_rows(named=True):
        api = at_quarter.filter(pl.col("policy") == row["policy.name"])
        assert row["ms_per_token"] == api["ms_per_token"][0]
    assert "quality_first:" in capsys.readouterr().out
