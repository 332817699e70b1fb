"""The capture's parallel trace writer and the Parquet row-group join under it (no torch needed)."""
from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from traces.capture.concat import ParquetJoin, concat_parquet, read_footer
from traces.capture.writer import ParallelTraceWriter
from traces.cli import main as cli_main
from traces.errors import InputError
from traces.format import CONTENT_KEY, TraceWriter, read_trace, recorded_content_hash
from traces.synth import synth_trace


def trace_columns(tokens=300, seed=0, top_r=6):
    """A synthetic trace with top-R logits and look-ahead routing, as TraceWriter.write arguments."""
    meta, chunk = synth_trace(tokens=tokens, layers=3, experts=16, top_k=2, seed=seed, logits="full",
                              seq_tokens=40, prompt_tokens=5, prompt_share=0.5)
    meta = replace(meta, logits_top_r=top_r, lookahead_depth=1, lookahead_top_r=4, lookahead_source="moe_input")
    ahead = np.roll(chunk.logits, -1, axis=1)[:, :, None, :]  # the next layer's logits, as a stand-in
    ids = np.argsort(-ahead, axis=-1, kind="stable")[..., :4]
    values = np.take_along_axis(ahead, ids, -1)
    ids[:, -1], values[:, -1] = -1, -np.inf
    cols = dict(seq=chunk.seq, pos=chunk.pos, phase=chunk.phase, experts=chunk.experts, weights=chunk.gates,
                logits=chunk.logits, token_id=chunk.token_id, domain=chunk.domain, nll=chunk.nll,
                lookahead_logits=values, lookahead_ids=ids)
    return meta, {k: v for k, v in cols.items() if v is not None}


def blocks(cols, cuts):
    edges = [0, *cuts, cols["seq"].shape[0]]
    return [{k: v[a:b] for k, v in cols.items()} for a, b in zip(edges, edges[1:], strict=False)]


