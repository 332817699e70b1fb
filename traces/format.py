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
logits          fixed_size_list<float16>[E]        optional: full router logits
residency       fixed_size_list<int8>[k]           optional: 1 = was resident when recorded
token_id        int32                              optional: vocabulary id of the token
domain          int16                              optional: index into meta.domains
nll             float32                            optional: teacher-forced NLL of the token (nats)
==============  =================================  ===========================================

File metadata: key ``moe_trace`` holds the JSON of :class:`TraceMeta`.

A *group* is the unit the simulator processes at once: a maximal run of consecutive prefill
tokens of one sequence (one batch per layer), or a single decode token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 1
META_KEY = b"moe_trace"
PHASE_PREFILL = 0
PHASE_DECODE = 1


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
    has_residency: bool = False
    layer_ids: list[int] = field(default_factory=list)  # real model layer index per MoE layer
    domains: list[str] = field(default_factory=list)  # names for the domain column
    dense_bytes: list[int] = field(default_factory=list)  # non-expert weight bytes per layer
    source: str = ""  # "synth", "route-csv", "capture", ...
    schema_version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)  # free-form provenance (seed, command, ...)


@dataclass
class TraceChunk:
    """A decoded block of whole groups, as plain arrays for the engines.

    T tokens, L layers, k ranks, E experts. Arrays are C-contiguous.
    ``group`` numbers groups globally across chunks (non-decreasing, first group of a trace is
    0); a chunk never splits a group. ``gates`` are the normalised gate weights g (the k
    weights of a token-layer divided by their sum). ``logits`` has shape (T, L, E) when the
    trace has logits, else (0, L, E); ``residency`` likewise (T, L, k) or (0, L, k).
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

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])


class ArraySource:
    """An in-memory trace: one :class:`TraceChunk` served in chunks of whole groups.

    Implements the chunk-source protocol the engines read (``meta`` and a re-iterable
    ``iter_chunks``), like the Parquet reader does.
    """

    def __init__(self, meta: TraceMeta, chunk: TraceChunk):
        self.meta = meta
        self.chunk = chunk

    def iter_chunks(self, max_tokens: int | None = None):
        """Yield sub-chunks of at most ``max_tokens`` tokens (more if one group is longer)."""
        c = self.chunk
        n = c.num_tokens
        if max_tokens is None or max_tokens >= n:
            yield c
            return
        start = 0
        while start < n:
            stop = min(start + max_tokens, n)
            # extend to the end of the group that straddles the cut
            while stop < n and c.group[stop] == c.group[stop - 1]:
                stop += 1
            yield slice_chunk(c, start, stop)
            start = stop


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
        nll=None if c.nll is None else c.nll[start:stop],
    )
