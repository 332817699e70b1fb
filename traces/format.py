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
experts         fixed_size_binary[2k]              selected expert ids, rank order (rank 0 first),
                                                   int16 little-endian bytes (see *Logits encoding*)
weights         fixed_size_binary[4k]              gate weights as the model applied them, float32
                                                   little-endian bytes
logits          fixed_size_binary[2E or 2R]        optional: router logits as float16 bytes, all E
                                                   or the top R (see *Logits encoding*)
logit_ids       fixed_size_binary[2R]              with top-R logits: the expert id of each logit,
                                                   int16 little-endian bytes (see *Logits encoding*)
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

Logits encoding: the float16 bytes of a token-layer's logits as one fixed-size binary value,
LZ4-compressed, so decoding is a decompression and a view. Measured on 2 cores (2,000 tokens of
a 48 x 512 x top-10 synthetic trace, and the bundled 6 x 64 capture), read with page checksums
verified, ms of CPU per 1k tokens to float16 / the logits column's size:

=====================================  =====================  ======================
logits column                          synthetic 48 x 512     bundled capture
=====================================  =====================  ======================
fixed_size_list<float16>, BSS + zstd   148 ms  64.5 MiB       2.5 ms  8.0 MiB
fixed_size_binary + zstd                80 ms  72.8 MiB       0.7 ms  9.3 MiB
fixed_size_binary + lz4 (the default)   21 ms  94.3 MiB       0.3 ms  14.7 MiB
=====================================  =====================  ======================

LZ4 barely compresses float16 logits (zstd's entropy coding does), so the default file is about
as large as the raw logits and decodes at about the speed of reading them. The compact
encoding, ``fixed_size_list<float16>`` with byte-stream-split and zstd (``TraceWriter(...,
compact_logits=True)``, ``moe-trace repack --compact-logits``; every earlier version wrote it),
is for files that must stay small, such as the bundled sample; readers take both. float16 ->
float32 goes through a 256 KiB lookup table (``F16_TO_F32``), at most ``astype``'s time.

The top-R ids are stored the same way, a token-layer's int16 ids as one fixed-size binary value
(LZ4-compressed; the compact encoding keeps ``fixed_size_list<int16>`` with dictionaries and
zstd, as earlier versions wrote them; readers take both). A nested list column costs Parquet a
level per value: on 256 tokens of a 48 x 128 capture with the top 64 ids (2 cores), writing the
column took 18.3 ms as a dictionary-encoded list (690 KB) and 3.8 ms as binary (880 KB); reading
it 6.1 ms and 1.5 ms. ``experts`` and ``weights`` are stored the same way, each token-layer's k
int16 ids and k float32 gates as one LZ4-compressed binary value (the compact encoding keeps
the lists). ``python -m traces.bench_decode`` (2 cores, 5,000 tokens of 48 x 512, top-10):
reading without the logits took 17.1 ms of CPU per 1k tokens in the compact encoding and 11.3
ms in the default one, then with zstd for these columns. LZ4 decodes them in half zstd's CPU
(the row groups of these columns and the per-token ones for 4,096 tokens of that shape, pages
verified, all threads, medians of 21 alternating reads: 18.9 ms with zstd, 10.4 ms with LZ4) for
a quarter more bytes (9.1 -> 11.3 MiB; beside full logits, 212 MiB, a percent). Files written
with zstd read as before.

Options every chunk source takes (``iter_chunks(max_tokens, *, logits=True, order_r=0,
stored_ids=False)`` and
``iter_chunks_reversed`` alike): ``logits=False`` leaves the logits column unread and undecoded
(``chunk.logits`` is (0, L, E)); ``order_r=R`` adds ``chunk.logit_order``, per token-layer the
ids of the R highest logits among the experts it did not select (at most E - k), descending,
ties by lower id: the order ``np.lexsort((ids, -logits))`` gives, the selected ids left out.
Those are a substitute's candidates in logit order (a step's own selections are never one).
``stored_ids=True`` lets a source give the expert ids as stored, int16, where int32 would cost a
conversion (a source holding int32 may give those; widen before arithmetic on them: the
kernel reads them as int16). ``logits="float16"`` asks for the logits as stored, dense
float16 (no conversion; a view of the column where it can be): for consumers that compare only a
few of them (the kernel converts a row when it needs one); a source holding float32 logits may
give those instead, the values are the same.

Reading streams by Parquet row group: a chunk holds whole groups and, by default, about
``CHUNK_BYTES`` of decoded arrays, so memory follows the chunk size, not the file size. Every bad
input raises :class:`traces.errors.InputError` with one line naming the file, the field and the
fix; metadata and schema are checked on open, rows and values per chunk while streaming.

Integrity: files are written with Parquet page checksums (CRC-32 of every page), verified on
every read, and with a content hash (key ``moe_trace_content``: ``sha256:<hex>`` of the
metadata JSON and every column's decoded values, see :class:`ContentHash`) that
:meth:`TraceReader.verify` checks (``moe-trace info --verify``, and the trace cache before it
keeps a copy), and the SHA-256 of the metadata JSON (key ``moe_trace_sha256``), checked on every
open. Files written before carry none of these and still read; ``moe-trace repack`` adds them.

Bounds: metadata integers are checked against caps named in the messages (``num_experts`` and
``num_layers`` at most 32767: ids and layers are int16 on disk; byte sizes at most 2**40 per
layer) before any arithmetic; a file with no rows, nulls in any column, or a read that would
need more memory than is available (estimated before allocating) is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import stat
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import wait
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from traces.atomic import output_errors, remove_orphans, temp_path
from traces.errors import InputError

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)  # version 1: the same columns, no look-ahead
META_KEY = b"moe_trace"
CONTENT_KEY = b"moe_trace_content"  # "sha256:<hex>" of the decoded content (ContentHash)
META_HASH_KEY = b"moe_trace_sha256"  # hex SHA-256 of the metadata JSON, checked on every open
MAX_IDS = 2**15 - 1  # experts, layers and domains are numbered in int16 columns on disk
MAX_LAYER_BYTES = 2**40  # sanity cap on the bytes of one expert, or of one layer's dense weights
MAX_LAYER_ID = 2**31 - 1
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
PHASE_PREFILL = 0
PHASE_DECODE = 1
CHUNK_BYTES = 64 * 2**20  # decoded bytes a default chunk aims at
# Arrow bytes of a written row group: decoding one (zstd pages, list levels) takes several times
# this, and a reader holds one row group besides its chunk
ROW_GROUP_BYTES = 16 * 2**20
SCAN_ROWS = 2**20  # rows per batch when streaming the small columns to plan chunks
# The scan that plans chunks keeps the per-token columns it reads (seq, pos, phase and domain: 11
# bytes a token) for traces of up to this many tokens, so that chunks read only the per-layer
# columns: each column a read decodes costs Arrow about 70 us per row group, even when tiny.
KEEP_SCANNED_TOKENS = 1 << 22
SCORE_FUNCTIONS = ("softmax", "sigmoid")
_TOKEN_COLUMNS = ("token_id", "domain", "nll")  # optional per-token columns, in file order
LOOKAHEAD_NO_LAYER = -1  # look-ahead id where layer l + d does not exist (its logits are -inf)


