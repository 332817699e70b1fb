"""The trace side under bad input and faults: every case ends in exit 2 with one stderr line and
no output, or in a correct result.

Table-driven cases reproduce each finding of the fuzz campaign that falls to the trace format,
the moe-trace command, the route-CSV importer and the trace cache; property-based cases
(Hypothesis, bounded) flip bits, mutate metadata, CSV cells and hardware profiles at random.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from table_cases import list_form

import simulator.trace_cache as trace_cache
import traces.format as trace_format
from simulator.hardware import validate_profile
from traces.cli import main
from traces.errors import InputError
from traces.format import (
    CONTENT_KEY,
    META_HASH_KEY,
    META_KEY,
    TraceChunk,
    TraceMeta,
    open_trace,
    read_trace,
)

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "traces" / "samples" / "fixture.parquet"
SMALL = ["--tokens", "120", "--layers", "3", "--experts", "16", "--top-k", "2", "--seed", "5",
         "--domains", "2", "--logits", "full"]
FUZZ = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def cli(*args) -> tuple[int, str, str]:
    """moe-trace in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def assert_refused(result: tuple[int, str, str], *words: str) -> str:
    code, out, err = result
    assert code == 2 and out == "" and err.count("\n") == 1, result
    assert err.startswith("moe-trace: error: ") and all(w in err for w in words), (words, err)
    return err


def chunks_equal(a: TraceChunk, b: TraceChunk) -> bool:
    return all((getattr(a, f.name) is None and getattr(b, f.name) is None)
               or np.array_equal(getattr(a, f.name), getattr(b, f.name), equal_nan=True)
               for f in fields(TraceChunk))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("small") / "small.parquet"
    assert cli("synth", path, *SMALL)[0] == 0
    return path


def rewritten(good: Path, out: Path, table: pa.Table | None = None, meta: dict | None = None) -> Path:
    """``good`` written again by hand (no content hash, no metadata hash), optionally changed."""
    table = table if table is not None else pq.read_table(good)
    kv = dict(pq.read_schema(good).metadata)
    for key in (CONTENT_KEY, META_HASH_KEY):
        kv.pop(key, None)
    if meta is not None:
        kv[META_KEY] = json.dumps(meta).encode()
    pq.write_table(table.replace_schema_metadata(kv), out)
    return out


def meta_of(path: Path, **changes) -> dict:
    return {**json.loads(pq.read_schema(path).metadata[META_KEY]), **changes}


def with_null(table: pa.Table, name: str, row: int, entry: int | None = None) -> pa.Table:
    """The table with row ``row`` of column ``name`` null (or, with ``entry``, one list entry; a
    column of bytes is rewritten in its list form, which readers also take, to hold one)."""
    column = table.column(name).combine_chunks()
    if entry is not None and pa.types.is_fixed_size_binary(column.type):
        column = list_form(column, name)
    if entry is None or not pa.types.is_fixed_size_list(column.type):
        mask = pa.array(np.arange(len(column)) == row)
        changed = pc.if_else(mask, pa.scalar(None, column.type), column)
    else:
        width = column.type.list_size
        values = column.flatten()
        mask = pa.array(np.arange(len(values)) == row * width + entry)
        child = pc.if_else(mask, pa.scalar(None, values.type), values)
        changed = pa.FixedSizeListArray.from_arrays(child, width)
    index = table.schema.get_field_index(name)
    return table.set_column(index, pa.field(name, changed.type, nullable=True), changed)


# --- the campaign's findings, one case each -----------------------------------------------------

def _table_case(change):
    return lambda good, out: rewritten(good, out, change(pq.read_table(good)))


def _meta_case(**changes):
    return lambda good, out: rewritten(good, out, meta=meta_of(good, **changes))


