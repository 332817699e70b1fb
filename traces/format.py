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
