"""The moe-sim app under bad input and faults (issue 10's app side) and what it tells the user
(issue 14): one line and exit 2 for every Hydra error, error.txt for every failed sweep job,
provenance, run directory names, domain names, ignored settings, hardware profile files."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from analysis.collect import collect_sweep
from analysis.provenance import FIELDS
from simulator.config import run_dir_name
from simulator.run import build_params, compose, ignored_settings, simulate_overrides
from traces.errors import InputError
from traces.format import TraceMeta, make_chunk, write_trace
from traces.synth import synth_trace

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "conf" / "hardware" / "TEMPLATE.yaml"


def small_trace(directory: Path) -> Path:
    """A 300-token trace (4 MoE layers x 32 experts, top-4, full logits, 3 domains)."""
    path = directory / "synth.parquet"
    meta, chunk = synth_trace(tokens=300, layers=4, experts=32, top_k=4, seed=3, logits="full",
                              prompt_tokens=32, domains=3)
    write_trace(path, meta, chunk)
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return small_trace(tmp_path_factory.mktemp("trace"))


def moe_sim(*args: str, cwd: Path = REPO, code: str | None = None) -> subprocess.CompletedProcess:
    """moe-sim in a fresh process; ``code`` runs first in that process (to plant a fault)."""
    program = "import sys; import simulator.run as run\n" + (code or "") + \
        "\nsys.argv = ['moe-sim', *sys.argv[1:]]; run.main()"
    return subprocess.run([sys.executable, "-c", program, *args], cwd=cwd,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True,
                          text=True, timeout=600)


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-sim: error: "), proc.stderr[-3000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


# --- every Hydra error: one line, exit 2, the valid choices, nothing written -------------------

POLICY_CHOICES = "cpu_offload, fetch_all, first_choice, quality_first, rule015, speed_first, substitute_all"


@pytest.mark.parametrize(("overrides", "words"), [
    (["policy=nope"], ["'policy=nope'", POLICY_CHOICES]),
    (["model="], ["'model='", "qwen3_next_80b_a3b", "trace"]),
    (["hardware="], ["'hardware='", "h200_measured, h200_pcie5", "hardware=PATH.yaml"]),
    (["-m", "policy=fetch_all,nope"], ["'policy=nope'", POLICY_CHOICES]),
    (["+cache.fractoin=0.5"], ["'+cache.fractoin'", "did you mean cache.fraction?"]),
    (["cache.fractoin=0.5"], ["'cache.fractoin'", "did you mean cache.fraction?"]),
    (["+seeed=1"], ["'+seeed'", "did you mean seed?"]),
    (["cache.fraction=abc"], ["'cache.fraction=abc'", "must be a number"]),
    (["per_token=maybe"], ["'per_token=maybe'", "true or false"]),
    (["cache.eviction=mru"], ["'cache.eviction=mru'", "lru, fifo, lfu"]),
    (["cache.budget_bytes=1e30"], ["'cache.budget_bytes=1e+30'", "whole number"]),
    (["cache.budget_bytes=99999999999999999999"], ["cache.budget_bytes", "int64"]),
    (["seed=9223372036854775808"], ["'seed=9223372036854775808'", "int64"]),
    (["model.expert_bytes=2^63"], ["'model.expert_bytes=2^63'", "override syntax"]),
    (["-m", "cache=global", "cache.budget_bytes=1000000,1e30"], ["cache.budget_bytes=1e+30"]),
    (["seed=${nope:1}"], ["interpolation type nope", "at seed"]),
])
def test_hydra_errors_are_one_line_with_the_choices(trace, tmp_path, overrides, words):
    proc = moe_sim(f"trace.path={trace}", *overrides, f"hydra.run.dir={tmp_path / 'run'}",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert_one_error_line(proc, *words)
    assert list(tmp_path.iterdir()) == []


def test_an_error_only_hydra_sees_is_one_line_too(trace, tmp_path):
    """An interpolation in Hydra's own settings fails inside Hydra: caught around its app."""
    proc = moe_sim(f"trace.path={trace}", "hydra.job.name=${nope:1}",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error_line(proc, "interpolation type nope", "moe-sim --help")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


@pytest.mark.parametrize(("overrides", "words"), [
    (["model.expert_bytes=abc"], ["'model.expert_bytes=abc'", "number of bytes"]),
    (["model.expert_bytes=9223372036854775808"], ["model.expert_bytes", "sanity cap"]),
    (["model.dense_bytes_per_layer=-1000000000"], ["model.dense_bytes_per_layer", ">= 0"]),
    (["trace.chunk_tokens=0"], ["'trace.chunk_tokens=0'", ">= 1"]),
    (["cache.init=frequency", "cache.warmup_tokens=100000"],
     ["'cache.warmup_tokens=100000'", "300 tokens", "lower cache.warmup_tokens"]),
    (["cache.init=frequency", "cache.warmup_tokens=300"], ["'cache.warmup_tokens=300'"]),
    (["prefetch.predictor=coactivation", "prefetch.train_tokens=300"],
     ["'prefetch.train_tokens=300'", "300 tokens", "lower prefetch.train_tokens"]),
])
def test_values_the_run_cannot_take_are_one_line_and_leave_no_run(trace, tmp_path, overrides, words):
    proc = moe_sim(f"trace.path={trace}", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error_line(proc, *words)
    assert not (tmp_path / "run").exists()


def test_no_decode_token_is_an_error_not_an_all_null_summary(tmp_path):
    meta = TraceMeta(model="toy", num_layers=2, num_experts=8, top_k=2, expert_bytes=[1000] * 2)
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((40, 2, 8)), axis=-1)[..., :2]
    chunk = make_chunk(meta, seq=np.zeros(40, int), pos=np.arange(40), phase=np.zeros(40, np.int8),
                       experts=experts, weights=np.ones((40, 2, 2)))
    path = tmp_path / "prefill.parquet"
    write_trace(path, meta, chunk)
    with pytest.raises(InputError, match="no decode token was simulated") as err:
        simulate_overrides([f"trace.path={path}", "cache.fraction=0.5"])
    assert "\n" not in str(err.value)


def test_an_unwritable_run_directory_is_one_line_naming_the_path(trace, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = moe_sim(f"trace.path={trace}", f"hydra.run.dir={blocker / 'run'}")
    assert_one_error_line(proc, str(blocker))


@pytest.mark.parametrize("fault", ["full", "permission"])
def test_a_full_disk_or_permission_error_writing_results_is_one_line_naming_the_path(trace, tmp_path, fault):
    plant = {
        # every temporary becomes a link to /dev/full: each write fails with ENOSPC
        "full": "import itertools, pathlib, traces.atomic as a\nn = itertools.count()\n"
                "def temp(p):\n    link = pathlib.Path(p).with_name(f'.x{next(n)}.tmp')\n"
                "    link.symlink_to('/dev/full')\n    return link\na.temp_path = temp",
        "permission": "import errno, pyarrow.parquet as pq\n"
                      "def refuse(*a, **k):\n    raise PermissionError(errno.EACCES, 'Permission denied')\n"
                      "pq.write_table = refuse",
    }[fault]
    out = tmp_path / "run"
    proc = moe_sim(f"trace.path={trace}", f"hydra.run.dir={out}", code=plant)
    cause = "No space left on device" if fault == "full" else "Permission denied"
    assert_one_error_line(proc, str(out), cause)
    assert not (out / "summary.json").exists()


# --- sweeps ------------------------------------------------------------------------------------

def test_a_sweep_with_input_failures_records_each_and_exits_2_without_traceback(trace, tmp_path):
    sweep = tmp_path / "sweep"
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "cache.fraction=0.5,2",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moe-sim: error:")]
    assert len(errors) == 3, errors  # one per failed job, then the sweep's closing line
    assert all("'cache.fraction=2.0' must be in (0, 1]" in line for line in errors[:2])
    assert errors[2].startswith("moe-sim: error: 2 of 4 jobs failed (2 on their input)")
    assert sorted(p.parent.name for p in sweep.glob("*/error.txt")) == ["1", "3"]
    assert sorted(p.parent.name for p in sweep.glob("*/summary.json")) == ["0", "2"]
    table = collect_sweep(sweep)
    assert table.filter(table["status"] == "failed")["error"].to_list() == [
        "'cache.fraction=2.0' must be in (0, 1], e.g. cache.fraction=0.25"] * 2
    assert [line for line in proc.stderr.splitlines() if "[sweep]" in line][1].endswith("(job 1: failed)")


def test_a_job_failing_on_a_non_input_error_leaves_its_error_txt(trace, tmp_path):
    """A fault of the program (not of the input) still fails only its job, with error.txt
    naming the exception; the sweep exits 1."""
    plant = ("real = run.run_prepared\n"  # every launcher's simulation of a checked config
             "def flaky(prepared, progress=False):\n"
             "    if prepared.cfg['policy']['name'] == 'rule015':\n"
             "        raise RuntimeError('engine state went wrong')\n"
             "    return real(prepared, progress)\n"
             "run.run_prepared = flaky")
    sweep = tmp_path / "sweep"
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", f"hydra.sweep.dir={sweep}",
                   code=plant)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (sweep / "1" / "error.txt").read_text() == "RuntimeError: engine state went wrong\n"
    assert (sweep / "0" / "summary.json").exists()
    assert "1 of 2 jobs failed (0 on their input)" in proc.stderr.splitlines()[-1]
    table = collect_sweep(sweep)
    assert table["status"].to_list() == ["ok", "failed"]
    assert table["error"][1] == "RuntimeError: engine state went wrong"


# --- what a run says about itself --------------------------------------------------------------

def test_summary_records_provenance_in_the_shape_the_report_reads(trace, tmp_path):
    out = tmp_path / "run"
    proc = moe_sim(f"trace.path={trace}", "policy=quality_first", "model=qwen3_next_80b_a3b",
                   "model.sizes_only=true", "hardware=rtx3090_pcie4", "trace.max_tokens=200",
                   f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    facts = summary["provenance"]
    for group, names in FIELDS.items():
        assert set(names) <= set(facts[group]), (group, facts[group])
    from simulator.trace_cache import trace_key
    from traces.format import open_trace

    with open_trace(trace) as reader:
        meta, tokens = reader.meta, reader.num_tokens
    assert facts["trace"]["path"] == str(trace.resolve())
    assert facts["trace"]["content_hash"] == trace_key(trace)
    assert (facts["trace"]["num_layers"], facts["trace"]["num_experts"], facts["trace"]["top_k"],
            facts["trace"]["tokens"], facts["trace"]["model"]) == (4, 32, 4, tokens, meta.model)
    assert facts["model"] == {"name": "qwen3_next_80b_a3b", "sizes_from": "preset, sizes only",
                              "expert_bytes": 6291456, "dense_bytes_per_layer": 70000000}
    assert facts["hardware"] == {"name": "rtx3090_pcie4", "source": "datasheet", "file": None}
    assert facts["policy"]["name"] == "quality_first" and facts["policy"]["substitute_by"] == "logit"
    assert facts["cache"]["eviction"] == "lfu" and facts["admission"] == {"beta": 0.5}
    assert facts["config"]["trace"]["max_tokens"] == 200 and facts["config"]["model"]["sizes_only"]
    # the report takes the recorded facts
    row = collect_sweep(out).row(0, named=True)
    assert row["provenance.model.sizes_from"] == "preset, sizes only"
    assert row["provenance.trace.content_hash"] == trace_key(trace)
    assert "provenance" not in row and "provenance.config.seed" not in row
    # the one-line result states the simulated shape
    line = proc.stdout.strip().splitlines()[-1]
    assert f"[synth.parquet: {summary['tokens']:,} tokens ({summary['decode_tokens']:,} decode) x 4 " \
           "MoE layers x 32 experts, top-4;" in line


@pytest.mark.parametrize(("overrides", "sizes_from"), [
    ([], "trace"), (["model.expert_bytes=5000"], "override"),
    (["model=olmoe_1b_7b", "model.sizes_only=true"], "preset, sizes only"),
])
def test_sizes_from_says_where_the_expert_sizes_come_from(trace, overrides, sizes_from):
    from traces.format import open_trace

    with open_trace(trace) as reader:
        recorded = reader.meta.expert_bytes[0]
    summary = simulate_overrides([f"trace.path={trace}", "trace.max_tokens=100", *overrides])
    assert summary["provenance"]["model"]["sizes_from"] == sizes_from
    expected = {"trace": recorded, "override": 5000,
                "preset, sizes only": 2048 * 1024 * 3 * 2}[sizes_from]  # OLMoE's bf16 expert
    assert summary["provenance"]["model"]["expert_bytes"] == expected


def test_per_token_names_each_tokens_domain(trace, tmp_path):
    out = tmp_path / "run"
    assert moe_sim(f"trace.path={trace}", f"hydra.run.dir={out}").returncode == 0
    table = pq.read_table(out / "per_token.parquet")
    domains = json.loads((out / "summary.json").read_text())["provenance"]["trace"]["domains"]
    assert len(domains) == 3
    index, names = table["domain"].to_pylist(), table["domain_name"].to_pylist()
    assert names == [domains[i] if i >= 0 else None for i in index]
    assert set(names) <= set(domains) and None not in names


def test_run_directories_carry_the_overrides(trace, tmp_path):
    proc = moe_sim(f"trace.path={trace}", "policy=rule015", "cache.fraction=0.5", "admission.beta=1",
                   "trace.max_tokens=100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("*/*")
    assert run.name.endswith("_rule015_beta=1,fraction=0.5,max_tokens=100,path=synth.parquet"), run.name
    assert (run / "summary.json").exists()


def test_run_dir_name_shortens_keys_paths_and_length():
    assert run_dir_name("quality_first", "") == "quality_first"
    assert run_dir_name("x", "policy=x,cache.fraction=0.25,trace.path=/a/b/t.parquet") == \
        "x_fraction=0.25,path=t.parquet"
    assert run_dir_name("x", "~hardware,hardware_file='/p/mine.yaml'") == "x_hardware_file=mine.yaml"
    assert run_dir_name("x", "model.expert_bytes=[1,2,3],seed=4") == "x_expert_bytes=-1,2,3-,seed=4"
    assert len(run_dir_name("x", ",".join(f"k{i}=v{i}" for i in range(50)))) == 80


# --- ignored settings warn -------------------------------------------------------------------

def _meta(logits=True):
    return TraceMeta(model="toy", num_layers=4, num_experts=16, top_k=2, expert_bytes=[1000] * 4,
                     has_logits=logits)


def _ignored(*overrides, logits=True) -> list[str]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(list(overrides)), resolve=True)
    params, _ = build_params(cfg, _meta(logits))
    return ignored_settings(cfg, params)


@pytest.mark.parametrize(("overrides", "words"), [
    (["policy=rule015", "cache.lfu_decay=0.99"], ["'cache.lfu_decay=0.99'", "evicts by lru", "substitutes by logit"]),
    (["policy=fetch_all", "admission.beta=0.5"], ["'admission.beta=0.5'", "fetches every miss"]),
    (["policy=cpu_offload", "admission.beta=0.5"], ["'admission.beta=0.5'", "CPU"]),
    (["policy=fetch_all", "policy.substitute_by=frequency"], ["'policy.substitute_by=frequency'"]),
    (["cache.window_tokens=64"], ["'cache.window_tokens=64'", "cache.eviction=window_lfu", "evicts by lru"]),
    (["cache.warmup_tokens=64"], ["'cache.warmup_tokens=64'", "starts cold"]),
    (["cache=global", "cache.budget_bytes=5000", "cache.fraction=0.5"], ["'cache.fraction=0.5'", "budget_bytes"]),
])
def test_settings_the_run_never_reads_give_one_warning(overrides, words):
    (line,) = _ignored(*overrides)
    assert all(w in line for w in words) and "\n" not in line, line


@pytest.mark.parametrize("overrides", [
    ["policy=quality_first", "cache.lfu_decay=0.99"],  # lfu eviction decays
    ["policy=rule015", "policy.substitute_by=frequency", "cache.lfu_decay=0.99"],  # frequency substitutes
    ["policy=quality_first", "admission.beta=0.25"],
    ["cache.eviction=window_lfu", "cache.window_tokens=64"],
    ["policy=cpu_offload", "cache.warmup_tokens=64"],
    ["policy=quality_first"],
])
def test_settings_the_run_reads_give_no_warning(overrides):
    assert _ignored(*overrides) == []


def test_the_warning_is_printed_once_on_stderr(trace, capsys):
    simulate_overrides([f"trace.path={trace}", "trace.max_tokens=100", "cache.lfu_decay=0.9"])
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("moe-sim: warning: 'cache.lfu_decay=0.9'")] == err


# --- hardware profiles given as files ----------------------------------------------------------

def _profile_file(tmp_path: Path, edit=None, name="mine.yaml") -> Path:
    profile = yaml.safe_load(TEMPLATE.read_text())
    if edit:
        edit(profile)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(profile))
    return path


def test_a_profile_file_is_accepted_as_hardware(trace, tmp_path):
    out = tmp_path / "run"
    proc = moe_sim(f"trace.path={trace}", f"hardware={TEMPLATE}", "trace.max_tokens=100",
                   f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads((out / "summary.json").read_text())["provenance"]["hardware"]
    assert facts == {"name": "template", "source": "datasheet", "file": str(TEMPLATE)}
    preset_like = simulate_overrides([f"trace.path={trace}", "trace.max_tokens=100",
                                      f"hardware={TEMPLATE}"])
    assert preset_like["ms_per_token"] == json.loads((out / "summary.json").read_text())["ms_per_token"]


def test_a_sweep_over_profile_files(trace, tmp_path):
    slow = _profile_file(tmp_path, lambda p: p["pcie"].update(bandwidth_gbps=5.0), "slow.yaml")
    sweep = tmp_path / "sweep"
    proc = moe_sim("-m", f"trace.path={trace}", f"hardware={TEMPLATE},{slow}", "trace.max_tokens=100",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = collect_sweep(sweep)
    assert table["provenance.hardware.name"].to_list() == ["template", "template"]
    assert table["hardware_file"].to_list() == [str(TEMPLATE), str(slow)]
    assert table["ms_per_token"][1] > table["ms_per_token"][0]


@pytest.mark.parametrize(("text", "words"), [
    ("- a\n- b\n", ["expected a mapping of sections"]),
    ("pcie: [\n", ["not a plain YAML mapping (line 2)"]),
    ("pcie: !!python/object:os.system {}\n", ["not a plain YAML mapping", "python/object"]),
])
def test_a_profile_file_that_is_not_a_plain_mapping_is_one_line(trace, tmp_path, text, words):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    proc = moe_sim(f"trace.path={trace}", f"hardware={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error_line(proc, str(bad), *words)


def test_every_problem_of_a_profile_file_is_reported_at_once(trace, tmp_path):
    def edit(p):
        p["source"] = "guess"
        p["pcie"]["latency_us"] = -1
        p["gpu"]["expert_fixed_uss"] = p["gpu"].pop("expert_fixed_us")
        p["pcie"]["copy_order"] = "fifo"

    proc = moe_sim(f"trace.path={trace}", f"hardware={_profile_file(tmp_path, edit)}")
    line = assert_one_error_line(proc, "hardware.source", "hardware.pcie.latency_us",
                                 "hardware.gpu.expert_fixed_uss", "'hardware.gpu.expert_fixed_us'",
                                 "'hardware.pcie.copy_order' must be one of priority, submission")
    assert line.count("; ") == 4


def test_missing_profile_files_and_mixed_sweeps_are_one_line(trace, tmp_path):
    assert_one_error_line(moe_sim(f"trace.path={trace}", f"hardware={tmp_path / 'none.yaml'}"),
                          "no such profile file")
    assert_one_error_line(moe_sim("-m", f"trace.path={trace}", f"hardware=rtx3090_pcie4,{TEMPLATE}"),
                          "mixes presets and profile files")


def test_the_template_documents_every_profile_field():
    from simulator.hardware import PROFILE_CHOICES, PROFILE_FIELDS, TOP_LEVEL, validate_profile

    profile = yaml.safe_load(TEMPLATE.read_text())
    validate_profile(profile)
    text = TEMPLATE.read_text()
    field_lines = [ln for ln in text.splitlines() if ln.startswith("  ") and ":" in ln]
    for section, fields in PROFILE_FIELDS.items():
        names = [*fields, *PROFILE_CHOICES.get(section, {})]
        assert set(names) == set(profile[section]), section
        for name in names:  # every field has its explanation on its line
            assert any(ln.startswith(f"  {name}:") and "  # " in ln for ln in field_lines), name
    for name in TOP_LEVEL - {"samples"}:
        assert f"\n{name}:" in text, name
    assert "# samples:" in text


def test_a_gpu_only_profile_runs_policies_that_never_read_cpu_or_ssd(trace, tmp_path):
    full = _profile_file(tmp_path, name="full.yaml")

    def gpu_only(p):
        del p["cpu"], p["ssd"]

    part = _profile_file(tmp_path, gpu_only, "gpu_only.yaml")
    for policy in ("fetch_all", "quality_first"):
        common = [f"trace.path={trace}", f"policy={policy}", "trace.max_tokens=150"]
        a = simulate_overrides([*common, f"hardware={full}"])
        b = simulate_overrides([*common, f"hardware={part}"])
        for key in ("ms_per_token", "hits", "substitutions", "mean_mass", "stall_ms_per_token"):
            assert a[key] == b[key], (policy, key)
    with pytest.raises(InputError, match=r"'hardware.cpu' is read with policy.miss_action=cpu"):
        simulate_overrides([f"trace.path={trace}", "policy=cpu_offload", f"hardware={part}"])
    with pytest.raises(InputError, match=r"'hardware.ssd' is read with a host RAM limit"):
        simulate_overrides([f"trace.path={trace}", f"hardware={part}",
                            "+hardware.host_ram_bytes=100000"])
    # hardware.* overrides given with a file apply on top of it
    slower = simulate_overrides([f"trace.path={trace}", "trace.max_tokens=150", f"hardware={full}",
                                 "hardware.pcie.bandwidth_gbps=1.0"])
    assert slower["provenance"]["config"]["hardware"]["pcie"]["bandwidth_gbps"] == 1.0
    assert slower["ms_per_token"] > simulate_overrides(
        [f"trace.path={trace}", "trace.max_tokens=150", f"hardware={full}"])["ms_per_token"]


def test_an_unread_section_that_is_present_is_still_checked(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(["policy=rule015"]), resolve=True)
    bad = copy.deepcopy(cfg)
    bad["hardware"]["cpu"]["memory_bandwidth_gbps"] = -1
    with pytest.raises(InputError, match="hardware.cpu.memory_bandwidth_gbps"):
        build_params(bad, _meta())