def row_group_tokens(path, meta) -> list[int]:
    md = pq.ParquetFile(path).metadata
    return [md.row_group(i).num_rows // meta.num_layers for i in range(md.num_row_groups)]


@pytest.mark.parametrize("processes", [False, True])
def test_the_write_that_reaches_the_expected_tokens_cuts_its_units_for_the_close(tmp_path, monkeypatch, processes):
    """With ``expected_tokens``, the write that reaches them cuts all that is pending into one
    unit per encoder at once (as the close would cut what is left); a number the writes never
    reach changes nothing, one they pass early leaves the rest to whole units and the close. The
    file's rows and content hash are a single writer's every time."""
    from traces.capture import writer as W

    monkeypatch.setattr(W, "FINAL_UNIT_TOKENS", 10)
    meta, cols = trace_columns()  # 300 tokens, written as 3, 47, 1, 149 and 100
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        writer.write(**cols)
    one = read_trace(tmp_path / "one.parquet")
    for expected, sizes in [(None, [64] * 4 + [15, 15, 14]), (1000, [64] * 4 + [15, 15, 14]),
                            (300, [64] * 3 + [36] * 3), (250, [64] * 3 + [36] * 3),
                            (200, [64] * 3 + [8, 64, 12, 12, 12])]:
        path = tmp_path / f"many{expected}.parquet"
        with ParallelTraceWriter(path, meta, unit_tokens=64, workers=3, processes=processes,
                                 expected_tokens=expected) as writer:
            for block in blocks(cols, [3, 50, 51, 200]):
                writer.write(**block)
        assert row_group_tokens(path, meta) == sizes, expected
        many = read_trace(path)
        for name in ("seq", "pos", "experts", "gates", "logits", "lookahead_ids"):
            np.testing.assert_array_equal(getattr(one[1], name), getattr(many[1], name), err_msg=name)
        assert recorded_content_hash(path) == recorded_content_hash(tmp_path / "one.parquet")
    with pytest.raises(ValueError, match="expected_tokens must be None or >= 1, got 0"):
        ParallelTraceWriter(tmp_path / "zero.parquet", meta, unit_tokens=64, expected_tokens=0)


def test_the_units_left_at_the_close_are_split_among_the_encoders(tmp_path, monkeypatch):
    """What is pending at the close is cut into one unit per encoder (not below FINAL_UNIT_TOKENS),
    so the close waits for a part of a unit, not a whole one; the file is the same."""
    from traces.capture import writer as W

    monkeypatch.setattr(W, "FINAL_UNIT_TOKENS", 40)
    meta, cols = trace_columns()
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        writer.write(**cols)
    for workers, sizes in [(3, [100, 100, 100]), (10, [40] * 7 + [20])]:
        path = tmp_path / f"many{workers}.parquet"
        with ParallelTraceWriter(path, meta, unit_tokens=1000, workers=workers) as writer:
            writer.write(**cols)  # 300 tokens: under one unit, all left for the close
        md = pq.ParquetFile(path).metadata
        layers = meta.num_layers
        assert [md.row_group(i).num_rows // layers for i in range(md.num_row_groups)] == sizes
        one, many = read_trace(tmp_path / "one.parquet"), read_trace(path)
        np.testing.assert_array_equal(one[1].experts, many[1].experts)
        np.testing.assert_array_equal(one[1].logits, many[1].logits)


def test_units_are_cut_as_views_of_the_written_blocks():
    """The capturing thread copies nothing: a unit is views of the blocks it spans, in order (the
    encoder copies them into its block), and the blocks left start where the unit ended."""
    from traces.capture.writer import _cut, _joined

    _, cols = trace_columns()
    written = blocks(cols, [3, 50, 51, 200])
    pieces, rest, offset = _cut(written, 0, 2)  # inside the first block
    assert len(pieces) == 1 and np.shares_memory(pieces[0]["logits"], written[0]["logits"])
    assert (rest, offset) == (written, 2)
    pieces, rest, offset = _cut(rest, offset, 60)  # tokens 2..61: across three blocks
    assert [p["seq"].shape[0] for p in pieces] == [1, 47, 1, 11]
    assert all(np.shares_memory(p["experts"], w["experts"]) for p, w in zip(pieces, written, strict=False))
    assert len(rest) == 2 and offset == 11 and rest[0] is written[3]
    for name, v in _joined(pieces).items():
        np.testing.assert_array_equal(v, cols[name][2:62], err_msg=name)


def test_an_encoder_joins_a_unit_that_spans_blocks_in_memory_it_keeps():
    """An encoder process joins the pieces of a unit that spans blocks as ``_joined`` does, in
    memory it keeps for the next such unit (new memory each time cost it page faults); a unit of
    one piece stays a view of its block."""
    from traces.capture.writer import _cut, _joined, _Mapped

    _, cols = trace_columns()
    written = blocks(cols, [3, 50, 51, 200])
    state = _Mapped()
    one, rest, offset = _cut(written, 0, 2)
    assert state.joined(one) is one[0]
    first, rest, offset = _cut(rest, offset, 160)  # tokens 2..161, across four blocks
    assert len(first) == 4
    joined = state.joined(first)
    for name, v in _joined(first).items():
        np.testing.assert_array_equal(joined[name], v, err_msg=name)
        assert joined[name].dtype == v.dtype and joined[name].shape == v.shape
    addresses = {name: v.ctypes.data for name, v in joined.items()}
    second, _, _ = _cut(rest, offset, 60)  # tokens 162..221, across two blocks: fewer, in the same memory
    assert len(second) == 2
    again = state.joined(second)
    for name, v in again.items():
        np.testing.assert_array_equal(v, cols[name][162:222], err_msg=name)
        assert v.ctypes.data == addresses[name], name


@pytest.mark.parametrize(("unit_tokens", "workers", "processes"),
                         [(7, 3, False), (64, 2, False), (1000, 1, False), (7, 3, True), (1000, 1, True)])
def test_parallel_writer_writes_what_one_writer_writes(tmp_path, unit_tokens, workers, processes):
    meta, cols = trace_columns()
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        writer.write(**cols)
    with ParallelTraceWriter(tmp_path / "many.parquet", meta, unit_tokens=unit_tokens, workers=workers,
                             processes=processes) as writer:
        for block in blocks(cols, [3, 50, 51, 200]):
            writer.write(**block)
        assert writer.num_tokens == 300
    one, many = read_trace(tmp_path / "one.parquet"), read_trace(tmp_path / "many.parquet")
    assert one[0] == many[0] and one[0].lookahead_depth == 1
    for name in ("seq", "pos", "phase", "group", "experts", "gates", "logits", "lookahead_ids",
                 "lookahead_logits"):
        np.testing.assert_array_equal(getattr(one[1], name), getattr(many[1], name), err_msg=name)
    groups = pq.ParquetFile(tmp_path / "many.parquet").metadata.num_row_groups
    assert groups == -(-300 // unit_tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.parquet", "one.parquet"]  # no parts left


def test_joining_one_file_gives_back_its_bytes(tmp_path):
    meta, cols = trace_columns(tokens=90, seed=1)
    for name, m in [("plain", replace(meta, lookahead_depth=0, lookahead_top_r=0, lookahead_source="",
                                      logits_top_r=0)), ("lookahead", meta)]:
        path = tmp_path / f"{name}.parquet"
        with TraceWriter(path, m, row_group_tokens=20) as writer:
            writer.write(**({k: v for k, v in cols.items() if not k.startswith("lookahead")}
                            if name == "plain" else cols))
        concat_parquet([path], tmp_path / f"{name}_joined.parquet", recorded_content_hash(path))
        assert (tmp_path / f"{name}_joined.parquet").read_bytes() == path.read_bytes()
        footer, start = read_footer(path)
        assert footer.num_rows == 90 * 3 and footer.row_groups[0] == 5
        md = pq.ParquetFile(path).metadata  # every page offset pyarrow knows is among the varints to shift
        known = {getattr(md.row_group(g).column(c), name) for g in range(5) for c in range(md.num_columns)
                 for name in ("data_page_offset", "dictionary_page_offset", "file_offset")} - {None}
        assert known <= {v for *_, kind, v in footer.holes if kind == "offset"}
        assert [v for *_, kind, v in footer.holes if kind == "ordinal"] in ([], [0, 1, 2, 3, 4])  # optional


def write_parts(folder: Path, meta, cols, cuts, row_group_tokens: int) -> list[Path]:
    """The tokens of ``cols`` cut at ``cuts``, each piece a trace file of its own."""
    parts = []
    for i, block in enumerate(blocks(cols, cuts)):
        parts.append(folder / f"part{i}.parquet")
        with TraceWriter(parts[-1], meta, row_group_tokens=row_group_tokens) as writer:
            writer.write(**block)
    return parts


def test_joined_file_is_the_parts_one_after_the_other(tmp_path):
    meta, cols = trace_columns(tokens=120, seed=2)
    parts = write_parts(tmp_path, meta, cols, [40, 80], row_group_tokens=15)
    concat_parquet(parts, tmp_path / "all.parquet")
    joined = pq.ParquetFile(tmp_path / "all.parquet")
    assert joined.metadata.num_row_groups == 9 and joined.metadata.num_rows == 120 * 3
    assert [joined.metadata.row_group(i).num_rows for i in range(9)] == [45, 45, 30] * 3
    shift = 0  # each part's pages moved by the bytes of the parts before it
    for i, part in enumerate(parts):
        source = pq.ParquetFile(part).metadata
        for g in range(3):
            for c in range(source.num_columns):
                was, now = source.row_group(g).column(c), joined.metadata.row_group(3 * i + g).column(c)
                assert now.data_page_offset == was.data_page_offset + shift
                assert now.dictionary_page_offset == (None if was.dictionary_page_offset is None
                                                      else was.dictionary_page_offset + shift)
        shift += read_footer(part)[1] - 4
    tables = [pq.read_table(p) for p in parts]
    assert joined.read().equals(pa.concat_tables(tables))
    other = tmp_path / "other.parquet"
    pq.write_table(pq.read_table(parts[0]).drop_columns(["domain"]), other)
    with pytest.raises(ValueError, match="schema or metadata differs"):
        concat_parquet([parts[0], other], tmp_path / "bad.parquet")
    assert not (tmp_path / "bad.parquet").exists()


def test_parts_copied_by_the_kernel_or_through_memory_give_the_same_file(tmp_path, monkeypatch):
    meta, cols = trace_columns(tokens=120, seed=3)
    parts = write_parts(tmp_path, meta, cols, [50, 70], row_group_tokens=25)
    concat_parquet(parts, tmp_path / "kernel.parquet")
    kernel_calls = []

    def refused(*args):
        kernel_calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refused)
    concat_parquet(parts, tmp_path / "memory.parquet")
    assert len(kernel_calls) == len(parts)  # asked once per part, then copied through memory
    assert (tmp_path / "kernel.parquet").read_bytes() == (tmp_path / "memory.parquet").read_bytes()
    assert pq.read_table(tmp_path / "memory.parquet").equals(pa.concat_tables([pq.read_table(p) for p in parts]))
    monkeypatch.undo()
    footer, start = read_footer(parts[1])
    with parts[1].open("r+b") as f:  # cut short after its footer was read
        f.truncate(start // 2)
    for name in ("kernel", "memory"):
        if name == "memory":
            monkeypatch.setattr(os, "copy_file_range", refused)
        with open(tmp_path / f"cut_{name}.parquet", "wb") as out:
            join = ParquetJoin(out)
            join.append(parts[0], *read_footer(parts[0]))
            with pytest.raises(ValueError, match="part1.parquet ends before its footer"):
                join.append(parts[1], footer, start)


@pytest.mark.parametrize("processes", [False, True])
def test_a_bad_unit_fails_the_whole_file_naming_it(tmp_path, processes):
    meta, cols = trace_columns()
    cols["logits"] = cols["logits"].copy()
    cols["logits"][250, 1, 3] = np.nan
    path = tmp_path / "t.parquet"
    with pytest.raises(InputError) as caught, \
            ParallelTraceWriter(path, meta, unit_tokens=16, workers=2, processes=processes) as writer:
        for block in blocks(cols, [100, 200]):
            writer.write(**block)
    assert str(caught.value).startswith(f"{path}: column 'logits'") and "NaN" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_tokens_out_of_order_across_units_are_refused_as_one_writer_refuses_them(tmp_path):
    meta, cols = trace_columns(tokens=40)
    cols["pos"] = cols["pos"].copy()
    cols["pos"][20:] -= 3  # token 20 (seq 0 pos 17) starts the third unit and repeats a position
    errors = []
    for name, writer in [("one", TraceWriter), ("many", lambda p, m: ParallelTraceWriter(p, m, 10, workers=2)),
                         ("processes", lambda p, m: ParallelTraceWriter(p, m, 10, workers=2, processes=True))]:
        path = tmp_path / f"{name}.parquet"
        with pytest.raises(InputError) as caught, writer(path, meta) as w:
            w.write(**cols)
        errors.append(str(caught.value).replace(str(path), "PATH"))
    assert errors[0] == errors[1] == errors[2] and "seq 0 pos 17: comes after" in errors[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("processes", [False, True])
def test_an_error_while_writing_leaves_nothing(tmp_path, processes):
    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    with pytest.raises(RuntimeError, match="stop"), \
            ParallelTraceWriter(path, meta, unit_tokens=16, processes=processes) as writer:
        writer.write(**blocks(cols, [100])[0])
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_capture_is_refused_as_a_single_writer_refuses_it(tmp_path):
    meta, _ = trace_columns()
    path = tmp_path / "t.parquet"
    with pytest.raises(InputError) as caught, ParallelTraceWriter(path, meta, unit_tokens=16):
        pass
    assert str(caught.value) == f"{path}: no tokens were written; a trace needs at least one token"
    assert list(tmp_path.iterdir()) == []


def parallel_and_single(tmp_path, unit_tokens, workers, processes=False, **trace):
    """The same tokens written by TraceWriter (one.parquet) and ParallelTraceWriter (many.parquet)."""
    meta, cols = trace_columns(**trace)
    one, many = tmp_path / "one.parquet", tmp_path / "many.parquet"
    with TraceWriter(one, meta) as writer:
        writer.write(**cols)
    with ParallelTraceWriter(many, meta, unit_tokens=unit_tokens, workers=workers, processes=processes) as writer:
        for block in blocks(cols, [3, 50, 51, 200]):
            writer.write(**block)
    return one, many


@pytest.mark.parametrize(("unit_tokens", "workers", "top_r", "processes"),
                         [(7, 3, 6, False), (64, 2, 0, False), (1000, 1, 6, False), (64, 2, 6, True)])
def test_the_joined_file_records_the_content_hash_and_metadata_one_writer_records(
        tmp_path, capsys, unit_tokens, workers, top_r, processes):
    one, many = parallel_and_single(tmp_path, unit_tokens, workers, processes, top_r=top_r)
    assert recorded_content_hash(many) == recorded_content_hash(one) is not None
    assert pq.read_metadata(many).metadata == pq.read_metadata(one).metadata  # moe_trace, its SHA-256, ...
    assert cli_main(["info", str(many), "--verify"]) == 0
    assert f"content {recorded_content_hash(one)} and every page checksum verified" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    _, other = parallel_and_single(tmp_path / "other", unit_tokens, workers, processes, top_r=top_r, seed=5)
    assert recorded_content_hash(other) != recorded_content_hash(many)  # it covers the tokens


def test_a_flipped_byte_in_the_pages_of_any_part_is_detected_on_read(tmp_path):
    _, many = parallel_and_single(tmp_path, unit_tokens=64, workers=3)
    data = many.read_bytes()
    md = pq.read_metadata(many)
    assert md.num_row_groups == 5
    for group in (0, 2, 4):  # the first part, one in the middle and the last
        for c in range(md.num_columns):
            col = md.row_group(group).column(c)
            end = min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None) \
                + col.total_compressed_size
            flipped = bytearray(data)
            flipped[end - 1] ^= 0x10  # the last page's data, after its header
            bad = tmp_path / "flipped.parquet"
            bad.write_bytes(bytes(flipped))
            with pytest.raises(InputError, match="CRC checksum verification failed"):
                read_trace(bad)


def test_the_join_compares_every_metadata_entry_but_the_content_hash_and_records_the_one_given(tmp_path):
    meta, cols = trace_columns(tokens=60, seed=3)
    first, second = blocks(cols, [30])
    parts = [tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "renamed.parquet"]
    for path, block, m in zip(parts, [first, second, second], [meta, meta, replace(meta, model="other")], strict=True):
        with TraceWriter(path, m) as writer:
            writer.write(**block)
    with pytest.raises(ValueError, match="renamed.parquet: schema or metadata differs"):
        concat_parquet([parts[0], parts[2]], tmp_path / "bad.parquet")
    concat_parquet(parts[:2], tmp_path / "none.parquet")  # the parts' own hashes are not kept
    assert recorded_content_hash(tmp_path / "none.parquet") is None
    kv = pq.read_metadata(parts[0]).metadata
    assert pq.read_metadata(tmp_path / "none.parquet").metadata == {k: v for k, v in kv.items() if k != CONTENT_KEY}
    # files without key-value metadata: the field is added, and left out again
    plain = [tmp_path / "p0.parquet", tmp_path / "p1.parquet"]
    for i, path in enumerate(plain):
        pq.write_table(pa.table({"x": np.arange(i, i + 5)}), path, store_schema=False)
    assert pq.read_metadata(plain[0]).metadata is None
    digest = "sha256:" + "ab" * 32
    concat_parquet(plain, tmp_path / "plain.parquet", digest)
    assert pq.read_metadata(tmp_path / "plain.parquet").metadata == {CONTENT_KEY: digest.encode()}
    assert pq.read_table(tmp_path / "plain.parquet")["x"].to_pylist() == [0, 1, 2, 3, 4, 1, 2, 3, 4, 5]
    concat_parquet([tmp_path / "plain.parquet"], tmp_path / "again.parquet")
    assert pq.read_metadata(tmp_path / "again.parquet").metadata is None


def test_an_encoder_process_that_dies_fails_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    """A killed encoder process: one error naming what happened, no file, no parts; the next
    writer starts a new encoder and writes."""
    from traces.capture import writer as writer_module

    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    real = writer_module._Encoder.write_unit

    def dies(self, *args):
        self.proc.kill()
        self.proc.wait()
        return real(self, *args)

    monkeypatch.setattr(writer_module._Encoder, "write_unit", dies)
    with pytest.raises(RuntimeError, match="trace encoder process exited"), \
            ParallelTraceWriter(path, meta, unit_tokens=64, workers=1, processes=True) as w:
        w.write(**cols)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(writer_module._Encoder, "write_unit", real)
    with ParallelTraceWriter(path, meta, unit_tokens=64, workers=1, processes=True) as w:
        w.write(**cols)
    assert read_trace(path)[1].num_tokens == 300


def stray_blocks() -> set[str]:
    """Blocks of shared memory that no idle encoder process keeps for its next unit."""
    from traces.capture import writer as writer_module

    folder = Path(writer_module.shared_folder() or writer_module.tempfile.gettempdir())
    kept = {c.block.path for c in writer_module._IDLE.get(writer_module._Encoder, []) if c.block}
    return {str(p) for p in folder.glob("moe-trace-encoder-*")} - kept


def test_a_joiner_process_that_dies_fails_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    """The process that appends units and hashes them is killed at its second unit: one error
    naming it, no file, no parts, no blocks of shared memory; the next writer writes."""
    from traces.capture import writer as writer_module

    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    before = stray_blocks()
    real = writer_module._Joiner.send
    appends = []

    def dies(self, request):
        if request[0] == "append":
            appends.append(request)
            if len(appends) == 2:
                self.proc.kill()
                self.proc.wait()
        return real(self, request)

    monkeypatch.setattr(writer_module._Joiner, "send", dies)
    with pytest.raises(RuntimeError, match="trace joiner process exited"), \
            ParallelTraceWriter(path, meta, unit_tokens=64, workers=2, processes=True) as w:
        w.write(**cols)
    assert list(tmp_path.iterdir()) == [] and stray_blocks() == before
    monkeypatch.setattr(writer_module._Joiner, "send", real)
    with ParallelTraceWriter(path, meta, unit_tokens=64, workers=2, processes=True) as w:
        w.write(**cols)
    assert read_trace(path)[1].num_tokens == 300 and stray_blocks() == before


def test_the_writer_cost_tool_times_the_writing_thread_and_the_child_processes(capsys, tmp_path, monkeypatch):
    import contextlib
    import tempfile

    from traces.capture.writer_cost import main, writer_cpu

    # its folder kept: each pass's file is removed after the pass (kept, every pass's pages would
    # be new memory, which costs a virtual machine's first touch), the warm-up's alone is left
    monkeypatch.setattr(tempfile, "TemporaryDirectory", lambda: contextlib.nullcontext(str(tmp_path)))
    cpu = writer_cpu(forwards=2, passes=2, workers=1, writers=("processes", "dispatcher"))
    assert [p.name for p in tmp_path.iterdir()] == ["warm.parquet"]
    # the thread hands a forward's rows on in milliseconds; the whole process spends at least
    # that; an encoder spends more on each unit
    assert sorted(cpu) == ["dispatcher", "processes"]
    assert all(len(v) == 2 for v in cpu.values())
    assert all(0 < thread <= process < 1000 and thread < unit for v in cpu.values() for thread, process, unit in v)
    with pytest.raises(SystemExit) as e:
        main(["--forwards", "0"])
    assert e.value.code == 2 and "--forwards" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--join-units", "-1"])
    assert e.value.code == 2 and "--join-units" in capsys.readouterr().err


def test_the_writer_cost_tool_times_the_close_told_the_tokens_and_not(capsys):
    """close_ms: paced passes, alternately with the writer told the pass's tokens; every file
    closed and removed, no shared blocks left; a negative count is refused."""
    from traces.capture.writer_cost import close_ms, main

    before = stray_blocks()
    times = close_ms(passes=3, forwards=2, workers=1, pace_s=0.0)
    assert [len(times["not told"]), len(times["told"])] == [2, 1]
    assert all(0 < ms < 60_000 for v in times.values() for ms in v)
    assert stray_blocks() == before
    with pytest.raises(SystemExit) as e:
        main(["--close-passes", "-1"])
    assert e.value.code == 2 and "--close-passes" in capsys.readouterr().err


def test_the_writer_cost_tool_times_the_joiner_with_its_threads_and_without():
    """join_ms: units alternately hashed on the joiner's threads and in turn, each unit's part and
    block removed after it."""
    from traces.capture.writer_cost import join_ms

    before = stray_blocks()
    times = join_ms(5)
    assert [len(times["in turn"]), len(times["threads"])] == [3, 2]
    assert all(0 < ms < 10_000 for v in times.values() for ms in v)
    assert stray_blocks() == before


def write_in_slabs(writer, cols, lent: set, peak: list[int]) -> None:
    """``cols`` in blocks of 10 tokens, each filled in shared memory the writer lends (``block``);
    ``lent`` gets the slabs, ``peak[0]`` the most tokens lent at a time."""
    for piece in blocks(cols, list(range(10, cols["seq"].shape[0], 10))):
        block = writer.block({name: (v.dtype, v.shape) for name, v in piece.items()})
        peak[0] = max(peak[0], writer._lent_tokens)
        for name, v in piece.items():
            block.views[name][...] = v
        lent.add(block.slab)
        writer.write(**block.views)


def lent_bound(unit_tokens: int, workers: int) -> int:
    """The most tokens ``block`` lends at a time where it has lent more than a unit's and a block's."""
    from traces.capture import writer as W

    return unit_tokens * (W.LENT_UNITS_PER_WORKER * workers + W.LENT_UNITS_MORE)


def most_slabs_lent(unit_tokens: int, workers: int, block_tokens: int) -> int:
    """The most slabs of ``block_tokens`` each lent at a time (so the most a writer makes): ``block``
    lends a block where the tokens lent then stay within the bound, or where fewer than a unit's and
    a block's were lent before (the writer may keep them for more rows)."""
    return max(lent_bound(unit_tokens, workers) // block_tokens, -(-(unit_tokens + block_tokens) // block_tokens))


@pytest.mark.parametrize(("processes", "as_stored"), [(False, False), (True, False), (True, True)])
def test_rows_in_lent_shared_memory_are_read_in_place_and_the_memory_is_lent_again(tmp_path, monkeypatch, processes,
                                                                                  as_stored):
    """Blocks filled in the writer's slabs (``ParallelTraceWriter.block``): encoder processes are
    told where the rows lie instead of getting a copy; a slab is lent again once all its tokens
    are in the file (and hashed), so 60 blocks need a few slabs; the file, content hash included,
    is the one a single writer makes of the same rows. Rows given as they are stored (top R
    selected, on-disk dtypes, as moe-capture gives them: ``as_stored``) are hashed by the joiner
    in the slabs; others, stored converted, from a block of their own."""
    from traces.capture import writer as W

    meta, cols = trace_columns(tokens=600)
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        stored = writer.write(**cols)
    if as_stored:
        cols = {name: v.copy() for name, v in stored.items()}
    sent, joined = [], []
    real_send, real_join = W._Encoder.send, W._Joiner.send
    monkeypatch.setattr(W._Encoder, "send", lambda self, request: (sent.append(request), real_send(self, request))[1])
    monkeypatch.setattr(W._Joiner, "send", lambda self, request: (joined.append(request), real_join(self, request))[1])
    before = stray_blocks()
    givers = []  # the threads that give slabs back: the joiner's replies, where it hashes in them
    real_give = ParallelTraceWriter._appended_pieces
    monkeypatch.setattr(ParallelTraceWriter, "_appended_pieces", lambda self, pieces: (
        givers.append(threading.current_thread().name) if pieces else None, real_give(self, pieces))[1])
    monkeypatch.setattr(W, "_FREE_SLABS", [])  # the slabs of earlier tests' writers would be lent in turn
    lent, peak = set(), [0]
    path = tmp_path / "lent.parquet"
    with ParallelTraceWriter(path, meta, unit_tokens=7, workers=1, processes=processes) as writer:
        write_in_slabs(writer, cols, lent, peak)
    # block() waits while the tokens lent would pass the bound (35 for one encoder of 7-token
    # units), however far the encoder or the joiner (which hashes the rows in the slabs where
    # they are as stored, and only then frees them) lags behind: at most 3 blocks of 10 at a time,
    # and a slab freed is lent again before a new one is made
    assert peak[0] <= lent_bound(7, 1)
    assert 1 < len(lent) <= most_slabs_lent(7, 1, 10) == 3
    assert lent <= set(W._FREE_SLABS)  # all back after the close
    if processes:
        assert len(sent) == -(-600 // 7)
        assert all(Path(source[0]).name.startswith("moe-trace-rows-") for request in sent for source in request[0])
        appended = [request[2] for request in joined if request[0] == "append"]
        assert len(appended) == len(sent)
        assert {where for where, _ in appended} == {"slabs" if as_stored else "block"}
        assert stray_blocks() == before and all(slab.path and Path(slab.path).exists() for slab in lent)
        assert set(givers) == ({"trace-joiner"} if as_stored else {"trace-encoder-0"})
    one, many = read_trace(tmp_path / "one.parquet"), read_trace(path)
    for name in ("seq", "pos", "experts", "gates", "logits", "nll", "lookahead_logits", "lookahead_ids"):
        np.testing.assert_array_equal(getattr(one[1], name), getattr(many[1], name), err_msg=name)
    assert recorded_content_hash(path) == recorded_content_hash(tmp_path / "one.parquet") is not None


def test_shared_memory_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A /dev/shm smaller than a slab (a container's default): ``block`` gives None, so the
    producer writes plain arrays, and leaves no file behind; the trace is written as ever."""
    import errno

    from traces.capture import writer as W

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(W.os, "posix_fallocate", full, raising=False)
    folder = Path(W.shared_folder() or W.tempfile.gettempdir())
    before = set(folder.glob("moe-trace-rows-*"))
    meta, cols = trace_columns()
    path = tmp_path / "t.parquet"
    with ParallelTraceWriter(path, meta, unit_tokens=64, workers=2) as writer:
        assert writer.block({"seq": (np.dtype(np.int32), (1 << 28,))}) is None
        writer.write(**cols)
    assert set(folder.glob("moe-trace-rows-*")) == before
    np.testing.assert_array_equal(read_trace(path)[1].experts, cols["experts"])


@pytest.mark.parametrize("threshold", [0, 1 << 12, None])
def test_a_content_hash_fed_on_threads_is_the_one_fed_in_turn(monkeypatch, threshold):
    """ContentHash.submit: each column's pieces hashed in order on a thread (every column,
    the large ones, or none: ``threshold``), over several units, gives update's digest."""
    from concurrent.futures import ThreadPoolExecutor

    from traces import format as F

    if threshold is not None:
        monkeypatch.setattr(F, "HASH_THREAD_BYTES", threshold)
    meta, cols = trace_columns(tokens=300)
    one, threaded = F.ContentHash(meta), F.ContentHash(meta)
    one.update(cols)
    with ThreadPoolExecutor(3) as pool:
        for unit in blocks(cols, [120, 250]):
            pieces = blocks(unit, [7, 40])  # a unit's pieces, as they lie in the slabs
            futures = threaded.submit(pieces, pool)
            assert len(futures) == (0 if threshold is None else sum(
                sum(p[name].nbytes for p in pieces) >= threshold for name in unit))
            for f in futures:
                f.result()
    assert threaded.hexdigest() == one.hexdigest()
    without = F.ContentHash(meta)  # no pool: every column here, nothing to wait for
    assert all(without.submit(blocks(unit, [7]), None) == [] for unit in blocks(cols, [120, 250]))
    assert without.hexdigest() == one.hexdigest()
    reordered = F.ContentHash(meta)  # the pieces' order within a column counts
    for unit in blocks(cols, [120, 250])[::-1]:
        reordered.update(unit)
    assert reordered.hexdigest() != one.hexdigest()


def test_the_joiner_hashes_large_columns_on_threads_and_records_the_hash_one_writer_records(tmp_path):
    """Units whose logits exceed HASH_THREAD_BYTES: the joiner process hashes them on its threads
    while it copies the unit's part; the file is the one a single writer makes."""
    from traces.format import HASH_THREAD_BYTES

    meta, chunk = synth_trace(tokens=2400, layers=3, experts=64, top_k=4, seed=1, logits="full",
                              seq_tokens=100, prompt_tokens=5, prompt_share=0.5)
    cols = {k: v for k, v in dict(seq=chunk.seq, pos=chunk.pos, phase=chunk.phase, experts=chunk.experts,
                                   weights=chunk.gates, logits=chunk.logits).items()}
    unit = 1200
    assert unit * 3 * 64 * 2 >= HASH_THREAD_BYTES  # a unit's float16 logits go to a thread
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        writer.write(**cols)
    with ParallelTraceWriter(tmp_path / "many.parquet", meta, unit_tokens=unit, workers=2, processes=True) as writer:
        for block in blocks(cols, [500, 1700]):
            writer.write(**block)
    assert recorded_content_hash(tmp_path / "many.parquet") == recorded_content_hash(tmp_path / "one.parquet")
    np.testing.assert_array_equal(read_trace(tmp_path / "many.parquet")[1].logits, chunk.logits)


def stored_rows(monkeypatch, tmp_path):
    """A single writer's file of 600 tokens (one.parquet): its meta and its rows as stored (the
    joiner hashes those in the slabs, and only then are they freed); a fresh pool of slabs."""
    from traces.capture import writer as W

    meta, cols = trace_columns(tokens=600)
    with TraceWriter(tmp_path / "one.parquet", meta) as writer:
        stored = writer.write(**cols)
    monkeypatch.setattr(W, "_FREE_SLABS", [])  # the slabs of earlier tests' writers would be lent in turn
    return meta, {name: v.copy() for name, v in stored.items()}


def writing_on_a_thread(writer, cols, lent: set, peak: list[int]) -> tuple[threading.Thread, list[BaseException]]:
    """:func:`write_in_slabs` and the writer's close on a thread, so that a writer that hangs fails
    the test instead of hanging it; the list gets its error."""
    errors = []

    def run():
        try:
            with writer:
                write_in_slabs(writer, cols, lent, peak)
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_a_producer_ahead_of_the_joiner_waits_in_block_within_the_bound(tmp_path, monkeypatch):
    """The joiner answers nothing for a while (a loaded machine): the slabs it has yet to hash
    stay lent, and ``block`` waits once the tokens lent reach the bound instead of lending new
    shared memory; once the joiner answers, the writing goes on and the file, content hash
    included, is a single writer's."""
    from traces.capture import writer as W

    meta, cols = stored_rows(monkeypatch, tmp_path)
    answer = threading.Event()
    real = W._Joiner.reply
    monkeypatch.setattr(W._Joiner, "reply", lambda self: (answer.wait(), real(self))[1])
    before = stray_blocks()
    lent, peak = set(), [0]
    path = tmp_path / "lent.parquet"
    writer = ParallelTraceWriter(path, meta, unit_tokens=7, workers=1, processes=True)
    thread, errors = writing_on_a_thread(writer, cols, lent, peak)
    thread.join(1.0)
    assert thread.is_alive()  # waiting for the joiner: no slab is freed before it answers
    assert len(lent) <= most_slabs_lent(7, 1, 10)
    time.sleep(0.5)
    answer.set()
    thread.join(120)
    assert not thread.is_alive() and errors == []
    assert 0.5 <= writer.lend_wait_s < 120  # block's wait counted, from before the sleep to the answer
    assert peak[0] <= lent_bound(7, 1)
    assert 1 < len(lent) <= most_slabs_lent(7, 1, 10) and lent <= set(W._FREE_SLABS)
    assert recorded_content_hash(path) == recorded_content_hash(tmp_path / "one.parquet") is not None
    np.testing.assert_array_equal(read_trace(path)[1].logits, read_trace(tmp_path / "one.parquet")[1].logits)
    assert stray_blocks() == before


def test_a_block_waiting_for_a_joiner_that_dies_raises(tmp_path, monkeypatch):
    """The joiner never gets the units (they stay lent), so ``block`` waits at the bound; the
    joiner is killed: the waiting ``block`` raises its exit instead of waiting for ever, and
    nothing is left but the single writer's file."""
    from traces.capture import writer as W

    meta, cols = stored_rows(monkeypatch, tmp_path)
    real = W._Joiner.send
    monkeypatch.setattr(W._Joiner, "send", lambda self, request: None if request[0] == "append" else real(self, request))
    lent, peak = set(), [0]
    writer = ParallelTraceWriter(tmp_path / "lent.parquet", meta, unit_tokens=7, workers=1, processes=True)
    # set where block() waits, before it lets go of the lock: the joiner's error comes after the wait
    waiting, real_wait = threading.Event(), writer._cond.wait
    writer._cond.wait = lambda timeout=None: (waiting.set(), real_wait(timeout))[1]
    thread, errors = writing_on_a_thread(writer, cols, lent, peak)
    assert waiting.wait(60) and writer._lent_tokens == 30  # 3 blocks of 10 lent, none freed
    writer._joiner.proc.kill()
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and "trace joiner process exited" in str(errors[0])
    assert len(lent) == 3 and lent <= set(W._FREE_SLABS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.parquet"]
