"""The trace file format: round trip, chunking, bounded reads, atomic writes, bad input."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from table_cases import column_values, with_values

from traces.cli import main
from traces.errors import InputError
from traces.format import (
    CHUNK_BYTES,
    META_KEY,
    PHASE_DECODE,
    PHASE_PREFILL,
    ArraySource,
    TraceChunk,
    TraceMeta,
    TraceWriter,
    concat_chunks,
    default_max_tokens,
    open_trace,
    plan_chunks,
    read_trace,
    write_trace,
)

L, E, K = 3, 16, 2


@dataclass
class Band:
    """A dataclass a caller might leave in ``TraceMeta.extra``."""

    low: float
    edges: list


def make_meta(**overrides) -> TraceMeta:
    values = dict(model="test-model", num_layers=L, num_experts=E, top_k=K, expert_bytes=[100, 200, 300],
                  has_logits=True, has_residency=True, layer_ids=[1, 3, 5], domains=["code", "chat"],
                  dense_bytes=[7, 8, 9], source="test", extra={"note": "round trip"})
    values.update(overrides)
    return TraceMeta(**values)


def make_arrays(tokens: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token arrays in trace order: 3 sequences, each a prefill prompt then decode."""
    rng = np.random.default_rng(seed)
    seq = np.sort(rng.integers(0, 3, tokens)).astype(np.int32)
    pos = (np.arange(tokens) - np.searchsorted(seq, seq)).astype(np.int32)
    phase = np.where(pos < 4, PHASE_PREFILL, PHASE_DECODE).astype(np.int8)
    logits = rng.standard_normal((tokens, L, E)).astype(np.float32)
    experts = np.argsort(-logits, axis=-1)[..., :K]
    return dict(
        seq=seq, pos=pos, phase=phase, experts=experts,
        weights=rng.uniform(0.1, 2.0, (tokens, L, K)).astype(np.float32),  # not normalised
        logits=logits, residency=rng.integers(0, 2, (tokens, L, K)).astype(np.int8),
        token_id=rng.integers(0, 50_000, tokens).astype(np.int32),
        domain=rng.integers(0, 2, tokens).astype(np.int16),
        nll=rng.uniform(0, 5, tokens).astype(np.float32),
    )


@pytest.fixture
def good_file(tmp_path) -> Path:
    path = tmp_path / "good.parquet"
    arrays = make_arrays()
    with TraceWriter(path, make_meta(), row_group_tokens=7) as writer:
        writer.write(**{name: v[:15] for name, v in arrays.items()})
        writer.write(**{name: v[15:] for name, v in arrays.items()})
    return path


def chunks_equal(a: TraceChunk, b: TraceChunk) -> bool:
    return all(
        (getattr(a, f.name) is None and getattr(b, f.name) is None)
        or np.array_equal(getattr(a, f.name), getattr(b, f.name), equal_nan=True)
        for f in fields(TraceChunk)
    )


