"""The simulation engines and the one loop that drives them over a trace.

``engine="numba"`` runs :mod:`simulator.engine.kernel`; ``engine="reference"`` runs the
plain-Python :mod:`simulator.engine.reference`. Both follow docs/semantics.md and agree exactly.
:func:`simulate` is the loop every tool uses (warm-up, the belady pre-pass, chunks); tools that
need to see inside a run pass an :class:`~simulator.engine.reference.Observer` (reference
engine).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from simulator.engine.layout import Layout, make_layout
from simulator.engine.nextuse import NextUseFile, after_group
from simulator.engine.params import INITS, SCOPES, SimParams
from simulator.metrics import SimResult
from simulator.policies import chosen, registries
from traces.errors import InputError
from traces.format import PHASE_DECODE, TraceChunk, TraceMeta

ENGINES = ("numba", "reference")

__all__ = ["ENGINES", "simulate", "warmup_counts", "check_params", "check_chunk", "read_options"]


def make_engine(params: SimParams, meta: TraceMeta, engine: str = "numba",
                first_use: np.ndarray | None = None, observer=None, layout: Layout | None = None,
                num_tokens: int | None = None):
    """A fresh simulator of ``engine`` for ``params`` on a trace with ``meta`` (``layout``:
    what :func:`check_params` returned for them, else derived again; ``num_tokens``: a bound
    on the run's tokens and group ordinals where known, :func:`token_bound`, which some kernel
    structures are sized by)."""
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "numba":
        if observer is not None:
            raise InputError("an observer needs engine=reference (the kernel reports no events)")
        from simulator.engine.kernel import KernelSimulator

        return KernelSimulator(params, meta, first_use, layout, num_tokens)
    from simulator.engine.reference import ReferenceSimulator

    return ReferenceSimulator(params, meta, first_use, observer, layout)


def read_options(params: SimParams, source=None) -> dict:
    """What the run reads of the trace, as chunk-source options: the router logits only where a
    miss can be substituted by logit, so a policy that never reads logits decodes none (and as
    stored, float16: the engines compare a few per step, the kernel converts a row only for its
    exact scan); and their
    top ``policy.top_r`` order (the walk of substitute/logit.py) where ``source`` keeps it
    (``keeps_logit_order``: the trace cache, which builds it once). Ranking every token-layer's
    logits costs a single pass more than the walk saves, so a plain Parquet pass scans instead:
    the same choices either way."""
    substitute = chosen(params)["substitute"]  # "frequency" where nothing is substituted
    reads = bool(registries()["substitute"][substitute].NEEDS_LOGITS)
    kept = bool(getattr(source, "keeps_logit_order", False)) if source is not None else True
    return {"logits": "float16" if reads else False,
            "order_r": int(params.options.get("top_r", 0)) if reads and kept else 0}


def needs_next_use(params: SimParams) -> bool:
    """Whether the eviction policy needs the belady pre-pass (each selection's next use)."""
    return getattr(registries()["eviction"][params.eviction], "NEEDS_NEXT_USE", False)


def simulate(
    source,
    params: SimParams,
    engine: str = "numba",
    progress: Callable[[int], object] | None = None,
    *,
    chunk_tokens: int | None = None,
    observer=None,
) -> SimResult:
    """Replay a trace through the cache, miss, eviction and admission policies of ``params``.

    ``source``: ``.meta`` (TraceMeta) and a re-iterable ``.iter_chunks(max_tokens)`` of whole
    groups (optionally ``.iter_chunks_reversed``, used by the belady pre-pass). The trace is
    streamed chunk by chunk (``chunk_tokens`` per chunk; None: the source's default).
    ``progress(tokens_done)`` is called after each chunk with the trace tokens read so far.
    ``observer``: see :class:`simulator.engine.reference.Observer` (reference engine only).
    """
    meta = source.meta
    layout = check_params(params, meta)
    counts, last_warmup_group = None, -1
    if params.init == "frequency":
        counts, last_warmup_group = warmup_counts(source, params, chunk_tokens)
    training, last_train_group = predictor_training(source, params, chunk_tokens)
    skipped = max(last_warmup_group, last_train_group)  # neither part is simulated
    with contextlib.ExitStack() as stack:
        next_use = None
        if needs_next_use(params):
            next_use = stack.enter_context(NextUseFile(source, skipped, chunk_tokens))
        sim = make_engine(params, meta, engine, None if next_use is None else next_use.first_use,
                          observer, layout, token_bound(source))
        if counts is not None:
            sim.warm(counts)
        if training is not None:
            sim.train_predictor(training, int(params.options.get("distance", 1)))
        tokens_done = 0
        row = 0
        # the kernel reads the ids as stored (int16): a source that holds them so skips widening
        options = dict(read_options(params, source), **({"stored_ids": True} if engine == "numba" else {}))
        # a source whose chunks were checked against the trace's metadata as they were decoded
        # (the trace cache) is not checked again: params match that metadata (check_params)
        checked = bool(getattr(source, "chunks_checked", False))
        for chunk in source.iter_chunks(chunk_tokens, **options):
            tokens_done += chunk.num_tokens
            if not checked:
                check_chunk(chunk, params)
            chunk = after_group(chunk, skipped)
            if chunk.num_tokens:
                stop = row + chunk.num_tokens
                sim.run_chunk(chunk, None if next_use is None else next_use.rows(row, stop))
                row = stop
            if progress is not None:
                progress(tokens_done)
        return sim.result()


def token_bound(source) -> int | None:
    """At most how many tokens ``source`` yields, all its group ordinals below it (its
    ``token_bound`` where a view says, else its ``num_tokens``); None where unknown."""
    bound = getattr(source, "token_bound", None)
    return int(bound) if bound is not None else getattr(source, "num_tokens", None)


def predictor_training(source, params: SimParams, chunk_tokens: int | None = None):
    """The selections int[N, L, k] that train the prefetch predictor, and their last group
    ordinal: the first ``train_tokens`` tokens (the predictor's ``TRAIN_TOKENS`` option) extended
    to a whole group, which are then not simulated; (None, -1) for a predictor that learns
    nothing ahead."""
    names = chosen(params)
    option = getattr(registries()["predictor"][names["predictor"]], "TRAIN_TOKENS", None)
    if option is None or names["prefetch"] == "none":
        return None, -1
    return leading_selections(source, params, int(params.options.get(option, 0)), chunk_tokens)


def leading_selections(source, params: SimParams, n: int, chunk_tokens: int | None = None):
    """The selections int[N, L, k] of the trace's first ``n`` tokens extended to a whole group,
    and that group's ordinal (-1 and no rows for ``n <= 0``)."""
    rows, last_group, seen = [], -1, 0
    for chunk in source.iter_chunks(chunk_tokens, logits=False) if n > 0 else ():
        T = chunk.num_tokens
        if T == 0:
            continue
        check_chunk(chunk, params)
        stop = T
        if seen + T >= n:
            last_group = int(chunk.group[n - seen - 1])
            stop = int(np.searchsorted(chunk.group, last_group, side="right"))
        else:
            last_group = int(chunk.group[-1])
        rows.append(np.asarray(chunk.experts[:stop]))
        seen += T
        if seen >= n:
            break
    return (np.concatenate(rows) if rows else np.zeros((0, params.num_layers, params.top_k), np.int32),
            last_group)


def warmup_counts(source, params: SimParams, chunk_tokens: int | None = None):
    """Selection counts int64[L*E] of the warm-up tokens and the last warm-up group ordinal.

    The warm-up is the first ``params.warmup_tokens`` tokens extended to a whole group
    (-1: no warm-up group).
    """
    L, E = params.num_layers, params.num_experts
    experts, last_group = leading_selections(source, params, params.warmup_tokens, chunk_tokens)
    x = experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]
    return np.bincount(x.ravel(), minlength=L * E).astype(np.int64), last_group


