"""Look-ahead routing in the trace format: round trips, the sentinel, version-1 files, bad values."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest

from traces.errors import InputError
from traces.format import (
    META_KEY,
    ArraySource,
    TraceMeta,
    TraceWriter,
    concat_chunks,
    default_max_tokens,
    read_trace,
    write_trace,
)

T, L, E, K, D, R = 40, 4, 16, 2, 2, 5


def make_meta(top_r: int = R, depth: int = D) -> TraceMeta:
    return TraceMeta(model="tiny", num_layers=L, num_experts=E, top_k=K, expert_bytes=[64] * L,
                     lookahead_depth=depth, lookahead_top_r=top_r if depth else 0,
                     lookahead_source="moe_input" if depth else "")


def routing(seed: int = 0) -> dict[str, np.ndarray]:
    """Token arrays of one sequence: k experts, weights, dense look-ahead logits (T, L, D, E)."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K]
    dense = rng.normal(size=(T, L, D, E)).astype(np.float16)
    dense[:, :, :, 3] = dense[:, :, :, 7]  # ties: the lower id must come first
    ahead = np.arange(L)[:, None] + np.arange(1, D + 1)[None, :]
    dense[:, ahead >= L] = -np.inf  # no layer l + d
    return {"seq": np.zeros(T, np.int32), "pos": np.arange(T, dtype=np.int32), "phase": np.ones(T, np.int8),
            "experts": experts, "weights": rng.uniform(0.1, 1, (T, L, K)).astype(np.float32), "dense": dense}


def expected(dense: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference decoding: ids by logit descending (stable, so ties keep the lower id), -1 for no layer."""
    ids = np.argsort(-dense.astype(np.float32), axis=-1, kind="stable")[..., :width]
    values = np.take_along_axis(dense.astype(np.float32), ids, axis=-1)
    return np.where(values == -np.inf, -1, ids), values


def stored(arrays: dict, meta: TraceMeta) -> dict:
    """The writer's keyword arguments: top-R ids and logits, or all E logits in expert order."""
    cols = {k: v for k, v in arrays.items() if k != "dense"}
    if not meta.lookahead_depth:
        return cols
    if meta.lookahead_top_r:
        ids, values = expected(arrays["dense"], meta.lookahead_top_r)
        cols.update(lookahead_ids=ids, lookahead_logits=values)
    else:
        cols["lookahead_logits"] = arrays["dense"]
    return cols


@pytest.mark.parametrize("top_r", [R, 0], ids=["top_r", "all_experts"])
def test_lookahead_round_trips_sorted_with_the_sentinel(tmp_path, top_r):
    meta, arrays = make_meta(top_r), routing()
    path = tmp_path / "la.parquet"
    with TraceWriter(path, meta, row_group_tokens=7) as writer:
        cols = stored(arrays, meta)
        writer.write(**{k: v[:13] for k, v in cols.items()})
        writer.write(**{k: v[13:] for k, v in cols.items()})
    back, chunk = read_trace(path)
    assert back.schema_version == 2 and back.lookahead_depth == D and back.lookahead_top_r == top_r
    ids, values = expected(arrays["dense"], top_r or E)
    assert chunk.lookahead_ids.shape == (T, L, D, top_r or E) and chunk.lookahead_ids.dtype == np.int32
    np.testing.assert_array_equal(chunk.lookahead_ids, ids)
    np.testing.assert_array_equal(chunk.lookahead_logits, values)
    assert (chunk.lookahead_ids[:, L - 1] == -1).all() and (chunk.lookahead_ids[:, L - 2, 1] == -1).all()
    assert (chunk.lookahead_ids[:, L - 2, 0] >= 0).all()
    # ties: expert 3 and 7 have equal logits, 3 comes first wherever both are listed
    both = (ids == 3).any(-1) & (ids == 7).any(-1)
    assert both.any() and (np.argmax(ids == 3, -1) < np.argmax(ids == 7, -1))[both].all()
    # a decoded chunk writes back to the same file contents
    write_trace(tmp_path / "again.parquet", back, chunk)
    _, again = read_trace(tmp_path / "again.parquet")
    np.testing.assert_array_equal(again.lookahead_ids, chunk.lookahead_ids)
    np.testing.assert_array_equal(again.lookahead_logits, chunk.lookahead_logits)


def test_sliced_and_joined_chunks_keep_the_lookahead(tmp_path):
    meta, arrays = make_meta(), routing(1)
    write_trace(tmp_path / "la.parquet", meta, ArraySource(meta, _chunk(meta, arrays)).chunk)
    _, chunk = read_trace(tmp_path / "la.parquet")
    pieces = list(ArraySource(meta, chunk).iter_chunks(max_tokens=6))
    assert len(pieces) == 7 and pieces[1].lookahead_ids.shape == (6, L, D, R)
    joined = concat_chunks(pieces)
    np.testing.assert_array_equal(joined.lookahead_ids, chunk.lookahead_ids)
    assert concat_chunks([replace(p, lookahead_ids=None) for p in pieces]).lookahead_ids is None


def _chunk(meta, arrays):
    from traces.format import make_chunk

    return make_chunk(meta, **stored(arrays, meta))


def test_version_1_files_still_open(tmp_path):
    meta, arrays = make_meta(depth=0), routing(2)
    path = tmp_path / "v2.parquet"
    write_trace(path, meta, _chunk(meta, arrays))
    table = pq.read_table(path)
    raw = json.loads(table.schema.metadata[META_KEY])
    assert raw["schema_version"] == 2 and "lookahead_depth" not in raw  # left out when not stored
    v1 = tmp_path / "v1.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps({**raw, "schema_version": 1})}), v1)
    back, chunk = read_trace(v1)
    assert back.schema_version == 1 and back.lookahead_depth == 0 and chunk.lookahead_ids is None
    np.testing.assert_array_equal(chunk.experts, arrays["experts"])
    bad = tmp_path / "v1_lookahead.parquet"
    claims = {**raw, "schema_version": 1, "lookahead_depth": 1, "lookahead_source": "moe_input"}
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(claims)}), bad)
    with pytest.raises(InputError, match="'lookahead_depth' is 1 in a schema_version 1 file"):
        read_trace(bad)