def test_round_trip_keeps_every_column_and_the_metadata(good_file):
    arrays = make_arrays()
    meta, chunk = read_trace(good_file)
    assert meta == make_meta()
    assert pq.ParquetFile(good_file).metadata.num_row_groups == 6  # 40 tokens, 7 per row group
    np.testing.assert_array_equal(chunk.seq, arrays["seq"])
    np.testing.assert_array_equal(chunk.pos, arrays["pos"])
    np.testing.assert_array_equal(chunk.phase, arrays["phase"])
    np.testing.assert_array_equal(chunk.experts, arrays["experts"])
    w = arrays["weights"]
    np.testing.assert_allclose(chunk.gates, w / w.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(chunk.gates.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(chunk.logits, arrays["logits"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(chunk.residency, arrays["residency"])
    np.testing.assert_array_equal(chunk.token_id, arrays["token_id"])
    np.testing.assert_array_equal(chunk.domain, arrays["domain"])
    np.testing.assert_array_equal(chunk.nll, arrays["nll"])
    assert chunk.experts.dtype == np.int32 and chunk.gates.dtype == np.float32
    assert chunk.logits.dtype == np.float32 and chunk.group.dtype == np.int64
    # groups: a prefill prompt is one group, every decode token its own
    for s in np.unique(chunk.seq):
        prompt = chunk.group[(chunk.seq == s) & (chunk.phase == PHASE_PREFILL)]
        assert prompt.size and (prompt == prompt[0]).all()
    decode = chunk.group[chunk.phase == PHASE_DECODE]
    assert np.unique(decode).size == decode.size
    assert chunk.group[0] == 0 and (np.diff(chunk.group) >= 0).all()


@pytest.mark.parametrize("domain", [True, False])
def test_the_per_token_columns_the_scan_keeps_read_as_from_the_rows(good_file, tmp_path, monkeypatch, domain):
    """Up to KEEP_SCANNED_TOKENS tokens, the plan's scan keeps seq, pos, phase and domain and the
    chunks read only the other columns; every chunk (both directions, any size) and every stored
    unit equals a read of them from the rows. An out-of-range domain is still found."""
    import traces.format as F

    path = good_file
    if not domain:
        path = tmp_path / "no_domain.parquet"
        with TraceWriter(path, make_meta(), row_group_tokens=7) as writer:
            writer.write(**{k: v for k, v in make_arrays().items() if k != "domain"})
        assert "domain" not in pq.ParquetFile(path).schema_arrow.names

    def read(keep: int):
        monkeypatch.setattr(F, "KEEP_SCANNED_TOKENS", keep)
        with open_trace(path) as reader:
            out = [list(reader.iter_chunks(n)) + list(reader.iter_chunks_reversed(n)) for n in (1, 6, 40)]
            out.append([cols for _, cols in reader.iter_stored(9)])
            kept = set(reader._scanned)
            columns = reader._chunk_columns()
        return out, kept, columns

    kept_read, kept, columns = read(1 << 22)
    rows_read, none_kept, all_columns = read(0)
    assert kept == {"seq", "pos", "phase"} | ({"domain"} if domain else set()) and not none_kept
    assert not kept & set(columns) and kept <= set(all_columns)
    for a, b in zip(kept_read[:-1], rows_read[:-1], strict=True):
        assert len(a) == len(b) and all(chunks_equal(x, y) for x, y in zip(a, b, strict=True))
    for a, b in zip(kept_read[-1], rows_read[-1], strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)

    if domain:  # a domain without a name in the metadata, now read from the scan's copy
        bad = tmp_path / "bad_domain.parquet"
        table = pq.read_table(good_file)
        domains = table.column("domain").to_numpy().copy()
        domains[25 * L:26 * L] = 7  # every row of token 25
        pq.write_table(table.set_column(table.schema.get_field_index("domain"), "domain",
                                        pa.array(domains, pa.int16())), bad)
        monkeypatch.setattr(F, "KEEP_SCANNED_TOKENS", 1 << 22)
        with open_trace(bad) as reader, pytest.raises(InputError, match="'domain'.*index 7"):
            list(reader.iter_chunks())


def test_optional_columns_absent_read_as_documented(tmp_path):
    meta = make_meta(has_logits=False, has_residency=False)
    arrays = make_arrays(12)
    path = tmp_path / "plain.parquet"
    with TraceWriter(path, meta) as writer:
        writer.write(**{n: arrays[n] for n in ("seq", "pos", "phase", "experts", "weights")})
    _, chunk = read_trace(path)
    assert chunk.logits.shape == (0, L, E) and chunk.residency.shape == (0, L, K)
    assert (chunk.domain == -1).all() and (chunk.token_id == -1).all() and chunk.nll is None
    assert set(pq.ParquetFile(path).schema_arrow.names) == {"seq", "pos", "layer", "phase", "experts",
                                                            "weights"}


def test_write_trace_of_a_read_chunk_reads_back_equal(good_file, tmp_path):
    meta, chunk = read_trace(good_file)
    copy = tmp_path / "copy.parquet"
    write_trace(copy, meta, chunk)
    again = read_trace(copy)[1]
    np.testing.assert_allclose(again.gates, chunk.gates, rtol=1e-6)  # renormalised once more
    again.gates = chunk.gates
    assert chunks_equal(again, chunk)


def test_empty_traces_are_neither_written_nor_opened(good_file, tmp_path):
    path = tmp_path / "empty.parquet"
    with pytest.raises(InputError, match="no tokens were written"), TraceWriter(path, make_meta()):
        pass
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == ["good.parquet"]
    rewrite(good_file, path, pq.read_table(good_file).slice(0, 0))  # a 0-row file written by hand
    with pytest.raises(InputError, match="no rows"):
        open_trace(path)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13, 1000])
def test_chunks_hold_whole_groups_and_join_to_the_whole(tiny_trace, tmp_path, max_tokens):
    source = tiny_trace()
    path = tmp_path / "tiny.parquet"
    with TraceWriter(path, source.meta, row_group_tokens=5) as writer:
        writer.write_chunk(source.chunk)
    _, whole = read_trace(path)
    reader = open_trace(path)
    chunks = list(reader.iter_chunks(max_tokens))
    for chunk in chunks:
        single_group = (chunk.group == chunk.group[0]).all()
        assert chunk.num_tokens <= max_tokens or single_group
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.group[0] == before.group[-1] + 1  # a cut only between groups
    assert chunks_equal(concat_chunks(chunks), whole)
    assert list(map(len, (c.seq for c in reader.iter_chunks(max_tokens)))) == [c.num_tokens for c in chunks]
    # reversed: the same chunks, last first
    backwards = list(reader.iter_chunks_reversed(max_tokens))
    assert len(backwards) == len(chunks)
    assert all(chunks_equal(a, b) for a, b in zip(backwards, chunks[::-1], strict=True))
    # the in-memory source cuts the same way
    memory = list(ArraySource(source.meta, whole).iter_chunks(max_tokens))
    assert all(chunks_equal(a, b) for a, b in zip(memory, chunks, strict=True))
    memory_back = list(ArraySource(source.meta, whole).iter_chunks_reversed(max_tokens))
    assert all(chunks_equal(a, b) for a, b in zip(memory_back, backwards, strict=True))


def test_reads_go_by_row_group_and_chunks_stay_small(tiny_trace, tmp_path, monkeypatch):
    source = tiny_trace(tokens=2000, layers=4, experts=32, seq_tokens=200, prompt_tokens=20)
    path = tmp_path / "larger.parquet"
    with TraceWriter(path, source.meta, row_group_tokens=64) as writer:
        writer.write_chunk(source.chunk)
    rows_read = []
    read_row_group = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        table = read_row_group(self, i, *args, **kwargs)
        rows_read.append((i, table.num_rows))
        return table

    def whole_file(*args, **kwargs):
        raise AssertionError("the reader must not read the whole file")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
    reader = open_trace(path)
    groups = reader._pf.metadata.num_row_groups
    for iterate in (reader.iter_chunks, reader.iter_chunks_reversed):
        rows_read.clear()
        sizes = [(c.num_tokens, (c.group == c.group[0]).all()) for c in iterate(50)]
        assert all(n <= 50 or one_group for n, one_group in sizes)
        assert sum(n for n, _ in sizes) == 2000
        assert max(rows for _, rows in rows_read) <= 64 * 4
        assert sorted(i for i, _ in rows_read) == list(range(groups))  # each row group once


def test_default_chunk_size_follows_the_decoded_bytes(tiny_trace):
    for logits in ("full", "none"):
        source = tiny_trace(tokens=200, layers=6, experts=256, top_k=8, logits=logits)
        chunk = source.chunk
        per_token = sum(getattr(chunk, f.name).nbytes for f in fields(TraceChunk)
                        if getattr(chunk, f.name) is not None) / chunk.num_tokens
        tokens = default_max_tokens(source.meta)
        assert 0.9 * CHUNK_BYTES <= tokens * per_token <= 1.1 * CHUNK_BYTES, (logits, tokens, per_token)
    with_logits = make_meta(num_layers=48, num_experts=512, top_k=10, expert_bytes=[1] * 48,
                            layer_ids=[], dense_bytes=[])
    assert default_max_tokens(with_logits) < default_max_tokens(
        make_meta(**{**asdict(with_logits), "has_logits": False})) / 20


def test_interrupted_write_leaves_no_file(tmp_path):
    path = tmp_path / "out.parquet"
    arrays = make_arrays()
    with pytest.raises(KeyboardInterrupt), TraceWriter(path, make_meta(), row_group_tokens=4) as writer:
        writer.write(**arrays)
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"previous")
    with pytest.raises(InputError), TraceWriter(path, make_meta()) as writer:
        bad = dict(arrays, experts=np.full_like(arrays["experts"], E))
        writer.write(**bad)
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["out.parquet"]


# --- bad input ---------------------------------------------------------------------------------


def rewrite(good: Path, out: Path, table: pa.Table | None = None, meta: dict | None = None,
            drop_meta: bool = False) -> Path:
    table = table if table is not None else pq.read_table(good)
    metadata = dict(pq.read_schema(good).metadata)
    if meta is not None:
        metadata[META_KEY] = json.dumps(meta).encode()
    if drop_meta:
        del metadata[META_KEY]
    pq.write_table(table.replace_schema_metadata(metadata), out)
    return out


def written(out: Path, data: bytes) -> Path:
    out.write_bytes(data)
    return out


def take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    return table.take(pa.array(rows))


def meta_dict(**changes) -> dict:
    return {**asdict(make_meta()), **changes}


def set_at(row: int, col: int, value):
    def change(values):
        values[row, col] = value
    return change


def duplicate_first(values):
    values[10, 1] = values[10, 0]


BAD_FILES = {
    # name: (how to make it from the good file, words the message must contain)
    "not_parquet": (lambda good, out: written(out, b"turn,phase\n1,2\n"), ["Parquet"]),
    "truncated": (lambda good, out: written(out, good.read_bytes()[:900]), ["Parquet"]),
    "no_metadata": (lambda good, out: rewrite(good, out, drop_meta=True), ["'moe_trace'"]),
    "bad_json": (lambda good, out: pq.write_table(pq.read_table(good).replace_schema_metadata(
        {META_KEY: b"{not json"}), out) or out, ["'moe_trace'", "JSON"]),
    "schema_version": (lambda good, out: rewrite(good, out, meta=meta_dict(schema_version=3)),
                       ["'schema_version'", "supports schema_version 1 and 2"]),
    "expert_bytes_length": (lambda good, out: rewrite(good, out, meta=meta_dict(expert_bytes=[1, 2])),
                            ["'expert_bytes'", "one byte size per MoE layer"]),
    "top_k_mismatch": (lambda good, out: rewrite(good, out, meta=meta_dict(top_k=3)),
                       ["'experts'", "top_k 3"]),
    "num_experts_mismatch": (lambda good, out: rewrite(good, out, meta=meta_dict(num_experts=E + 1)),
                             ["'logits'", f"num_experts {E + 1}"]),
    "missing_column": (lambda good, out: rewrite(good, out, pq.read_table(good).drop_columns(["weights"])),
                       ["'weights'", "missing"]),
    "missing_logits": (lambda good, out: rewrite(good, out, pq.read_table(good).drop_columns(["logits"])),
                       ["'logits'", "has_logits"]),
    "wrong_type": (lambda good, out: rewrite(good, out, pq.read_table(good).set_column(
        0, "seq", pq.read_table(good).column("seq").cast(pa.int64()))), ["'seq'", "int32"]),
    "missing_layer_row": (lambda good, out: rewrite(good, out, take_rows(
        pq.read_table(good), np.delete(np.arange(40 * L), 7))), ["num_layers", "missing layers"]),
    "layers_out_of_order": (lambda good, out: rewrite(good, out, take_rows(
        pq.read_table(good), np.r_[0:6, 7, 6, 8:40 * L])), ["'layer'", "row 6"]),
    "tokens_out_of_order": (lambda good, out: rewrite(good, out, take_rows(
        pq.read_table(good), np.r_[0:3 * L, 4 * L:5 * L, 3 * L:4 * L, 5 * L:40 * L])),
        ["'seq/pos'", "order rows"]),
    "expert_too_large": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "experts", set_at(20, 1, E))), ["'experts'", f"expert id {E}", "0..15"]),
    "expert_negative": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "experts", set_at(20, 0, -3))), ["'experts'", "expert id -3"]),
    "duplicate_expert": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "experts", duplicate_first)), ["'experts'", "repeats"]),
    "weight_nan": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "weights", set_at(30, 0, np.nan))), ["'weights'", "not finite"]),
    "weight_inf": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "weights", set_at(30, 1, np.inf))), ["'weights'"]),
    "weight_negative": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "weights", set_at(31, 0, -0.5))), ["'weights'", "non-negative"]),
    "logit_nan": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "logits", set_at(50, 3, np.nan))), ["'logits'", "NaN"]),
    "residency_value": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "residency", set_at(5, 0, 7))), ["'residency'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_one_line_naming_file_field_and_fix(case, good_file, tmp_path, capsys):
    make, words = BAD_FILES[case]
    bad = make(good_file, tmp_path / f"{case}.parquet")
    with pytest.raises(InputError) as caught:
        read_trace(bad)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(bad)), message
    assert all(word in message for word in words), message
    assert ";" in message  # the fix follows the problem
    # the CLI: exit 2, one line on stderr, nothing on stdout, nothing written
    before = sorted(tmp_path.iterdir())
    assert main(["info", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("moe-trace: error: ")
    assert sorted(tmp_path.iterdir()) == before


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such trace file"):
        open_trace(tmp_path / "absent.parquet")


def test_writer_rejects_bad_metadata(tmp_path):
    with pytest.raises(InputError, match="'expert_bytes'"):
        TraceWriter(tmp_path / "x.parquet", make_meta(expert_bytes=[1]))
    with pytest.raises(InputError, match="'top_k'"):
        TraceWriter(tmp_path / "x.parquet", make_meta(top_k=E + 1))
    assert list(tmp_path.iterdir()) == []


def test_row_groups_that_split_tokens_read_the_same(good_file, tmp_path):
    odd = tmp_path / "odd.parquet"
    pq.write_table(pq.read_table(good_file), odd, row_group_size=5)  # 5 rows: tokens of 3 rows split
    assert pq.ParquetFile(odd).metadata.num_row_groups > 1
    _, whole = read_trace(good_file)
    reader = open_trace(odd)
    for max_tokens in (1, 4, 100):
        assert chunks_equal(concat_chunks(list(reader.iter_chunks(max_tokens))), whole)
        assert chunks_equal(concat_chunks(list(reader.iter_chunks_reversed(max_tokens))[::-1]), whole)


def test_plan_from_a_stream_of_pieces_equals_the_plan_from_one():
    rng = np.random.default_rng(1)
    for _ in range(50):
        num_tokens = int(rng.integers(1, 300))
        starts = np.flatnonzero(rng.random(num_tokens) < rng.uniform(0.05, 1.0))
        starts = np.union1d([0], starts)
        max_tokens = int(rng.integers(1, 40))
        whole = plan_chunks([starts], num_tokens, max_tokens)
        cuts = np.sort(rng.integers(0, starts.size + 1, 4))
        pieces = np.split(starts, cuts)
        assert np.array_equal(plan_chunks(iter(pieces), num_tokens, max_tokens), whole)
        assert whole[0, 0] == 0 and whole[-1, 1] == num_tokens
        assert (whole[1:, 0] == whole[:-1, 1]).all() and np.isin(whole[:, 0], starts).all()
        group_of = np.searchsorted(starts, whole[:, 0])
        assert (whole[:, 2] == group_of).all()
        sizes = whole[:, 1] - whole[:, 0]
        one_group = np.searchsorted(starts, whole[:, 1], side="left") - group_of == 1
        assert ((sizes <= max_tokens) | one_group).all()


def test_repack_is_lossless_by_default_and_rounds_logits_to_a_quantum(tiny_trace, tmp_path):
    from traces.format import repack_trace

    src = tiny_trace(tokens=200, experts=32)
    path, exact, rounded = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.parquet"
    write_trace(path, src.meta, src.chunk)
    repack_trace(path, exact, model_name="renamed")
    m0, c0 = read_trace(path)
    m1, c1 = read_trace(exact)
    assert m1.model == "renamed" and "logits_quantum" not in m1.extra
    for name in ("experts", "gates", "logits", "seq", "pos", "phase"):
        np.testing.assert_array_equal(getattr(c0, name), getattr(c1, name))
    q = 1 / 32
    repack_trace(path, rounded, logits_quantum=q)
    m2, c2 = read_trace(rounded)
    assert m2.extra["logits_quantum"] == q
    np.testing.assert_array_equal(c0.experts, c2.experts)
    np.testing.assert_array_equal(c0.gates, c2.gates)
    err = np.abs(c2.logits - c0.logits)
    assert err.max() <= q / 2 + 1e-2 and err.max() > 0  # rounded (plus float16 spacing), not exact
    assert np.allclose(c2.logits / q, np.round(c2.logits / q), atol=0.05)


def test_repack_refuses_a_bad_quantum_and_writes_nothing(tiny_trace, tmp_path):
    from traces.format import repack_trace

    src = tiny_trace()
    path = tmp_path / "a.parquet"
    write_trace(path, src.meta, src.chunk)
    with pytest.raises(InputError, match="logits-quantum"):
        repack_trace(path, tmp_path / "out.parquet", logits_quantum=2.0)
    assert not (tmp_path / "out.parquet").exists()
    assert main(["repack", str(path), str(tmp_path / "out.parquet"), "--logits-quantum", "3"]) == 2
    assert not (tmp_path / "out.parquet").exists()


# --- top-R logits ------------------------------------------------------------------------------

R = 5


def top_r_expected(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Dense logits as a top-R trace reads back: float16 values at ``keep`` (ids), -inf elsewhere."""
    dense = np.full(logits.shape, -np.inf, np.float32)
    values = np.take_along_axis(logits, keep, -1).astype(np.float16).astype(np.float32)
    np.put_along_axis(dense, keep, values, -1)
    return dense


@pytest.fixture
def top_r_file(tmp_path) -> Path:
    path = tmp_path / "top_r.parquet"
    with TraceWriter(path, make_meta(logits_top_r=R), row_group_tokens=7) as writer:
        writer.write(**make_arrays())
    return path


def test_top_r_logits_round_trip(top_r_file, tmp_path, capsys):
    arrays = make_arrays()
    meta, chunk = read_trace(top_r_file)
    assert meta == make_meta(logits_top_r=R) and meta.has_logits
    schema = pq.read_schema(top_r_file)
    assert schema.field("logits").type.byte_width == 2 * R and schema.field("logit_ids").type.byte_width == 2 * R
    stored = column_values(pq.read_table(top_r_file).column("logits").combine_chunks(), "logits")
    assert (np.diff(stored.astype(np.float32), axis=-1) <= 0).all()  # descending
    group = pq.ParquetFile(top_r_file).metadata.row_group(0)  # no min/max of a token-layer's bytes
    described = {group.column(i).path_in_schema: group.column(i).is_stats_set for i in range(group.num_columns)}
    assert described["pos"] and not any(described[c] for c in ("experts", "weights", "logits", "logit_ids"))
    top = np.argsort(-arrays["logits"], axis=-1)[..., :R]
    assert chunk.logits.dtype == np.float32 and chunk.logits.shape == (40, L, E)
    np.testing.assert_array_equal(chunk.logits, top_r_expected(arrays["logits"], top))
    np.testing.assert_array_equal(chunk.experts, arrays["experts"])
    # written again from the dense logits: the same file contents
    copy = tmp_path / "copy.parquet"
    write_trace(copy, meta, chunk)
    np.testing.assert_array_equal(read_trace(copy)[1].logits, chunk.logits)
    assert main(["info", str(top_r_file)]) == 0
    assert f"logits top-{R}, residency yes" in capsys.readouterr().out
    # all-E traces keep the metadata JSON earlier readers know
    assert "logits_top_r" not in json.loads(make_meta().to_json())


@pytest.mark.parametrize("overrides", [
    {},
    dict(logits_top_r=8, lookahead_depth=2, lookahead_top_r=4, lookahead_source="moe_input"),
    dict(extra={"versions": {"torch": "2.13", "sizes": (1, 2)}, "windows": [[1, 2], (3,)], "band": Band(0.5, [1.0])}),
])
def test_the_metadata_json_is_the_one_a_deep_copy_of_the_fields_gives(overrides):
    """``to_json`` reads the fields as they are: the JSON (keys sorted, defaults left out as
    earlier versions wrote them) is the one :func:`dataclasses.asdict` gives, with nested dicts,
    lists, tuples and a dataclass inside ``extra``; and a value JSON cannot hold is refused."""
    meta = make_meta(**overrides)
    values = asdict(meta)
    for name in ("logits_top_r", "lookahead_depth", "lookahead_top_r", "lookahead_source"):
        if not values[name]:
            del values[name]
    assert meta.to_json() == json.dumps(values, sort_keys=True)
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        make_meta(extra={"ids": {1, 2}}).to_json()


def test_top_r_keeps_the_selected_experts_when_the_router_did_not_pick_the_highest(tmp_path):
    arrays = make_arrays()
    arrays["experts"] = np.argsort(-arrays["logits"], axis=-1)[..., [0, E - 1]]  # rank 1: the lowest
    path = tmp_path / "biased.parquet"
    with TraceWriter(path, make_meta(logits_top_r=R)) as writer:
        writer.write(**arrays)
    order = np.argsort(-arrays["logits"], axis=-1)
    keep = np.concatenate([order[..., :R - 1], order[..., E - 1:]], axis=-1)
    np.testing.assert_array_equal(read_trace(path)[1].logits, top_r_expected(arrays["logits"], keep))


def replace_first_id(values):
    """Row 20 loses its first id (rank 0's expert, the highest logit) to an id not listed."""
    values[20, 0] = next(e for e in range(E) if e not in values[20])


BAD_TOP_R = {
    "r_below_k": (lambda good, out: rewrite(good, out, meta=meta_dict(logits_top_r=1)),
                  ["'logits_top_r'", "is 1", "top_k 2"]),
    "r_without_logits": (lambda good, out: rewrite(good, out, meta=meta_dict(logits_top_r=R, has_logits=False)),
                         ["'logits_top_r'", "has_logits"]),
    "width_mismatch": (lambda good, out: rewrite(good, out, meta=meta_dict(logits_top_r=R + 1)),
                       ["'logits'", f"logits_top_r {R + 1}"]),
    "missing_ids": (lambda good, out: rewrite(good, out, pq.read_table(good).drop_columns(["logit_ids"]),
                                              meta=meta_dict(logits_top_r=R)),
                    ["'logit_ids'", "missing", f"logits_top_r {R}"]),
    "selected_missing": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "logit_ids", replace_first_id)), ["'logit_ids'", "selected expert", "not among"]),
    "duplicate_id": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "logit_ids", duplicate_first)), ["'logit_ids'", "repeat"]),
    "id_out_of_range": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "logit_ids", set_at(20, R - 1, E))), ["'logit_ids'", f"expert id {E}"]),
    "logit_nan": (lambda good, out: rewrite(good, out, with_values(
        pq.read_table(good), "logits", set_at(50, 3, np.nan))), ["'logits'", "NaN"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TOP_R))
