"""Discoverable settings: ``moe-sim --help`` and the README's override table come from the
structured configs' field help; every tool's ``--help`` works without the optional extras;
``moe-capture --help`` shows its own settings only; moe-trace closes with a line."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from simulator.config import (
    README,
    TABLE_BEGIN,
    TABLE_END,
    group_options,
    hardware_settings,
    markdown_table,
    readme_with_table,
    schema_fields,
    settings,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
WITHOUT_EXTRAS = "import sys\nfor name in ('torch', 'transformers'):\n    sys.modules[name] = None\n"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """A console script in a fresh process in which torch and transformers cannot be imported."""
    module, function = SCRIPTS[name].split(":")
    program = (WITHOUT_EXTRAS + f"import {module} as m\nsys.argv = [{name!r}, *sys.argv[1:]]\n"
               f"sys.exit(m.{function}())")
    return subprocess.run([sys.executable, "-c", program, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def sim_help() -> str:
    proc = run_script("moe-sim", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


def test_moe_sim_help_lists_every_field_with_type_default_help_and_choices(sim_help):
    lines = sim_help.splitlines()
    for key, field, _ in schema_fields():
        if key in ("hardware", "model"):
            continue
        (head,) = [i for i, ln in enumerate(lines) if ln.startswith(f"  {key}  (")]
        text = " ".join(ln.strip() for ln in lines[head + 1:head + 4])
        assert field.metadata["help"].split(";")[0][:40] in text, key
        for choice in field.metadata.get("choices", ()):
            assert choice in text, (key, choice)
    for s in settings():
        if s.type == "preset":
            assert f"  {s.key}={s.default}" in sim_help, s.key
            for option in group_options(s.key):
                assert f"      {option}" in sim_help, (s.key, option)
    assert "TEMPLATE" not in [ln.split()[0] for ln in lines if ln.startswith("      ") and ln.strip()]
    for s in hardware_settings():
        assert f"  {s.key}  (" in sim_help and s.help, s.key
    assert "model.expert_bytes" in sim_help and "-m KEY=A,B" in sim_help


def test_the_readme_override_table_is_the_generated_one():
    text = README.read_text()
    block = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN):text.index(TABLE_END)].strip()
    assert block == markdown_table(), ("the README's override table is out of date: run "
                                       "python -m simulator.config --write-readme")
    assert readme_with_table(text) == text
    for key in ("trace.max_tokens", "progress", "per_token", "cache.warmup_tokens",
                "hardware.host_ram_bytes", "hardware.ssd.bandwidth_gbps", "hardware.host_pinned_bytes"):
        assert f"| `{key}` |" in block, key


def test_every_profile_field_has_its_help_from_the_template():
    assert all(s.help and not s.help.startswith("[") for s in hardware_settings())
    keys = {s.key for s in hardware_settings()}
    assert {"hardware.pcie.idle_latency_us", "hardware.pcie.pageable_bandwidth_gbps",
            "hardware.gpu.memory_bytes", "hardware.gpu.token_fixed_us",
            "hardware.gpu.step_fixed_us"} <= keys


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_help_works_without_the_optional_extras(name):
    proc = run_script(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert name.removeprefix("moe-") in proc.stdout.lower() and "Traceback" not in proc.stderr


def test_moe_capture_help_shows_its_own_settings_only():
    proc = run_script("moe-capture", "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("moe-capture: record the routing")
    assert "model:\n  path: null" in out and "lookahead:" in out and "out: outputs/capture.parquet" in out
    for foreign in ("policy:", "fetch_all", "hardware:", "h200", "Configuration groups"):
        assert foreign not in out, foreign


def test_moe_emulate_without_torch_says_what_is_missing_in_one_line(tmp_path):
    proc = run_script("moe-emulate", "--out", str(tmp_path / "e"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("moe-emulate: error: needs torch") and "'.[capture]'" in proc.stderr
    assert not (tmp_path / "e").exists()


# --- moe-trace: a closing line beside the progress bar ---------------------------------------

@pytest.mark.parametrize("command", ["synth", "repack", "import"])
def test_moe_trace_writers_close_with_a_line_on_a_terminal(command, tmp_path, monkeypatch, capsys):
    import traces.cli as cli
    from traces.format import open_trace

    monkeypatch.setattr(cli, "_progress", lambda: True)  # as on a terminal
    synth = tmp_path / "s.parquet"
    small = ["--tokens", "300", "--layers", "2", "--experts", "8", "--top-k", "2", "--seed", "1"]
    assert cli.main(["synth", str(synth), *small]) == 0
    if command == "repack":
        assert cli.main(["repack", str(synth), str(tmp_path / "r.parquet")]) == 0
    elif command == "import":
        csv = tmp_path / "r.csv"
        rows = [f"0,1,{step},{layer},{slot},{(step + slot) % 8},{0.6 - 0.2 * slot},0,{100 * (layer + 1)}"
                for step in range(20) for layer in range(2) for slot in range(2)]
        csv.write_text("\n".join([
            "# route_trace v1", "# model=m arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=2",
            "# layer=0 expert_bytes=100 dense_bytes=10", "# layer=1 expert_bytes=200 dense_bytes=20",
            "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes", *rows]) + "\n")
        assert cli.main(["import", "route-csv", str(csv), str(tmp_path / "r.parquet")]) == 0, \
            capsys.readouterr().err
    out = synth if command == "synth" else tmp_path / "r.parquet"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    with open_trace(out) as reader:
        tokens = reader.num_tokens
    assert last.startswith(f"moe-trace: wrote {out}: {tokens:,} tokens x 2 MoE layers x 8 experts, top-2 ("), last
    assert last.endswith(" s")


def test_moe_trace_writers_stay_quiet_off_a_terminal(tmp_path, capsys):
    import traces.cli as cli

    assert cli.main(["synth", str(tmp_path / "s.parquet"), "--tokens", "100", "--layers", "2",
                     "--experts", "8", "--top-k", "2", "--seed", "1"]) == 0
    assert capsys.readouterr().err == ""
