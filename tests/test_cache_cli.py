"""The trace cache says what it writes: one line with the copy's path and size when it builds
one, nothing when it re-uses one; ``moe-trace cache list`` and ``clear`` show and remove copies."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator import trace_cache
from traces.cli import main
from traces.format import write_trace
from traces.synth import synth_trace


def _trace(path: Path, seed: int) -> Path:
    meta, chunk = synth_trace(tokens=200, layers=2, experts=8, top_k=2, seed=seed, logits="full")
    write_trace(path, meta, chunk)
    return path


@pytest.fixture
def traces(tmp_path) -> list[Path]:
    return [_trace(tmp_path / f"t{i}.parquet", i) for i in range(2)]


def _build(path: Path, cache: Path) -> trace_cache.CachedTrace:
    source = trace_cache.cached_source(path, cache)
    source.build()
    return source


def test_a_built_copy_is_announced_once_with_its_path_and_size(traces, tmp_path, capsys):
    cache = tmp_path / "cache"
    source = _build(traces[0], cache)
    (line,) = capsys.readouterr().err.splitlines()
    size = sum(p.stat().st_size for p in source.directory.rglob("*") if p.is_file())
    assert line.startswith(f"trace cache: decoded {traces[0]} into {source.directory} (")
    assert f"({size / 2**20:.1f} MiB)" in line and "the cache holds 1 copy" in line
    assert "moe-trace cache list | clear" in line
    _build(traces[0], cache)  # re-used: nothing to say
    assert capsys.readouterr().err == ""
    _build(traces[1], cache)
    assert "the cache holds 2 copies" in capsys.readouterr().err


def test_cache_list_shows_every_copy_and_clear_removes_them(traces, tmp_path, capsys):
    cache = tmp_path / "cache"
    built = [_build(t, cache) for t in traces]
    capsys.readouterr()
    assert main(["cache", "list", "--json", "--cache-dir", str(cache)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(e["trace"] for e in listed) == sorted(str(t.resolve()) for t in traces)
    assert all(e["tokens"] == 200 and e["bytes"] > 0 for e in listed)
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 3 and text[-1].startswith("2 decoded copies, ")
    key = built[0].directory.name
    assert main(["cache", "clear", key[:10], "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.startswith("removed 1 decoded copy, ")
    assert not built[0].directory.exists() and built[1].directory.exists()
    assert main(["cache", "clear", "--cache-dir", str(cache)]) == 0
    assert [p.name for p in trace_cache.cache_root(cache).iterdir()] == []


def test_clearing_an_unknown_key_is_one_line_and_removes_nothing(traces, tmp_path, capsys):
    cache = tmp_path / "cache"
    copy = _build(traces[0], cache)
    capsys.readouterr()
    assert main(["cache", "clear", "nosuchkey", "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no copy has a key starting with 'nosuchkey'" in err
    assert copy.directory.exists()


def test_the_cache_directory_follows_moe_sim_cache(traces, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "env"))
    _build(traces[0], None)
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "env" / "traces"))