def test_bad_top_r_file_raises_one_line_naming_the_field(case, top_r_file, tmp_path):
    make, words = BAD_TOP_R[case]
    bad = make(top_r_file, tmp_path / f"{case}.parquet")
    with pytest.raises(InputError) as caught:
        read_trace(bad)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(bad)) and ";" in message, message
    assert all(word in message for word in words), message


def test_writer_rejects_top_r_below_top_k_and_nan_logits(tmp_path):
    with pytest.raises(InputError, match="'logits_top_r' is 1, outside top_k 2"):
        TraceWriter(tmp_path / "x.parquet", make_meta(logits_top_r=1))
    arrays = make_arrays()
    lowest = int(np.argmin(arrays["logits"][3, 1]))
    arrays["logits"][3, 1, lowest] = np.nan  # outside the top R: checked before the top R are kept
    with pytest.raises(InputError, match="'logits' at seq .* layer 1: router logits contain NaN"), \
            TraceWriter(tmp_path / "x.parquet", make_meta(logits_top_r=R)) as writer:
        writer.write(**arrays)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_any_nan_finds_a_nan_in_any_block(dtype):
    from traces.format import _any_nan

    values = np.zeros((5, 3, 7), dtype)
    assert not _any_nan(values, block=4)
    for flat in (0, 3, 4, 104):  # first, block end, next block's start, last of a partial block
        v = values.copy()
        v.reshape(-1)[flat] = np.nan
        assert _any_nan(v, block=4) and _any_nan(v)
    v = values.copy()
    v[...] = np.inf  # infinities are no NaN
    assert not _any_nan(v, block=4)