def check_params(params: SimParams, meta: TraceMeta) -> Layout:
    """Raise InputError where ``params`` cannot run on a trace with ``meta``; else the engines'
    constants for them (simulator.engine.layout)."""
    layout = make_layout(params, meta)
    if params.scope not in SCOPES:
        raise InputError(f"params.scope = {params.scope!r} is not one of {SCOPES}")
    if params.init not in INITS:
        raise InputError(f"params.init = {params.init!r} is not one of {INITS}")
    reg = registries()
    for family, name in (("eviction", params.eviction), ("miss_rule", params.miss_rule),
                         ("miss_action", params.miss_action),
                         ("substitute", params.substitute_by), ("predictor", params.predictor),
                         ("prefetch", params.prefetch)):
        reg[family][name]  # noqa: B018 - raises InputError naming the choices
    if params.pcie_copy_order not in ("priority", "submission"):
        raise InputError(f"pcie_copy_order must be priority or submission, got {params.pcie_copy_order!r}")
    if not 0.0 < params.lfu_decay <= 1.0:
        raise InputError(f"lfu_decay must be in (0, 1], got {params.lfu_decay}")
    if params.warmup_tokens < 0:
        raise InputError(f"warmup_tokens must be >= 0, got {params.warmup_tokens}")
    names = chosen(params)
    predictor = reg["predictor"][names["predictor"]]
    distance = int(params.options.get("distance", 1))
    if getattr(predictor, "NEEDS_LOOKAHEAD", False) and meta.lookahead_depth < distance:
        raise InputError(
            f"prefetch.predictor={names['predictor']} needs look-ahead routing {distance} layer(s) "
            f"ahead; this trace has {meta.lookahead_depth} (capture with lookahead.enabled=true "
            "lookahead.depth=D, or choose another predictor)"
        )
    substitute = reg["substitute"][names["substitute"]]
    if substitute.NEEDS_LOGITS and not meta.has_logits:
        raise InputError(
            f"substitute_by={params.substitute_by} needs a trace with router logits; this trace "
            "has none (use substitute_by=frequency)"
        )
    return layout


def _largest_unsigned(ids: np.ndarray) -> int:
    """The largest of ``ids`` read as unsigned (one pass, where min and max take two)."""
    if ids.dtype.kind == "i":
        ids = np.ascontiguousarray(ids).view(ids.dtype.str.replace("i", "u"))
    return int(ids.max())


def check_chunk(chunk: TraceChunk, params: SimParams) -> None:
    """Raise InputError where a chunk breaks the TraceChunk contract the engines rely on."""
    if chunk.experts.ndim != 3 or chunk.experts.shape[1:] != (params.num_layers, params.top_k):
        raise InputError(f"chunk experts have shape {chunk.experts.shape}; expected (T, L, k)")
    T = chunk.num_tokens
    if T == 0:
        return
    if _largest_unsigned(chunk.experts) >= params.num_experts:  # a negative id wraps above E
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
