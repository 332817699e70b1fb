"""moe-trace synth --like / --preset / --check: fitted traces from the command line."""
from __future__ import annotations

import numpy as np
import pytest

from traces.cli import main
from traces.format import read_trace
from traces.synth import write_synth_trace


@pytest.fixture(scope="module")
def plain_real(tmp_path_factory):
    """A small trace without logits, with prefill prompts and domains, standing in for a real one."""
    path = tmp_path_factory.mktemp("real") / "real.parquet"
    write_synth_trace(path, tokens=600, layers=3, experts=16, top_k=2, seed=4, logits="none",
                      seq_tokens=150, prompt_tokens=20, domains=2)
    return path


def test_like_a_trace_without_logits(plain_real, tmp_path, capsys):
    out = tmp_path / "like.parquet"
    assert main(["synth", str(out), "--like", str(plain_real), "--tokens", "900", "--seed", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    line = captured.out.strip()
    assert line.count("\n") == 0 and line.startswith("mrc check:") and "first 600 tokens" in line
    assert "pp per_layer" in line and "pp global" in line
    meta, chunk = read_trace(out)
    real_meta, real = read_trace(plain_real)
    assert chunk.num_tokens == 900 and not meta.has_logits  # logits as the real trace has them
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (3, 16, 2)
    assert meta.expert_bytes == real_meta.expert_bytes and meta.domains == real_meta.domains
    assert meta.extra["synth"] == {"like": str(plain_real), "tokens": 900, "seed": 2, "logits": "none"}
    assert meta.extra["fit"]["source"]["tail_gap_from"] == "gates"
    np.testing.assert_array_equal(chunk.phase[:600], real.phase)  # the real layout
    # asked for, the fitted trace of a trace without logits has consistent logits
    full = tmp_path / "full.parquet"
    assert main(["synth", str(full), "--like", str(plain_real), "--tokens", "300", "--logits", "full"]) == 0
    _, chunk = read_trace(full)
    order = np.argsort(-chunk.logits, axis=-1, kind="stable")[..., :2]
    np.testing.assert_array_equal(order, chunk.experts)


def test_check_prints_the_table(plain_real, tmp_path, capsys):
    out = tmp_path / "s.parquet"
    assert main(["synth", str(out), "--like", str(plain_real), "--tokens", "600", "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["scope", "fraction", "size", "real", "synth", "delta"]
    assert len(lines) == 1 + 20 + 1 and lines[-1].startswith("mrc check:")
    assert main(["synth", "--check", str(plain_real), str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == lines[1:]


def test_preset(tmp_path, capsys):
    out = tmp_path / "p.parquet"
    assert main(["synth", str(out), "--preset", "qwen3_30b_a3b_route", "--tokens", "50",
                 "--logits", "top:8"]) == 0
    assert capsys.readouterr().out == ""
    meta, chunk = read_trace(out)
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.logits_top_r) == (48, 128, 6, 8)
    assert meta.extra["synth"]["preset"] == "qwen3_30b_a3b_route" and chunk.num_tokens == 50


@pytest.mark.parametrize("args, words", [
    (["--like", "{real}", "--tokens", "10", "--layers", "4"], "'layers' (--layers) does not apply"),
    (["--like", "{real}"], "'tokens' (--tokens) is missing"),
    (["--like", "{real}", "--preset", "qwen3_next_paper", "--tokens", "5"], "exclude each other"),
    (["--preset", "nope", "--tokens", "5"], "no such fit"),
    (["--tokens", "5", "--check"], "needs --like"),
    (["--tokens", "5"], "'layers' (--layers) is missing"),
    (["--like", "{real}", "--tokens", "5", "--logits", "top:1"], "'logits' (--logits)"),
    (["--like", "{real}", "--tokens", "0"], "'tokens' (--tokens) is 0"),
    (["--preset", "qwen3_next_paper", "--tokens", "5", "--seed", "-1"], "'seed' (--seed) is -1"),
])
def test_bad_options_exit_2_with_one_line_and_write_nothing(plain_real, tmp_path, capsys, args, words):
    out = tmp_path / "o.parquet"
    argv = ["synth", str(out), *(a.replace("{real}", str(plain_real)) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-trace: error: ") and words in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--check", "a.parquet"], ["OUT", "--check", "a.parquet", "b.parquet"], []])
def test_check_forms(tmp_path, capsys, args):
    argv = ["synth", *(str(tmp_path / a) if a.endswith("parquet") or a == "OUT" else a for a in args)]
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
