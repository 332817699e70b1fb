"""The decoded trace cache: identical chunks, re-used without Parquet, safe under concurrency,
keyed by content and checked when opened."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from table_cases import with_values

import simulator.trace_cache as trace_cache
from simulator.engine import simulate
from simulator.run import build_params, compose
from simulator.trace_cache import cache_root, cached_source
from traces.errors import InputError
from traces.format import open_trace, recorded_content_hash, write_trace


@pytest.fixture
def trace_file(tiny_trace, tmp_path):
    source = tiny_trace(tokens=150, seed=4)
    path = tmp_path / "trace.parquet"
    write_trace(path, source.meta, source.chunk)
    return path


def built(path, cache_dir):
    """A cached source whose copy is in place (built now if it was not)."""
    source = cached_source(path, cache_dir)
    source.build()
    return source


def assert_same_chunks(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if u is None or v is None:
                assert u is None and v is None, f.name
                continue
            assert u.dtype == v.dtype and u.shape == v.shape, f.name
            assert np.array_equal(u, v, equal_nan=True), f.name


@pytest.mark.parametrize("max_tokens", [None, 1, 7, 40, 1000])
def test_cached_chunks_equal_the_readers(trace_file, tmp_path, max_tokens):
    cached = cached_source(trace_file, tmp_path / "c")
    with open_trace(trace_file) as reader:
        assert cached.meta == reader.meta and cached.num_tokens == reader.num_tokens
        assert_same_chunks(cached.iter_chunks(max_tokens), reader.iter_chunks(max_tokens))
        assert_same_chunks(cached.iter_chunks_reversed(max_tokens),
                           reader.iter_chunks_reversed(max_tokens))


def test_a_run_that_reads_no_logits_takes_fewer_larger_chunks_of_the_copy(trace_file, tmp_path, monkeypatch):
    """Chunks of the copy are views: sized by what a run decodes, so one without logits makes
    fewer kernel calls; the rows are the same."""
    import traces.format as fmt

    source = built(trace_file, tmp_path / "c")
    # ~10 tokens per chunk with logits (3 layers x 16 experts x 4 bytes each), ~50 without
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 10 * fmt._token_bytes(source.meta, 8, 4, 27))
    with_logits = list(source.iter_chunks())
    without = list(source.iter_chunks(logits=False))
    assert len(without) * 3 < len(with_logits)
    for name in ("experts", "gates", "group"):
        assert np.array_equal(np.concatenate([getattr(c, name) for c in with_logits]),
                              np.concatenate([getattr(c, name) for c in without]))
    # logit ids to walk (order_r) are computed from the logits the first time (chunks sized with
    # them), then read from the kept order like the selections
    first = list(source.iter_chunks(logits=False, order_r=4))
    again = list(source.iter_chunks(logits=False, order_r=4))
    assert len(first) == len(with_logits) and len(again) == len(without)
    assert np.array_equal(np.concatenate([c.logit_order for c in first]),
                          np.concatenate([c.logit_order for c in again]))
    # dense logits as stored (float16) are views of the copy: sized as the selections
    stored = list(source.iter_chunks(logits="float16"))
    assert len(stored) == len(without) and stored[0].logits.dtype == np.float16


def test_stored_ids_are_the_int16_ids_of_every_source(trace_file, tmp_path):
    """stored_ids=True: the reader and the cache give the ids as stored (int16), the same values;
    the same chunks otherwise; the engine's results do not change with them."""
    cached = cached_source(trace_file, tmp_path / "c")
    list(cached.iter_chunks())  # builds the copy
    with open_trace(trace_file) as reader:
        for source in (reader, cached):
            for wide, narrow in zip(source.iter_chunks(7), source.iter_chunks(7, stored_ids=True), strict=True):
                assert wide.experts.dtype == np.int32 and narrow.experts.dtype == np.int16
                assert np.array_equal(wide.experts, narrow.experts)
                narrow.experts = wide.experts
                assert_same_chunks([wide], [narrow])
        cfg = OmegaConf.to_container(compose(["policy=quality_first", "cache.fraction=0.25"]), resolve=True)
        params = build_params(cfg, reader.meta)[0]
        by_engine = [simulate(s, params, engine=e) for s in (reader, cached) for e in ("numba", "reference")]
    for r in by_engine[1:]:
        assert np.array_equal(r.time_us, by_engine[0].time_us) and np.array_equal(r.layer_hits, by_engine[0].layer_hits)


def test_second_open_reuses_the_copy_without_parquet(trace_file, tmp_path, monkeypatch):
    first = cached_source(trace_file, tmp_path / "c")
    assert first.built
    assert sum(c.num_tokens for c in first.iter_chunks()) == 150  # the first pass builds the copy

    def no_parquet(path):
        raise AssertionError("the Parquet file was parsed again")

    monkeypatch.setattr(trace_cache, "open_trace", no_parquet)
    again = cached_source(trace_file, tmp_path / "c")
    assert not again.built and again.directory == first.directory
    assert_same_chunks(again.iter_chunks(), first.iter_chunks())