def _nested_dataclass(value):
    """A dataclass inside the metadata (in ``extra``) as :func:`dataclasses.asdict` gives it."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


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
        # the fields as they are, not asdict's deep copy of every list and dict: the same JSON in
        # a fifth of the time (10 against 54 us for a capture's; its encoders write it three times per unit)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("logits_top_r", *_LOOKAHEAD_FIELDS):
            if not values[name]:
                del values[name]  # the default: the JSON earlier versions wrote
        return json.dumps(values, sort_keys=True, default=_nested_dataclass)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> TraceMeta:
        """Parse and check the metadata JSON; ``where`` names the file in error messages."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
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
        for name, (low, high, why) in META_BOUNDS.items():  # before any arithmetic on them
            value = getattr(self, name)
            for i, v in enumerate(value if isinstance(value, list) else [value]):
                if not low <= v <= high:
                    at = f" at layer {i}" if isinstance(value, list) else ""
                    side = f"below {low}" if v < low else f"above the cap {high:,} ({why})"
                    raise bad(name, f"is {v}{at}, {side}", "fix 'moe_trace' or re-create the trace")
        if len(self.domains) > MAX_IDS:
            raise bad("domains", f"has {len(self.domains)} names, above the cap {MAX_IDS} (the domain "
                      "column is int16)", "merge domains")
        if self.top_k > self.num_experts:
            raise bad("top_k", f"is {self.top_k} > num_experts {self.num_experts}",
                      "top_k must not exceed num_experts")
        if len(self.expert_bytes) != self.num_layers:
            raise bad("expert_bytes", f"has {len(self.expert_bytes)} entries for {self.num_layers} layers",
                      "give one byte size per MoE layer")
        for name in ("dense_bytes", "layer_ids"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise bad(name, f"has {len(getattr(self, name))} entries for {self.num_layers} layers",
                          "give one entry per MoE layer or none")
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


# integer metadata: field -> (lowest, highest, why the cap); checked per entry for lists
META_BOUNDS = {
    "num_layers": (1, MAX_IDS, "layers are numbered in an int16 column"),
    "num_experts": (1, MAX_IDS, "expert ids are int16 on disk"),
    "top_k": (1, MAX_IDS, "expert ids are int16 on disk"),
    "logits_top_r": (0, MAX_IDS, "expert ids are int16 on disk"),
    "expert_bytes": (1, MAX_LAYER_BYTES, "a sanity cap of 1 TiB per expert"),
    "dense_bytes": (0, MAX_LAYER_BYTES, "a sanity cap of 1 TiB per layer"),
    "layer_ids": (0, MAX_LAYER_ID, "model layer indices are int32"),
}

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
    ``residency`` likewise (T, L, k) or (0, L, k). ``logit_order`` (T, L, R): per token-layer
    the ids of the R highest logits among the experts it did not select, descending, ties by
    lower id (a source's ``order_r``).
    ``lookahead_ids`` / ``lookahead_logits`` are (T, L, D, R) when the trace has look-ahead
    routing (module docstring), else None.
    """

    seq: np.ndarray  # int32[T]
    pos: np.ndarray  # int32[T]
    phase: np.ndarray  # int8[T]
    group: np.ndarray  # int64[T]
    domain: np.ndarray  # int16[T], -1 where absent
    token_id: np.ndarray  # int32[T], -1 where absent
    experts: np.ndarray  # int32[T, L, k]
    gates: np.ndarray  # float32[T, L, k]
    logits: np.ndarray  # float32[T, L, E] (float16 where a source was asked logits="float16") or [0, L, E]
    residency: np.ndarray  # int8[T, L, k] or [0, L, k]
    nll: np.ndarray | None = None  # float32[T] (NaN where absent), or None
    lookahead_ids: np.ndarray | None = None  # int32[T, L, D, R], by logit descending; -1: no layer
    lookahead_logits: np.ndarray | None = None  # float32[T, L, D, R], descending; -inf: no layer
    logit_order: np.ndarray | None = None  # int16[T, L, R] with order_r=R, else [0, L, 0]

    def __post_init__(self):
        if self.logit_order is None:
            self.logit_order = np.zeros((0, self.experts.shape[1], 0), np.int16)

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
                 stored: bool = False, logits: bool = True) -> int:
    """Bytes of one token; ``stored``: top-R logits as on disk (value and id), else dense E;
    ``logits=False``: without the router logits (not read)."""
    k = meta.top_k
    per_layer = k * per_rank + (k if meta.has_residency else 0)
    if meta.has_logits and logits:
        top_r = stored and meta.logits_top_r
        per_layer += meta.logits_top_r * (per_logit + 2) if top_r else meta.num_experts * per_logit
    if meta.lookahead_depth:  # decoded: int32 ids beside the float32 logits; stored: int16 ids if top-R
        id_bytes = (2 if meta.lookahead_top_r else 0) if stored else per_logit
        per_layer += meta.lookahead_depth * _lookahead_width(meta) * (per_logit + id_bytes)
    return meta.num_layers * per_layer + per_token


def default_max_tokens(meta: TraceMeta, logits: bool = True) -> int:
    """Tokens per chunk so that a decoded chunk (int32 experts, float32 gates/logits) is ~CHUNK_BYTES;
    ``logits=False``: for a reader that decodes no logits."""
    return max(1, CHUNK_BYTES // _token_bytes(meta, per_rank=8, per_logit=4, per_token=27, logits=logits))


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
    ids_dtype=np.int32,
) -> TraceChunk:
    """A :class:`TraceChunk` from token arrays: weights (T, L, k) become gates, dtypes as documented.

    Takes what :meth:`TraceWriter.write` takes. The tokens must start at a group boundary; groups
    are numbered from ``first_group``. ``logits`` may be left out of a trace that has them (the
    chunk then holds none).
    """
    cols = _columns(meta, seq=seq, pos=pos, phase=phase, experts=experts, weights=weights,
                    logits=logits, residency=residency, token_id=token_id, domain=domain, nll=nll,
                    logit_ids=logit_ids, lookahead_logits=lookahead_logits, lookahead_ids=lookahead_ids,
                    logits_optional=True)
    t, num_layers = cols["seq"].shape[0], meta.num_layers
    gates = normalised_gates(cols["weights"])
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
        experts=np.ascontiguousarray(cols["experts"], dtype=ids_dtype),
        gates=np.ascontiguousarray(gates),
        logits=(np.ascontiguousarray(logits, dtype=np.float32) if logits is not None
                else np.zeros((0, num_layers, meta.num_experts), np.float32)),
        residency=(residency if residency is not None
                   else np.zeros((0, num_layers, meta.top_k), np.int8)),
        nll=cols.get("nll"),
        lookahead_ids=ahead_ids,
        lookahead_logits=ahead_logits,
    )


def normalised_gates(weights: np.ndarray) -> np.ndarray:
    """Gate weights (T, L, k) divided by their sum per token-layer, as float32.

    In float32, as the emulation (simulator/emulate.py) and earlier versions normalise, so
    results stay bit-identical; a token-layer whose float32 sum overflows (weights near 3e38,
    which would make every gate 0) is normalised in float64. The gates are checked finite.
    """
    w = np.ascontiguousarray(weights, dtype=np.float32)
    if _one_pass_pays(w.size) and w.ndim == 3:
        from traces.fastcheck import gates
        fast = gates(w)  # None where it does not apply: then NumPy's path below
        if fast is not None:
            return fast
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # refused below instead
        sums = w.sum(axis=-1, keepdims=True)
        gates = w / sums
    overflow = ~np.isfinite(sums[..., 0])
    if overflow.any():
        wide = w[overflow].astype(np.float64)
        gates[overflow] = wide / wide.sum(axis=-1, keepdims=True)
    if not np.isfinite(gates).all():
        raise ValueError("gate weights must be finite, non-negative and of positive sum")
    return gates


def _columns(meta: TraceMeta, logits_optional: bool = False, **arrays) -> dict[str, np.ndarray]:
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
        if name in wanted and (value is not None) != wanted[name] and not (
                name == "logits" and logits_optional and value is None):
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
    if not _plausible_weights(weights):  # the per-row masks (slow reductions) only to find the row
        bad_weight = ((~np.isfinite(weights) | (weights < 0)).any(axis=-1)
                      | (weights.sum(axis=-1, dtype=np.float64) <= 0))
        t, layer = first(bad_weight)
        shown = [float(f"{w:.4g}") for w in weights[t, layer]]
        return Problem("weights", t, layer, f"gate weights {shown} are not finite, "
                       "non-negative and of positive sum", "record the gate weights the model applied")
    logits = cols.get("logits")
    if logits is not None and _any_nan(logits):
        nan = _is_nan(logits).any(axis=-1)
        if nan.any():
            t, layer = first(nan)
            return Problem("logits", t, layer, "router logits contain NaN",
                           "re-capture in a precision that does not overflow, or drop the logits")
    ids = cols.get("logit_ids")
    if ids is not None and (not _one_pass_pays(ids.size) or not _top_r_ids_ok(ids, experts, num_experts)):
        problem = _top_r_problem(ids, experts, num_experts, first)
        if problem:
            return problem
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


# The one-pass checks repay loading Numba (about a second, once per process) on units as large as
# a capture's (a 3,206-token unit of 8 layers with top-64 ids holds 1.6 M ids); smaller ones take the
# NumPy checks alone (under 7 ms at this size), unless the process has loaded Numba already.
FAST_CHECK_MIN_IDS = 1 << 20


def _one_pass_pays(size: int) -> bool:
    """Whether a unit of ``size`` values takes ``traces.fastcheck``'s one-pass Numba functions:
    at least ``FAST_CHECK_MIN_IDS`` values, or any size where Numba is loaded already (as in the
    simulator: then what remains is loading their cached machine code, once per process)."""
    return size >= FAST_CHECK_MIN_IDS or "numba" in sys.modules


def _top_r_ids_ok(ids: np.ndarray, experts: np.ndarray, num_experts: int) -> bool:
    """The one-pass check (``traces.fastcheck``), imported on first use: a trace without top-R ids
    never loads Numba."""
    from traces.fastcheck import top_r_ids_ok
    return top_r_ids_ok(ids, experts, num_experts)


def _top_r_problem(ids: np.ndarray, experts: np.ndarray, num_experts: int, first) -> Problem | None:
    """The first token-layer whose top-R ids leave 0..E-1, repeat one or miss a selected expert."""
    problem = _range_problem("logit_ids", ids, num_experts, first)
    if problem:
        return problem
    listed = _id_table(ids, num_experts)  # one table for both checks: R pairs would be R(R-1)/2
    # a repeat leaves fewer flags than ids: counted over the whole table (several times faster
    # than per row), per row only to find the first
    if np.count_nonzero(listed) < ids.size:
        t, layer = first(np.count_nonzero(listed, axis=-1) < ids.shape[-1])
        return Problem("logit_ids", t, layer, f"top-R ids {ids[t, layer].tolist()} repeats an expert",
                       "each token-layer must list R distinct experts")
    missing = ~listed.reshape(-1)[_flat_ids(experts, num_experts)].reshape(experts.shape)
    if missing.any():
        t, layer = first(missing.any(axis=-1))
        expert = experts[t, layer][missing[t, layer]][0]
        return Problem("logit_ids", t, layer, f"selected expert {expert} is not among the top-R ids "
                       f"{ids[t, layer].tolist()}", "store the logits of every selected expert")
    return None


def _id_table(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """bool[..., E]: the experts each row of ``ids`` (all in 0..E-1) lists. Marking a table of E
    flags per row is faster than comparing pairs of ids once rows are longer than about 16 (and
    reading the selected experts back from it, than comparing each with every listed one)."""
    table = np.zeros(ids.size // max(ids.shape[-1], 1) * num_experts, bool)
    table[_flat_ids(ids, num_experts)] = True
    return table.reshape(*ids.shape[:-1], num_experts)


def _flat_ids(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """intp[n, r]: each id of ``ids`` (all in 0..E-1; n rows of r) as an index into a flat table of
    E flags per row (a gather from it is about twice as fast as ``take_along_axis``)."""
    r = ids.shape[-1]
    n = ids.size // max(r, 1)
    flat = ids.reshape(n, r).astype(np.intp)
    flat += np.arange(0, n * num_experts, num_experts, dtype=np.intp)[:, None]
    return flat


def _is_nan(values: np.ndarray) -> np.ndarray:
    """NaN mask; float16 by its bits (numpy computes float16 isnan element by element in software)."""
    if values.dtype != np.float16:
        return np.isnan(values)
    return (values.view(np.uint16) & 0x7FFF) > 0x7C00


def _any_nan(values: np.ndarray, block: int = 1 << 20) -> bool:
    """Whether ``values`` hold a NaN, ``block`` values at a time (a mask of a whole chunk would be
    fresh memory to zero, three times the time of the test itself)."""
    flat = values.reshape(-1)
    return any(_is_nan(flat[a:a + block]).any() for a in range(0, flat.size, block))


def _plausible_weights(weights: np.ndarray) -> bool:
    """Every gate weight finite and non-negative, and every token-layer with a positive one (so of
    positive sum). In NumPy, whole-array reductions and one pass per rank, which are several
    times faster than reducing each token-layer's k weights; the one-pass check where it pays."""
    if _one_pass_pays(weights.size) and weights.ndim == 3:
        from traces.fastcheck import weights_ok
        return weights_ok(weights)
    if not (np.isfinite(weights).all() and (weights >= 0).all()):
        return False
    positive = np.zeros(weights.shape[:-1], bool)
    for i in range(weights.shape[-1]):
        positive |= weights[..., i] > 0
    return bool(positive.all())


def _range_problem(column: str, ids: np.ndarray, num_experts: int, first) -> Problem | None:
    """The first token-layer with an expert id outside 0..E-1, or None."""
    if not ids.size or (ids.min() >= 0 and ids.max() < num_experts):
        return None
    out_of_range = (ids < 0) | (ids >= num_experts)
    if out_of_range.any():
        t, layer = first(out_of_range.any(axis=-1))
        value = ids[t, layer][out_of_range[t, layer]][0]
        return Problem(column, t, layer, f"expert id {value} is outside 0..{num_experts - 1}",
                       "fix the ids or the metadata's num_experts")
    return None


def _ids_problem(column: str, ids: np.ndarray, num_experts: int, first, listed: str,
                 fix: str) -> Problem | None:
    """The first token-layer whose expert ids leave 0..E-1 or repeat one, or None."""
    problem = _range_problem(column, ids, num_experts, first)
    if problem:
        return problem
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


def arrow_schema(meta: TraceMeta, token_columns: Iterable[str] = (), compact_logits: bool = False) -> pa.Schema:
    """The Arrow schema of a trace file with these optional per-token columns, metadata attached;
    ``compact_logits``: the per-layer value columns (logits, ids, experts, weights) in the compact
    encoding (module docstring, *Logits encoding*)."""
    types = _arrow_types(meta)
    if compact_logits:
        types.update(_compact_types(meta))
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
        "experts": pa.binary(2 * k), "weights": pa.binary(4 * k),
        "logits": pa.binary(2 * width), "logit_ids": pa.binary(2 * width),
        "residency": pa.list_(pa.int8(), k),
        "token_id": pa.int32(), "domain": pa.int16(), "nll": pa.float32(),
        "lookahead_logits": pa.list_(pa.float16(), meta.lookahead_depth * _lookahead_width(meta)),
        "lookahead_ids": pa.list_(pa.int16(), meta.lookahead_depth * meta.lookahead_top_r),
    }


def _logits_width(meta: TraceMeta) -> int:
    """Logits stored per token-layer: R, or all E."""
    return meta.logits_top_r or meta.num_experts


def _compact_types(meta: TraceMeta) -> dict[str, pa.DataType]:
    """The per-layer value columns in the compact encoding (as earlier versions wrote every
    trace)."""
    width, k = _logits_width(meta), meta.top_k
    return {"logits": pa.list_(pa.float16(), width), "logit_ids": pa.list_(pa.int16(), width),
            "experts": pa.list_(pa.int16(), k), "weights": pa.list_(pa.float32(), k)}


# the numpy type of a fixed-size binary column's bytes (little-endian, as every trace stores them)
BINARY_DTYPES = {"logits": np.dtype("<f2"), "logit_ids": np.dtype("<i2"), "experts": np.dtype("<i2"),
                 "weights": np.dtype("<f4")}


F16_TO_F32 = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)  # 256 KiB


