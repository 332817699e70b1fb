"""Every chunk source with every option: the same chunks from both logits encodings, from memory,
from the trace cache (while it is built and after), and through a limit; ``logit_order`` is the
lexsort order; the cache keeps float16 and is built by the first full pass."""
from __future__ import annotations

import itertools
from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import simulator.trace_cache as trace_cache
from simulator.trace_cache import cache_root, cached_source
from traces.format import (
    PHASE_DECODE,
    PHASE_PREFILL,
    ArraySource,
    TraceChunk,
    TraceMeta,
    TraceWriter,
    concat_chunks,
    logit_order,
    open_trace,
    read_trace,
    recorded_content_hash,
    repack_trace,
    slice_chunk,
)
from traces.sources import LimitedSource

L, E, K, T = 3, 80, 2, 60
ORDERS = (0, 1, 4, 64)


def lexsort_order(logits: np.ndarray, r: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """The reference: ids by descending logit, ties by lower id, the ``exclude`` ids left out."""
    ids = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
    order = np.lexsort((ids, -logits.astype(np.float64)), axis=-1)
    if exclude is not None:  # the excluded ids moved behind the others, which keep their order
        dropped = (order[..., :, None] == exclude[..., None, :]).any(axis=-1)
        order = np.take_along_axis(order, np.argsort(dropped, axis=-1, kind="stable"), axis=-1)
    return order[..., :r].astype(np.int16)


def write(path: Path, top_r: int = 0, logits: bool = True, seed: int = 0) -> Path:
    """A trace with many tied logits (small integers, -0.0 and -inf among them) and prefill groups."""
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(4, dtype=np.int32), T // 4)
    pos = np.tile(np.arange(T // 4, dtype=np.int32), 4)
    phase = np.where(pos < 5, PHASE_PREFILL, PHASE_DECODE).astype(np.int8)
    values = rng.integers(-3, 4, (T, L, E)).astype(np.float32)
    values[0, 0, :4] = [-0.0, 0.0, -np.inf, -np.inf]
    experts = lexsort_order(values, K)
    arrays = dict(seq=seq, pos=pos, phase=phase, experts=experts,
                  weights=rng.uniform(0.1, 1.0, (T, L, K)).astype(np.float32),
                  domain=rng.integers(0, 2, T).astype(np.int16))
    meta = TraceMeta(model="ties", num_layers=L, num_experts=E, top_k=K, expert_bytes=[64] * L,
                     has_logits=logits, logits_top_r=top_r, domains=["a", "b"])
    with TraceWriter(path, meta, row_group_tokens=9) as writer:
        writer.write(**arrays, logits=values if logits else None)
    return path


def chunks_equal(a: TraceChunk, b: TraceChunk) -> bool:
    for f in fields(TraceChunk):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            if not (x is None and y is None):
                return False
        elif x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
            return False
    return True


def expected(whole: TraceChunk, meta: TraceMeta, max_tokens, reverse: bool, logits: bool,
             order_r: int) -> list[TraceChunk]:
    """The reference chunks: an in-memory source's cut, logits dropped or ordered as asked."""
    chunks = list(ArraySource(meta, whole).iter_chunks(max_tokens or 10**9))
    for c in chunks:
        if order_r:
            c.logit_order = lexsort_order(c.logits, min(order_r, E - K), c.experts)
        if not logits:
            c.logits = whole.logits[:0]
    return chunks[::-1] if reverse else chunks


@pytest.fixture(params=["full", "top_r"])
def trace(request, tmp_path) -> tuple[Path, Path]:
    """(default encoding, compact encoding as every earlier version wrote) of the same trace."""
    path = write(tmp_path / "t.parquet", top_r=8 if request.param == "top_r" else 0)
    legacy = tmp_path / "legacy.parquet"
    repack_trace(path, legacy, compact_logits=True)
    assert pq.read_schema(legacy).field("logits").type == pa.list_(pa.float16(), 8 if request.param == "top_r" else E)
    for name, width, value in (("experts", 2, pa.int16()), ("weights", 4, pa.float32())):  # bytes; lists compact
        assert pq.read_schema(path).field(name).type == pa.binary(width * K)
        assert pq.read_schema(legacy).field(name).type == pa.list_(value, K)
    if request.param == "top_r":  # the ids: int16 bytes by default, a list of int16 compact
        assert pq.read_schema(path).field("logit_ids").type == pa.binary(16)
        assert pq.read_schema(legacy).field("logit_ids").type == pa.list_(pa.int16(), 8)
    return path, legacy


def test_every_source_and_option_gives_the_same_chunks(trace, tmp_path):
    path, legacy = trace
    meta, whole = read_trace(path)
    assert chunks_equal(read_trace(legacy)[1], whole)
    with open_trace(path) as a, open_trace(legacy) as b:  # the content, not its encoding
        assert a.content_hash == b.content_hash == a.verify() == b.verify()
    grid = itertools.product([True, False], ORDERS, [False, True], [None, 7])
    for n, (logits, order_r, reverse, max_tokens) in enumerate(grid):
        cache = tmp_path / f"cache{n}"
        sources = {"reader": lambda: open_trace(path), "compact encoding": lambda: open_trace(legacy),
                   "memory": lambda: ArraySource(meta, whole),
                   "memory, order kept": lambda: ArraySource(meta, whole, keep_order=True),
                   "cache, building": lambda c=cache: cached_source(path, c),  # the first pass builds it
                   "cache, built": lambda c=cache: cached_source(path, c),
                   "limited reader": lambda: LimitedSource(open_trace(path), T),
                   "limited cache": lambda c=cache: LimitedSource(cached_source(path, c), T)}
        want = expected(whole, meta, max_tokens, reverse, logits, order_r)
        for name, make in sources.items():
            source = make()
            if name.startswith("cache"):
                assert source.built == (name == "cache, building")
            iterate = source.iter_chunks_reversed if reverse else source.iter_chunks
            got = list(iterate(max_tokens, logits=logits, order_r=order_r))
            assert len(got) == len(want) and all(map(chunks_equal, got, want)), (
                name, logits, order_r, reverse, max_tokens)


def test_an_in_memory_source_keeps_its_order_once_ranked(trace):
    """``keep_order``: ranked once over the whole trace, served as views in later passes; the
    same rows as a source that ranks every chunk."""
    meta, whole = read_trace(trace[0])
    kept, plain = ArraySource(meta, whole, keep_order=True), ArraySource(meta, whole)
    assert kept.keeps_logit_order and not getattr(plain, "keeps_logit_order", False)
    first = list(kept.iter_chunks(5, order_r=3))
    again = list(kept.iter_chunks_reversed(7, order_r=3))[::-1]
    base = first[0].logit_order.base
    assert base is not None and all(c.logit_order.base is base for c in first + again)
    for mine, theirs in ((first, plain.iter_chunks(5, order_r=3)), (again, plain.iter_chunks(7, order_r=3))):
        theirs = list(theirs)
        assert len(mine) == len(theirs) and all(map(chunks_equal, mine, theirs))
    assert list(kept.iter_chunks(order_r=2))[0].logit_order.shape[-1] == 2  # another R, ranked apart


@pytest.mark.parametrize("r", [1, 4, 64])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("block_rows", [None, 7])  # 7: 600 token-layers in blocks, one cut inside a token
def test_logit_order_is_the_lexsort_order_with_ties(r, dtype, block_rows, monkeypatch):
    import traces.format

    if block_rows:
        monkeypatch.setattr(traces.format, "_ORDER_BLOCK_ROWS", block_rows)
    rng = np.random.default_rng(r)
    logits = rng.integers(-4, 4, (200, 3, 96)).astype(dtype)  # ties everywhere
    logits[0, 0, :3] = [-0.0, 0.0, -np.inf]
    logits[1, 1] = -np.inf
    logits[2, 2] = rng.standard_normal(96).astype(dtype)
    got = logit_order(logits, r)
    assert got.dtype == np.int16 and got.shape == (200, 3, r)
    np.testing.assert_array_equal(got, lexsort_order(logits, r))
    selected = np.argsort(rng.random(logits.shape), axis=-1)[..., :5]  # 5 distinct ids per row
    got = logit_order(logits, r, exclude=selected)
    np.testing.assert_array_equal(got, lexsort_order(logits, r, selected))
    assert not (got[..., :, None] == selected[..., None, :]).any()
    # the same over the ids of a sparse (top-R) row, 90 ids in any order, no -inf among them
    finite = rng.integers(-4, 4, logits.shape).astype(dtype)
    keep = np.argsort(rng.random(logits.shape), axis=-1)[..., :90]
    sparse = np.take_along_axis(finite, keep, axis=-1)
    dense = np.full_like(logits, -np.inf)
    np.put_along_axis(dense, keep, sparse, axis=-1)
    chosen = np.take_along_axis(keep, np.argsort(rng.random(keep.shape), axis=-1)[..., :5], axis=-1)
    np.testing.assert_array_equal(logit_order(sparse, min(r, 85), keep, exclude=chosen),
                                  logit_order(dense, min(r, 85), exclude=chosen))


def test_a_trace_without_logits_has_no_order(tmp_path):
    path = write(tmp_path / "plain.parquet", logits=False)
    for source in (open_trace(path), cached_source(path, tmp_path / "c"), ArraySource(*read_trace(path))):
        chunk = next(iter(source.iter_chunks(logits=False)))
        assert chunk.logits.shape == (0, L, E) and chunk.logit_order.shape == (0, L, 0)
        with pytest.raises(ValueError, match="order_r needs a trace with logits"):
            source.iter_chunks(order_r=4)


def test_logits_false_reads_no_logits_column(tmp_path, monkeypatch):
    path = write(tmp_path / "t.parquet")
    read = []
    read_row_group = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kwargs):
        read.append(tuple(columns))
        return read_row_group(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    chunks = list(open_trace(path).iter_chunks(logits=False))
    assert read and not any("logits" in columns for columns in read)
    assert sum(c.num_tokens for c in chunks) == T and all(c.logits.shape[0] == 0 for c in chunks)


def test_the_cache_keeps_float16_within_20_percent_of_the_logits(tmp_path):
    rng = np.random.default_rng(0)
    tokens, layers, experts, k = 300, 4, 512, 10
    logits = rng.standard_normal((tokens, layers, experts)).astype(np.float16)
    meta = TraceMeta(model="wide", num_layers=layers, num_experts=experts, top_k=k,
                     expert_bytes=[1] * layers, has_logits=True)
    path = tmp_path / "wide.parquet"
    with TraceWriter(path, meta) as writer:
        writer.write(seq=np.zeros(tokens, np.int32), pos=np.arange(tokens, dtype=np.int32),
                     phase=np.ones(tokens, np.int8), experts=lexsort_order(logits, k),
                     weights=np.ones((tokens, layers, k), np.float32), logits=logits)
    cache = cached_source(path, tmp_path / "c")
    for _ in cache.iter_chunks(order_r=64):  # builds the copy and keeps the order for R = 64
        pass
    cache = cached_source(path, tmp_path / "c")
    for _ in cache.iter_chunks(order_r=64):
        pass
    on_disk = sum(p.stat().st_size for p in cache.directory.iterdir())
    assert (cache.directory / "candidate_order_64.npy").is_file()
    assert np.load(cache.directory / "logits.npy", mmap_mode="r").dtype == np.float16
    assert on_disk <= 1.2 * logits.nbytes, on_disk / logits.nbytes


def test_the_first_full_pass_builds_the_cache_from_one_decode(tmp_path, monkeypatch):
    path = write(tmp_path / "t.parquet")
    groups = pq.ParquetFile(path).metadata.num_row_groups
    read = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, *a, **kw: read.append(i) or read_row_group(self, i, *a, **kw))
    source = cached_source(path, tmp_path / "c")
    assert source.built and not source.directory.exists()
    first = list(source.iter_chunks(7, order_r=4))
    assert sorted(read) == list(range(groups)) and source.directory.is_dir()  # each row group once
    read.clear()
    again = list(source.iter_chunks(7, order_r=4))
    assert read == [] and all(map(chunks_equal, again, first))
    assert (source.directory / "candidate_order_4.npy").is_file()  # kept by the building pass


def test_a_pass_that_stops_early_or_fails_leaves_no_copy(tmp_path):
    path = write(tmp_path / "t.parquet")
    root = cache_root(tmp_path / "c")
    source = cached_source(path, tmp_path / "c")
    assert sum(c.num_tokens for c in LimitedSource(source, 20).iter_chunks(7)) < T
    with pytest.raises(RuntimeError):
        for n, _ in enumerate(source.iter_chunks(7)):
            if n == 3:
                raise RuntimeError("the consumer fails")
    assert sorted(p.name for p in root.iterdir()) == []  # no copy, no build directory
    outer = source.iter_chunks(7)
    next(outer)  # this pass builds; a pass started meanwhile reads the trace itself
    assert chunks_equal(list(source.iter_chunks(10**9))[0], read_trace(path)[1])
    assert not source.directory.exists()
    assert sum(c.num_tokens for c in outer) == T - 7 and source.directory.is_dir()


def test_a_kept_order_serves_every_smaller_r(tmp_path, monkeypatch):
    path = write(tmp_path / "t.parquet")
    source = cached_source(path, tmp_path / "c")
    source.build()
    for _ in source.iter_chunks(order_r=64):  # computed from the copy, then kept
        pass
    assert (source.directory / "candidate_order_64.npy").is_file()

    def no_computing(*args, **kwargs):
        raise AssertionError("the kept order was computed again")

    monkeypatch.setattr(trace_cache, "stored_logit_order", no_computing)
    kept = cached_source(path, tmp_path / "c")
    meta, whole = read_trace(path)
    for r in (64, 4, 1):
        want = expected(whole, meta, 11, True, False, r)
        assert all(map(chunks_equal, kept.iter_chunks_reversed(11, logits=False, order_r=r), want))


def test_repack_converts_the_earlier_encoding_without_changing_the_content(trace, tmp_path):
    path, legacy = trace
    again = tmp_path / "again.parquet"
    repack_trace(legacy, again)
    schema = pq.read_schema(again)
    assert pa.types.is_fixed_size_binary(schema.field("logits").type)
    assert "logit_ids" not in schema.names or pa.types.is_fixed_size_binary(schema.field("logit_ids").type)
    assert recorded_content_hash(again) == recorded_content_hash(path)
    assert chunks_equal(read_trace(again)[1], read_trace(path)[1])
    with open_trace(again) as reader:
        assert reader.verify() == recorded_content_hash(path)


def test_slicing_and_joining_chunks_keeps_the_order(tmp_path):
    path = write(tmp_path / "t.parquet")
    whole = next(iter(open_trace(path).iter_chunks(10**9, order_r=4)))
    parts = [slice_chunk(whole, 0, 13), slice_chunk(whole, 13, T)]
    assert parts[0].logit_order.shape == (13, L, 4) and chunks_equal(concat_chunks(parts), whole)
    plain = next(iter(open_trace(path).iter_chunks(10**9, logits=False)))
    assert chunks_equal(concat_chunks([slice_chunk(plain, 0, 5), slice_chunk(plain, 5, T)]), plain)
    assert slice_chunk(plain, 0, 5).logit_order.shape == (0, L, 0)
