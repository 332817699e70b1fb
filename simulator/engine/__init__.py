"""The simulation engines: ``simulate`` replays a trace through the policies of a SimParams.

``engine="numba"`` runs :mod:`simulator.engine.kernel`; ``engine="reference"`` runs the
plain-Python :mod:`simulator.engine.reference`. Both follow docs/semantics.md and agree exactly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from simulator.engine.kernel import KernelSimulator
from simulator.engine.layout import make_layout
from simulator.engine.nextuse import NextUseFile, after_group
from simulator.engine.params import (
    EVICTIONS,
    INITS,
    MISS_ACTIONS,
    SCOPES,
    SUBSTITUTE_BY,
    SimParams,
    SimResult,
)
from simulator.engine.reference import ReferenceSimulator, StepDecision
from simulator.policies.miss_rule import can_leave_misses
from traces.errors import InputError
from traces.format import PHASE_DECODE, TraceChunk, TraceMeta

ENGINES = {"numba": KernelSimulator, "reference": ReferenceSimulator}

__all__ = ["ENGINES", "ReferenceSimulator", "StepDecision", "simulate"]


def simulate(
    source,
    params: SimParams,
    engine: str = "numba",
    progress: Callable[[int], object] | None = None,
    *,
    chunk_tokens: int | None = None,
) -> SimResult:
    """Replay a trace through the cache, miss, eviction and admission policies of ``params``.

    ``source``: ``.meta`` (TraceMeta) and a re-iterable ``.iter_chunks(max_tokens)`` of whole
    groups (optionally ``.iter_chunks_reversed``, used by the belady pre-pass). The trace is
    streamed chunk by chunk (``chunk_tokens`` per chunk; None: the source's default).
    ``progress(tokens_done)`` is called after each chunk with the trace tokens read so far.
    """
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    meta = source.meta
    check_params(params, meta)
    counts, last_warmup_group = None, -1
    if params.init == INITS["frequency"]:
        counts, last_warmup_group = warmup_counts(source, params, chunk_tokens)
    with contextlib.ExitStack() as stack:
        next_use = None
        if params.eviction == EVICTIONS["belady"]:
            next_use = stack.enter_context(NextUseFile(source, last_warmup_group, chunk_tokens))
        sim = ENGINES[engine](params, meta, None if next_use is None else next_use.first_use)
        if counts is not None:
            sim.warm(counts)
        tokens_done = 0
        row = 0
        for chunk in source.iter_chunks(chunk_tokens):
            tokens_done += chunk.num_tokens
            check_chunk(chunk, params)
            chunk = after_group(chunk, last_warmup_group)
            if chunk.num_tokens:
                stop = row + chunk.num_tokens
                sim.run_chunk(chunk, None if next_use is None else next_use.rows(row, stop))
                row = stop
            if progress is not None:
                progress(tokens_done)
        return sim.result()


def warmup_counts(source, params: SimParams, chunk_tokens: int | None = None):
    """Selection counts int64[L*E] of the warm-up tokens and the last warm-up group ordinal.

    The warm-up is the first ``params.warmup_tokens`` tokens extended to a whole group
    (-1: no warm-up group).
    """
    L, E = params.num_layers, params.num_experts
    counts = np.zeros(L * E, np.int64)
    last_group = -1
    if params.warmup_tokens <= 0:
        return counts, last_group
    layer_base = (np.arange(L, dtype=np.int64) * E)[None, :, None]
    seen = 0
    for chunk in source.iter_chunks(chunk_tokens):
        T = chunk.num_tokens
        if T == 0:
            continue
        check_chunk(chunk, params)
        stop = T
        if seen + T >= params.warmup_tokens:
            last_group = int(chunk.group[params.warmup_tokens - seen - 1])
            stop = int(np.searchsorted(chunk.group, last_group, side="right"))
        else:
            last_group = int(chunk.group[-1])
        x = chunk.experts[:stop].astype(np.int64) + layer_base
        counts += np.bincount(x.ravel(), minlength=L * E)
        seen += T
        if seen >= params.warmup_tokens:
            break
    return counts, last_group


def check_params(params: SimParams, meta: TraceMeta) -> None:
    """Raise InputError where ``params`` cannot run on a trace with ``meta``."""
    make_layout(params, meta)
    for name, codes in (
        ("scope", SCOPES),
        ("eviction", EVICTIONS),
        ("init", INITS),
        ("miss_action", MISS_ACTIONS),
        ("substitute_by", SUBSTITUTE_BY),
    ):
        if getattr(params, name) not in codes.values():
            raise InputError(f"params.{name} = {getattr(params, name)} is not one of {codes}")
    if not 0.0 < params.lfu_decay <= 1.0:
        raise InputError(f"lfu_decay must be in (0, 1], got {params.lfu_decay}")
    if params.warmup_tokens < 0:
        raise InputError(f"warmup_tokens must be >= 0, got {params.warmup_tokens}")
    if (
        params.substitute_by == SUBSTITUTE_BY["logit"]
        and params.miss_action == MISS_ACTIONS["substitute"]
        and can_leave_misses(params.protect_ranks, params.tau, params.top_k)
        and not meta.has_logits
    ):
        raise InputError(
            "substitute_by=logit needs a trace with router logits; this trace has none "
            "(use substitute_by=frequency)"
        )


def check_chunk(chunk: TraceChunk, params: SimParams) -> None:
    """Raise InputError where a chunk breaks the TraceChunk contract the engines rely on."""
    if chunk.experts.ndim != 3 or chunk.experts.shape[1:] != (params.num_layers, params.top_k):
        raise InputError(f"chunk experts have shape {chunk.experts.shape}; expected (T, L, k)")
    T = chunk.num_tokens
    if T == 0:
        return
    if chunk.experts.min() < 0 or chunk.experts.max() >= params.num_experts:
        raise InputError(f"expert ids must lie in [0, {params.num_experts})")
    if chunk.logits.shape[0] not in (0, T):
        raise InputError("chunk logits must cover every token or none")
    same = chunk.group[1:] == chunk.group[:-1]
    if np.any(chunk.group[1:] < chunk.group[:-1]):
        raise InputError("group ordinals must not decrease")
    if np.any(same & (chunk.phase[1:] != chunk.phase[:-1])):
        raise InputError("a group mixes prefill and decode tokens")
    if np.any(same & (chunk.phase[1:] == PHASE_DECODE)):
        raise InputError("a decode group must be a single token")