def float32_logits(stored: np.ndarray) -> np.ndarray:
    """float16 logits as float32, through the lookup table (exactly ``astype``'s values)."""
    return np.take(F16_TO_F32, np.ascontiguousarray(stored).view(np.uint16), mode="clip")


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
    if ids.dtype.itemsize > 2 and ids.size and np.iinfo(np.int16).min <= ids.min() and ids.max() <= np.iinfo(np.int16).max:
        ids = ids.astype(np.int16)
    # every pair of ranks compared column against column: k(k-1)/2 contiguous comparisons,
    # 60x faster than sorting each row at k = 10 and still faster at k = 64
    columns = [np.ascontiguousarray(ids[..., i]) for i in range(ids.shape[-1])]
    out = np.zeros(ids.shape[:-1], bool)
    for i, a in enumerate(columns):
        for b in columns[i + 1:]:
            out |= a == b
    return out


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
    """Top-R logits and their ids -> (T, L, E) in their dtype, -inf outside the R."""
    dense = np.full((*values.shape[:-1], meta.num_experts), -np.inf, values.dtype)
    np.put_along_axis(dense, ids.astype(np.intp), values, axis=-1)
    return dense


def decoded_logits(meta: TraceMeta, stored: np.ndarray, ids: np.ndarray | None,
                   as_stored: bool = False) -> np.ndarray:
    """Stored float16 logits (T, L, E), or top R with their ids, as the dense float32 readers give
    (``as_stored``: dense float16, the stored values unconverted)."""
    dense = stored if ids is None else _dense_logits(meta, stored, ids)
    return np.ascontiguousarray(dense, dtype=np.float16) if as_stored else float32_logits(dense)


