"""Fit the synthetic routing model (traces/synth.py, RoutingFit) to a real trace, and check it.

What is estimated from the real trace (docs/SYNTH.md has the model and the numbers):

- **Sequences**: every sequence's prompt and total length and domain, repeated by the generator.
- **Gates**: per rank r, the quantiles of the logit gap ``log g_r - log g_(r+1)`` (pooled over
  layers); the gates of a synthetic token are the softmax of logits with these gaps.
- **Logits**: the first choice's median logit and the median gap from the k-th logit to the
  best unselected one (the scale of the unselected logits); without logits, the last gate gap.
- **Selection** (per layer): recency weights over LRU stack positions, a rank-frequency curve,
  per-domain popularity offsets and the cross-layer co-activation bonus. These are calibrated
  by simulation: the model is run on the real trace's own layout (its tokens, sequences and
  domains, as replicas when the trace is short, so that cold starts count alike) and each
  parameter is moved by the log ratio of the real to the simulated statistic it controls:

  ======================  ==================================================================
  parameter               statistic matched
  ======================  ==================================================================
  recency weight of bin   share of selections at those LRU stack positions (and first uses)
  popularity knot         calls of the experts at those frequency ranks (sorted counts)
  domain shift            mutual information of (domain, expert)
  token-type boost        mutual information of (expert at layer l, expert at l +- 1)
  rank weight             rank 0 minus rank k-1: share of selections in the top quarter of the stack
  ======================  ==================================================================

Stack positions are measured with the simulator's steps (traces.synth.stack_positions), so the
LRU miss-ratio curve (simulator/mrc.py) is their cumulative distribution on decode tokens:
matching the positions matches the curve. :func:`mrc_check` compares the curves of two traces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from simulator.jit import jit
from traces.errors import InputError
from traces.format import PHASE_DECODE, PHASE_PREFILL, TraceMeta, group_ids
from traces.synth import FIRST_USE, REPEAT, RoutingFit, RoutingModel, fitted_trace, stack_positions

FIT_SELECTIONS = 50_000_000  # at most this many selections (tokens x layers x k) are read
CALIBRATION_TOKENS = 20_000  # at most this many tokens per calibration round (replicas of a shorter trace)
CALIBRATION_WORK = 50_000_000  # and at most about this many token x layer x expert weights per round
CALIBRATION_ROUNDS = 30
LOGIT_TOKENS = 20_000  # logit statistics come from the first chunks up to this many tokens
TAIL_TOKENS = 2_000  # synthetic tokens drawn to set the scale of the unselected logits
MAX_SEQUENCES = 1024  # sequences kept in the layout (evenly spaced when the trace has more)
GATE_LEVELS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9,
               0.95, 0.98, 0.99, 1.0)
RECENCY_BINS = 48  # at most this many recency bins (stack positions with equal weight)
MIN_BIN_SELECTIONS = 20  # real selections per layer a recency bin holds at least
POLISH_ROUNDS = 10  # last rounds: only recency and popularity move, in ever smaller steps
MAX_SHIFT = 3.0  # largest std of a domain's log-popularity offsets
MAX_RANK_WEIGHT = 10.0  # largest weight of log(popularity x recency) in the rank order
RANK_STEP = 1.0  # rank-weight change per unit of rank slope missed
MAX_BOOST = 6.0  # largest log weight factor of a token type's favourite experts
TOKEN_TYPES = 32  # token types of the fitted model (uniform); fewer types recur more often
STEP = 0.5  # share of a log ratio applied per round (recency and popularity both respond to it)
PSEUDO_COUNT = 0.5  # added to both counts of a ratio, so that empty bins stay finite
CHECK_FRACTIONS = tuple(np.round(np.arange(0.05, 0.501, 0.05), 2))
SCOPES = ("per_layer", "global")


@dataclass
class RealTrace:
    """The parts of a trace the fit reads: layout, selections and gates (T tokens)."""

    meta: TraceMeta
    seq: np.ndarray  # int32[T]
    phase: np.ndarray  # int8[T]
    domain: np.ndarray  # int64[T], -1 where absent
    experts: np.ndarray  # int16[T, L, k]
    gates: np.ndarray  # float32[T, L, k]
    first_logit: float | None  # median logit of the first choice, None without logits
    tail_gap: float | None  # median gap k-th logit -> best unselected logit, None if unknown


def read_real(source) -> RealTrace:
    """Stream a chunk source (traces/format.py) into a RealTrace (at most FIT_SELECTIONS)."""
    meta = source.meta
    limit = max(1, FIT_SELECTIONS // (meta.num_layers * meta.top_k))
    parts: dict[str, list[np.ndarray]] = {"seq": [], "phase": [], "domain": [], "experts": [], "gates": []}
    first, tail = [], []
    count = 0
    for chunk in source.iter_chunks():
        take = min(chunk.num_tokens, limit - count)
        for name in parts:
            parts[name].append(getattr(chunk, name)[:take])
        if chunk.logits.shape[0] and count < LOGIT_TOKENS:
            logits, experts = chunk.logits[:take], chunk.experts[:take]
            first.append(np.median(np.take_along_axis(logits, experts[..., :1].astype(np.intp), axis=-1)))
            gap = tail_gap(experts, logits)
            if gap is not None:
                tail.append(gap)
        count += take
        if count >= limit:
            break
    if not count:
        raise InputError(f"{getattr(source, 'path', 'trace')}: has no tokens; fit a trace with tokens")
    arrays = {name: np.concatenate(values) for name, values in parts.items()}
    return RealTrace(meta=meta, seq=arrays["seq"], phase=arrays["phase"],
                     domain=arrays["domain"].astype(np.int64),
                     experts=arrays["experts"].astype(np.int16), gates=arrays["gates"].astype(np.float32),
                     first_logit=float(np.median(first)) if first else None,
                     tail_gap=float(np.median(tail)) if tail else None)


def sequence_table(real: RealTrace) -> list[list[int]]:
    """[prompt tokens, tokens, domain] of each sequence of the trace (at most MAX_SEQUENCES)."""
    start = np.flatnonzero(np.diff(real.seq, prepend=real.seq[0] - 1))
    length = np.diff(np.append(start, real.seq.shape[0]))
    prompt = np.add.reduceat((real.phase == PHASE_PREFILL).astype(np.int64), start)
    table = np.stack([prompt, length, real.domain[start]], axis=1)
    if table.shape[0] > MAX_SEQUENCES:
        table = table[np.linspace(0, table.shape[0] - 1, MAX_SEQUENCES).round().astype(np.int64)]
    return table.tolist()


@dataclass
class Layout:
    """The tokens a calibration runs the model over: the real trace's first tokens."""

    domain: np.ndarray  # int64[T]: domain index (0 where the trace has none)
    phase: np.ndarray  # int8[T]: PHASE_PREFILL or PHASE_DECODE (the index of a phase's recency)
    group: np.ndarray  # int64[T]: the simulator's steps (a decode token, or a prefill batch)