def test_the_key_is_the_content(trace_file, tmp_path, tiny_trace):
    a = cached_source(trace_file, tmp_path / "c")
    copy = tmp_path / "elsewhere.parquet"
    copy.write_bytes(trace_file.read_bytes())
    assert cached_source(copy, tmp_path / "c").directory == a.directory
    other = tiny_trace(tokens=150, seed=5)
    write_trace(trace_file, other.meta, other.chunk)  # new content at the same path
    b = cached_source(trace_file, tmp_path / "c")
    assert b.built and b.directory != a.directory


def test_concurrent_builds_leave_one_complete_copy(trace_file, tmp_path):
    with ThreadPoolExecutor(4) as pool:
        sources = list(pool.map(lambda _: built(trace_file, tmp_path / "c"), range(4)))
    root = cache_root(tmp_path / "c")
    assert len({s.directory for s in sources}) == 1
    assert len(list(root.glob("[0-9a-f]*"))) == 1 and not list(root.glob(".build-*"))
    for s in sources[1:]:
        assert_same_chunks(s.iter_chunks(), sources[0].iter_chunks())


def test_cache_dir_from_environment(trace_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env" / "traces"
    assert cached_source(trace_file).directory.parent == tmp_path / "env" / "traces"


def test_simulating_from_the_cache_equals_the_reader(trace_file, tmp_path):
    cached = cached_source(trace_file, tmp_path / "c")
    for overrides in (["policy=quality_first"], ["policy=fetch_all", "cache.eviction=belady"]):
        cfg = OmegaConf.to_container(compose(overrides), resolve=True)
        params = build_params(cfg, cached.meta)[0]
        with open_trace(trace_file) as reader:
            a = simulate(reader, params, chunk_tokens=32)
        b = simulate(cached, params, chunk_tokens=32)
        assert np.array_equal(a.time_us, b.time_us) and np.array_equal(a.layer_hits, b.layer_hits)


def test_chunks_from_the_copy_are_not_checked_again_but_other_sources_are(trace_file, tmp_path, monkeypatch):
    """The copy holds what the validating reader decoded: simulate() skips check_chunk for it
    (a pass over the copy or the first, building one) and still checks a plain source's chunks."""
    import simulator.engine as engine
    from traces.format import ArraySource, concat_chunks

    checked = []
    monkeypatch.setattr(engine, "check_chunk", lambda chunk, params: checked.append(chunk.num_tokens))
    cached = cached_source(trace_file, tmp_path / "c")  # not built: this pass builds it
    params = build_params(OmegaConf.to_container(compose(["policy=fetch_all"]), resolve=True), cached.meta)[0]
    first = simulate(cached, params, chunk_tokens=32)
    again = simulate(cached_source(trace_file, tmp_path / "c"), params, chunk_tokens=32)
    assert checked == [] and np.array_equal(first.time_us, again.time_us)
    with open_trace(trace_file) as reader:
        plain = ArraySource(reader.meta, concat_chunks(list(reader.iter_chunks())))
    simulate(plain, params, chunk_tokens=32)
    assert sum(checked) == plain.num_tokens


# --- integrity: keyed by content, verified when opened ------------------------------------------


def legacy_copy(path: Path, out: Path) -> Path:
    """``path`` written again without the content and metadata hashes, as older versions wrote."""
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), out)
    assert recorded_content_hash(out) is None
    return out


def test_an_edited_cached_array_with_its_mtime_restored_is_rebuilt_with_one_warning(trace_file, tmp_path,
                                                                                   capfd):
    first = built(trace_file, tmp_path / "c")
    capfd.readouterr()  # the first build announces its copy
    gates = first.directory / "gates.npy"
    st = gates.stat()
    data = bytearray(gates.read_bytes())
    data[-4:] = np.float32(0.5).tobytes()  # same size, a plausible value
    gates.write_bytes(bytes(data))
    os.utime(gates, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = built(trace_file, tmp_path / "c")
    err = capfd.readouterr().err
    assert again.built and err.count("\n") == 1 and "CRC-32" in err and "'gates'" in err
    with open_trace(trace_file) as reader:
        assert_same_chunks(again.iter_chunks(), reader.iter_chunks())
    assert not cached_source(trace_file, tmp_path / "c").built and capfd.readouterr().err == ""


@pytest.mark.parametrize("damage", ["truncated array", "garbage manifest", "old layout", "missing array"])
def test_a_damaged_or_stale_copy_is_rebuilt_with_one_warning(trace_file, tmp_path, capfd, damage):
    first = built(trace_file, tmp_path / "c")
    capfd.readouterr()  # the first build announces its copy
    manifest = first.directory / "manifest.json"
    if damage == "truncated array":
        experts = first.directory / "experts.npy"
        experts.write_bytes(experts.read_bytes()[:-100])
    elif damage == "garbage manifest":
        manifest.write_text("{not json")
    elif damage == "old layout":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "layout_version": 1}))
    else:
        (first.directory / "pos.npy").unlink()
    again = built(trace_file, tmp_path / "c")
    err = capfd.readouterr().err
    assert again.built and err.count("\n") == 1 and err.startswith("warning: trace cache ")
    with open_trace(trace_file) as reader:
        assert_same_chunks(again.iter_chunks(7), reader.iter_chunks(7))