def _order_preserving(bits: np.ndarray) -> np.ndarray:
    """Unsigned keys in the order of the floats whose bits these are (-0.0 keyed as +0.0)."""
    sign = bits.dtype.type(1 << (8 * bits.itemsize - 1))
    bits = np.where(bits == sign, 0, bits)
    return np.where(bits & sign, ~bits, bits | sign)


# a float16's sort key, shifted above the 16 bits that hold 0xFFFF - id (256 KiB)
_F16_SORT_KEY = _order_preserving(np.arange(2**16, dtype=np.uint16)).astype(np.uint32) << np.uint32(16)


# token-layers whose sort keys :func:`logit_order` builds at once: 2,048 of 512 experts are 4 MiB
# of keys and 8 MiB of indices, which the allocator reuses block after block. Keys and indices for
# a whole 656-token chunk of 48 x 512 (192 MiB) were fresh pages each time, and the kernel zeroing
# them took most of the order's CPU: the first substituting job of ``make bench``'s sweep (10k
# tokens, which builds the order) took 4.1 s, now 1.5 s (2 cores; 0.090 -> 0.075 CPU s per chunk
# where the pages are reused anyway).
_ORDER_BLOCK_ROWS = 2048


def logit_order(logits: np.ndarray, r: int, ids: np.ndarray | None = None,
                exclude: np.ndarray | None = None) -> np.ndarray:
    """int16 (..., r): the ids of the ``r`` highest logits, descending, ties by lower id;
    ``exclude`` (..., k): ids left out (at least r others remain).

    ``logits`` (..., n) float16 or float32 (not NaN); their ids are 0..n-1, or ``ids`` (...,
    n). One sort key per logit (the logit made order-preserving, above 0xFFFF - id) is unique
    within a token-layer, so a partition and a sort of the r largest give exactly the order of
    ``np.lexsort((ids, -logits))``. float16 keys come from a lookup table, in uint32. An excluded
    id's key is 0, below every logit's (even ``-inf`` keys above 0).
    """
    n = logits.shape[-1]
    rows = logits.size // max(n, 1)
    if rows > _ORDER_BLOCK_ROWS:  # block by block: the keys of a whole chunk would be fresh memory
        out = np.empty((*logits.shape[:-1], r), np.int16)
        flat, flat_out = logits.reshape(rows, n), out.reshape(rows, r)
        flat_ids = None if ids is None else ids.reshape(rows, n)
        flat_exclude = None if exclude is None else exclude.reshape(rows, -1)
        for a in range(0, rows, _ORDER_BLOCK_ROWS):
            b = a + _ORDER_BLOCK_ROWS
            flat_out[a:b] = logit_order(flat[a:b], r, None if flat_ids is None else flat_ids[a:b],
                                        None if flat_exclude is None else flat_exclude[a:b])
        return out
    low = 0xFFFF - (np.arange(n) if ids is None else ids.astype(np.int64))
    if logits.dtype == np.float16:
        keys = np.take(_F16_SORT_KEY, np.ascontiguousarray(logits).view(np.uint16), mode="clip")
        keys |= low.astype(np.uint32)
    else:
        bits = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint32)
        keys = (_order_preserving(bits).astype(np.uint64) << np.uint64(16)) | low.astype(np.uint64)
    if exclude is not None and ids is None:
        np.put_along_axis(keys, exclude.astype(np.int64), 0, axis=-1)
    elif exclude is not None:
        keys[(ids[..., :, None] == exclude[..., None, :]).any(axis=-1)] = 0
    keys.partition(n - r, axis=-1)
    top = np.sort(keys[..., n - r:], axis=-1)[..., ::-1]
    return (0xFFFF - (top & 0xFFFF)).astype(np.int16)


def stored_logit_order(meta: TraceMeta, stored: np.ndarray, ids: np.ndarray | None, r: int,
                       experts: np.ndarray) -> np.ndarray:
    """:func:`logit_order` of the dense logits without the token-layers' selected ``experts``,
    from the stored float16 ones (top-R with ids).

    From a top-R trace's R stored logits alone when r <= R - k (the R hold every selected
    expert) and none of them is ``-inf`` (the experts outside the R are ``-inf``: they rank
    lower); otherwise over the dense logits.
    """
    if ids is None:
        return logit_order(stored, r, exclude=experts)
    if r <= ids.shape[-1] - experts.shape[-1] and not np.isneginf(stored).any():
        return logit_order(stored, r, ids, exclude=experts)
    return logit_order(_dense_logits(meta, stored, ids), r, exclude=experts)


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
        elif pa.types.is_fixed_size_binary(schema.field(name).type):  # a token-layer's values as bytes
            data = np.ascontiguousarray(value, dtype=BINARY_DTYPES[name])
            arrays.append(pa.FixedSizeBinaryArray.from_buffers(
                schema.field(name).type, t * num_layers, [None, pa.py_buffer(data)]))
        else:
            flat = value.astype(schema.field(name).type.value_type.to_pandas_dtype(), copy=False)
            per_row = int(np.prod(value.shape[2:]))  # look-ahead: D blocks in one list
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), per_row))
    return pa.Table.from_arrays(arrays, schema=schema)


