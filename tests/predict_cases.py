"""Builders shared by the predictor tests: traces with look-ahead routing, and both twins of a
predictor driven step by step in the engines' order."""
from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
from engine_cases import params as make_params

from analysis.predict import kernel_chunk
from simulator.engine.layout import make_layout
from simulator.engine.state import make_consts, make_core_state
from simulator.jit import specialise
from simulator.policies.predictor import REGISTRY
from traces.format import LOOKAHEAD_NO_LAYER, PHASE_DECODE, ArraySource, TraceMeta, make_chunk


def lookahead_trace(experts, lookahead_ids=None, *, num_experts: int, phase=None, seq=None,
                    expert_bytes=None, all_experts: bool = False) -> ArraySource:
    """An in-memory trace from experts [T, L, k] and look-ahead ids [T, L, D, R] (best first;
    the ids of rows l + d >= L are replaced by the sentinel); all decode tokens of sequence 0
    unless ``phase`` / ``seq`` say otherwise. ``all_experts``: stored as all E logits in expert
    order (R must be E) instead of top-R with ids."""
    experts = np.asarray(experts, dtype=np.int16)
    T, L, k = experts.shape
    phase = np.full(T, PHASE_DECODE) if phase is None else np.asarray(phase)
    seq = np.zeros(T, np.int32) if seq is None else np.asarray(seq)
    ahead = {}
    depth = top_r = 0
    if lookahead_ids is not None:
        ids = np.array(lookahead_ids, dtype=np.int16)
        depth, top_r = ids.shape[2], ids.shape[3]
        logits = np.broadcast_to(-np.arange(top_r, dtype=np.float32), ids.shape).copy()
        missing = (np.arange(L)[:, None] + np.arange(1, depth + 1)[None, :]) >= L
        ids[:, missing] = LOOKAHEAD_NO_LAYER
        logits[:, missing] = -np.inf
        ahead = dict(lookahead_ids=ids, lookahead_logits=logits)
        if all_experts:
            dense = np.full(logits.shape, -np.inf, np.float32)
            np.put_along_axis(dense, np.maximum(ids, 0).astype(np.intp), logits, axis=-1)
            ahead, top_r = dict(lookahead_logits=dense), 0
    meta = TraceMeta(model="hand", num_layers=L, num_experts=num_experts, top_k=k,
                     expert_bytes=list(expert_bytes or [100] * L), lookahead_depth=depth,
                     lookahead_top_r=top_r, lookahead_source="moe_input" if depth else "")
    chunk = make_chunk(meta, seq=seq, pos=np.arange(T), phase=phase, experts=experts,
                       weights=np.full((T, L, k), 1.0 / k), **ahead)
    return ArraySource(meta, chunk)


def random_lookahead_trace(rng: np.random.Generator, tokens: int = 60,
                           all_experts: bool = False) -> ArraySource:
    """Skewed routing with prompts and decode tokens in several sequences, and look-ahead ids
    that list the true experts of layer l + d among random others (all E of them with
    ``all_experts``, stored in expert order)."""
    L = int(rng.integers(2, 5))
    E = int(rng.choice([4, 8, 16]))
    k = int(rng.integers(1, min(4, E) + 1))
    D = int(rng.integers(1, L))
    R = E if all_experts else int(rng.integers(1, E + 1))
    seq, phase = [], []
    while len(seq) < tokens:
        s = len(set(seq))
        if rng.random() < 0.5:
            n = int(rng.integers(1, 6))
            seq, phase = seq + [s] * n, phase + [0] * n
        n = int(rng.integers(1, 12))
        seq, phase = seq + [s] * n, phase + [1] * n
    T = len(seq)
    popularity = np.log(rng.zipf(1.5, size=(L, E)).astype(float))
    experts = np.argsort(-(popularity[None] + rng.gumbel(size=(T, L, E))), axis=-1)[..., :k]
    noise = rng.gumbel(size=(T, L, D, E))
    for d in range(1, D + 1):  # the true experts of l + d score higher
        ahead = np.roll(experts, -d, axis=1)  # [t, l] -> experts[t, l + d] (wrapped rows unused)
        np.put_along_axis(noise[:, :, d - 1], ahead, noise.max() + 1.0, axis=-1)
    ids = np.argsort(-noise, axis=-1, kind="stable")[..., :R]
    return lookahead_trace(experts, ids, num_experts=E, phase=phase, seq=seq,
                           expert_bytes=[int(b) for b in rng.integers(50, 400, size=L)],
                           all_experts=all_experts)


predictor = None  # bound per compiled step by specialise


def _predict(core, st, c, ch, a, layer, d, top_p, out):
    return predictor.predict(core, st, c, ch, a, layer, d, top_p, out)


def _observe(core, st, c, ch, a, layer):
    predictor.observe(core, st, c, ch, a, layer)


def twin_steps(source: ArraySource, name: str, distances, top_ps, train_tokens: int = 0,
               options: dict | None = None) -> Iterator[tuple[int, int, int, int, list, list]]:
    """Run one predictor's kernel hooks and its reference twin side by side over a trace, in the
    engines' order (frequencies advance at each step's start; predict, then observe, at decode
    steps); yields ``(row, layer, d, P, kernel's prediction, twin's prediction)`` at every
    decode step of rows >= ``train_tokens`` and every d, P with layer + d < L."""
    meta, chunk = source.meta, source.chunk
    T, L, k = chunk.experts.shape
    E = meta.num_experts
    params = make_params(meta, options={"train_tokens": train_tokens, **(options or {})})
    layout = make_layout(params, meta)
    consts, core = make_consts(params, layout), make_core_state(params, layout)
    module = REGISTRY[name]
    # compiled as the engine compiles hooks: the cache key follows every policy source
    predict, observe = (specialise(f, {"predictor": module}) for f in (_predict, _observe))
    state = module.make_state(params, layout)
    sim = SimpleNamespace(params=params, freq=[0.0] * (L * E))
    twin = module.Reference(sim)
    if module.TRAIN_TOKENS is not None:
        state = module.train(state, chunk.experts[:train_tokens], max(distances))
        twin.train(chunk.experts[:train_tokens], max(distances))
    ch = kernel_chunk(chunk, meta)
    out = np.zeros(max(top_ps), np.int64)
    a = 0
    while a < T:
        b = a + 1
        while b < T and chunk.group[b] == chunk.group[a]:
            b += 1
        for layer in range(L):
            for x in (layer * E + chunk.experts[a:b, layer]).ravel():
                core.freq[x] += 1.0
                sim.freq[x] += 1.0
            if chunk.phase[a] != PHASE_DECODE:
                continue
            for d in distances if a >= train_tokens else ():
                for p in top_ps if layer + d < L else ():
                    n = predict(core, state, consts, ch, a, layer, d, p, out)
                    yield a, layer, d, p, [int(x) for x in out[:n]], twin.predict(chunk, a, layer, d, p)
            observe(core, state, consts, ch, a, layer)
            twin.observe(chunk, a, layer)
        a = b