def test_a_copied_cache_is_checked_once_then_trusted(trace_file, tmp_path, capfd, monkeypatch):
    first = built(trace_file, tmp_path / "c")
    capfd.readouterr()  # the first build announces its copy
    shutil.copytree(tmp_path / "c", tmp_path / "copy")  # new inodes: every identity differs
    checked = []
    crc32 = trace_cache._crc32
    monkeypatch.setattr(trace_cache, "_crc32", lambda path: checked.append(path.name) or crc32(path))
    copy = cached_source(trace_file, tmp_path / "copy")
    assert not copy.built and len(checked) == len(json.loads((first.directory / "manifest.json").read_text())["arrays"])
    checked.clear()
    assert not cached_source(trace_file, tmp_path / "copy").built and checked == []
    assert capfd.readouterr().err == ""


def test_a_trace_rewritten_in_place_with_its_mtime_restored_is_not_served_stale(tiny_trace, tmp_path):
    """Keyed by the recorded content hash; a file without one by its bytes, remembered per inode
    change time (which no rewrite can restore)."""
    path = tmp_path / "trace.parquet"
    write_trace(path, tiny_trace(tokens=150, seed=4).meta, tiny_trace(tokens=150, seed=4).chunk)
    legacy = legacy_copy(path, tmp_path / "legacy.parquet")
    for trace in (path, legacy):
        before = built(trace, tmp_path / "c")
        st = trace.stat()
        data = trace.read_bytes()
        at = data.rindex(b'"model": "synthetic"')  # the footer's metadata: same length, valid
        with open(trace, "r+b") as f:  # the same inode
            f.seek(at + len(b'"model": "'))
            f.write(b"SYNTHETIC")
        os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns))
        if trace == path:  # the recorded hashes no longer match: refused, never served
            with pytest.raises(InputError, match="does not match its recorded SHA-256"):
                cached_source(trace, tmp_path / "c")
            continue
        after = built(trace, tmp_path / "c")
        assert before.meta.model == "synthetic" and after.meta.model == "SYNTHETIC"
        assert after.built and after.directory != before.directory


def test_a_trace_whose_content_does_not_match_its_hash_is_not_cached(trace_file, tmp_path):
    table = pq.read_table(trace_file)
    kv = dict(pq.read_metadata(trace_file).metadata)
    kv.pop(b"ARROW:schema")
    table = with_values(table, "weights", lambda w: w.__setitem__((0, 0), 2 * w[0, 0]))  # still a valid weight
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(table.replace_schema_metadata(kv), damaged)
    with pytest.raises(InputError, match="does not match the hash the file records"):
        built(damaged, tmp_path / "c")
    root = cache_root(tmp_path / "c")
    assert [p.name for p in root.iterdir() if p.name != "hashes"] == []


@pytest.mark.parametrize("failing_write", [1, 3])
def test_a_write_failing_in_the_writing_thread_is_one_error_and_leaves_no_copy(trace_file, tmp_path,
                                                                              monkeypatch, failing_write):
    """The copy's arrays are written by a thread of its own; a disk-full error there stops the
    streaming first run with the one error line, and neither a copy nor a build folder remains."""
    calls = {"n": 0}
    append = trace_cache._NpyWriter.append

    def full(self, value):
        calls["n"] += 1
        if calls["n"] == failing_write:
            raise OSError(28, "No space left on device")
        append(self, value)

    monkeypatch.setattr(trace_cache._NpyWriter, "append", full)
    cache = tmp_path / "c"
    source = cached_source(trace_file, cache)
    with pytest.raises(InputError, match="cannot be written \\(No space left on device\\); free disk space"):
        list(source.iter_chunks(7))  # small chunks: the error comes while the first run streams
    assert not source.directory.exists()  # no copy in place
    assert not [p for p in cache.rglob("*") if p.is_dir() and p.name.startswith(("build", ".build"))]
    monkeypatch.setattr(trace_cache._NpyWriter, "append", append)
    assert_same_chunks(cached_source(trace_file, cache).iter_chunks(7), open_trace(trace_file).iter_chunks(7))