# a column of at least this many bytes is hashed on a thread of its own (ContentHash.submit);
# smaller ones (a unit's per-token columns: tens of KB) are hashed in less time than a hand-over takes
HASH_THREAD_BYTES = 1 << 18


def _content_bytes(value: np.ndarray) -> memoryview:
    return np.ascontiguousarray(value).view(np.uint8).reshape(-1).data


def _feed(digest, data: list[memoryview]) -> None:
    for d in data:
        digest.update(d)


class ContentHash:
    """SHA-256 of a trace's decoded content, independent of row groups, chunking and encoding.

    The digest covers the metadata JSON and, per column present, the values in their on-disk
    dtypes in trace order: per-token columns once per token, per-layer columns per token-layer
    (logits as float16, top-R logits with their ``logit_ids``; ``layer`` is implied by the row
    structure). Writer and reader feed it the same arrays, so it is what a reader decodes.
    """

    def __init__(self, meta: TraceMeta):
        self._meta = meta.to_json().encode()
        self._columns: dict[str, hashlib._Hash] = {}

    def update(self, cols: dict[str, np.ndarray]) -> None:
        """Add consecutive tokens' columns (on-disk dtypes, as TraceReader reads them)."""
        for name, value in cols.items():
            digest = self._columns.setdefault(name, hashlib.sha256())
            digest.update(_content_bytes(value))

    def submit(self, pieces: list[dict[str, np.ndarray]], pool) -> list:
        """:meth:`update` with each of ``pieces`` in turn, each column of at least
        :data:`HASH_THREAD_BYTES` hashed on a thread of ``pool`` (a ``concurrent.futures``
        executor; SHA-256 runs without the GIL), its pieces in order; the rest here, and every
        column where ``pool`` is None. Returns the futures: every one must be done before the
        arrays change or the next update. The columns' streams are independent, so the digest is
        :meth:`update`'s."""
        futures = []
        try:
            for name in pieces[0] if pieces else ():
                digest = self._columns.setdefault(name, hashlib.sha256())
                data = [_content_bytes(piece[name]) for piece in pieces]
                if pool is not None and sum(d.nbytes for d in data) >= HASH_THREAD_BYTES:
                    futures.append(pool.submit(_feed, digest, data))
                else:
                    _feed(digest, data)
        except BaseException:
            wait(futures)  # none may still read the arrays
            raise
        return futures

    def hexdigest(self) -> str:
        whole = hashlib.sha256(b"moe-trace content v1\n" + self._meta)
        for name in sorted(self._columns):
            whole.update(name.encode() + b"\0" + self._columns[name].digest())
        return "sha256:" + whole.hexdigest()