def test_top_r_trace_substitutes_as_the_full_trace_when_the_best_resident_is_in_the_top_r(tmp_path):
    """The same substitutes as with all logits wherever the highest-logit eligible resident is
    among the token's R highest; with R = k (every resident outside) the choices differ."""
    from engine_cases import assert_same, decide, params, run_both

    rng = np.random.default_rng(3)
    tokens, layers, experts, k, r = 80, 2, 16, 2, 8
    # a popular core of 6 experts per layer whose members drift: the cache holds mostly experts
    # near the top, and at times one that has fallen out of the top R
    drift = np.cumsum(rng.normal(0, 0.4, (tokens, layers, experts)), axis=0)
    logits = (np.where(np.arange(experts) < 6, 3.0, 0.0) + drift + rng.gumbel(size=drift.shape))
    logits = logits.astype(np.float32)
    arrays = dict(seq=np.zeros(tokens, np.int32), pos=np.arange(tokens, dtype=np.int32),
                  phase=np.full(tokens, PHASE_DECODE, np.int8),
                  experts=np.argsort(-logits, axis=-1)[..., :k],
                  weights=rng.uniform(0.1, 1.0, (tokens, layers, k)).astype(np.float32), logits=logits)
    base = dict(model="m", num_layers=layers, num_experts=experts, top_k=k, expert_bytes=[90] * layers,
                has_logits=True)

    def source(top_r: int) -> ArraySource:
        path = tmp_path / f"r{top_r}.parquet"
        with TraceWriter(path, TraceMeta(**base, logits_top_r=top_r)) as writer:
            writer.write(**arrays)
        return ArraySource(*read_trace(path))

    def substitutes(src: ArraySource) -> list:
        p = params(src.meta, budget_experts=5, rule="first_choice")
        return [[step.substitutes for step in token] for token in decide(src, p)[1]], p

    full = source(0)
    subs_full, p = substitutes(full)
    top = np.argsort(-logits, axis=-1)[..., :r]
    chosen = [(t, layer, s) for t, token in enumerate(subs_full) for layer, step in enumerate(token)
              for s in step if s >= 0]
    assert len(chosen) > 30 and all(s in top[t, layer] for t, layer, s in chosen)  # the premise
    assert substitutes(source(r))[0] == subs_full
    assert_same(run_both(source(r), p), run_both(full, p))
    assert substitutes(source(k))[0] != subs_full