def _set_weights(table: pa.Table, value: float) -> pa.Table:
    column = table.column("weights").combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        column = list_form(column, "weights")
    values = column.flatten().to_numpy().copy()
    values[: 2 * 2] = value  # the first two rows' top-2 weights
    array = pa.FixedSizeListArray.from_arrays(pa.array(values), 2)
    return table.set_column(table.schema.get_field_index("weights"), "weights", array)


REFUSED_FILES = {
    # name: (make the bad file from the good one, words the one line must contain)
    "null expert id": (_table_case(lambda t: with_null(t, "experts", 7, 1)), ["'experts'", "null"]),
    "null experts list": (_table_case(lambda t: with_null(t, "experts", 7)), ["'experts'", "null"]),
    "null weight": (_table_case(lambda t: with_null(t, "weights", 9, 0)), ["'weights'", "null"]),
    "null logits": (_table_case(lambda t: with_null(t, "logits", 4)), ["'logits'", "null"]),
    "null domain": (_table_case(lambda t: with_null(t, "domain", 30)), ["'domain'", "null"]),
    "null phase": (_table_case(lambda t: with_null(t, "phase", 30)), ["'phase'", "null"]),
    "null seq": (_table_case(lambda t: with_null(t, "seq", 0)), ["'seq'", "null"]),
    "expert_bytes 2^62": (_meta_case(expert_bytes=[2**62] * 3), ["'expert_bytes'", "above the cap"]),
    "num_experts 10^9": (_meta_case(num_experts=10**9), ["'num_experts'", "above the cap 32,767"]),
    "num_layers beyond int64": (_meta_case(num_layers=2**70), ["'num_layers'", "above the cap"]),
    "top_k beyond num_experts": (_meta_case(top_k=17), ["'top_k'"]),
    "dense_bytes negative": (_meta_case(dense_bytes=[-1, 0, 0]), ["'dense_bytes'", "below 0"]),
    "logits_top_r beyond int64": (_meta_case(logits_top_r=2**64), ["'logits_top_r'"]),
    "num_experts a float": (_meta_case(num_experts=1e30), ["'num_experts'", "expected int"]),
    "deeply nested extra": (lambda good, out: rewritten(good, out, meta=None) and _raw_meta(
        out, b'{"extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), ["'moe_trace'", "JSON"]),
    "zero rows": (_table_case(lambda t: t.slice(0, 0)), ["no rows"]),
    "metadata edited, hash kept": (lambda good, out: _raw_meta(
        out, pq.read_schema(good).metadata[META_KEY].replace(b"synthetic", b"synthetiq"), good),
        ["does not match its recorded SHA-256"]),
}


def _raw_meta(out: Path, text: bytes, good: Path | None = None) -> Path:
    """``out`` (or ``good`` copied) with the metadata JSON replaced by ``text``, other keys kept."""
    source = good if good is not None else out
    table = pq.read_table(source)
    kv = {**pq.read_schema(source).metadata, META_KEY: text}
    if good is not None:  # keep the writer's hashes: the edit must be caught by them
        recorded = pq.read_metadata(good).metadata
        kv.update({key: recorded[key] for key in (META_HASH_KEY, CONTENT_KEY)})
    pq.write_table(table.replace_schema_metadata(kv), out)
    return out


@pytest.mark.parametrize("case", sorted(REFUSED_FILES))
def test_each_bad_file_exits_2_with_one_line_and_writes_nothing(case, small, tmp_path):
    make, words = REFUSED_FILES[case]
    bad = make(small, tmp_path / "bad.parquet")
    before = sorted(tmp_path.iterdir())
    assert_refused(cli("info", bad), *words)
    with pytest.raises(InputError):
        read_trace(bad)
    assert_refused(cli("repack", bad, tmp_path / "out.parquet"))
    assert sorted(tmp_path.iterdir()) == before


def test_gate_weights_near_float32_max_normalise_instead_of_becoming_0(small, tmp_path):
    bad = rewritten(small, tmp_path / "big.parquet", _set_weights(pq.read_table(small), 3e38))
    _, chunk = read_trace(bad)
    assert chunk.gates[0, 0].tolist() == [0.5, 0.5] and chunk.gates[0, 1].tolist() == [0.5, 0.5]
    assert np.isfinite(chunk.gates).all()
    np.testing.assert_allclose(chunk.gates.sum(-1), 1.0, rtol=1e-6)


def test_a_content_change_behind_valid_metadata_is_caught_by_verify(small, tmp_path):
    table = pq.read_table(small)
    column = table.column("experts").combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        column = list_form(column, "experts")
    values = column.flatten().to_numpy().copy()
    values[[0, 1]] = values[[1, 0]]  # swap the first token-layer's two experts: still valid
    table = table.set_column(table.schema.get_field_index("experts"), "experts",
                             pa.FixedSizeListArray.from_arrays(pa.array(values), 2))
    kv = dict(pq.read_metadata(small).metadata)
    kv.pop(b"ARROW:schema")
    changed = tmp_path / "swapped.parquet"
    pq.write_table(table.replace_schema_metadata(kv), changed)
    assert cli("info", changed)[0] == 0  # every value is plausible
    assert_refused(cli("info", changed, "--verify"), "changed or damaged")
    code, out, _ = cli("info", small, "--verify")
    assert code == 0 and "verified" in out


def test_control_characters_in_metadata_are_escaped_when_printed(small, tmp_path):
    bad = rewritten(small, tmp_path / "ansi.parquet",
                    meta=meta_of(small, model="evil\x1b[2J\x07name\ud800", domains=["a\nb", "c\rd"]))
    code, out, err = cli("info", bad)
    assert code == 0 and err == ""
    assert not any(ch in out for ch in "\x1b\x07\r\ud800") and "evil\\x1b[2J\\x07name\\ud800" in out
    assert "a\\nb" in out
    code, out, _ = cli("info", bad, "--json")
    assert code == 0 and json.loads(out)["model"] == "evil\x1b[2J\x07name\ud800"


def test_special_files_are_refused_at_once_without_reading(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "traces.cli", "info", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done
        assert "not a regular file" in done.stderr and time.monotonic() - start < 30
    assert_refused(cli("import", "route-csv", fifo, tmp_path / "o.parquet"), "named pipe")
    assert_refused(cli("repack", "/dev/zero", tmp_path / "o.parquet"), "character device")
    assert not (tmp_path / "o.parquet").exists()


# --- memory: estimated before anything is allocated ---------------------------------------------

def _capped(limit_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


@pytest.fixture(scope="module")
def memory_cap() -> int:
    """An address-space cap 200 MiB above what importing moe-trace takes."""
    probe = subprocess.run([sys.executable, "-c", "import traces.cli; print(open('/proc/self/status').read())"],
                           capture_output=True, text=True, timeout=120, check=True)
    peak_kib = next(int(line.split()[1]) for line in probe.stdout.splitlines() if line.startswith("VmPeak"))
    return peak_kib * 1024 + 200 * 2**20


def _capped_cli(limit: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traces.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_capped(limit))


def _claiming(small: Path, out: Path, *, layers: int, experts: int, top_r: int = 0) -> Path:
    """A one-token trace whose metadata claims a huge shape (tiny on disk: constant columns);
    with ``top_r``, that many logits per layer, which decode to all ``experts``."""
    rows = layers

    def lists(dtype, width: int) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(rows * width, dtype)), width)

    columns = {"seq": pa.array(np.zeros(rows, np.int32)), "pos": pa.array(np.zeros(rows, np.int32)),
               "layer": pa.array(np.arange(rows, dtype=np.int16)), "phase": pa.array(np.ones(rows, np.int8)),
               "experts": lists(np.int16, 1), "weights": lists(np.float32, 1)}
    if top_r:
        columns.update(logits=lists(np.float16, top_r), logit_ids=lists(np.int16, top_r))
    meta = dict(meta_of(small), num_layers=layers, num_experts=experts, top_k=1, expert_bytes=[1] * layers,
                dense_bytes=[], layer_ids=[], domains=[], has_logits=bool(top_r), logits_top_r=top_r)
    return rewritten(small, out, pa.table(columns), meta=meta)


def test_a_1_kb_file_claiming_10_9_experts_exits_2_under_a_200_mb_cap(small, tmp_path, memory_cap):
    bomb = rewritten(small, tmp_path / "bomb.parquet", pq.read_table(small).slice(0, 3),
                     meta=meta_of(small, num_experts=10**9))
    assert bomb.stat().st_size < 8192
    done = _capped_cli(memory_cap, "info", bomb)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "'num_experts'" in done.stderr, done
    assert _capped_cli(memory_cap, "info", small).returncode == 0  # the cap leaves room for real work


def test_shapes_within_the_caps_are_refused_by_the_memory_estimate(small, tmp_path, memory_cap):
    summary = _claiming(small, tmp_path / "wide.parquet", layers=32767, experts=32767)
    decode = _claiming(small, tmp_path / "logits.parquet", layers=32767, experts=32767, top_r=1)
    for bomb in (summary, decode):
        assert bomb.stat().st_size < 2**20
        done = _capped_cli(memory_cap, "info", bomb)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done
        assert "needs about" in done.stderr and "GiB available" in done.stderr


ROUTE_HEADER = ["# route_trace v1",
                "# model=/m/Tiny-Q8_0.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
                "# layer=0 expert_bytes=100 dense_bytes=10", "# layer=1 expert_bytes=200 dense_bytes=20",
                "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"]
ROUTE_ROWS = ["0,1,0,0,0,1,0.6,1,0", "0,1,0,0,1,2,0.4,0,100", "0,1,0,1,0,3,0.7,0,200",
              "0,1,0,1,1,0,0.3,1,0", "0,1,1,0,0,2,0.5,0,100", "0,1,1,0,1,1,0.5,1,0",
              "0,1,1,1,0,0,0.9,1,0", "0,1,1,1,1,3,0.1,0,200"]


def route_csv(path: Path, header=ROUTE_HEADER, rows=ROUTE_ROWS) -> Path:
    path.write_text("\n".join([*header, *rows]) + "\n")
    return path


def test_route_csv_headers_claiming_huge_shapes_exit_2_under_the_cap(tmp_path, memory_cap):
    for field, words in (("n_expert=1000000000", "n_expert=1000000000"),
                         ("n_layer=10000000000", "n_layer=10000000000")):
        header = [ROUTE_HEADER[0], f"# model=m {field} " + " ".join(
            f for f in ("n_layer=2", "n_expert=4", "n_expert_used=2") if f.split("=")[0] != field.split("=")[0]),
                  *ROUTE_HEADER[2:]]
        bomb = route_csv(tmp_path / "bomb.csv", header)
        for args in (("info", bomb), ("import", "route-csv", bomb, tmp_path / "o.parquet")):
            done = _capped_cli(memory_cap, *args)
            assert done.returncode == 2 and done.stderr.count("\n") == 1, done
            assert words in done.stderr and "above the cap" in done.stderr
        assert not (tmp_path / "o.parquet").exists()


# --- route CSV ---------------------------------------------------------------------------------

ROUTE_CASES = {
    "header and no rows": (ROUTE_HEADER, [], ["no data rows"]),
    "int beyond int64": (ROUTE_HEADER, [*ROUTE_ROWS[:3], "0,1,0,1,1,99999999999999999999,0.3,1,0"],
                         ["line 9", "'expert'", "int64"]),
    "a 2 MB line": (ROUTE_HEADER, [*ROUTE_ROWS[:2], "0,1,0," + "7" * 2_000_000], ["line 8"]),
    "a 2 MB field": (ROUTE_HEADER, [*ROUTE_ROWS[:2], "0,1,0,1,0,x" + "y" * 2_000_000 + ",0.7,0,200",
                                    *ROUTE_ROWS[3:]], ["line 8", "'expert'"]),
    "expert_bytes beyond the cap": ([*ROUTE_HEADER[:2], "# layer=0 expert_bytes=4611686018427387904 dense_bytes=1",
                                     *ROUTE_HEADER[3:]], ROUTE_ROWS, ["line 3", "expert_bytes", "above the cap"]),
    "n_expert_used beyond n_expert": ([ROUTE_HEADER[0], "# model=m n_layer=2 n_expert=4 n_expert_used=9",
                                       *ROUTE_HEADER[2:]], ROUTE_ROWS, ["n_expert_used=9"]),
}


@pytest.mark.parametrize("case", sorted(ROUTE_CASES))
def test_route_csv_errors_give_the_line_and_stay_short(case, tmp_path):
    header, rows, words = ROUTE_CASES[case]
    path = route_csv(tmp_path / "r.csv", header, rows)
    err = assert_refused(cli("import", "route-csv", path, tmp_path / "o.parquet"), *words)
    assert len(err) < 700, len(err)
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]


def test_info_on_a_csv_that_is_not_a_route_trace_says_so(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("turn,phase,step\n" + "1,2,3\n" * 10)
    assert_refused(cli("info", path), "CSV", "'turn,phase,step'", "route_trace v1")
    path.write_bytes(b"\x00\x01binary")
    assert_refused(cli("info", path), "not a Parquet file")


def test_import_to_a_directory_is_one_line_and_leaves_no_temporary(tmp_path):
    src = route_csv(tmp_path / "r.csv")
    out = tmp_path / "out"
    out.mkdir()
    for extra in ([], ["--force"]):
        assert_refused(cli("import", "route-csv", src, out, *extra), "is a directory")
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.csv"]
    assert cli("import", "route-csv", src, out / "t.parquet")[0] == 0
    assert cli("import", "route-csv", src, out / "t.parquet", "--force")[0] == 0
    assert [p.name for p in out.iterdir()] == ["t.parquet"]


# --- disk full, permissions, killed writers -----------------------------------------------------

def _full_disk_temp(monkeypatch, tmp_path: Path) -> None:
    """Writers' temporaries become links to /dev/full: every write fails with ENOSPC."""
    made = iter(range(1000))

    def temp_path(path):
        link = Path(path).with_name(f".{Path(path).name}.full{next(made)}.tmp")
        link.symlink_to("/dev/full")
        return link

    monkeypatch.setattr(trace_format, "temp_path", temp_path)


@pytest.mark.parametrize("command", ["synth", "import", "repack"])
def test_a_full_disk_while_writing_is_one_line_naming_the_path(command, small, tmp_path, monkeypatch):
    src = route_csv(tmp_path / "r.csv")
    out = tmp_path / "o.parquet"
    args = {"synth": ["synth", out, *SMALL], "import": ["import", "route-csv", src, out],
            "repack": ["repack", small, out]}[command]
    _full_disk_temp(monkeypatch, tmp_path)
    assert_refused(cli(*args), str(out), "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


def test_a_permission_error_while_writing_is_one_line_naming_the_path(small, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(pq, "ParquetWriter", refuse)
    out = tmp_path / "o.parquet"
    assert_refused(cli("repack", small, out), str(out), "Permission denied")
    assert list(tmp_path.iterdir()) == []


def _kill_when(process: subprocess.Popen, appeared, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not appeared():
        assert process.poll() is None and time.monotonic() < deadline, "the writer ended first"
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_a_killed_synth_leaves_a_temporary_that_the_next_write_removes(tmp_path):
    out = tmp_path / "big.parquet"
    big = ["--tokens", "400000", "--layers", "8", "--experts", "64", "--top-k", "4", "--seed", "1"]
    writer = subprocess.Popen([sys.executable, "-m", "traces.cli", "synth", str(out), *big])
    _kill_when(writer, lambda: any(tmp_path.glob(f".{out.name}.*.tmp")))
    assert any(tmp_path.glob(f".{out.name}.*.tmp")) and not out.exists()
    assert cli("synth", out, *SMALL)[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_killed_cache_build_is_removed_by_the_next_run(small, tmp_path):
    slow = ("import sys, time, simulator.trace_cache as tc\n"
            "append = tc._NpyWriter.append\n"
            "tc._NpyWriter.append = lambda self, v: (time.sleep(0.02), append(self, v))\n"
            "tc.cached_source(sys.argv[1], sys.argv[2], max_tokens=1).build()\n")
    root = trace_cache.cache_root(tmp_path / "c")
    builder = subprocess.Popen([sys.executable, "-c", slow, str(small), str(tmp_path / "c")])
    _kill_when(builder, lambda: any(p.is_dir() for p in root.glob(".build-*")))
    assert any(root.glob(".build-*"))
    cached = trace_cache.cached_source(small, tmp_path / "c")
    assert not list(root.glob(".build-*")) and not list(root.glob(".*.tmp"))
    assert chunks_equal(next(cached.iter_chunks(10_000)), read_trace(small)[1])


def test_a_full_disk_while_building_the_cache_is_one_line_and_leaves_nothing(small, tmp_path, monkeypatch):
    def full(self, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trace_cache._NpyWriter, "append", full)
    with pytest.raises(InputError) as caught:
        trace_cache.cached_source(small, tmp_path / "c").build()
    message = str(caught.value)
    assert "\n" not in message and "No space left on device" in message
    assert str(trace_cache.cache_root(tmp_path / "c")) in message
    root = trace_cache.cache_root(tmp_path / "c")
    assert [p.name for p in root.iterdir() if p.name != "hashes"] == []


# --- page data: a flipped bit is detected or changes nothing ---------------------------------

def page_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of every column chunk's pages (headers and data) in the file."""
    md = pq.read_metadata(path)
    ranges = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(g).column(c)
            start = min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None)
            ranges.append((start, start + col.total_compressed_size))
    return ranges


def _flipped(data: bytes, offset: int, bit: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 1 << bit
    return bytes(b)


def _detected_or_equal(path: Path, original: tuple[TraceMeta, TraceChunk]) -> bool:
    """True if reading ``path`` fails with InputError; asserts it equals ``original`` otherwise."""
    try:
        meta, chunk = read_trace(path)
    except InputError:
        return True
    assert meta == original[0] and chunks_equal(chunk, original[1])
    with open_trace(path) as reader:
        reader.verify()
    return False


def test_random_bit_flips_in_the_page_data_of_a_committed_trace_are_detected(tmp_path):
    original = read_trace(FIXTURE)  # the bundled trace, as committed: page checksums, content hash
    data = FIXTURE.read_bytes()
    rng = np.random.default_rng(10)
    ranges = page_ranges(FIXTURE)
    detected = 0
    for _ in range(40):
        start, stop = ranges[int(rng.integers(len(ranges)))]
        bad = tmp_path / "flipped.parquet"
        bad.write_bytes(_flipped(data, int(rng.integers(start, stop)), int(rng.integers(8))))
        detected += _detected_or_equal(bad, original)
    assert detected >= 36  # the rest hit page statistics, which no reader uses


@FUZZ
@given(offset=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_bit_flip_anywhere_is_refused_or_changes_nothing(small, tmp_path, offset, bit):
    data = small.read_bytes()
    bad = tmp_path / "flip.parquet"
    bad.write_bytes(_flipped(data, offset % len(data), bit))
    code, out, err = cli("info", bad, "--verify")
    if code:
        assert_refused((code, out, err))
    else:
        assert chunks_equal(read_trace(bad)[1], read_trace(small)[1]) and "verified" in out


# --- metadata, nulls, CSV cells, profiles at random ---------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=8)
META_FIELDS = [f.name for f in fields(TraceMeta)] + ["unknown_field"]


@FUZZ
@given(name=st.sampled_from(META_FIELDS), value=JSON_VALUES)
def test_random_metadata_values_are_refused_or_read_as_written(small, tmp_path, name, value):
    meta = meta_of(small, **{name: value})
    bad = rewritten(small, tmp_path / "meta.parquet", meta=meta)
    code, out, err = cli("info", bad, "--json")
    if code:
        assert_refused((code, out, err))
    else:
        assert json.loads(out)["tokens"] == 120
        assert asdict(open_trace(bad).meta)[name] == value


@FUZZ
@given(name=st.sampled_from(["seq", "pos", "layer", "phase", "experts", "weights", "logits",
                             "domain"]), row=st.integers(0, 359), entry=st.integers(0, 15))
def test_a_null_anywhere_is_refused_naming_its_column(small, tmp_path, name, row, entry):
    table = pq.read_table(small)
    nested = pa.types.is_fixed_size_list(table.schema.field(name).type)
    entry = entry % table.schema.field(name).type.list_size if nested else None  # binary logits: whole
    bad = rewritten(small, tmp_path / "null.parquet", with_null(table, name, row, entry))
    assert_refused(cli("info", bad), f"'{name}'", "null")


CELLS = (st.text(max_size=30) | st.integers(-(2**70), 2**70).map(str)
         | st.floats().map(repr) | st.just("") | st.just("1" * 5000))


@FUZZ
@given(line=st.integers(0, len(ROUTE_HEADER) + len(ROUTE_ROWS) - 1), field=st.integers(0, 8), cell=CELLS)
def test_random_route_csv_cells_are_refused_with_a_line_or_imported(tmp_path, line, field, cell):
    lines = [*ROUTE_HEADER, *ROUTE_ROWS]
    parts = lines[line].split(",") if "," in lines[line] else lines[line].split(" ")
    parts[field % len(parts)] = cell
    lines[line] = ("," if "," in lines[line] else " ").join(parts)
    src = tmp_path / "r.csv"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.parquet"
    out.unlink(missing_ok=True)  # left by an earlier example
    code, stdout, err = cli("import", "route-csv", src, out)
    if code:
        assert_refused((code, stdout, err))
        assert len(err) < 1000 and not out.exists()
    else:
        assert read_trace(out)[1].num_tokens >= 1


@pytest.fixture(scope="module")
def profile() -> dict:
    from omegaconf import OmegaConf

    from simulator.run import compose

    return OmegaConf.to_container(compose(["hardware=h200_measured"]), resolve=True)["hardware"]


PROFILE_PATHS = [("pcie", "latency_us"), ("pcie", "bandwidth_gbps"), ("ssd", "latency_us"),
                 ("ssd", "bandwidth_gbps"), ("gpu", "expert_fixed_us"), ("gpu", "memory_bandwidth_gbps"),
                 ("cpu", "memory_bandwidth_gbps"), ("host_ram_bytes",), ("source",), ("gpu",),
                 ("compute", "qwen3_next_80b_a3b", "gpu_expert_us")]


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PROFILE_PATHS), JSON_VALUES), min_size=1, max_size=3))
def test_random_profiles_are_refused_in_one_line_or_physical(profile, changes):
    bad = copy.deepcopy(profile)
    for path, value in changes:
        node = bad
        for key in path[:-1]:
            node = node[key] if isinstance(node.get(key), dict) else node.setdefault(key, {})
        node[path[-1]] = value
    try:
        validate_profile(bad)
    except InputError as exc:
        assert "\n" not in str(exc) and str(exc).count("'hardware.") >= 1
        return
    for section in ("pcie", "ssd", "gpu", "cpu"):
        for value in bad[section].values():
            assert isinstance(value, int | float) and 0 <= value <= 1e5