def test_lookahead_metadata_is_checked():
    for changes, words in [({"lookahead_depth": L}, "'lookahead_depth' is 4, outside 1 .. num_layers - 1"),
                           ({"lookahead_top_r": E + 1}, "'lookahead_top_r' is 17"),
                           ({"lookahead_source": ""}, "'lookahead_source' is empty"),
                           ({"lookahead_depth": 0}, "'lookahead_top_r' is 5 but lookahead_depth is 0")]:
        with pytest.raises(InputError, match=words):
            replace(make_meta(), **changes).check("x")


def _set(name, index, value):
    def change(cols):
        cols[name] = cols[name].copy()
        cols[name][index] = value
    return change


BAD_LOOKAHEAD = {
    "nan": (_set("lookahead_logits", (5, 1, 0, 2), np.nan), "'lookahead_logits' at seq 0 pos 5 layer 1",
            "NaN (distance 1)"),
    "sentinel_logit": (_set("lookahead_logits", (6, L - 1, 1, 0), 1.0), "layer 3", "not all -inf"),
    "sentinel_id": (_set("lookahead_ids", (6, L - 1, 0, 0), 2), "'lookahead_ids'", "not all -1"),
    "id_range": (_set("lookahead_ids", (7, 0, 1, 4), E), "'lookahead_ids' at seq 0 pos 7 layer 0",
                 "outside 0..15 (distance 2)"),
    "repeat": (lambda c: _set("lookahead_ids", (8, 0, 0, 1), c["lookahead_ids"][8, 0, 0, 0])(c),
               "'lookahead_ids'", "repeat an expert"),
    "order": (_set("lookahead_logits", (9, 1, 0, 4), 100.0), "'lookahead_logits'", "descending"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOOKAHEAD))
def test_bad_lookahead_values_stop_with_one_line(case, tmp_path):
    change, where, what = BAD_LOOKAHEAD[case]
    meta = make_meta()
    cols = stored(routing(3), meta)
    change(cols)
    with pytest.raises(InputError) as caught, TraceWriter(tmp_path / "bad.parquet", meta) as writer:
        writer.write(**cols)
    message = str(caught.value)
    assert "\n" not in message and where in message and what in message and ";" in message, message
    assert not (tmp_path / "bad.parquet").exists()


def test_lookahead_columns_are_required_exactly_when_stored(tmp_path):
    meta = make_meta()
    cols = stored(routing(), meta)
    with pytest.raises(ValueError, match="'lookahead_ids' must be given"), TraceWriter(tmp_path / "a", meta) as w:
        w.write(**{**cols, "lookahead_ids": None})
    plain = make_meta(depth=0)
    with pytest.raises(ValueError, match="'lookahead_logits' must be given"), TraceWriter(tmp_path / "b", plain) as w:
        w.write(**{**cols, "lookahead_ids": None})


def test_chunks_shrink_to_hold_the_decoded_lookahead():
    assert default_max_tokens(make_meta(top_r=0)) < default_max_tokens(make_meta()) < default_max_tokens(
        make_meta(depth=0))