def test_the_bundled_trace_keeps_its_content_with_checksums_and_a_content_hash():
    """Rewritten by ``moe-trace repack --compact-logits`` to add page checksums and a content
    hash: the hash is that of the file's decoded content before (computed from the original)."""
    fixture = Path(__file__).resolve().parent.parent / "traces" / "samples" / "fixture.parquet"
    original = "sha256:2661e74c5bfdc69dbb0f45a846a9ef76e10feccdf74564b4cfff81ca6b076252"
    with open_trace(fixture) as reader:
        assert reader.content_hash == original and reader.verify() == original
    assert fixture.stat().st_size < 20 * 2**20


@pytest.mark.parametrize("k", [1, 2, 3, 10, 64])
def test_repeated_ids_are_found_in_every_row_that_has_them(k):
    from traces.format import _repeats

    rng = np.random.default_rng(k)
    ids = rng.integers(0, k * k + 2, (200, 5, k))  # about 40 % of the rows repeat an id (k > 1)
    expected = np.array([[len(set(row)) < k for row in layer] for layer in ids])
    for dtype in (np.int16, np.int32, np.int64):
        assert np.array_equal(_repeats(ids.astype(dtype)), expected)
    assert 0 < expected.mean() < 1 or k == 1


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("row", [(0, 0), (17, 1), (39, L - 1)])
def test_a_repeated_top_r_id_is_found_at_its_token_and_layer(row, one_pass, monkeypatch):
    """The whole-table count finds that some row repeats an id; the first such row is named. With
    ``one_pass`` (as for a capture's large units) the one-pass check finds it first."""
    import traces.format as F
    from traces.format import find_problem

    consulted = []
    real = F._top_r_ids_ok
    monkeypatch.setattr(F, "_top_r_ids_ok", lambda *a: (consulted.append(1), real(*a))[1])
    monkeypatch.setattr(F, "_one_pass_pays", lambda size: one_pass)

    arrays = make_arrays()
    ids = np.argsort(-arrays["logits"], axis=-1)[..., :R].astype(np.int16)
    cols = {k: arrays[k] for k in ("seq", "pos", "phase", "experts", "weights")}
    cols.update(logits=np.take_along_axis(arrays["logits"], ids, -1).astype(np.float16), logit_ids=ids)
    meta = make_meta(logits_top_r=R, has_residency=False)
    assert find_problem(meta, cols) is None
    t, layer = row
    ids[t, layer, R - 1] = ids[t, layer, 0]  # the last id repeats the first
    if row != (39, L - 1):  # a later repeat too: the first is named
        ids[39, L - 1, R - 1] = ids[39, L - 1, 0]
    problem = find_problem(meta, cols)
    assert (problem.column, problem.token, problem.layer) == ("logit_ids", t, layer) and "repeats" in problem.what
    assert len(consulted) == (2 if one_pass else 0)  # the clean unit, then the bad one


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_top_r_check_agrees_with_the_numpy_checks(seed):
    """traces.fastcheck gates the NumPy checks: it must say "bad" exactly where they name a problem."""
    from traces.fastcheck import top_r_ids_ok
    from traces.format import _top_r_problem

    rng = np.random.default_rng(seed)
    outcomes = set()
    for _ in range(60):
        experts_n = int(rng.choice([8, 63, 64, 65, 130, 512]))
        k = int(rng.integers(1, min(8, experts_n) + 1))
        r = int(rng.integers(k, min(70, experts_n) + 1))
        n, layers = int(rng.integers(1, 12)), int(rng.integers(1, 4))
        ids = np.argsort(rng.random((n, layers, experts_n)), axis=-1)[..., :r]
        experts = ids[..., rng.permutation(r)[:k]].copy()  # the selected experts are among the ids
        t, layer = int(rng.integers(n)), int(rng.integers(layers))
        fault = rng.integers(5)
        if fault == 1:  # an id out of range
            ids[t, layer, rng.integers(r)] = rng.choice([-1, experts_n, experts_n + 64])
        elif fault == 2 and r > 1:  # a repeat
            i, j = rng.choice(r, 2, replace=False)
            ids[t, layer, i] = ids[t, layer, j]
        elif fault == 3 and r < experts_n:  # a selected expert the ids do not list
            absent = np.setdiff1d(np.arange(experts_n), ids[t, layer])
            experts[t, layer, rng.integers(k)] = rng.choice(absent)
        ids, experts = ids.astype(rng.choice([np.int16, np.int32, np.int64])), experts.astype(np.int16)
        if fault == 4:  # strided views, as of a wider array
            wide = np.zeros((n, layers, 2 * r), ids.dtype)
            wide[..., ::2], ids = ids, wide[..., ::2]
            experts = np.repeat(experts, 2, axis=-1)[..., ::2]

        def first(mask, layers=layers):
            flat = int(np.argmax(mask.reshape(-1)))
            return flat // layers, flat % layers

        expected = _top_r_problem(ids, experts, experts_n, first) is None
        assert top_r_ids_ok(ids, experts, experts_n) == expected, (fault, experts_n, r, k)
        outcomes.add(expected)
    assert outcomes == {True, False}


