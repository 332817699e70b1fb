"""The trace format: Parquet schema, metadata, validation and the chunked reader (the one owner).

On disk, one row per (sequence, token, MoE layer), rows ordered by (seq, pos, layer) and every
token has exactly ``num_layers`` rows, layer 0..L-1 in order:

==============  =================================  ===========================================
column          type                               meaning
==============  =================================  ===========================================
seq             int32                              sequence id (a document / conversation)
pos             int32                              token position within the sequence
layer           int16                              MoE layer ordinal 0..L-1 (real index: meta)
phase           int8                               0 = prefill, 1 = decode
experts         fixed_size_list<int16>[k]          selected expert ids, rank order (rank 0 first)
weights         fixed_size_list<float32>[k]        gate weights as the model applied them
logits          fixed_size_list<float16>[E or R]   optional: router logits, all E or the top R
logit_ids       fixed_size_list<int16>[R]          with top-R logits: the expert id of each logit
residency       fixed_size_list<int8>[k]           optional: 1 = was resident when recorded
token_id        int32                              optional: vocabulary id of the token
domain          int16                              optional: index into meta.domains
nll             float32                            optional: teacher-forced NLL of the token (nats)
==============  =================================  ===========================================

``logits`` is present exactly when ``meta.has_logits``, ``residency`` exactly when
``meta.has_residency``. File metadata: key ``moe_trace`` holds the JSON of :class:`TraceMeta`
(``schema_version`` 2; files of version 1, which has no look-ahead columns, read as before).

``meta.logits_top_r = R > 0`` stores only the R highest logits of each token-layer, descending,
with their expert ids in ``logit_ids`` (R >= top_k; the selected experts are always among them,
also where a router selects by biased scores; a tie at the R-th place keeps the lower id). The
reader decodes them to the dense (T, L, E) logits every reader gets, with ``-inf`` for the
experts outside the R: such an expert ranks below every expert inside them, and among
themselves they tie (the simulator breaks ties by lower expert id). The key is left out of the
JSON when 0 (all E logits), so such files read as before.

*Look-ahead routing* (``meta.lookahead_depth = D > 0``, schema version 2), two optional columns:

================  ====================================  ==========================================
lookahead_logits  fixed_size_list<float16>[D*R or D*E]  routers of layers l+1..l+D at layer l
lookahead_ids     fixed_size_list<int16>[D*R]           with top-R look-ahead: each logit's expert
================  ====================================  ==========================================

For each token and MoE layer l, the logits that the routers of MoE layers l+1 .. l+D give for a
hidden state of layer l (which one: ``meta.lookahead_source``, e.g. ``moe_input``, the input of
layer l's MoE block: the "stale gate"). ``lookahead_logits`` holds D blocks, distance 1 first;
each block is the R highest logits, descending (ties: the lower id first), with their ids in
``lookahead_ids`` (``meta.lookahead_top_r = R``), or all E logits in expert order without ids
(``lookahead_top_r`` 0). Where layer l+d does not exist (the last D layers) the block is the
sentinel: logits ``-inf`` and ids -1. Decoded chunks carry ``lookahead_ids`` and
``lookahead_logits`` as (T, L, D, R) arrays sorted by logit, descending (R = E for full storage):
``lookahead_ids[t, l, d - 1, :P]`` are the P experts layer l predicts for layer l + d.

A *group* is the unit the simulator processes at once: a maximal run of consecutive prefill
tokens of one sequence (one batch per layer), or a single decode token.

Reading streams by Parquet row group: a chunk holds whole groups and, by default, about
``CHUNK_BYTES`` of decoded arrays, so memory follows the chunk size, not the file size. Every bad
input raises :class:`traces.errors.InputError` with one line naming the file, the field and the
fix; metadata and schema are checked on open, rows and values per chunk while streaming.
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from traces.errors import InputError

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)  # version 1: the same columns, no look-ahead
META_KEY = b"moe_trace"
PHASE_PREFILL = 0
PHASE_DECODE = 1
CHUNK_BYTES = 64 * 2**20  # decoded bytes a default chunk aims at
# Arrow bytes of a written row group: decoding one (zstd pages, list levels) takes several times
# this, and a reader holds one row group besides its chunk
ROW_GROUP_BYTES = 16 * 2**20
SCAN_ROWS = 2**20  # rows per batch when streaming the small columns to plan chunks
SCORE_FUNCTIONS = ("softmax", "sigmoid")
_TOKEN_COLUMNS = ("token_id", "domain", "nll")  # optional per-token columns, in file order
LOOKAHEAD_NO_LAYER = -1  # look-ahead id where layer l + d does not exist (its logits are -inf)


@dataclass
class TraceMeta:
    """File-level metadata of a trace (stored as JSON under the Parquet key ``moe_trace``)."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: list[int]  # bytes of one routed expert, per MoE layer (len num_layers)
    dtype: str = "bfloat16"  # dtype the expert_bytes refer to
    score_function: str = "softmax"  # "softmax" or "sigmoid"
    renormalize: bool = True  # top-k gate weights renormalised to sum 1 by the model
    has_logits: bool = False
    logits_top_r: int = 0  # R > 0: only the R highest logits (with their ids) stored; 0 = all E
    has_residency: bool = False
    layer_ids: list[int] = field(default_factory=list)  # real model layer index per MoE layer
    domains: list[str] = field(default_factory=list)  # names for the domain column
    dense_bytes: list[int] = field(default_factory=list)  # non-expert weight bytes per layer
    source: str = ""  # "synth", "route-csv", "capture", ...
    schema_version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)  # free-form provenance (seed, command, ...)
    lookahead_depth: int = 0  # D > 0: routers of layers l+1..l+D evaluated at layer l are stored
    lookahead_top_r: int = 0  # R > 0: the R highest look-ahead logits with their ids; 0 = all E
    lookahead_source: str = ""  # the hidden state the look-ahead routers saw, e.g. "moe_input"

    def to_json(self) -> str:
        values = asdict(self)
        for name in ("logits_top_r", *_LOOKAHEAD_FIELDS):
            if not values[name]:
                del values[name]  # the default: the JSON earlier versions wrote
        return json.dumps(values, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> TraceMeta:
        """Parse and check the metadata JSON; ``where`` names the file in error messages."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(
                f"{where}: metadata 'moe_trace' is not valid JSON ({_one_line(exc)}); "
                "re-create the trace with moe-trace or the capture tool"
            ) from None
        if not isinstance(raw, dict):
            raise InputError(f"{where}: metadata 'moe_trace' must be a JSON object; re-create the trace")
        version = raw.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise InputError(
                f"{where}: metadata field 'schema_version' is {version!r}, but this reader supports "
                f"schema_version {' and '.join(map(str, READABLE_SCHEMA_VERSIONS))}; re-create or "
                "convert the trace with a matching moe-trace version"
            )
        known = {f.name: f for f in fields(cls)}
        for name in raw:
            if name not in known:
                raise InputError(
                    f"{where}: metadata field '{name}' is unknown to schema_version "
                    f"{SCHEMA_VERSION}; remove it or put it under 'extra'"
                )
        for name, f in known.items():
            if name not in raw:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise InputError(f"{where}: metadata field '{name}' is missing; add it to 'moe_trace'")
                continue
            if not _has_type(raw[name], f.type):
                raise InputError(
                    f"{where}: metadata field '{name}' is {raw[name]!r}, expected {f.type}; fix 'moe_trace'"
                )
        meta = cls(**raw)
        meta.check(where)
        return meta

    def check(self, where: str) -> None:
        """Raise InputError unless the metadata is self-consistent."""
        def bad(name: str, problem: str, fix: str) -> InputError:
            return InputError(f"{where}: metadata field '{name}' {problem}; {fix}")

        if self.schema_version not in READABLE_SCHEMA_VERSIONS:
            raise bad("schema_version", f"is {self.schema_version}, only "
                      f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))} are supported",
                      f"write schema_version {SCHEMA_VERSION}")
        for name in ("num_layers", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise bad(name, f"is {getattr(self, name)}", "it must be at least 1")
        if self.top_k > self.num_experts:
            raise bad("top_k", f"is {self.top_k} > num_experts {self.num_experts}",
                      "top_k must not exceed num_experts")
        if len(self.expert_bytes) != self.num_layers:
            raise bad("expert_bytes", f"has {len(self.expert_bytes)} entries for {self.num_layers} layers",
                      "give one byte size per MoE layer")
        if min(self.expert_bytes, default=1) < 1:
            raise bad("expert_bytes", "has a size below 1 byte", "give each layer's expert size in bytes")
        for name in ("dense_bytes", "layer_ids"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise bad(name, f"has {len(getattr(self, name))} entries for {self.num_layers} layers",
                          "give one entry per MoE layer or none")
        if min(self.dense_bytes, default=0) < 0:
            raise bad("dense_bytes", "has a negative size", "give non-negative byte sizes")
        if self.score_function not in SCORE_FUNCTIONS:
            raise bad("score_function", f"is {self.score_function!r}", f"use one of {', '.join(SCORE_FUNCTIONS)}")
        r = self.logits_top_r
        if r and not (self.has_logits and self.top_k <= r <= self.num_experts):
            problem = ("is set but has_logits is false" if not self.has_logits else
                       f"is {r}, outside top_k {self.top_k} .. num_experts {self.num_experts}")
            raise bad("logits_top_r", problem,
                      "keep at least the top_k selected experts' logits, or write 0 for all logits")
        problem = _lookahead_meta_problem(self)
        if problem:
            raise bad(*problem)


_TYPE_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list[int]": lambda v: isinstance(v, list) and all(_TYPE_CHECKS["int"](x) for x in v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def _has_type(value, type_name: str) -> bool:
    return _TYPE_CHECKS[type_name](value)


@dataclass
class TraceChunk:
    """A decoded block of whole groups, as plain arrays for the engines.

    T tokens, L layers, k ranks, E experts. Arrays are C-contiguous.
    ``group`` numbers groups globally across chunks (non-decreasing, first group of a trace is
    0); a chunk never splits a group. ``gates`` are the normalised gate weights g (the k
    weights of a token-layer divided by their sum). ``logits`` has shape (T, L, E) when the
    trace has logits (``-inf`` outside the top R of a top-R trace), else (0, L, E);
    ``residency`` likewise (T, L, k) or (0, L, k). ``lookahead_ids`` / ``lookahead_logits``
    are (T, L, D, R) when the trace has look-ahead routing (module docstring), else None.
    """

    seq: np.ndarray  # int32[T]
    pos: np.ndarray  # int32[T]
    phase: np.ndarray  # int8[T]
    group: np.ndarray  # int64[T]
    domain: np.ndarray  # int16[T], -1 where absent
    token_id: np.ndarray  # int32[T], -1 where absent
    experts: np.ndarray  # int32[T, L, k]
    gates: np.ndarray  # float32[T, L, k]
    logits: np.ndarray  # float32[T, L, E] or [0, L, E]
    residency: np.ndarray  # int8[T, L, k] or [0, L, k]
    nll: np.ndarray | None = None  # float32[T] (NaN where absent), or None
    lookahead_ids: np.ndarray | None = None  # int32[T, L, D, R], by logit descending; -1: no layer
    lookahead_logits: np.ndarray | None = None  # float32[T, L, D, R], descending; -inf: no layer

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])


def starts_group(seq: np.ndarray, phase: np.ndarray, prev: tuple[int, int] | None = None) -> np.ndarray:
    """bool[T]: the token starts a group. ``prev`` is the (seq, phase) of the token before, if any.

    A group is a maximal run of consecutive prefill tokens of one sequence, or one decode token.
    """
    seq_before = np.concatenate([[prev[0] if prev else -1], seq[:-1]])
    phase_before = np.concatenate([[prev[1] if prev else PHASE_DECODE], phase[:-1]])
    return (phase == PHASE_DECODE) | (phase_before == PHASE_DECODE) | (seq != seq_before)


def group_ids(seq: np.ndarray, phase: np.ndarray, first_group: int = 0) -> np.ndarray:
    """Global group id per token (int64[T]); the first token starts group ``first_group``."""
    return first_group + np.cumsum(starts_group(seq, phase), dtype=np.int64) - 1


def plan_chunks(starts: Iterable[np.ndarray], num_tokens: int, max_tokens: int) -> np.ndarray:
    """Cut a trace into chunks of whole groups: int64[n, 3] rows (start, stop, first group).

    ``starts`` yields the sorted token indices where groups start, in pieces (a stream, so a
    reader never holds them all). A chunk has at most ``max_tokens`` tokens unless it is a
    single longer group.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    plan: list[tuple[int, int, int]] = []
    chunk_start, first_group = 0, 0
    pending = np.empty(0, dtype=np.int64)  # known group starts after chunk_start

    def cut(pending: np.ndarray) -> np.ndarray:
        nonlocal chunk_start, first_group
        while pending.size:
            i = int(np.searchsorted(pending, chunk_start + max_tokens, side="right"))
            if i == pending.size:
                break  # every known group start fits; the chunk may still grow
            # pending[i] lies beyond the limit: end before the group it closes, or at the end
            # of the one over-long group that starts the chunk
            taken = max(i, 1)
            plan.append((chunk_start, int(pending[taken - 1]), first_group))
            chunk_start, first_group = int(pending[taken - 1]), first_group + taken
            pending = pending[taken:]
        return pending

    for piece in starts:
        piece = np.asarray(piece, dtype=np.int64)
        pending = cut(np.concatenate([pending, piece[piece > chunk_start]]))
    cut(np.concatenate([pending, np.array([num_tokens], dtype=np.int64)]))
    if chunk_start < num_tokens:
        plan.append((chunk_start, num_tokens, first_group))
    return np.array(plan, dtype=np.int64).reshape(-1, 3)


def _token_bytes(meta: TraceMeta, per_rank: int, per_logit: int, per_token: int,
                 stored: bool = False) -> int:
    """Bytes of one token; ``stored``: top-R logits as on disk (value and id), else dense E."""
    k = meta.top_k
    per_layer = k * per_rank + (k if meta.has_residency else 0)
    if meta.has_logits:
        top_r = stored and meta.logits_top_r
        per_layer += meta.logits_top_r * (per_logit + 2) if top_r else meta.num_experts * per_logit
    if meta.lookahead_depth:  # decoded: int32 ids beside the float32 logits; stored: int16 ids if top-R
        id_bytes = (2 if meta.lookahead_top_r else 0) if stored else per_logit
        per_layer += meta.lookahead_depth * _lookahead_width(meta) * (per_logit + id_bytes)
    return meta.num_layers * per_layer + per_token


def default_max_tokens(meta: TraceMeta) -> int:
    """Tokens per chunk so that a decoded chunk (int32 experts, float32 gates/logits) is ~CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // _token_bytes(meta, per_rank=8, per_logit=4, per_token=27))


def default_row_group_tokens(meta: TraceMeta) -> int:
    """Tokens per written row group so that one row group in Arrow memory is ~ROW_GROUP_BYTES."""
    rows = _token_bytes(meta, per_rank=6, per_logit=2, per_token=0, stored=True) + 11 * meta.num_layers
    return max(1, ROW_GROUP_BYTES // rows)


def make_chunk(
    meta: TraceMeta,
    *,
    seq: np.ndarray,
    pos: np.ndarray,
    phase: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    logits: np.ndarray | None = None,
    residency: np.ndarray | None = None,
    token_id: np.ndarray | None = None,
    domain: np.ndarray | None = None,
    nll: np.ndarray | None = None,
    logit_ids: np.ndarray | None = None,
    lookahead_logits: np.ndarray | None = None,
    lookahead_ids: np.ndarray | None = None,
    first_group: int = 0,
) -> TraceChunk:
    """A :class:`TraceChunk` from token arrays: weights (T, L, k) become gates, dtypes as documented.

    Takes what :meth:`TraceWriter.write` takes. The tokens must start at a group boundary; groups
    are numbered from ``first_group``.
    """
    cols = _columns(meta, seq=seq, pos=pos, phase=phase, experts=experts, weights=weights,
                    logits=logits, residency=residency, token_id=token_id, domain=domain, nll=nll,
                    logit_ids=logit_ids, lookahead_logits=lookahead_logits, lookahead_ids=lookahead_ids)
    t, num_layers = cols["seq"].shape[0], meta.num_layers
    gates = cols["weights"] / cols["weights"].sum(axis=-1, keepdims=True)
    logits = cols.get("logits")
    if "logit_ids" in cols:
        logits = _dense_logits(meta, logits, cols["logit_ids"])
    residency = cols.get("residency")
    ahead_ids, ahead_logits = (_decoded_lookahead(meta, cols["lookahead_logits"], cols.get("lookahead_ids"))
                               if "lookahead_logits" in cols else (None, None))
    return TraceChunk(
        seq=cols["seq"],
        pos=cols["pos"],
        phase=cols["phase"],
        group=group_ids(cols["seq"], cols["phase"], first_group),
        domain=cols["domain"] if "domain" in cols else np.full(t, -1, np.int16),
        token_id=cols["token_id"] if "token_id" in cols else np.full(t, -1, np.int32),
        experts=np.ascontiguousarray(cols["experts"], dtype=np.int32),
        gates=np.ascontiguousarray(gates),
        logits=(np.ascontiguousarray(logits, dtype=np.float32) if logits is not None
                else np.zeros((0, num_layers, meta.num_experts), np.float32)),
        residency=(residency if residency is not None
                   else np.zeros((0, num_layers, meta.top_k), np.int8)),
        nll=cols.get("nll"),
        lookahead_ids=ahead_ids,
        lookahead_logits=ahead_logits,
    )


def _columns(meta: TraceMeta, **arrays) -> dict[str, np.ndarray]:
    """Token arrays with shapes checked and on-disk dtypes; absent optional columns left out."""
    t = np.shape(arrays["seq"])[0]
    shape_k = (t, meta.num_layers, meta.top_k)
    # logits come dense (T, L, E), or as the stored top R (T, L, R) together with their ids
    selected = arrays.get("logit_ids") is not None
    if selected and not meta.logits_top_r:
        raise ValueError("'logit_ids' can be given only when meta.logits_top_r > 0")
    spec = {
        "seq": ((t,), np.int32), "pos": ((t,), np.int32), "phase": ((t,), np.int8),
        "experts": (shape_k, np.int16), "weights": (shape_k, np.float32),
        "logits": ((t, meta.num_layers, meta.logits_top_r if selected else meta.num_experts), np.float16),
        "logit_ids": ((t, meta.num_layers, meta.logits_top_r), np.int16),
        "residency": (shape_k, np.int8),
        "token_id": ((t,), np.int32), "domain": ((t,), np.int16), "nll": ((t,), np.float32),
        **_lookahead_spec(meta, t),
    }
    for name, stored in _lookahead_stored(meta).items():
        if (arrays.get(name) is not None) != stored:
            raise ValueError(f"'{name}' must be given exactly when the metadata stores it "
                             "(lookahead_depth, lookahead_top_r)")
    wanted = {"logits": meta.has_logits, "residency": meta.has_residency}
    cols = {}
    for name, (shape, dtype) in spec.items():
        value = arrays.get(name)
        if name in wanted and (value is not None) != wanted[name]:
            raise ValueError(f"'{name}' must be given exactly when meta.has_{name} is true")
        if value is None:
            continue
        value = np.asarray(value)
        if value.shape != shape:
            raise ValueError(f"'{name}' has shape {value.shape}, expected {shape}")
        if name == "experts" and value.size and (value.min() < -(2**15) or value.max() >= 2**15):
            raise ValueError("'experts' ids do not fit int16 (the on-disk type)")
        # logits keep their precision in memory; they are rounded to float16 only on disk
        cols[name] = value if name == "logits" else np.ascontiguousarray(value, dtype=dtype)
    return cols


@dataclass(frozen=True)
class Problem:
    """A bad value found in token arrays: which column, where (token index, layer) and why."""

    column: str
    token: int
    layer: int | None
    what: str
    fix: str


def find_problem(meta: TraceMeta, cols: dict[str, np.ndarray]) -> Problem | None:
    """The first bad value in token arrays (checked in a fixed order), or None."""
    experts, weights = cols["experts"], cols["weights"]
    num_layers, num_experts = meta.num_layers, meta.num_experts

    def first(mask: np.ndarray) -> tuple[int, int]:
        flat = int(np.argmax(mask.reshape(-1)))
        return flat // num_layers, flat % num_layers

    problem = _ids_problem("experts", experts, num_experts, first, "top-k",
                           "each token-layer must select k distinct experts")
    if problem:
        return problem
    bad_weight = (~np.isfinite(weights) | (weights < 0)).any(axis=-1) | (weights.sum(axis=-1) <= 0)
    if bad_weight.any():
        t, layer = first(bad_weight)
        shown = [float(f"{w:.4g}") for w in weights[t, layer]]
        return Problem("weights", t, layer, f"gate weights {shown} are not finite, "
                       "non-negative and of positive sum", "record the gate weights the model applied")
    logits = cols.get("logits")
    if logits is not None:
        nan = np.isnan(logits).any(axis=-1)
        if nan.any():
            t, layer = first(nan)
            return Problem("logits", t, layer, "router logits contain NaN",
                           "re-capture in a precision that does not overflow, or drop the logits")
    ids = cols.get("logit_ids")
    if ids is not None:
        problem = _ids_problem("logit_ids", ids, num_experts, first, "top-R ids",
                               "each token-layer must list R distinct experts")
        if problem:
            return problem
        missing = ~(experts[..., :, None] == ids[..., None, :]).any(axis=-1)
        if missing.any():
            t, layer = first(missing.any(axis=-1))
            expert = experts[t, layer][missing[t, layer]][0]
            return Problem("logit_ids", t, layer, f"selected expert {expert} is not among the top-R ids "
                           f"{ids[t, layer].tolist()}", "store the logits of every selected expert")
    problem = _lookahead_problem(meta, cols, first)
    if problem:
        return problem
    residency = cols.get("residency")
    if residency is not None:
        bad = ((residency != 0) & (residency != 1)).any(axis=-1)
        if bad.any():
            t, layer = first(bad)
            return Problem("residency", t, layer, f"values {residency[t, layer].tolist()} are not 0/1",
                           "write 1 for resident, 0 for not")
    domain = cols.get("domain")
    if domain is not None:
        bad = (domain < -1) | (domain >= len(meta.domains))
        if bad.any():
            t = int(np.argmax(bad))
            return Problem("domain", t, None, f"index {domain[t]} has no name in the metadata's "
                           f"{len(meta.domains)} domains", "list every domain name in meta.domains")
    return None


def _ids_problem(column: str, ids: np.ndarray, num_experts: int, first, listed: str,
                 fix: str) -> Problem | None:
    """The first token-layer whose expert ids leave 0..E-1 or repeat one, or None."""
    out_of_range = (ids < 0) | (ids >= num_experts)
    if out_of_range.any():
        t, layer = first(out_of_range.any(axis=-1))
        value = ids[t, layer][out_of_range[t, layer]][0]
        return Problem(column, t, layer, f"expert id {value} is outside 0..{num_experts - 1}",
                       "fix the ids or the metadata's num_experts")
    duplicate = _repeats(ids)
    if duplicate.any():
        t, layer = first(duplicate)
        return Problem(column, t, layer, f"{listed} {ids[t, layer].tolist()} repeats an expert", fix)
    return None


def order_problem(seq: np.ndarray, pos: np.ndarray, phase: np.ndarray,
                  prev: tuple[int, int] | None) -> Problem | None:
    """The first token out of (seq, pos) order or with an unknown phase, or None.

    ``prev`` is the (seq, pos) of the token before the arrays, if any.
    """
    bad_phase = (phase != PHASE_PREFILL) & (phase != PHASE_DECODE)
    if bad_phase.any():
        t = int(np.argmax(bad_phase))
        return Problem("phase", t, None, f"phase {phase[t]} is neither 0 (prefill) nor 1 (decode)",
                       "write 0 or 1")
    s = np.concatenate([[prev[0]], seq]).astype(np.int64) if prev else seq.astype(np.int64)
    p = np.concatenate([[prev[1]], pos]).astype(np.int64) if prev else pos.astype(np.int64)
    ds, dp = np.diff(s), np.diff(p)
    bad = (ds < 0) | ((ds == 0) & (dp <= 0))
    if bad.any():
        t = int(np.argmax(bad)) + (0 if prev else 1)
        return Problem("seq/pos", t, None, "comes after a token with an equal or later (seq, pos)",
                       "order rows by (seq, pos, layer) with each token once")
    return None


def _raise(where: str, problem: Problem, seq: np.ndarray, pos: np.ndarray):
    at = f"seq {seq[problem.token]} pos {pos[problem.token]}"
    if problem.layer is not None:
        at += f" layer {problem.layer}"
    raise InputError(f"{where}: column '{problem.column}' at {at}: {problem.what}; {problem.fix}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def arrow_schema(meta: TraceMeta, token_columns: Iterable[str] = ()) -> pa.Schema:
    """The Arrow schema of a trace file with these optional per-token columns, metadata attached."""
    types = _arrow_types(meta)
    names = ["seq", "pos", "layer", "phase", "experts", "weights"]
    names += [name for name, present in (("logits", meta.has_logits), ("logit_ids", meta.logits_top_r > 0),
                                         ("residency", meta.has_residency)) if present]
    names += [name for name, stored in _lookahead_stored(meta).items() if stored]
    names += [name for name in _TOKEN_COLUMNS if name in set(token_columns)]
    schema = pa.schema([(name, types[name]) for name in names])
    return schema.with_metadata({META_KEY: meta.to_json().encode()})


def _arrow_types(meta: TraceMeta) -> dict[str, pa.DataType]:
    k, width = meta.top_k, _logits_width(meta)
    return {
        "seq": pa.int32(), "pos": pa.int32(), "layer": pa.int16(), "phase": pa.int8(),
        "experts": pa.list_(pa.int16(), k), "weights": pa.list_(pa.float32(), k),
        "logits": pa.list_(pa.float16(), width), "logit_ids": pa.list_(pa.int16(), width),
        "residency": pa.list_(pa.int8(), k),
        "token_id": pa.int32(), "domain": pa.int16(), "nll": pa.float32(),
        "lookahead_logits": pa.list_(pa.float16(), meta.lookahead_depth * _lookahead_width(meta)),
        "lookahead_ids": pa.list_(pa.int16(), meta.lookahead_depth * meta.lookahead_top_r),
    }


def _logits_width(meta: TraceMeta) -> int:
    """Logits stored per token-layer: R, or all E."""
    return meta.logits_top_r or meta.num_experts


# ---- look-ahead routing (schema version 2): metadata, stored form, checks, decoding ----

_LOOKAHEAD_FIELDS = ("lookahead_depth", "lookahead_top_r", "lookahead_source")
_OPTIONAL_CHUNK_ARRAYS = ("nll", "lookahead_ids", "lookahead_logits")  # TraceChunk fields that may be None


def _lookahead_meta_problem(meta: TraceMeta) -> tuple[str, str, str] | None:
    """(field, problem, fix) when the look-ahead metadata does not hold together, else None."""
    depth, top_r, source = meta.lookahead_depth, meta.lookahead_top_r, meta.lookahead_source
    if not depth:
        if top_r or source:
            name = "lookahead_top_r" if top_r else "lookahead_source"
            return name, f"is {getattr(meta, name)!r} but lookahead_depth is 0", "set lookahead_depth or drop it"
        return None
    if meta.schema_version < 2:
        return ("lookahead_depth", f"is {depth} in a schema_version {meta.schema_version} file",
                f"write schema_version {SCHEMA_VERSION}")
    if not 1 <= depth < meta.num_layers:
        return ("lookahead_depth", f"is {depth}, outside 1 .. num_layers - 1 = {meta.num_layers - 1}",
                "look at most num_layers - 1 layers ahead")
    if not 0 <= top_r <= meta.num_experts:
        return ("lookahead_top_r", f"is {top_r}, outside 0 .. num_experts {meta.num_experts}",
                "keep at most num_experts logits, or write 0 for all")
    if not source:
        return "lookahead_source", "is empty", "name the hidden state the look-ahead routers saw, e.g. moe_input"
    return None


def _lookahead_width(meta: TraceMeta) -> int:
    """Look-ahead logits stored per token-layer and distance: R, or all E."""
    return meta.lookahead_top_r or meta.num_experts


def _lookahead_stored(meta: TraceMeta) -> dict[str, bool]:
    """Which look-ahead columns the file has."""
    depth = meta.lookahead_depth > 0
    return {"lookahead_logits": depth, "lookahead_ids": depth and meta.lookahead_top_r > 0}


def _lookahead_shapes(meta: TraceMeta) -> dict[str, tuple[int, int]]:
    """Per token-layer shape (D, R or E) of each stored look-ahead column."""
    return {name: (meta.lookahead_depth, meta.lookahead_top_r if name == "lookahead_ids" else _lookahead_width(meta))
            for name, stored in _lookahead_stored(meta).items() if stored}


def _lookahead_spec(meta: TraceMeta, t: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Array shapes and on-disk dtypes of the look-ahead columns, as ``_columns`` checks them."""
    dtypes = {"lookahead_logits": np.float16, "lookahead_ids": np.int16}
    return {name: ((t, meta.num_layers, *shape), dtypes[name]) for name, shape in _lookahead_shapes(meta).items()}


def lookahead_missing(num_layers: int, depth: int) -> np.ndarray:
    """bool[L, D]: layer l + d does not exist, so its look-ahead block is the sentinel."""
    ahead = np.arange(num_layers)[:, None] + np.arange(1, depth + 1)[None, :]
    return ahead >= num_layers


def _lookahead_problem(meta: TraceMeta, cols: dict[str, np.ndarray], first) -> Problem | None:
    """The first bad look-ahead value in stored-form arrays (T, L, D, R or E), or None.

    ``first`` maps a (T, L) mask to the (token, layer) of its first true entry.
    """
    logits = cols.get("lookahead_logits")
    if logits is None:
        return None
    ids = cols.get("lookahead_ids")
    missing = lookahead_missing(meta.num_layers, meta.lookahead_depth)[None]  # (1, L, D)
    sentinel = "write logits -inf and ids -1 where layer l + d does not exist"
    checks = [  # (column, bad (T, L, D), what, fix), in the order they are reported
        ("lookahead_logits", lambda: np.isnan(logits).any(axis=-1), "look-ahead logits contain NaN",
         "re-capture in a precision that does not overflow"),
        ("lookahead_logits", lambda: missing & ~(logits == -np.inf).all(axis=-1),
         "logits are not all -inf past the last layer", sentinel),
    ]
    if ids is not None:
        checks += [
            ("lookahead_ids", lambda: missing & (ids != LOOKAHEAD_NO_LAYER).any(axis=-1),
             "ids are not all -1 past the last layer", sentinel),
            ("lookahead_ids", lambda: ~missing & ((ids < 0) | (ids >= meta.num_experts)).any(axis=-1),
             f"an expert id is outside 0..{meta.num_experts - 1}", "fix the ids or num_experts"),
            ("lookahead_ids", lambda: ~missing & _repeats(ids), "the top-R ids repeat an expert",
             "list R distinct experts"),
            ("lookahead_logits", lambda: ~missing & (logits[..., 1:] > logits[..., :-1]).any(axis=-1),
             "top-R logits are not in descending order", "store the R highest logits, highest first"),
        ]
    for column, bad_of, what, fix in checks:
        bad = bad_of()
        if bad.any():
            t, layer = first(bad.any(axis=-1))
            distance = int(np.argmax(bad[t, layer])) + 1
            return Problem(column, t, layer, f"{what} (distance {distance})", fix)
    return None


def _repeats(ids: np.ndarray) -> np.ndarray:
    """bool[...]: the last axis of ``ids`` lists an id twice."""
    ranked = np.sort(ids, axis=-1)
    return (ranked[..., 1:] == ranked[..., :-1]).any(axis=-1)


def _decoded_lookahead(meta: TraceMeta, logits: np.ndarray, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Stored look-ahead -> (int32 ids, float32 logits), each (T, L, D, R), by logit descending."""
    if ids is not None:
        return ids.astype(np.int32), logits.astype(np.float32)
    values = logits.astype(np.float32)
    order = np.argsort(-values, axis=-1, kind="stable")  # ties: the lower id first
    ids = order.astype(np.int32)
    ids[:, lookahead_missing(meta.num_layers, meta.lookahead_depth)] = LOOKAHEAD_NO_LAYER
    return ids, np.take_along_axis(values, order, axis=-1)


def _lookahead_to_store(meta: TraceMeta, ids: np.ndarray | None, logits: np.ndarray | None) -> dict:
    """Decoded look-ahead -> the writer's keyword arguments (expert order when all E are stored)."""
    if not meta.lookahead_depth:
        return {}
    if meta.lookahead_top_r:
        return {"lookahead_logits": logits, "lookahead_ids": ids}
    dense = np.full((*ids.shape[:-1], meta.num_experts), -np.inf, np.float32)
    np.put_along_axis(dense, np.maximum(ids, 0), np.where(ids >= 0, logits, -np.inf), axis=-1)
    return {"lookahead_logits": dense}


def _stored_logits(meta: TraceMeta, logits: np.ndarray, experts: np.ndarray) -> dict[str, np.ndarray]:
    """Dense logits (T, L, E) as stored: float16, or the top R descending with their ids."""
    r = meta.logits_top_r
    if not r:
        return {"logits": np.ascontiguousarray(logits, dtype=np.float16)}
    score = np.array(logits, dtype=np.float32)
    np.put_along_axis(score, experts.astype(np.intp), np.inf, axis=-1)  # selected experts stay
    ids = np.argsort(-score, axis=-1, kind="stable")[..., :r]  # ties: the lower id
    values = np.take_along_axis(np.asarray(logits), ids, axis=-1).astype(np.float16)
    order = np.argsort(-values, axis=-1, kind="stable")  # descending
    return {"logits": np.take_along_axis(values, order, axis=-1),
            "logit_ids": np.take_along_axis(ids, order, axis=-1).astype(np.int16)}


def _dense_logits(meta: TraceMeta, values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Top-R logits and their ids -> float32 (T, L, E), -inf outside the R."""
    dense = np.full((*values.shape[:-1], meta.num_experts), -np.inf, np.float32)
    np.put_along_axis(dense, ids.astype(np.intp), values.astype(np.float32), axis=-1)
    return dense


def _to_table(meta: TraceMeta, cols: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """Token arrays -> one row per (token, layer)."""
    num_layers = meta.num_layers
    t = cols["seq"].shape[0]
    arrays = []
    for name in schema.names:
        if name == "layer":
            arrays.append(pa.array(np.tile(np.arange(num_layers, dtype=np.int16), t)))
            continue
        value = cols[name]
        if value.ndim == 1:
            arrays.append(pa.array(np.repeat(value, num_layers)))
        else:
            flat = value.astype(schema.field(name).type.value_type.to_pandas_dtype(), copy=False)
            per_row = int(np.prod(value.shape[2:]))  # look-ahead: D blocks in one list
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), per_row))
    return pa.Table.from_arrays(arrays, schema=schema)


class TraceWriter:
    """Writes whole tokens to a trace file, streaming row groups of ``row_group_tokens`` tokens.

    Rows go to a temporary file beside ``path``, which replaces ``path`` only when the writer
    closes without error; an exception inside the ``with`` block leaves no file at ``path``.
    """

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, row_group_tokens: int | None = None):
        self.path = Path(path)
        self.meta = meta
        meta.check(str(self.path))
        self.row_group_tokens = row_group_tokens or default_row_group_tokens(meta)
        if not self.path.parent.is_dir():
            raise InputError(f"{self.path}: directory {self.path.parent} does not exist; create it first")
        # a hidden name beside the target (same file system, so the final rename is atomic);
        # created by the Parquet writer, so it gets the usual permissions
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_tokens = 0
        self._last: tuple[int, int] | None = None
        self.num_tokens = 0

    def write(self, *, seq, pos, phase, experts, weights, logits=None, residency=None,
              token_id=None, domain=None, nll=None, logit_ids=None, lookahead_logits=None,
              lookahead_ids=None) -> None:
        """Append tokens: seq/pos/phase (T,), experts/weights/residency (T, L, k), logits (T, L, E).

        Logits are dense; with ``meta.logits_top_r`` only the top R are stored. A caller that
        selected them already (as :func:`_stored_logits` does) gives the R logits (T, L, R) with
        their ``logit_ids``. Look-ahead columns come in their stored form (module docstring):
        (T, L, D, R) logits and ids, or (T, L, D, E) logits in expert order.
        Optional per-token columns (token_id, domain, nll) must be given in every call or none.
        """
        cols = _columns(self.meta, seq=seq, pos=pos, phase=phase, experts=experts, weights=weights,
                        logits=logits, residency=residency, token_id=token_id, domain=domain, nll=nll,
                        logit_ids=logit_ids, lookahead_logits=lookahead_logits, lookahead_ids=lookahead_ids)
        problem = order_problem(cols["seq"], cols["pos"], cols["phase"], self._last) or find_problem(
            self.meta, cols)
        if problem:
            _raise(str(self.path), problem, cols["seq"], cols["pos"])
        if "logits" in cols and "logit_ids" not in cols:
            cols.update(_stored_logits(self.meta, cols["logits"], cols["experts"]))
        if self._schema is None:
            self._schema = arrow_schema(self.meta, [n for n in _TOKEN_COLUMNS if n in cols])
        elif set(cols) != set(self._schema.names) - {"layer"}:
            raise ValueError("every write must give the same optional columns as the first")
        if not cols["seq"].size:
            return
        self._last = (int(cols["seq"][-1]), int(cols["pos"][-1]))
        self._pending.append(cols)
        self._pending_tokens += cols["seq"].shape[0]
        self.num_tokens += cols["seq"].shape[0]
        if self._pending_tokens >= self.row_group_tokens:
            self._flush(final=False)

    def write_chunk(self, chunk: TraceChunk) -> None:
        """Append a decoded chunk (its gates are written as the weights)."""
        self.write(
            seq=chunk.seq, pos=chunk.pos, phase=chunk.phase, experts=chunk.experts,
            weights=chunk.gates,
            logits=chunk.logits if self.meta.has_logits else None,
            residency=chunk.residency if self.meta.has_residency else None,
            token_id=chunk.token_id, domain=chunk.domain, nll=chunk.nll,
            **_lookahead_to_store(self.meta, chunk.lookahead_ids, chunk.lookahead_logits),
        )

    def _flush(self, final: bool) -> None:
        if self._writer is None:
            if self._schema is None:
                self._schema = arrow_schema(self.meta)
            self._writer = pq.ParquetWriter(self._tmp, self._schema, **parquet_options(self._schema))
        if not self._pending:
            return
        merged = {name: np.concatenate([c[name] for c in self._pending]) for name in self._pending[0]}
        n = merged["seq"].shape[0]
        whole = n if final else n - n % self.row_group_tokens
        for start in range(0, whole, self.row_group_tokens):
            part = {name: v[start:start + self.row_group_tokens] for name, v in merged.items()}
            table = _to_table(self.meta, part, self._schema)
            self._writer.write_table(table, row_group_size=table.num_rows)
        rest = {name: v[whole:] for name, v in merged.items()}
        self._pending = [rest] if whole < n else []
        self._pending_tokens = n - whole

    def close(self) -> None:
        """Write what is pending and move the file into place."""
        try:
            self._flush(final=True)
            self._writer.close()
        except BaseException:
            self.abort()
            raise
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop everything written; ``path`` is left as it was."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the file is discarded anyway
                pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def parquet_options(schema: pa.Schema) -> dict:
    """Writer settings: zstd, and byte-stream-split for float columns (about 13 % smaller logits)."""
    def leaf(f: pa.Field) -> tuple[str, pa.DataType]:
        nested = pa.types.is_fixed_size_list(f.type)
        return (f"{f.name}.list.element", f.type.value_type) if nested else (f.name, f.type)

    leaves = [leaf(f) for f in schema]
    floats = [name for name, t in leaves if pa.types.is_floating(t)]
    others = [name for name, t in leaves if not pa.types.is_floating(t)]
    # dictionary encoding would take precedence over byte-stream-split: integers only
    return {"compression": "zstd", "use_dictionary": others,
            "use_byte_stream_split": floats}


def repack_trace(src: str | os.PathLike, dst: str | os.PathLike, logits_quantum: float | None = None,
                 model_name: str | None = None, progress: bool = False) -> TraceMeta:
    """Rewrite a trace row group by row group, optionally rounding its logits to a quantum.

    Rounding router logits to multiples of ``logits_quantum`` (recorded in the metadata as
    ``extra.logits_quantum``) is lossy but keeps gate weights and expert ids exact; a quantum of
    1/32 is the resolution bf16 itself has for logits of magnitude 4 to 8.
    """
    reader = open_trace(src)
    meta = reader.meta
    if model_name:
        meta.model = model_name
    if logits_quantum is not None:
        if not meta.has_logits:
            raise InputError(f"{src}: has no logits; drop --logits-quantum")
        if not (0 < logits_quantum <= 1):
            raise InputError(f"--logits-quantum={logits_quantum} must be in (0, 1], e.g. 0.03125")
        meta.extra = {**meta.extra, "logits_quantum": float(logits_quantum)}
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    pf = reader._pf
    schema = pf.schema_arrow.with_metadata({META_KEY: meta.to_json().encode()})
    try:
        with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as writer:
            for i in tqdm(range(pf.num_row_groups), desc="repack", unit="row group", disable=not progress):
                table = pf.read_row_group(i).replace_schema_metadata(schema.metadata)
                if logits_quantum is not None:
                    logits = table.column("logits").combine_chunks()
                    values = logits.values.to_numpy(zero_copy_only=False).astype(np.float32)
                    rounded = (np.round(values / logits_quantum) * logits_quantum).astype(np.float16)
                    column = pa.FixedSizeListArray.from_arrays(pa.array(rounded), _logits_width(meta))
                    table = table.set_column(table.schema.get_field_index("logits"), "logits", column)
                writer.write_table(table, row_group_size=table.num_rows)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        reader.close()
    return meta


def write_trace(path: str | os.PathLike, meta: TraceMeta, chunk: TraceChunk) -> None:
    """Write one in-memory chunk as a trace file (atomically)."""
    with TraceWriter(path, meta) as writer:
        writer.write_chunk(chunk)


class _RowGroups:
    """Reads row ranges of a Parquet file by row group, keeping the last row group read."""

    def __init__(self, pf: pq.ParquetFile, columns: list[str], where: str):
        self.pf, self.columns, self.where = pf, columns, where
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._cached: tuple[int, pa.Table] | None = None

    def _group(self, i: int) -> pa.Table:
        if self._cached is None or self._cached[0] != i:
            try:
                table = self.pf.read_row_group(i, columns=self.columns)
            except (pa.ArrowException, OSError) as exc:
                raise InputError(
                    f"{self.where}: row group {i} cannot be read ({_one_line(exc)}); the file is "
                    "damaged or truncated, re-create it"
                ) from None
            self._cached = (i, table)
        return self._cached[1]

    def read(self, start: int, stop: int, descending: bool) -> pa.Table:
        """Rows [start, stop); row groups are visited in the iteration's direction."""
        if stop <= start:
            return self.pf.schema_arrow.empty_table().select(self.columns)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, stop - 1, side="right")) - 1
        order = range(last, first - 1, -1) if descending else range(first, last + 1)
        pieces = {}
        for i in order:
            lo = max(start, self.offsets[i]) - self.offsets[i]
            hi = min(stop, self.offsets[i + 1]) - self.offsets[i]
            pieces[i] = self._group(i).slice(int(lo), int(hi - lo))
        return pa.concat_tables([pieces[i] for i in sorted(pieces)])


def _numpy(table: pa.Table, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A column as a numpy array of ``shape`` (list columns flattened), copied out of Arrow."""
    pieces = []
    for piece in table.column(name).chunks:
        if pa.types.is_fixed_size_list(piece.type):
            piece = piece.flatten()
        pieces.append(piece.to_numpy(zero_copy_only=False))  # a view where Arrow allows
    return np.concatenate(pieces).reshape(shape)


class TraceReader:
    """A trace file opened for streaming: ``meta``, sizes and chunk iterators of whole groups."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._where = str(self.path)
        self._pf = _open_parquet(self.path)
        self.meta = _read_meta(self._pf, self._where)
        self._columns = _check_schema(self._pf.schema_arrow, self.meta, self._where)
        self.num_rows = int(self._pf.metadata.num_rows)
        if self.num_rows % self.meta.num_layers:
            raise InputError(
                f"{self._where}: {self.num_rows} rows are not a multiple of num_layers "
                f"{self.meta.num_layers} (a token is missing layers or the file is truncated); "
                "re-create the trace"
            )
        self._plans: dict[int, np.ndarray] = {}

    @property
    def num_tokens(self) -> int:
        return self.num_rows // self.meta.num_layers

    def iter_chunks(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """Chunks of whole groups in trace order, each of at most ``max_tokens`` tokens.

        A group longer than ``max_tokens`` comes as one chunk. Default: ~CHUNK_BYTES decoded.
        """
        return self._iter(self._plan(max_tokens), descending=False)

    def iter_chunks_reversed(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first (group ids as in forward order)."""
        return self._iter(self._plan(max_tokens)[::-1], descending=True)

    def read_all(self) -> TraceChunk:
        """The whole trace as one chunk (small traces, tests)."""
        self._plan(max(1, self.num_tokens))  # checks the row structure
        rows = _RowGroups(self._pf, self._columns, self._where)
        return self._read_chunk(rows, 0, self.num_tokens, 0, descending=False)

    def _iter(self, plan: np.ndarray, descending: bool) -> Iterator[TraceChunk]:
        rows = _RowGroups(self._pf, self._columns, self._where)
        for start, stop, first_group in plan:
            yield self._read_chunk(rows, int(start), int(stop), int(first_group), descending)

    def _read_chunk(self, rows: _RowGroups, start: int, stop: int, first_group: int,
                    descending: bool) -> TraceChunk:
        meta = self.meta
        num_layers, t = meta.num_layers, stop - start
        table = rows.read(start * num_layers, stop * num_layers, descending)
        per_layer = {"experts": (meta.top_k,), "weights": (meta.top_k,), "residency": (meta.top_k,),
                     "logits": (_logits_width(meta),), "logit_ids": (_logits_width(meta),),
                     **_lookahead_shapes(meta)}
        cols = {}
        for name in self._columns:
            if name in per_layer:
                cols[name] = _numpy(table, name, (t, num_layers, *per_layer[name]))
            elif name != "layer":
                cols[name] = _numpy(table, name, (t, num_layers))[:, 0].copy()
        del table
        if "logits" in cols:
            cols["logits"] = cols["logits"].astype(np.float32)  # once, on load
        problem = find_problem(meta, cols)
        if problem:
            _raise(self._where, problem, cols["seq"], cols["pos"])
        if "logit_ids" in cols:
            cols["logits"] = _dense_logits(meta, cols["logits"], cols.pop("logit_ids"))
        return make_chunk(meta, **cols, first_group=first_group)

    def _plan(self, max_tokens: int | None) -> np.ndarray:
        max_tokens = default_max_tokens(self.meta) if max_tokens is None else int(max_tokens)
        if max_tokens not in self._plans:
            self._plans[max_tokens] = plan_chunks(self._scan_group_starts(), self.num_tokens, max_tokens)
        return self._plans[max_tokens]

    def _scan_group_starts(self) -> Iterator[np.ndarray]:
        """Stream the small columns, check row structure and order, yield group starts."""
        num_layers = self.meta.num_layers
        expected_layers = np.arange(num_layers, dtype=np.int16)
        prev: tuple[int, int, int] | None = None  # (seq, pos, phase) of the last token seen
        first_token = 0
        batches = _whole_token_rows(self._pf, ["seq", "pos", "layer", "phase"],
                                    max(1, SCAN_ROWS // num_layers), num_layers, self._where)
        for rows in batches:
            by_token = {name: v.reshape(-1, num_layers) for name, v in rows.items()}
            mismatch = by_token["layer"] != expected_layers
            for name in ("seq", "pos", "phase"):
                mismatch |= by_token[name] != by_token[name][:, :1]
            if mismatch.any():
                t, layer = np.unravel_index(int(np.argmax(mismatch)), mismatch.shape)
                row = (first_token + t) * num_layers + layer
                found = ", ".join(f"{n} {by_token[n][t, layer]}" for n in ("seq", "pos", "layer"))
                raise InputError(
                    f"{self._where}: column 'layer' at row {row}: expected layer {layer} of seq "
                    f"{by_token['seq'][t, 0]} pos {by_token['pos'][t, 0]}, found {found}; every token "
                    f"needs one row per layer 0..{num_layers - 1}, rows ordered by (seq, pos, layer)"
                )
            seq, pos, phase = (by_token[name][:, 0] for name in ("seq", "pos", "phase"))
            problem = order_problem(seq, pos, phase, prev[:2] if prev else None)
            if problem:
                _raise(self._where, problem, seq, pos)
            starts = starts_group(seq, phase, (prev[0], prev[2]) if prev else None)
            yield first_token + np.flatnonzero(starts)
            prev = (int(seq[-1]), int(pos[-1]), int(phase[-1]))
            first_token += seq.shape[0]

    def close(self) -> None:
        self._pf.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _whole_token_rows(pf: pq.ParquetFile, columns: list[str], tokens: int, num_layers: int,
                      where: str) -> Iterator[dict[str, np.ndarray]]:
    """Stream columns in batches of whole tokens (num_layers rows each), whatever the row groups."""
    carry: dict[str, np.ndarray] | None = None
    try:
        for batch in pf.iter_batches(batch_size=tokens * num_layers, columns=columns):
            rows = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in columns}
            if carry:
                rows = {name: np.concatenate([carry[name], rows[name]]) for name in columns}
            whole = rows[columns[0]].shape[0] // num_layers * num_layers
            carry = {name: v[whole:] for name, v in rows.items()}
            if whole:
                yield {name: v[:whole] for name, v in rows.items()}
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{where}: the rows cannot be read ({_one_line(exc)}); the file is damaged or "
            "truncated, re-create it"
        ) from None


def _open_parquet(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise InputError(f"{path}: no such trace file; check the path")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{path}: not a readable Parquet file ({_one_line(exc)}); check the path, or re-create "
            "the trace if it was cut short"
        ) from None


def _read_meta(pf: pq.ParquetFile, where: str) -> TraceMeta:
    kv = pf.metadata.metadata or {}
    if META_KEY not in kv:
        raise InputError(
            f"{where}: metadata 'moe_trace' is missing (not a moe-trace file); write traces with "
            "moe-trace, the capture tool or traces.format.TraceWriter"
        )
    return TraceMeta.from_json(kv[META_KEY], where)


def _check_schema(schema: pa.Schema, meta: TraceMeta, where: str) -> list[str]:
    """The columns to read; raises unless required ones exist with the documented types."""
    types = _arrow_types(meta)
    required = ["seq", "pos", "layer", "phase", "experts", "weights"]
    required += [name for name, flag in (("logits", meta.has_logits), ("logit_ids", meta.logits_top_r > 0),
                                         ("residency", meta.has_residency)) if flag]
    required += [name for name, stored in _lookahead_stored(meta).items() if stored]
    for name in required:
        if name not in schema.names:
            flag = {"logits": " (metadata says has_logits)", "residency": " (metadata says has_residency)",
                    "logit_ids": f" (metadata says logits_top_r {meta.logits_top_r})",
                    "lookahead_logits": f" (metadata says lookahead_depth {meta.lookahead_depth})",
                    "lookahead_ids": f" (metadata says lookahead_top_r {meta.lookahead_top_r})"}
            raise InputError(
                f"{where}: column '{name}' is missing{flag.get(name, '')}; write it as "
                f"{_type_name(types[name])} or fix the metadata"
            )
    columns = required + [name for name in _TOKEN_COLUMNS if name in schema.names]
    for name in columns:
        found = schema.field(name).type
        if _type_name(found) != _type_name(types[name]):
            raise InputError(
                f"{where}: column '{name}' has type {_type_name(found)}, expected "
                f"{_type_name(types[name])} (top_k {meta.top_k}, num_experts {meta.num_experts}"
                f"{f', logits_top_r {meta.logits_top_r}' if meta.logits_top_r else ''} from the "
                "metadata); rewrite the column or fix the metadata"
            )
    return columns


def _type_name(t: pa.DataType) -> str:
    """A type as the docstring's table writes it (list child names and nullability ignored)."""
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{_type_name(t.value_type)}>[{t.list_size}]"
    return {pa.float16(): "float16", pa.float32(): "float32"}.get(t, str(t))


def open_trace(path: str | os.PathLike) -> TraceReader:
    """Open a trace file for streaming; the metadata and schema are checked now."""
    return TraceReader(path)


def read_trace(path: str | os.PathLike) -> tuple[TraceMeta, TraceChunk]:
    """A whole trace file in memory (small traces and tests): (meta, one chunk)."""
    with open_trace(path) as reader:
        return reader.meta, reader.read_all()


class ArraySource:
    """An in-memory trace: one :class:`TraceChunk` served in chunks of whole groups.

    Implements the chunk-source protocol the engines read (``meta``, ``num_tokens`` and the
    re-iterable ``iter_chunks`` / ``iter_chunks_reversed``), cut like the Parquet reader cuts.
    """

    def __init__(self, meta: TraceMeta, chunk: TraceChunk):
        self.meta = meta
        self.chunk = chunk

    @property
    def num_tokens(self) -> int:
        return self.chunk.num_tokens

    def iter_chunks(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """Sub-chunks of at most ``max_tokens`` tokens (a longer group comes whole); None: all."""
        return (slice_chunk(self.chunk, start, stop) for start, stop, _ in self._plan(max_tokens))

    def iter_chunks_reversed(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first."""
        return (slice_chunk(self.chunk, start, stop) for start, stop, _ in self._plan(max_tokens)[::-1])

    def _plan(self, max_tokens: int | None) -> np.ndarray:
        group = self.chunk.group
        starts = np.flatnonzero(np.diff(group, prepend=group[:1] - 1))
        return plan_chunks([starts], self.num_tokens, max_tokens or max(1, self.num_tokens))


def slice_chunk(c: TraceChunk, start: int, stop: int) -> TraceChunk:
    """Tokens [start, stop) of a chunk, as a chunk (views, no copies)."""
    return TraceChunk(
        seq=c.seq[start:stop],
        pos=c.pos[start:stop],
        phase=c.phase[start:stop],
        group=c.group[start:stop],
        domain=c.domain[start:stop],
        token_id=c.token_id[start:stop],
        experts=c.experts[start:stop],
        gates=c.gates[start:stop],
        logits=c.logits[start:stop] if c.logits.shape[0] else c.logits,
        residency=c.residency[start:stop] if c.residency.shape[0] else c.residency,
        **{name: None if getattr(c, name) is None else getattr(c, name)[start:stop]
           for name in _OPTIONAL_CHUNK_ARRAYS},
    )


def concat_chunks(chunks: list[TraceChunk]) -> TraceChunk:
    """Consecutive chunks of one trace joined into one (copies)."""
    def join(name: str) -> np.ndarray:
        parts = [getattr(c, name) for c in chunks]
        if name in ("logits", "residency") and not any(p.shape[0] for p in parts):
            return parts[0]
        return np.concatenate(parts)

    optional = {name: None if any(getattr(c, name) is None for c in chunks)
                else np.concatenate([getattr(c, name) for c in chunks]) for name in _OPTIONAL_CHUNK_ARRAYS}
    names = [f.name for f in fields(TraceChunk) if f.name not in optional]
    return TraceChunk(**{name: join(name) for name in names}, **optional)