class TraceWriter:
    """Writes whole tokens to a trace file, streaming row groups of ``row_group_tokens`` tokens.

    Rows go to a temporary file beside ``path``, which replaces ``path`` only when the writer
    closes without error; an exception inside the ``with`` block leaves no file at ``path``, and
    temporaries of writers killed before them are removed when the next writer to ``path``
    starts. A trace needs at least one token; a full disk or a permission error raises one
    InputError naming ``path``. ``compact_logits``: the smaller, slower logits encoding.
    ``record_content=False``: no content hash is computed or recorded (a part of a file whose
    hash the caller computes over all parts, from the columns :meth:`write` returns); ``after``:
    the (seq, pos) of the token before the part's first, which the first must follow.
    """

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, row_group_tokens: int | None = None,
                 compact_logits: bool = False, record_content: bool = True,
                 after: tuple[int, int] | None = None):
        self.path = Path(path)
        self.meta = meta
        self.compact_logits = compact_logits
        self.record_content = record_content
        meta.check(str(self.path))
        self.row_group_tokens = row_group_tokens or default_row_group_tokens(meta)
        if not self.path.parent.is_dir():
            raise InputError(f"{self.path}: directory {self.path.parent} does not exist; create it first")
        if self.path.is_dir():
            raise InputError(f"{self.path}: is a directory; give the trace a file name inside it")
        remove_orphans(self.path.parent, self.path.name)
        self._tmp = temp_path(self.path)  # created by the Parquet writer: the usual permissions
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_tokens = 0
        self._last = after
        self._content = ContentHash(meta)
        self.num_tokens = 0

    def write(self, *, seq, pos, phase, experts, weights, logits=None, residency=None,
              token_id=None, domain=None, nll=None, logit_ids=None, lookahead_logits=None,
              lookahead_ids=None) -> dict[str, np.ndarray]:
        """Append tokens: seq/pos/phase (T,), experts/weights/residency (T, L, k), logits (T, L, E).

        Logits are dense; with ``meta.logits_top_r`` only the top R are stored. A caller that
        selected them already (as :func:`_stored_logits` does) gives the R logits (T, L, R) with
        their ``logit_ids``. Look-ahead columns come in their stored form (module docstring):
        (T, L, D, R) logits and ids, or (T, L, D, E) logits in expert order.
        Optional per-token columns (token_id, domain, nll) must be given in every call or none.
        Returns the columns as stored (on-disk dtypes, top R selected): what :class:`ContentHash`
        hashes.
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
        self._append(cols)
        return cols

    def _append(self, cols: dict[str, np.ndarray]) -> None:
        """Append checked tokens in their on-disk form (as TraceReader reads them)."""
        if self._schema is None:
            self._schema = arrow_schema(self.meta, [n for n in _TOKEN_COLUMNS if n in cols], self.compact_logits)
        elif set(cols) != set(self._schema.names) - {"layer"}:
            raise ValueError("every write must give the same optional columns as the first")
        if not cols["seq"].size:
            return
        if self.record_content:
            self._content.update(cols)
        self._last = (int(cols["seq"][-1]), int(cols["pos"][-1]))
        self._pending.append(cols)
        self._pending_tokens += cols["seq"].shape[0]
        self.num_tokens += cols["seq"].shape[0]
        if self._pending_tokens >= self.row_group_tokens:
            with output_errors(self.path):
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
            self._writer = pq.ParquetWriter(self._tmp, self._schema, **parquet_options(self._schema))
        if not self._pending:
            return
        merged = self._pending[0] if len(self._pending) == 1 else {  # one write: no copy
            name: np.concatenate([c[name] for c in self._pending]) for name in self._pending[0]}
        n = merged["seq"].shape[0]
        whole = n if final else n - n % self.row_group_tokens
        for start in range(0, whole, self.row_group_tokens):
            part = {name: v[start:start + self.row_group_tokens] for name, v in merged.items()}
            table = _to_table(self.meta, part, self._schema)
            self._writer.write_table(table, row_group_size=table.num_rows)
        rest = {name: v[whole:].copy() for name, v in merged.items()}  # the caller may fill its arrays again
        self._pending = [rest] if whole < n else []
        self._pending_tokens = n - whole

    def close(self) -> None:
        """Write what is pending, record the content hash and move the file into place."""
        try:
            if not self.num_tokens:
                raise InputError(f"{self.path}: no tokens were written; a trace needs at least one token")
            with output_errors(self.path):
                self._flush(final=True)
                content = {CONTENT_KEY: self._content.hexdigest()} if self.record_content else {}
                self._writer.add_key_value_metadata({
                    **content, META_HASH_KEY: hashlib.sha256(self.meta.to_json().encode()).hexdigest()})
                self._writer.close()
                os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

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
    """Writer settings: LZ4 for the binary columns (see *Logits encoding*), zstd and
    byte-stream-split for the float columns, zstd and dictionaries for the integers, a CRC-32 checksum on every
    page (verified by the reader), and min/max statistics for every column but the binary ones."""
    def leaf(f: pa.Field) -> tuple[str, pa.DataType]:
        nested = pa.types.is_fixed_size_list(f.type)
        return (f"{f.name}.list.element", f.type.value_type) if nested else (f.name, f.type)

    leaves = [leaf(f) for f in schema]
    floats = [name for name, t in leaves if pa.types.is_floating(t)]
    integers = [name for name, t in leaves if pa.types.is_integer(t)]
    # the min and max of binary values (a token-layer's bytes) tell a reader nothing: not computed
    # (1.8 of 24 ms of a 3,206-token unit's encoding with top-64 logits, 2 cores)
    described = [name for name, t in leaves if not pa.types.is_fixed_size_binary(t)]
    # dictionary encoding would take precedence over byte-stream-split: integers only
    # LZ4 for the per-token-layer binary values (logits, ids, gates): zstd saves little on them
    # and takes twice the CPU to decode (see *Logits encoding*)
    binary = {name for name, t in leaves if pa.types.is_fixed_size_binary(t)}
    return {"compression": {name: "lz4" if name in binary else "zstd" for name, _ in leaves},
            "use_dictionary": integers, "use_byte_stream_split": floats, "write_page_checksum": True,
            "write_statistics": described}


def repack_trace(src: str | os.PathLike, dst: str | os.PathLike, logits_quantum: float | None = None,
                 model_name: str | None = None, progress: bool = False,
                 compact_logits: bool = False) -> TraceMeta:
    """Rewrite a trace in the current encoding (``compact_logits``: the compact one), with page
    checksums and a content hash.

    Every value is read, checked and written as it was, except that with ``logits_quantum``
    the router logits are rounded to multiples of it (recorded in the metadata as
    ``extra.logits_quantum``): lossy, but gate weights and expert ids stay exact; a quantum of
    1/32 is the resolution bf16 itself has for logits of magnitude 4 to 8.
    """
    with open_trace(src) as reader:
        meta = reader.meta
        if model_name:
            meta.model = model_name
        if logits_quantum is not None:
            if not meta.has_logits:
                raise InputError(f"{src}: has no logits; drop --logits-quantum")
            if not (0 < logits_quantum <= 1):
                raise InputError(f"--logits-quantum={logits_quantum} must be in (0, 1], e.g. 0.03125")
            meta.extra = {**meta.extra, "logits_quantum": float(logits_quantum)}
        with TraceWriter(dst, meta, compact_logits=compact_logits) as writer, tqdm(total=reader.num_tokens, unit="tok", desc="repack",
                                                     disable=not progress) as bar:
            for _, cols in reader.iter_stored():
                if logits_quantum is not None:
                    values = cols["logits"].astype(np.float32)
                    cols["logits"] = (np.round(values / logits_quantum) * logits_quantum).astype(np.float16)
                writer._append(cols)
                bar.update(cols["seq"].shape[0])
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
                table = self.pf.read_row_group(i, columns=self.columns, use_threads=False)
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
    """A column as a numpy array of ``shape`` (list columns flattened, binary columns viewed as
    their ``BINARY_DTYPES``), copied out of Arrow; binary logits of one piece stay a read-only
    view of it (they are converted, never handed out as they are)."""
    pieces = []
    chunks = table.column(name).chunks
    for piece in chunks:
        if pa.types.is_fixed_size_binary(piece.type):
            width = piece.type.byte_width
            data = np.frombuffer(piece.buffers()[1], np.uint8)
            pieces.append(data[piece.offset * width:(piece.offset + len(piece)) * width].view(BINARY_DTYPES[name]))
            if len(chunks) == 1:
                return pieces[0].reshape(shape) if name == "logits" else pieces[0].reshape(shape).copy()
            continue
        if pa.types.is_fixed_size_list(piece.type):
            piece = piece.flatten()
        pieces.append(piece.to_numpy(zero_copy_only=False))  # a view where Arrow allows
    return np.concatenate(pieces).reshape(shape)


def _first_null_row(column: pa.ChunkedArray) -> int | None:
    """Index of the first row that is null or holds a null list entry, or None."""
    offset = 0
    for piece in column.chunks:
        nested = pa.types.is_fixed_size_list(piece.type)
        if piece.null_count or (nested and piece.flatten().null_count):
            null = piece.is_null().to_numpy(zero_copy_only=False)
            if nested:  # the entries of every row, null rows included
                width = piece.type.list_size
                entries = piece.values.slice(piece.offset * width, len(piece) * width)
                null |= entries.is_null().to_numpy(zero_copy_only=False).reshape(len(piece), width).any(axis=1)
            return offset + int(np.argmax(null))
        offset += len(piece)
    return None


def _raise_on_nulls(where: str, columns: Iterable[tuple[str, pa.ChunkedArray]], first_row: int,
                    num_layers: int) -> None:
    for name, column in columns:
        row = _first_null_row(column)
        if row is not None:
            row += first_row
            raise InputError(
                f"{where}: column '{name}' at row {row} (token {row // num_layers}, layer "
                f"{row % num_layers}) is null or holds a null entry; nulls are not allowed in a "
                "trace, re-create it"
            )


class TraceReader:
    """A trace file opened for streaming: ``meta``, sizes and chunk iterators of whole groups."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._where = str(self.path)
        self._pf = _open_parquet(self.path)
        self.meta = _read_meta(self._pf, self._where)
        self._columns = _check_schema(self._pf.schema_arrow, self.meta, self._where)
        self.num_rows = int(self._pf.metadata.num_rows)
        if not self.num_rows:
            raise InputError(f"{self._where}: the trace has no rows (0 tokens); re-create it with at "
                             "least one token")
        if self.num_rows % self.meta.num_layers:
            raise InputError(
                f"{self._where}: {self.num_rows} rows are not a multiple of num_layers "
                f"{self.meta.num_layers} (a token is missing layers or the file is truncated); "
                "re-create the trace"
            )
        md = self._pf.metadata
        self._max_row_group_rows = max(md.row_group(i).num_rows for i in range(md.num_row_groups))
        self._need_memory(1)  # one token and one row group
        self._plans: dict[int, np.ndarray] = {}
        self._scanned: dict[str, np.ndarray] = {}  # per-token columns the scan kept (whole trace)

    @property
    def num_tokens(self) -> int:
        return self.num_rows // self.meta.num_layers

    @property
    def content_hash(self) -> str | None:
        """The content hash the file records (``sha256:<hex>``), or None for older files."""
        return _recorded_hash(self._pf, self._where)

    def iter_chunks(self, max_tokens: int | None = None, *, logits: bool = True,
                    order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """Chunks of whole groups in trace order, each of at most ``max_tokens`` tokens.

        A group longer than ``max_tokens`` comes as one chunk. Default: ~CHUNK_BYTES decoded.
        ``logits=False``: the logits column is not read; ``order_r``: ``chunk.logit_order``;
        ``stored_ids``: int16 expert ids (module docstring, *Options*).
        """
        return self._iter(self._plan(max_tokens), False, logits, order_width(self.meta, order_r), stored_ids)

    def iter_chunks_reversed(self, max_tokens: int | None = None, *, logits: bool = True,
                             order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first (group ids as in forward order)."""
        return self._iter(self._plan(max_tokens)[::-1], True, logits, order_width(self.meta, order_r), stored_ids)

    def iter_stored(self, max_tokens: int | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(first group, checked columns) of each chunk in trace order, the columns in their
        on-disk form (what TraceWriter writes, ContentHash hashes and :func:`decode_stored`
        decodes): per-token columns (T,), per-layer ones (T, L, width), logits float16."""
        plan = self._plan(max_tokens)  # first: the scan may keep per-token columns
        rows = _RowGroups(self._pf, self._chunk_columns(), self._where)
        for start, stop, first_group in plan:
            yield int(first_group), self._read_stored(rows, int(start), int(stop), descending=False)

    def verify(self) -> str:
        """Decode the whole file and check it against its recorded content hash; return the hash.

        Raises InputError if the file records none (written by an older version) or if the
        decoded content differs (the file was changed or damaged after it was written).
        """
        recorded = self.content_hash
        if recorded is None:
            raise InputError(f"{self._where}: records no content hash (written by an older version); "
                             "moe-trace repack IN OUT writes a copy with one")
        content = ContentHash(self.meta)
        for _, cols in self.iter_stored():
            content.update(cols)
        found = content.hexdigest()
        if found != recorded:
            raise InputError(f"{self._where}: the decoded content has hash {found[:23]}..., the file "
                             f"records {recorded[:23]!r}...; the file was changed or damaged after it "
                             "was written, re-create or restore it")
        return found

    def read_all(self) -> TraceChunk:
        """The whole trace as one chunk (small traces, tests)."""
        return next(self._iter(self._plan(max(1, self.num_tokens)), False, True, 0, False))

    def _iter(self, plan: np.ndarray, descending: bool, logits: bool, order_r: int,
              stored_ids: bool) -> Iterator[TraceChunk]:
        skipped = () if logits or order_r else ("logits", "logit_ids")
        rows = _RowGroups(self._pf, self._chunk_columns(skipped), self._where)
        for start, stop, first_group in plan:
            stored = self._read_stored(rows, int(start), int(stop), descending)
            yield decode_stored(self.meta, stored, int(first_group), logits=logits, order_r=order_r,
                                stored_ids=stored_ids)

    def _chunk_columns(self, skipped: Iterable[str] = ()) -> list[str]:
        """The columns a chunk's read decodes: all but ``skipped``, ``layer`` (which the plan's
        scan has checked; a chunk holds tokens, not rows) and the per-token columns the scan kept."""
        return [name for name in self._columns if name not in ("layer", *skipped, *self._scanned)]

    def _read_stored(self, rows: _RowGroups, start: int, stop: int,
                     descending: bool) -> dict[str, np.ndarray]:
        meta = self.meta
        num_layers, t = meta.num_layers, stop - start
        table = rows.read(start * num_layers, stop * num_layers, descending)
        _raise_on_nulls(self._where, ((name, table.column(name)) for name in rows.columns),
                        start * num_layers, num_layers)
        per_layer = {"experts": (meta.top_k,), "weights": (meta.top_k,), "residency": (meta.top_k,),
                     "logits": (_logits_width(meta),), "logit_ids": (_logits_width(meta),),
                     **_lookahead_shapes(meta)}
        cols = {}
        for name in rows.columns:
            if name in per_layer:
                cols[name] = _numpy(table, name, (t, num_layers, *per_layer[name]))
            else:
                cols[name] = _numpy(table, name, (t, num_layers))[:, 0].copy()
        del table
        for name in self._columns:
            if name in self._scanned and name not in cols:
                cols[name] = self._scanned[name][start:stop].copy()
        problem = find_problem(meta, cols)
        if problem:
            _raise(self._where, problem, cols["seq"], cols["pos"])
        return cols

    def _plan(self, max_tokens: int | None) -> np.ndarray:
        max_tokens = default_max_tokens(self.meta) if max_tokens is None else int(max_tokens)
        if max_tokens not in self._plans:
            plan = plan_chunks(self._scan_group_starts(), self.num_tokens, max_tokens)
            self._need_memory(int((plan[:, 1] - plan[:, 0]).max()))
            self._plans[max_tokens] = plan
        return self._plans[max_tokens]

    def _need_memory(self, chunk_tokens: int) -> None:
        """Refuse, before allocating, a read whose chunk and row group exceed the free memory."""
        meta = self.meta
        stored_token = _token_bytes(meta, per_rank=6, per_logit=2, per_token=15, stored=True)
        # a row group in Arrow memory, the chunk's stored copy, and the decoded chunk
        need = (self._max_row_group_rows * (stored_token // meta.num_layers + 11)
                + chunk_tokens * (stored_token + _token_bytes(meta, per_rank=8, per_logit=4, per_token=27)))
        ensure_memory(need, f"decoding a chunk of {chunk_tokens:,} tokens ({meta.num_layers} layers x "
                            f"{meta.num_experts} experts)", self._where)

    def _scan_group_starts(self) -> Iterator[np.ndarray]:
        """Stream the small columns, check row structure and order, yield group starts."""
        num_layers = self.meta.num_layers
        expected_layers = np.arange(num_layers, dtype=np.int16)
        prev: tuple[int, int, int] | None = None  # (seq, pos, phase) of the last token seen
        first_token = 0
        kept = (["seq", "pos", "phase"] + [n for n in ("domain",) if n in self._columns]
                if self.num_tokens <= KEEP_SCANNED_TOKENS else [])
        pieces: dict[str, list[np.ndarray]] = {name: [] for name in kept}
        batches = _whole_token_rows(self._pf, ["seq", "pos", "layer", "phase", *kept[3:]],
                                    max(1, SCAN_ROWS // num_layers), num_layers, self._where)
        for rows in batches:
            by_token = {name: v.reshape(-1, num_layers) for name, v in rows.items()}
            for name in kept:
                pieces[name].append(by_token[name][:, 0].copy())
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
        if kept:  # the whole trace scanned and checked
            self._scanned = {name: np.concatenate(pieces[name]) for name in kept}

    def close(self) -> None:
        self._pf.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decode_stored(meta: TraceMeta, stored: dict[str, np.ndarray], first_group: int, *,
                  logits: bool = True, order_r: int = 0, stored_ids: bool = False) -> TraceChunk:
    """The chunk of checked on-disk columns (:meth:`TraceReader.iter_stored`); groups from
    ``first_group``. Logits become dense float32 if ``logits`` (dense float16 for
    ``logits="float16"``); ``order_r`` (at most E - k) adds ``logit_order``; ``stored_ids``
    keeps the expert ids int16."""
    cols = dict(stored)
    values, ids = cols.pop("logits", None), cols.pop("logit_ids", None)
    as_stored = logits == "float16"
    if logits and values is not None and not as_stored:
        cols["logits"] = decoded_logits(meta, values, ids)
    chunk = make_chunk(meta, **cols, first_group=first_group, ids_dtype=np.int16 if stored_ids else np.int32)
    if as_stored and values is not None:
        chunk.logits = decoded_logits(meta, values, ids, as_stored=True)
    if order_r:
        chunk.logit_order = stored_logit_order(meta, values, ids, order_r, stored["experts"])
    return chunk


def order_width(meta: TraceMeta, order_r: int) -> int:
    """The R of ``logit_order`` for a source's ``order_r`` option: at most E - k (the experts a
    token-layer did not select); 0 for none."""
    order_r = int(order_r)
    if order_r < 0:
        raise ValueError(f"order_r must be >= 0, got {order_r}")
    if order_r and not meta.has_logits:
        raise ValueError("order_r needs a trace with logits")
    return min(order_r, meta.num_experts - meta.top_k)


def _whole_token_rows(pf: pq.ParquetFile, columns: list[str], tokens: int, num_layers: int,
                      where: str) -> Iterator[dict[str, np.ndarray]]:
    """Stream columns in batches of whole tokens (num_layers rows each), whatever the row groups."""
    carry: dict[str, np.ndarray] | None = None
    first_row = 0  # of the batch
    try:
        for batch in pf.iter_batches(batch_size=tokens * num_layers, columns=columns):
            _raise_on_nulls(where, ((name, pa.chunked_array([batch.column(name)])) for name in columns),
                            first_row, num_layers)
            first_row += batch.num_rows
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


def regular_file(path: str | os.PathLike, what: str = "trace file") -> Path:
    """``path`` if it names a regular file; checked with stat, so a pipe or device is never opened."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}; check the path") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror}); check the path and its "
                         "permissions") from None
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                 (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                 (stat.S_ISSOCK, "a socket"))
        kind = next((name for test, name in kinds if test(mode)), "a special file")
        raise InputError(f"{path}: is {kind}, not a regular file; give the path of a {what}")
    return path


def available_memory_bytes() -> int:
    """Bytes this process can still allocate: the least of the system's available memory, the
    cgroup's headroom and the address-space limit's headroom (``ulimit -v``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    if not limits:
        limits.append(os.sysconf("SC_AVPHYS_PAGES") * page)
    try:
        cgroup = Path("/sys/fs/cgroup")
        high = (cgroup / "memory.max").read_text().strip()
        if high != "max":
            limits.append(int(high) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as f:
            limits.append(soft - int(f.read().split()[0]) * page)
    return max(0, min(limits))


def ensure_memory(nbytes: int, what: str, where: str) -> None:
    """Raise InputError, before anything is allocated, if ``what`` needs more than the free memory."""
    available = available_memory_bytes()
    if nbytes > available:
        raise InputError(
            f"{where}: {what} needs about {nbytes / 2**30:,.1f} GiB ({nbytes:,} bytes), more than the "
            f"{available / 2**30:,.1f} GiB available; check the sizes in the metadata (a damaged file "
            "can claim absurd ones), or use a host with more memory"
        )


def recorded_content_hash(path: str | os.PathLike) -> str | None:
    """The content hash a trace file records, read from its footer alone (None for older files);
    the footer's metadata is checked as on open."""
    pf = _open_parquet(Path(path))
    try:
        _read_meta(pf, str(path))
        return _recorded_hash(pf, str(path))
    finally:
        pf.close()


def _recorded_hash(pf: pq.ParquetFile, where: str) -> str | None:
    value = (pf.metadata.metadata or {}).get(CONTENT_KEY)
    if value is None:
        return None
    text = value.decode("ascii", "replace")
    if not _HASH.fullmatch(text):
        raise InputError(f"{where}: metadata '{CONTENT_KEY.decode()}' is {text[:80]!r}, not "
                         "'sha256:' and 64 hex digits; the file is damaged, re-create or restore it")
    return text


def _open_parquet(path: Path) -> pq.ParquetFile:
    regular_file(path)
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
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
    recorded = kv.get(META_HASH_KEY)
    if recorded is not None and hashlib.sha256(kv[META_KEY]).hexdigest().encode() != recorded:
        raise InputError(f"{where}: metadata 'moe_trace' does not match its recorded SHA-256; the "
                         "file was changed or damaged after it was written, re-create or restore it")
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
        found = _type_name(schema.field(name).type)
        compact = _compact_types(meta).get(name)
        if found != _type_name(types[name]) and not (compact and found == _type_name(compact)):
            raise InputError(
                f"{where}: column '{name}' has type {found}, expected "
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
    ``keep_order``: a ``logit_order`` asked for is ranked once over the whole trace and kept, as
    the trace cache keeps it (so the engines walk it, :func:`simulator.engine.read_options`);
    without, every pass that asks ranks its chunks again.
    """

    def __init__(self, meta: TraceMeta, chunk: TraceChunk, keep_order: bool = False):
        self.meta = meta
        self.chunk = chunk
        self.keeps_logit_order = keep_order
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_tokens(self) -> int:
        return self.chunk.num_tokens

    @property
    def token_bound(self) -> int:
        """Above the tokens and every group ordinal here (a chunk cut from a longer trace keeps
        the trace's ordinals)."""
        last = int(self.chunk.group[-1]) + 1 if self.chunk.num_tokens else 0
        return max(self.chunk.num_tokens, last)

    def iter_chunks(self, max_tokens: int | None = None, *, logits: bool = True,
                    order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """Sub-chunks of at most ``max_tokens`` tokens (a longer group comes whole); None: all.

        ``logits`` and ``order_r`` as the reader's (module docstring, *Options*); the ids come
        as the chunk holds them whatever ``stored_ids``.
        """
        return self._chunks(self._plan(max_tokens), logits, order_width(self.meta, order_r))

    def iter_chunks_reversed(self, max_tokens: int | None = None, *, logits: bool = True,
                             order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first."""
        return self._chunks(self._plan(max_tokens)[::-1], logits, order_width(self.meta, order_r))

    def _chunks(self, plan: np.ndarray, logits: bool, order_r: int) -> Iterator[TraceChunk]:
        if order_r and self.keeps_logit_order and order_r not in self._orders:
            self._orders[order_r] = logit_order(self.chunk.logits, order_r, exclude=self.chunk.experts)
        for start, stop, _ in plan:
            c = slice_chunk(self.chunk, int(start), int(stop))
            if order_r in self._orders:
                c.logit_order = self._orders[order_r][start:stop]
            elif order_r:
                c.logit_order = logit_order(c.logits, order_r, exclude=c.experts)
            if not logits:
                c.logits = self.chunk.logits[:0]
            yield c

    def _plan(self, max_tokens: int | None) -> np.ndarray:
        return group_plan(self.chunk.group, max_tokens or max(1, self.num_tokens))


def group_plan(group: np.ndarray, max_tokens: int) -> np.ndarray:
    """:func:`plan_chunks` of tokens whose global group ids are ``group`` (int64[T])."""
    starts = np.flatnonzero(np.diff(group, prepend=group[:1] - 1))
    return plan_chunks([starts], group.shape[0], max_tokens)


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
        logit_order=c.logit_order[start:stop] if c.logit_order.shape[0] else c.logit_order,
        **{name: None if getattr(c, name) is None else getattr(c, name)[start:stop]
           for name in _OPTIONAL_CHUNK_ARRAYS},
    )


def concat_chunks(chunks: list[TraceChunk]) -> TraceChunk:
    """Consecutive chunks of one trace joined into one (copies)."""
    def join(name: str) -> np.ndarray:
        parts = [getattr(c, name) for c in chunks]
        if name in ("logits", "residency", "logit_order") and not any(p.shape[0] for p in parts):
            return parts[0]
        return np.concatenate(parts)

    optional = {name: None if any(getattr(c, name) is None for c in chunks)
                else np.concatenate([getattr(c, name) for c in chunks]) for name in _OPTIONAL_CHUNK_ARRAYS}
    names = [f.name for f in fields(TraceChunk) if f.name not in optional]
    return TraceChunk(**{name: join(name) for name in names}, **optional)