@pytest.mark.parametrize("seed", range(4))
def test_the_one_pass_weight_check_agrees_with_the_numpy_check(seed, monkeypatch):
    """traces.fastcheck.weights_ok stands in for the NumPy check (find_problem names the row only
    where it says no): the two must give the same answer, also on -0.0, subnormals and views."""
    import traces.format as F
    from traces.fastcheck import weights_ok

    rng = np.random.default_rng(seed)
    outcomes = set()
    for _ in range(80):
        n, layers, k = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 12))
        w = rng.random((n, layers, k)).astype(rng.choice([np.float32, np.float64]))
        t, layer, j = int(rng.integers(n)), int(rng.integers(layers)), int(rng.integers(k))
        fault = rng.integers(7)
        if fault == 1:
            w[t, layer, j] = rng.choice([np.nan, np.inf, -np.inf, -1e-30])
        elif fault == 2:  # a token-layer of zeros, or of zeros of both signs
            w[t, layer] = rng.choice([0.0, -0.0], k)
        elif fault == 3:  # tiny but positive: fine
            w[t, layer] = np.finfo(w.dtype).smallest_subnormal
        elif fault == 4:  # a strided view
            wide = np.zeros((n, layers, 2 * k), w.dtype)
            wide[..., ::2], w = w, wide[..., ::2]
        monkeypatch.setattr(F, "_one_pass_pays", lambda size: False)
        expected = F._plausible_weights(w)
        assert weights_ok(w) == expected, (fault, w[t, layer])
        monkeypatch.setattr(F, "_one_pass_pays", lambda size: True)
        assert F._plausible_weights(w) == expected
        outcomes.add(expected)
    assert outcomes == {True, False}


