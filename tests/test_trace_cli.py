"""The moe-trace command: synth, import route-csv, info, repack; overwrite refusal and bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from traces.cli import main
from traces.format import read_trace, recorded_content_hash

REPO = Path(__file__).resolve().parent.parent
SHARED_ROUTE = REPO.parent / "shared" / "traces" / "qwen3-30b-a3b.route.csv"
SYNTH = ["--tokens", "600", "--layers", "4", "--experts", "32", "--top-k", "4", "--seed", "3"]


def test_synth_then_info(tmp_path, capsys):
    out = tmp_path / "t.parquet"
    assert main(["synth", str(out), *SYNTH, "--logits", "none", "--domains", "3"]) == 0
    assert capsys.readouterr().err == ""  # no progress bar when stderr is not a terminal
    meta, chunk = read_trace(out)
    assert chunk.num_tokens == 600 and not meta.has_logits and len(meta.domains) == 3
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "600" in text and "4 layers x 32 experts, top-4" in text and "logits no" in text
    assert "the top 4 experts of a layer (10 %)" in text
    assert main(["info", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 600
    assert summary["prefill_tokens"] + summary["decode_tokens"] == 600
    assert summary["prefill_tokens"] == int((chunk.phase == 0).sum())
    assert summary["sequences"] == np.unique(chunk.seq).size
    assert sum(summary["domains"].values()) == 600 and set(summary["domains"]) <= set(meta.domains)
    share = summary["top_experts_call_share"]
    assert 0.1 < share["min"] <= share["median"] <= share["max"] <= 1
    assert summary["decode_hit_rate"] is None and summary["has_logits"] is False


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "t.parquet"
    out.write_bytes(b"keep me")
    assert main(["synth", str(out), *SYNTH]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err and err.startswith("moe-trace: error: ")
    assert out.read_bytes() == b"keep me"
    assert main(["synth", str(out), *SYNTH, "--force"]) == 0
    assert read_trace(out)[1].num_tokens == 600


@pytest.mark.parametrize("args, words", [
    (["--top-k", "40"], "'top_k' (--top-k)"),
    (["--reuse", "1.5"], "'reuse' (--reuse)"),
    (["--domains", "0"], "'domains' (--domains)"),
])
def test_bad_synth_options_exit_2_and_write_nothing(tmp_path, capsys, args, words):
    out = tmp_path / "t.parquet"
    assert main(["synth", str(out), *SYNTH, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
    assert list(tmp_path.iterdir()) == []


def test_missing_output_directory_and_missing_input(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "no" / "t.parquet"), *SYNTH]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "absent.parquet")]) == 2
    assert main(["import", "route-csv", str(tmp_path / "absent.csv"), str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "no such" in err
    assert list(tmp_path.iterdir()) == []


def test_console_entry_point(tmp_path):
    out = tmp_path / "t.parquet"
    run = [sys.executable, "-m", "traces.cli"]
    done = subprocess.run([*run, "synth", str(out), *SYNTH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*run, "info", str(tmp_path / "x.parquet")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1


@pytest.mark.skipif(not SHARED_ROUTE.exists(), reason="the shared route trace is not beside the repo")
def test_import_route_csv_and_recorded_hit_rate(tmp_path, capsys):
    out = tmp_path / "qwen3.parquet"
    assert main(["import", "route-csv", str(SHARED_ROUTE), str(out)]) == 0
    for path in (out, SHARED_ROUTE):  # info reads the imported trace and the CSV itself
        assert main(["info", str(path)]) == 0
        text = capsys.readouterr().out
        assert "decode hit rate 80.3 % (29,597 of 36,864 decode calls)" in text, text
        assert "156: 28 prefill in 1 batches, 128 decode" in text
    assert main(["info", str(out), "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)["decode_hit_rate"]
    assert (hit["hits"], hit["calls"]) == (29_597, 36_864)


def test_info_verify_and_repack_of_a_file_without_hashes(tmp_path, capsys):
    out = tmp_path / "t.parquet"
    assert main(["synth", str(out), *SYNTH, "--logits", "full"]) == 0
    assert main(["info", str(out)]) == 0
    assert "content hash sha256:" in capsys.readouterr().out
    assert main(["info", str(out), "--verify"]) == 0
    assert "and every page checksum verified" in capsys.readouterr().out
    older = tmp_path / "older.parquet"  # as earlier versions wrote it: no hashes, no checksums
    pq.write_table(pq.read_table(out).replace_schema_metadata(pq.read_schema(out).metadata), older)
    assert main(["info", str(older)]) == 0
    assert "no content hash or page checksums" in capsys.readouterr().out
    assert main(["info", str(older), "--verify"]) == 2
    assert "records no content hash" in capsys.readouterr().err
    again = tmp_path / "again.parquet"
    assert main(["repack", str(older), str(again)]) == 0
    assert main(["info", str(again), "--verify", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verified"] and summary["content_hash"] == recorded_content_hash(out)
    a, b = read_trace(out)[1], read_trace(again)[1]
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("experts", "gates", "logits", "seq"))


@pytest.mark.parametrize("make", ["directory", "fifo"])
def test_out_that_is_not_a_regular_file_is_refused_even_with_force(tmp_path, capsys, make):
    out = tmp_path / "out"
    out.mkdir() if make == "directory" else os.mkfifo(out)
    for force in ([], ["--force"]):
        assert main(["synth", str(out), *SYNTH, *force]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("is a directory" in err or "not a regular file" in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