@dataclass
class RoutingStats:
    """The statistics the calibration matches, per layer (replica means for a simulation)."""

    positions: np.ndarray  # float64[phase, L, bins + 1]: selections per recency bin; last = first uses
    ranked_calls: np.ndarray  # float64[L, E]: calls of each layer's experts, most called first
    calls: np.ndarray  # int64[R, L, E]: calls of each expert in each replica
    domain_mi: np.ndarray  # float64[L]: mutual information (nats) of (domain, expert)
    cross_mi: np.ndarray  # float64[L]: of (expert at layer l - 1, expert at l); 0 at layer 0
    rank_recent: np.ndarray  # float64[k]: share of each rank's selections in the top quarter of the stack


def routing_stats(experts: np.ndarray, position: np.ndarray, layout: Layout, num_experts: int,
                  edges: np.ndarray) -> RoutingStats:
    """Statistics of replicas of one layout: experts and position int[R, T, L, k].

    Stack positions are counted per phase (prefill, decode: the miss-ratio curve's lookups).
    """
    R, T, L, k = experts.shape
    E, bins = num_experts, len(edges) - 1
    domain = layout.domain
    bin_of = np.append(np.repeat(np.arange(bins), np.diff(edges)), bins)[np.maximum(position, FIRST_USE)]
    layer = np.arange(L)[None, None, :, None]
    phase = layout.phase.astype(np.int64)[None, :, None, None]
    looked_up = np.broadcast_to(position != REPEAT, position.shape)
    cell = np.broadcast_to((phase * L + layer) * (bins + 1) + bin_of, position.shape)
    positions = np.bincount(cell[looked_up], minlength=2 * L * (bins + 1)).reshape(2, L, bins + 1)
    flat = (np.arange(R)[:, None, None, None] * L + layer) * E + experts
    calls = np.bincount(flat.ravel(), minlength=R * L * E).reshape(R, L, E)
    ranked = -np.sort(-calls, axis=-1).mean(axis=0)
    domains = int(domain.max()) + 1 if domain.size else 1
    domain_mi = np.zeros(L)
    cross_mi = np.zeros(L)
    by_token = np.broadcast_to(domain.astype(np.int16)[None, :, None], (R, T, 1))
    for layer_l in range(L):
        if domains > 1:
            domain_mi[layer_l] = _pair_information(by_token, experts[:, :, layer_l], domains, E).mean()
        if layer_l:
            cross_mi[layer_l] = _pair_information(experts[:, :, layer_l - 1], experts[:, :, layer_l],
                                                  E, E).mean()
    decode = layout.phase == PHASE_DECODE
    counted = position[:, decode] if decode.any() else position
    recent = (counted >= 0) & (counted < max(1, E // 4))
    return RoutingStats(positions / R, ranked, calls, domain_mi, cross_mi, recent.mean(axis=(0, 1, 2)))


@jit
def _pair_information(a, b, size_a, size_b):
    """float64[R]: mutual information (nats) of the pairs (a[r, t, i], b[r, t, j]) of each replica r.

    ``a`` int[R, T, m] values below ``size_a``, ``b`` int[R, T, n] below ``size_b``: every token
    contributes its m x n pairs.
    """
    R, T, m = a.shape
    n = b.shape[2]
    table = np.zeros(size_a * size_b, dtype=np.int64)
    row = np.zeros(size_a, dtype=np.int64)
    col = np.zeros(size_b, dtype=np.int64)
    touched = np.empty(T * m * n, dtype=np.int64)
    out = np.empty(R)
    for r in range(R):
        cells = 0
        for t in range(T):
            for i in range(m):
                for j in range(n):
                    key = np.int64(a[r, t, i]) * size_b + b[r, t, j]
                    if table[key] == 0:
                        touched[cells] = key
                        cells += 1
                    table[key] += 1
            for i in range(m):
                row[a[r, t, i]] += n
            for j in range(n):
                col[b[r, t, j]] += m
        total = T * m * n
        information = 0.0
        for c in range(cells):
            key = touched[c]
            v = table[key]
            information += v * math.log(v * total / (row[key // size_b] * col[key % size_b]))
            table[key] = 0
        out[r] = information / total if total else 0.0
        row[:] = 0
        col[:] = 0
    return out


def recency_edges(real_positions: np.ndarray, num_experts: int, top_k: int) -> np.ndarray:
    """Recency bin starts: every position of the top 2k, then bins of about equal real mass.

    ``real_positions``: int[T, L, k] stack positions of the real trace (-1: first use). A bin
    holds at least MIN_BIN_SELECTIONS selections per layer, so its weight is not fitted to noise.
    """
    seen = real_positions[real_positions >= 0]
    per_layer = seen.size / real_positions.shape[1]
    count = int(min(RECENCY_BINS, max(1, per_layer // MIN_BIN_SELECTIONS)))
    quantiles = np.quantile(seen, np.linspace(0, 1, count + 1)[1:-1]) if seen.size else []
    single = np.arange(min(2 * top_k, num_experts))
    edges = np.unique(np.concatenate([single, np.ceil(quantiles), [0, num_experts]]).astype(np.int64))
    return edges[edges <= num_experts]


def popularity_ranks(num_experts: int) -> np.ndarray:
    """Knot ranks of the rank-frequency curve: about four per doubling of the rank."""
    ranks = np.unique(np.round(np.geomspace(1, num_experts, int(4 * math.log2(max(2, num_experts))) + 1)))
    return np.unique(np.concatenate([[0], ranks.astype(np.int64) - 1, [num_experts - 1]]))


def _knot_windows(knots: np.ndarray, num_experts: int) -> np.ndarray:
    """Rank boundaries of the knots' windows (the ranks nearest each knot): int[knots + 1]."""
    return np.concatenate([[0], (knots[1:] + knots[:-1] + 1) // 2, [num_experts]])


def gate_gap_quantiles(gates: np.ndarray) -> list[list[float]]:
    """Per rank r, quantiles (at GATE_LEVELS) of ``log g_r - log g_(r+1)`` over all token-layers."""
    log_g = np.log(np.maximum(gates.astype(np.float64), 1e-30))
    gaps = np.maximum(log_g[..., :-1] - log_g[..., 1:], 0.0).reshape(-1, gates.shape[-1] - 1)
    if not gaps.size:
        return []
    return np.quantile(gaps, GATE_LEVELS, axis=0).T.round(5).tolist()


def fit_routing(source, seed: int = 0, rounds: int = CALIBRATION_ROUNDS, progress: bool = False,
                name: str = "") -> RoutingFit:
    """Fit the synthetic routing model to a real trace (a chunk source); deterministic in ``seed``.

    ``name`` is recorded as the fit's source (a path). Reads at most FIT_SELECTIONS selections.
    """
    real = read_real(source)
    meta = real.meta
    L, E, k = meta.num_layers, meta.num_experts, meta.top_k
    domains = [name_ for name_ in meta.domains] if (real.domain >= 0).any() else []
    per_token = L * E
    window = int(min(real.seq.shape[0], CALIBRATION_TOKENS, max(1, CALIBRATION_WORK // per_token)))
    experts = real.experts[:window]
    layout = Layout(domain=np.maximum(real.domain[:window], 0), phase=real.phase[:window],
                    group=group_ids(real.seq[:window], real.phase[:window]))
    position = stack_positions(experts, E, layout.group)
    edges = recency_edges(position, E, k)
    knots = popularity_ranks(E)
    target = routing_stats(experts[None], position[None], layout, E, edges)
    replicas = max(1, min(math.ceil(CALIBRATION_TOKENS / window), CALIBRATION_WORK // (window * per_token)))

    present = target.positions.sum(axis=(1, 2)) > 0  # phases the trace has
    density = (target.positions[..., :-1] + PSEUDO_COUNT) / np.diff(edges)
    recency = np.log(density / density.max(axis=2, keepdims=True))
    recency[~present] = recency[present][0]
    cold = recency.min(axis=2)
    cut = _knot_windows(knots, E)
    ranked = np.add.reduceat(target.ranked_calls, cut[:-1], axis=1) / np.diff(cut)
    popularity = np.log(ranked + PSEUDO_COUNT / E)
    topical = np.unique(layout.domain).size > 1  # domain offsets can only be fitted across domains
    shift = np.full(L, 0.3 if topical else 0.0)
    boost = np.full(L, 1.0)
    rank_weight = 1.0
    gaps = gate_gap_quantiles(real.gates)
    last_gap = float(np.median(np.log(np.maximum(real.gates[..., -2], 1e-30))
                               - np.log(np.maximum(real.gates[..., -1], 1e-30)))) if k > 1 else 1.0

    def make(tail_scale: float = 1.0, check: dict | None = None) -> RoutingFit:
        return RoutingFit(
            model=f"{meta.model}-synthetic", layers=L, experts=E, top_k=k,
            expert_bytes=list(meta.expert_bytes), dense_bytes=list(meta.dense_bytes),
            layer_ids=list(meta.layer_ids), dtype=meta.dtype, domains=domains,
            sequences=sequence_table(real), recency_edges=edges.tolist(),
            recency=_rounded(recency), recency_cold=_rounded(cold),
            popularity_ranks=knots.tolist(), popularity=_rounded(popularity),
            domain_shift=_rounded(shift), token_types=TOKEN_TYPES, type_boost=_rounded(boost),
            rank_weight=round(rank_weight, 5),
            gate_levels=list(GATE_LEVELS), gate_gaps=gaps,
            logit_level=round(real.first_logit or 0.0, 5), tail_scale=round(tail_scale, 5),
            structure_seed=seed,
            source={"trace": name, "model": meta.model, "tokens": int(real.seq.shape[0]),
                    "calibration_tokens": window, "replicas": replicas, "rounds": rounds,
                    "seed": seed, **(check or {})})

    for round_ in tqdm(range(rounds), desc="fit", unit="round", disable=not progress):
        sim, rank_of = simulate_stats(make(), layout, replicas, seed, edges)
        step = STEP * min(1.0, (rounds - round_) / POLISH_ROUNDS)  # settles over the last rounds
        real_bins, sim_bins = target.positions[present], sim.positions[present]
        recency[present] += step * _log_ratio(real_bins[..., :-1], sim_bins[..., :-1])
        cold[present] += step * _log_ratio(real_bins[..., -1], sim_bins[..., -1])
        recency[~present], cold[~present] = recency[present][0], cold[present][0]  # a phase the trace lacks
        popularity += step * popularity_step(target.ranked_calls, sim.calls, rank_of, knots)
        # a designated rank must stay the realised rank: the curve stays non-increasing
        popularity = np.minimum.accumulate(popularity, axis=1)
        popularity -= popularity[:, :1]
        top = np.maximum(recency.max(axis=2), cold)
        recency, cold = recency - top[..., None], cold - top
        if round_ >= rounds - POLISH_ROUNDS:
            continue  # the last rounds settle recency and popularity under fixed structure
        if topical:
            shift = np.clip(shift * np.sqrt(_ratio(target.domain_mi, sim.domain_mi)), 0.0, MAX_SHIFT)
        rank_weight = float(np.clip(rank_weight + RANK_STEP * (_rank_slope(target) - _rank_slope(sim)),
                                    0.0, MAX_RANK_WEIGHT))
        if L > 1:
            boost = np.clip(boost + STEP * np.log(_ratio(_neighbour_mean(target.cross_mi),
                                                         _neighbour_mean(sim.cross_mi))), 0.0, MAX_BOOST)
    sim, _ = simulate_stats(make(), layout, replicas, seed, edges)
    # unselected logits: the synthetic gap at scale 1 (in log p units), scaled to the real one
    target_gap = real.tail_gap if real.tail_gap is not None else last_gap
    _, drawn = fitted_trace(make(), min(window, TAIL_TOKENS), seed, "full")
    tail_scale = max(target_gap, 1e-3) / max(tail_gap(drawn.experts, drawn.logits) or 1.0, 1e-3)
    checked = PHASE_DECODE if present[PHASE_DECODE] else PHASE_PREFILL  # the curve's lookups
    hit_real = np.cumsum(target.positions[checked, :, :-1].sum(axis=0)) / target.positions[checked].sum()
    hit_sim = np.cumsum(sim.positions[checked, :, :-1].sum(axis=0)) / sim.positions[checked].sum()
    check = {"max_position_cdf_delta": round(float(np.abs(hit_real - hit_sim).max()), 5),
             "tail_gap": round(target_gap, 5), "tail_gap_from": "logits" if real.tail_gap is not None
             else "gates",
             # how far the structure parameters reached their targets (simulated / real)
             "cross_mi_ratio": round(float(sim.cross_mi.sum() / max(target.cross_mi.sum(), 1e-12)), 3),
             "domain_mi_ratio": round(float(sim.domain_mi.sum() / target.domain_mi.sum()), 3)
             if topical else None,
             "rank_slope": [round(_rank_slope(target), 4), round(_rank_slope(sim), 4)]}
    return make(tail_scale, check)


def simulate_stats(fit: RoutingFit, layout: Layout, replicas: int, seed: int,
                   edges: np.ndarray) -> tuple[RoutingStats, np.ndarray]:
    """Statistics of ``replicas`` runs of the model from a cold start over the layout's tokens,
    and the model's popularity rank of every expert (int[L, E]; one structure for all replicas)."""
    domain = layout.domain
    experts = np.empty((replicas, domain.shape[0], fit.layers, fit.top_k), dtype=np.int16)
    position = np.empty(experts.shape, dtype=np.int32)
    t = np.arange(domain.shape[0])
    model = RoutingModel(fit, seed)
    for r in range(replicas):
        model.reset(stream=1 + r)  # stream 0 is what a trace of this seed draws: keep the check out of sample
        experts[r], _, _ = model.route(t, layout.phase, domain)
        position[r] = stack_positions(experts[r], fit.experts, layout.group)
    return routing_stats(experts, position, layout, fit.experts, edges), model.rank_of


def popularity_step(real_ranked: np.ndarray, calls: np.ndarray, rank_of: np.ndarray,
                    knots: np.ndarray) -> np.ndarray:
    """float64[L, knots]: log corrections of the popularity curve at its knots.

    Every simulated expert should get the calls the real trace gives its realised rank
    (``real_ranked``); the log ratio is averaged over the experts of a knot's window of the
    model's own popularity ranks (``rank_of``), so that an expert pushed up by its domain or
    type corrects the rank it was given, not the rank it reached.
    """
    realised = np.argsort(np.argsort(-calls, axis=-1, kind="stable"), axis=-1)
    target = np.take_along_axis(np.broadcast_to(real_ranked, calls.shape), realised, axis=-1)
    step = np.log((target + PSEUDO_COUNT) / (calls + PSEUDO_COUNT)).mean(axis=0)  # [L, E] by expert
    by_rank = np.empty_like(step)
    np.put_along_axis(by_rank, rank_of, step, axis=1)
    cut = _knot_windows(knots, calls.shape[-1])
    return np.add.reduceat(by_rank, cut[:-1], axis=1) / np.diff(cut)


def tail_gap(experts: np.ndarray, logits: np.ndarray) -> float | None:
    """Median gap from the k-th logit to the best unselected one (None if no logit is known)."""
    chosen = np.take_along_axis(logits, experts.astype(np.intp), axis=-1)
    rest = logits.copy()
    np.put_along_axis(rest, experts.astype(np.intp), -np.inf, axis=-1)
    best = rest.max(axis=-1)
    known = np.isfinite(best)
    return float(np.median((chosen[..., -1] - best)[known])) if known.any() else None


def _neighbour_mean(cross_mi: np.ndarray) -> np.ndarray:
    """Per layer l: the mean mutual information with layers l - 1 and l + 1 (cross_mi[l]: l-1 -> l)."""
    pairs = cross_mi[1:]
    total = np.concatenate([[0.0], pairs]) + np.concatenate([pairs, [0.0]])
    count = np.full(cross_mi.shape, 2.0)
    count[[0, -1]] = 1.0
    return total / count


def _rank_slope(stats: RoutingStats) -> float:
    """How much more often the first choice than the last is a recently selected expert."""
    return float(stats.rank_recent[0] - stats.rank_recent[-1])


def _ratio(real: np.ndarray, sim: np.ndarray) -> np.ndarray:
    return (np.asarray(real) + 1e-9) / (np.asarray(sim) + 1e-9)


def _log_ratio(real: np.ndarray, sim: np.ndarray) -> np.ndarray:
    return np.log((real + PSEUDO_COUNT) / (sim + PSEUDO_COUNT))


def _rounded(values: np.ndarray) -> list:
    return np.round(np.asarray(values, dtype=np.float64), 5).tolist()


@dataclass(frozen=True)
class CheckRow:
    """One cache size of an MRC comparison: decode hit rates under LRU, fetch-every-miss, cold start."""

    scope: str
    fraction: float
    size: int  # per_layer: experts per layer; global: units of the curve
    real: float
    synth: float

    @property
    def delta(self) -> float:
        return self.synth - self.real


def mrc_check(real_source, synth_source, fractions=CHECK_FRACTIONS,
              scopes=SCOPES) -> tuple[int, list[CheckRow]]:
    """Compare the one-pass LRU miss-ratio curves of two traces of one shape at cache fractions.

    Both are cut to the shorter one's tokens (whole groups), so that cold starts weigh alike.
    Returns (tokens compared, rows).
    """
    from simulator.mrc import mrc
    from traces.sources import LimitedSource

    a, b = real_source.meta, synth_source.meta
    if (a.num_layers, a.num_experts, a.top_k) != (b.num_layers, b.num_experts, b.top_k):
        raise InputError(f"the traces differ in shape ({a.num_layers} x {a.num_experts}, top-{a.top_k} "
                         f"vs {b.num_layers} x {b.num_experts}, top-{b.top_k}); compare traces of one shape")
    tokens = min(real_source.num_tokens, synth_source.num_tokens)
    real, synth = LimitedSource(real_source, tokens), LimitedSource(synth_source, tokens)
    rows = []
    for scope in scopes:
        curves = [mrc(s, scope, expert_bytes=a.expert_bytes) for s in (real, synth)]
        for fraction in fractions:
            size = curves[0].size_of(fraction=float(fraction), num_experts=a.num_experts,
                                     expert_bytes=a.expert_bytes)
            rows.append(CheckRow(scope, float(fraction), size, float(curves[0].hit_rate[size]),
                                 float(curves[1].hit_rate[size])))
    return tokens, rows


def max_delta(rows: list[CheckRow], scope: str) -> float:
    """Largest |synthetic - real| hit rate over the rows of one scope."""
    return max(abs(r.delta) for r in rows if r.scope == scope)


def format_check(rows: list[CheckRow]) -> str:
    """The comparison as an aligned table, one line per scope and fraction."""
    lines = [f"{'scope':<10} {'fraction':>8} {'size':>8} {'real':>7} {'synth':>7} {'delta':>7}"]
    for r in rows:
        lines.append(f"{r.scope:<10} {r.fraction:>8.2f} {r.size:>8} {r.real * 100:>6.1f}% "
                     f"{r.synth * 100:>6.1f}% {r.delta * 100:>+6.1f}")
    return "\n".join(lines)


def reshape_fit(base: RoutingFit, experts: int, top_k: int, *, model: str, expert_bytes: int,
                sequences: list[list[int]], popularity_scale: float = 1.0, recency_scale: float = 1.0,
                source: dict | None = None) -> RoutingFit:
    """A fit of another shape (same layers) from ``base``: stack positions and popularity ranks
    keep their share of the experts, deeper gate gaps repeat the base's last one, and the log
    popularity and log recency weights are multiplied by the two scales (steeper above 1).
    The domains are dropped (``sequences`` give no domain) and every layer gets ``expert_bytes``.
    """
    if top_k > experts or top_k < 1:
        raise InputError(f"top_k {top_k} must be within 1 .. experts ({experts})")
    ratio = experts / base.experts
    edges = np.unique(np.round(np.asarray(base.recency_edges) * ratio).astype(np.int64))
    source_bin = np.searchsorted(base.recency_edges, edges[:-1] / ratio, side="right") - 1
    recency = recency_scale * np.asarray(base.recency)[..., source_bin]
    knots = popularity_ranks(experts)
    popularity = popularity_scale * np.stack([np.interp(knots / ratio, base.popularity_ranks, row)
                                              for row in base.popularity])
    last = len(base.gate_gaps) - 1
    gaps = [base.gate_gaps[min(r, last)] for r in range(top_k - 1)] if base.gate_gaps else []
    return RoutingFit(
        model=model, layers=base.layers, experts=experts, top_k=top_k,
        expert_bytes=[expert_bytes] * base.layers, dense_bytes=[], layer_ids=list(base.layer_ids),
        dtype=base.dtype, domains=[], sequences=sequences, recency_edges=edges.tolist(),
        recency=_rounded(recency), recency_cold=_rounded(recency_scale * np.asarray(base.recency_cold)),
        popularity_ranks=knots.tolist(), popularity=_rounded(popularity),
        domain_shift=[0.0] * base.layers, token_types=base.token_types, type_boost=list(base.type_boost),
        rank_weight=base.rank_weight, gate_levels=list(base.gate_levels), gate_gaps=gaps,
        logit_level=base.logit_level, tail_scale=base.tail_scale, structure_seed=base.structure_seed,
        source=source or {})


def main(argv: list[str] | None = None) -> int:
    """``python -m traces.fit``: write a fit as JSON (``fit``), or a fit reshaped (``reshape``).

    The bundled presets are made with these (docs/SYNTH.md); ``moe-trace synth --preset FILE``
    draws from such a file.
    """
    import argparse
    import json
    import sys
    from pathlib import Path

    from traces.atomic import atomic_write_text
    from traces.errors import EXIT_INPUT_ERROR
    from traces.format import open_trace
    from traces.synth import load_preset

    parser = argparse.ArgumentParser(prog="python -m traces.fit", description=main.__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="fit the routing model to a trace")
    fit.add_argument("trace", help="real trace (.parquet)")
    fit.add_argument("out", help="fit to write (.json)")
    fit.add_argument("--seed", type=int, default=0, help="seed of the calibration (default: 0)")
    reshape = commands.add_parser("reshape", help="carry a fit over to another shape (reshape_fit)")
    reshape.add_argument("base", help="fit (.json) or preset name")
    reshape.add_argument("out", help="fit to write (.json)")
    for name, kind, text in (("experts", int, "routed experts per layer"),
                             ("top-k", int, "experts per token"),
                             ("expert-bytes", int, "bytes of one expert"), ("model", str, "model name"),
                             ("sequence-tokens", int, "tokens of every (decode-only) sequence"),
                             ("popularity-scale", float, "factor on the log popularity"),
                             ("recency-scale", float, "factor on the log recency weights")):
        reshape.add_argument(f"--{name}", type=kind, required=True, help=text)
    args = parser.parse_args(argv)
    try:
        if args.command == "fit":
            with open_trace(args.trace) as source:
                result = fit_routing(source, seed=args.seed, progress=sys.stderr.isatty(), name=args.trace)
        else:
            base = load_preset(args.base)
            result = reshape_fit(
                base, args.experts, args.top_k, model=args.model, expert_bytes=args.expert_bytes,
                sequences=[[0, args.sequence_tokens, -1]], popularity_scale=args.popularity_scale,
                recency_scale=args.recency_scale,
                source={"reshaped_from": {"fit": Path(args.base).name, **base.source},
                        "popularity_scale": args.popularity_scale, "recency_scale": args.recency_scale})
        result.check(args.out)
        atomic_write_text(args.out, json.dumps(result.to_dict(), indent=1) + "\n")
    except InputError as exc:
        print(f"python -m traces.fit: error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