@pytest.mark.parametrize("k", [1, 2, 7, 8, 9, 10, 15, 16, 17, 63, 64, 65, 127, 128, 129])
def test_one_pass_gates_are_numpys_bit_for_bit(k, monkeypatch):
    """normalised_gates through traces.fastcheck (one pass, NumPy's summation order) gives the
    float32 bits NumPy's division by the summed weights gives, at every width k (above the
    128-value block it declines and NumPy's path runs); overflowing sums are widened and bad
    weights refused as on NumPy's path."""
    import traces.format as F
    from traces.fastcheck import gates

    rng = np.random.default_rng(k)
    w = (rng.random((37, 5, k)) * 10.0 ** rng.integers(-8, 9, (37, 5, k))).astype(np.float32)
    w[3, 1] = 3e38  # the float32 sum overflows (k > 1): NumPy's path widens this token-layer
    assert (gates(w) is None) == (k > 1)
    w[3, 1] = 1.0
    fast = gates(w)
    assert (fast is None) == (k > 128)
    monkeypatch.setattr(F, "_one_pass_pays", lambda size: False)
    expected = F.normalised_gates(w)
    if fast is not None:
        assert fast.dtype == np.float32 and fast.tobytes() == expected.tobytes()
    w[3, 1] = 3e38
    expected_wide = F.normalised_gates(w)
    monkeypatch.setattr(F, "_one_pass_pays", lambda size: True)
    assert F.normalised_gates(w).tobytes() == expected_wide.tobytes()
    w[0, 0] = 0.0
    with pytest.raises(ValueError, match="positive sum"):
        F.normalised_gates(w)


def test_a_writer_keeps_no_view_of_a_write_it_flushed_part_of(tmp_path):
    """One write of 1.5 row groups flushes one and keeps the rest: a copy, since the caller may
    reuse its arrays before the next write."""
    arrays = make_arrays(tokens=40)
    first = {k: v[:30].copy() for k, v in arrays.items()}
    path = tmp_path / "t.parquet"
    with TraceWriter(path, make_meta(), row_group_tokens=20) as writer:
        writer.write(**first)
        for v in first.values():  # the caller's buffers, filled with something else
            v[...] = v[::-1] if v.ndim == 1 else 0
        writer.write(**{k: v[30:] for k, v in arrays.items()})
    _, chunk = read_trace(path)
    np.testing.assert_array_equal(chunk.experts, arrays["experts"])
    np.testing.assert_array_equal(chunk.pos, arrays["pos"])
