"""``moe-trace predict TRACE``: how well each predictor names the experts a later layer selects.

Every predictor of :mod:`simulator.policies.predictor` runs over the trace through its own kernel
hooks (the ones prefetch calls in the engine), with selection frequencies advancing as in the
engine (counts since the start of the trace, no decay) and no cache. At every decode token of
the scored part and every layer l with l + d < L, the predictor names up to P experts of layer
l + d; against the k experts the token selects there:

- ``recall@k`` = |predicted ∩ selected| / k (the share of the k expert calls a prefetch of the
  prediction would have covered);
- ``precision`` = |predicted ∩ selected| / |predicted| (= / P whenever the predictor names P:
  ``previous`` names none after a prompt, ``frequency`` only experts selected before);
- ``bytes/token``: the bytes the prediction would move per scored token, |predicted| experts at
  the trace's ``expert_bytes`` of layer l + d, summed over layers; ``new bytes/token``: the part
  of it the previous token did not select (a cache holding the previous token's experts would
  still have to move it).

The first ``train_tokens`` tokens train ``coactivation`` and are not scored for any predictor
(the others observe them); only decode tokens are scored. Per layer means per predicted layer
l + d. Results: a Markdown table on stdout, and in ``--out`` ``predict.md`` (with the per-layer
detail), ``predict.json`` and ``predict.png`` (recall against distance and against layer),
each written atomically. docs/PREDICT.md has an example.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from simulator.engine.kernel import Chunk
from simulator.engine.layout import make_layout
from simulator.engine.params import SimParams
from simulator.engine.state import kernel_array, make_consts, make_core_state
from simulator.jit import specialise
from simulator.policies.predictor import REGISTRY
from simulator.policies.predictor.coactivation import Options as CoactivationOptions
from simulator.trace_cache import cached_source
from traces.atomic import atomic_write_bytes, output_errors
from traces.errors import InputError
from traces.format import PHASE_DECODE, TraceChunk, TraceMeta

# the predictor module the scoring kernel calls; bound per compiled kernel by specialise
predictor = None

# columns of the per-layer counts
STEPS, PREDICTED, HITS, NEW = range(4)
N_COUNTS = 4
DEFAULT_TRAIN_SHARE = 4  # default train_tokens: at most 1 / this of the trace
MIB = 2**20
LINE_STYLES = ("-", "--", ":", "-.")  # one per P in the plot


def _score_chunk(ch, c, core, st, distances, top_ps, first_scored, prev, counts, out):
    """Run one predictor over a chunk; count its predictions at the decode rows >= first_scored.

    ``distances`` int64[nd], ``top_ps`` int64[np]; ``prev`` int32[L, k]: the selections of the
    token before the chunk's first (-1: none), updated in place; ``counts`` int64[nd, np, L,
    N_COUNTS] by predicted layer; ``out`` int64[max P] scratch.
    """
    experts, group, phase = ch.experts, ch.group, ch.phase
    T, L, K = experts.shape
    E = c.num_experts
    a = 0
    while a < T:
        b = a + 1
        while b < T and group[b] == group[a]:
            b += 1
        decode = phase[a] == PHASE_DECODE
        scoring = decode and a >= first_scored
        for layer in range(L):
            base = layer * E
            for t in range(a, b):
                for i in range(K):
                    core.freq[base + experts[t, layer, i]] += 1.0
            if not decode:
                continue
            for di in range(distances.shape[0] if scoring else 0):
                d = distances[di]
                target = layer + d
                if target >= L:
                    continue
                for pi in range(top_ps.shape[0]):
                    n = predictor.predict(core, st, c, ch, a, layer, d, top_ps[pi], out)
                    counts[di, pi, target, STEPS] += 1
                    counts[di, pi, target, PREDICTED] += n
                    for j in range(n):
                        e = out[j] - target * E
                        for i in range(K):
                            if experts[a, target, i] == e:
                                counts[di, pi, target, HITS] += 1
                        new = 1
                        for i in range(K):
                            if prev[target, i] == e:
                                new = 0
                        counts[di, pi, target, NEW] += new
            predictor.observe(core, st, c, ch, a, layer)
        for layer in range(L):
            for i in range(K):
                prev[layer, i] = experts[b - 1, layer, i]
        a = b


@dataclass
class Score:
    """One predictor at one distance and P: counts per predicted layer (int64[L, N_COUNTS])."""

    predictor: str
    distance: int
    top_p: int
    counts: np.ndarray

    def recall(self, k: int) -> np.ndarray:
        """float64[L + 1]: recall@k per predicted layer (NaN where none), then overall."""
        return _ratio(self.counts[:, HITS], k * self.counts[:, STEPS])

    def precision(self) -> np.ndarray:
        """float64[L + 1]: precision per predicted layer (NaN where none), then overall."""
        return _ratio(self.counts[:, HITS], self.counts[:, PREDICTED])


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num = np.append(num, num.sum()).astype(np.float64)
    den = np.append(den, den.sum()).astype(np.float64)
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)


@dataclass
class Scores:
    """Every score of one trace, with what they were measured on."""

    trace: str
    meta: TraceMeta
    train_tokens: int
    scored_tokens: int  # decode tokens after the training part
    scores: list[Score]
    notes: list[str] = field(default_factory=list)

    def bytes_per_token(self, s: Score, column: int) -> np.ndarray:
        """float64[L + 1]: bytes per scored token of ``column`` (PREDICTED or NEW) per predicted
        layer, then their sum."""
        per_layer = s.counts[:, column] * np.asarray(self.meta.expert_bytes, np.float64)
        return np.append(per_layer, per_layer.sum()) / max(self.scored_tokens, 1)


def _scoring_params(meta: TraceMeta, options: dict) -> SimParams:
    """SimParams that give the predictors the engine's state without a cache or time."""
    L = meta.num_layers
    zero = np.zeros(L)
    return SimParams(
        num_layers=L, num_experts=meta.num_experts, top_k=meta.top_k, scope="per_layer",
        pool_budget_bytes=np.zeros(L, np.int64), expert_bytes=np.asarray(meta.expert_bytes),
        eviction="lru", lfu_decay=1.0, init="cold", warmup_tokens=0, protect_ranks=0, tau=0.0,
        miss_action="substitute", substitute_by="frequency", beta=math.inf, pcie_latency_us=0.0,
        pcie_bytes_per_us=1.0, ssd_latency_us=0.0, ssd_bytes_per_us=1.0, host_ram_budget_bytes=-1,
        gpu_expert_us=zero, nonexpert_us=zero, cpu_expert_us=zero, options=options)


def kernel_chunk(chunk: TraceChunk, meta: TraceMeta) -> Chunk:
    """The kernel's view of a chunk (no next-use rows: no predictor reads them)."""
    L, k = meta.num_layers, meta.top_k
    ahead = chunk.lookahead_ids
    return Chunk(
        experts=kernel_array(chunk.experts, np.int32),
        gates=kernel_array(chunk.gates, np.float32),
        logits=kernel_array(chunk.logits, np.float32),
        logit_bits=np.zeros((0, L, meta.num_experts), np.uint16),
        group=kernel_array(chunk.group, np.int64),
        phase=kernel_array(chunk.phase, np.int8),
        next_use=np.zeros((0, L, k), np.int32),
        lookahead_ids=(np.zeros((0, L, 0, 0), np.int32) if ahead is None
                       else kernel_array(ahead, np.int32)),
        logit_order=np.zeros((0, L, 0), np.int16))


def default_train_tokens(num_tokens: int) -> int:
    """``train_tokens`` when none is given: coactivation's default, at most a quarter of the trace."""
    return min(CoactivationOptions.train_tokens, num_tokens // DEFAULT_TRAIN_SHARE)


def chosen_runs(meta: TraceMeta, predictors: list[str] | None,
                distances: list[int]) -> tuple[dict[str, list[int]], list[str]]:
    """The distances each predictor is scored at, and notes on what is skipped.

    ``predictors`` None: every registered one but ``none``, those that need look-ahead routing
    the trace lacks skipped with a note; named explicitly, such a predictor is an error.
    """
    explicit = predictors is not None
    names = predictors if explicit else [n for n in REGISTRY if n != "none"]
    runs, notes = {}, []
    for name in dict.fromkeys(names):
        if name not in tuple(REGISTRY):  # Mapping.__contains__ would raise the registry's own error
            raise InputError(f"predict --predictor {name} is not known; choose from: "
                             f"{', '.join(REGISTRY)}")
        module = REGISTRY[name]
        usable = distances
        if module.NEEDS_LOOKAHEAD:
            depth = meta.lookahead_depth
            usable = [d for d in distances if d <= depth]
            beyond = [d for d in distances if d > depth]
            stored = (f"stores look-ahead routing to distance {depth}" if depth
                      else "has no look-ahead routing")
            if beyond and explicit:
                raise InputError(f"predict --predictor {name} needs look-ahead routing to distance "
                                 f"{max(beyond)}, but the trace {stored}; capture with moe-capture "
                                 f"lookahead.enabled=true lookahead.depth={max(beyond)}, or lower "
                                 "--distance")
            if beyond:
                notes.append(f"{name} is skipped at distance {', '.join(map(str, beyond))}: the "
                             f"trace {stored} (moe-capture lookahead.enabled=true records it)")
        if usable:
            runs[name] = usable
    return runs, notes


def _check(meta: TraceMeta, num_tokens: int, distances: list[int], top_ps: list[int],
           train_tokens: int) -> None:
    L, E = meta.num_layers, meta.num_experts
    for d in distances:
        if not 1 <= d < L:
            raise InputError(f"predict --distance {d} is outside 1 .. L - 1 = {L - 1} (the trace "
                             f"has {L} MoE layers); give a distance in that range")
    for p in top_ps:
        if not 1 <= p <= E:
            raise InputError(f"predict --top-p {p} is outside 1 .. E = {E} (experts per layer); "
                             "give a P in that range")
    if not 0 <= train_tokens < num_tokens:
        raise InputError(f"predict --train-tokens {train_tokens} leaves no token to score (the "
                         f"trace has {num_tokens:,}); give 0 .. {num_tokens - 1}")


class _Run:
    """One predictor's kernel, state and counts during the pass over the trace."""

    def __init__(self, name: str, distances: list[int], top_ps: list[int], params: SimParams,
                 layout):
        self.name, self.module = name, REGISTRY[name]
        self.kernel = specialise(_score_chunk, {"predictor": self.module})
        self.core = make_core_state(params, layout)
        self.state = self.module.make_state(params, layout)
        self.distances = np.asarray(distances, np.int64)
        self.top_ps = np.asarray(top_ps, np.int64)
        L, k = params.num_layers, params.top_k
        self.prev = np.full((L, k), -1, np.int32)
        self.counts = np.zeros((len(distances), len(top_ps), L, N_COUNTS), np.int64)
        self.out = np.zeros(max(top_ps), np.int64)

    def train(self, experts: np.ndarray) -> None:
        if self.module.TRAIN_TOKENS is not None:
            self.state = self.module.train(self.state, experts, int(self.distances.max()))

    def scores(self, top_ps: list[int]) -> list[Score]:
        return [Score(self.name, int(d), p, self.counts[di, pi])
                for di, d in enumerate(self.distances) for pi, p in enumerate(top_ps)]


def score_trace(source, *, predictors: list[str] | None = None, distances: list[int] = (1,),
                top_ps: list[int] | None = None, train_tokens: int | None = None,
                trace: str = "") -> Scores:
    """Score the predictors on a chunk source (module docstring); ``top_ps`` default [k],
    ``train_tokens`` default :func:`default_train_tokens`."""
    meta, num_tokens = source.meta, source.num_tokens
    distances = list(dict.fromkeys(int(d) for d in distances))
    top_ps = list(dict.fromkeys(int(p) for p in (top_ps or [meta.top_k])))
    if train_tokens is None:
        train_tokens = default_train_tokens(num_tokens)
    _check(meta, num_tokens, distances, top_ps, train_tokens)
    plan, notes = chosen_runs(meta, predictors, distances)
    if not plan:
        raise InputError("predict has no predictor to score on this trace: " + "; ".join(notes))
    params = _scoring_params(meta, {"train_tokens": train_tokens})
    layout = make_layout(params, meta)
    consts = make_consts(params, layout)
    runs = [_Run(name, ds, top_ps, params, layout) for name, ds in plan.items()]
    training: list[np.ndarray] = []  # the training part's selections, until it is complete
    trained = False
    start = scored = 0
    for chunk in source.iter_chunks():
        T = chunk.num_tokens
        first_scored = max(0, train_tokens - start)
        if not trained:
            training.append(chunk.experts[:min(T, first_scored)])
            if first_scored < T:
                experts = np.concatenate(training)
                for run in runs:
                    run.train(experts)
                trained = True
        ch = kernel_chunk(chunk, meta)
        for run in runs:
            run.kernel(ch, consts, run.core, run.state, run.distances, run.top_ps, first_scored,
                       run.prev, run.counts, run.out)
        scored += int(np.count_nonzero(chunk.phase[first_scored:] == PHASE_DECODE))
        start += T
    if scored == 0:
        raise InputError(f"{trace or 'the trace'}: no decode token after the first "
                         f"{train_tokens:,} (--train-tokens); lower --train-tokens or use a trace "
                         "with decode tokens")
    return Scores(trace, meta, train_tokens, scored, [s for run in runs for s in run.scores(top_ps)],
                  notes)


# --- tables, plot, files -----------------------------------------------------------------------


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f} %"


def _mib(value: float) -> str:
    return f"{value / MIB:.3f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def headline(s: Scores) -> str:
    m = s.meta
    return (f"{s.trace or m.model}: {m.num_layers} MoE layers x {m.num_experts} experts, "
            f"top-{m.top_k}; scored {s.scored_tokens:,} decode tokens after the first "
            f"{s.train_tokens:,} (training part)")


def overall_table(s: Scores) -> str:
    """Per predictor, distance and P: overall recall@k, precision and bytes per token."""
    k = s.meta.top_k
    rows = [[x.predictor, str(x.distance), str(x.top_p), _pct(x.recall(k)[-1]),
             _pct(x.precision()[-1]), _mib(s.bytes_per_token(x, PREDICTED)[-1]),
             _mib(s.bytes_per_token(x, NEW)[-1])] for x in s.scores]
    return _markdown(["predictor", "distance", "P", f"recall@{k}", "precision", "MiB/token",
                      "new MiB/token"], rows)


def layer_recall_table(s: Scores) -> str:
    """Recall@k per predicted layer (columns), one row per predictor, distance and P."""
    k, L = s.meta.top_k, s.meta.num_layers
    rows = [[x.predictor, str(x.distance), str(x.top_p), *map(_pct, x.recall(k)[:-1])]
            for x in s.scores]
    return _markdown(["predictor", "distance", "P", *(f"layer {j}" for j in range(L))], rows)


def layer_detail_table(s: Scores) -> str:
    """Every predicted layer's recall, precision and bytes per token."""
    k = s.meta.top_k
    rows = []
    for x in s.scores:
        recall, precision = x.recall(k), x.precision()
        moved, new = s.bytes_per_token(x, PREDICTED), s.bytes_per_token(x, NEW)
        rows += [[x.predictor, str(x.distance), str(x.top_p), str(j), _pct(recall[j]),
                  _pct(precision[j]), _mib(moved[j]), _mib(new[j])]
                 for j in range(s.meta.num_layers) if x.counts[j, STEPS]]
    return _markdown(["predictor", "distance", "P", "layer", f"recall@{k}", "precision",
                      "MiB/token", "new MiB/token"], rows)


def summary_text(s: Scores, detail: bool = False) -> str:
    """The Markdown summary: headline, notes, overall and per-layer tables."""
    parts = [f"# Predictors: {headline(s)}", *(f"Note: {n}" for n in s.notes),
             "## Overall", overall_table(s), f"## Recall@{s.meta.top_k} per predicted layer (l + d)",
             layer_recall_table(s)]
    if detail:
        parts += ["## Per predicted layer", layer_detail_table(s)]
    return "\n\n".join(parts) + "\n"


def plot(s: Scores) -> Figure:
    """Recall@k against distance (left) and against the predicted layer at the smallest
    distance scored (right), one line per predictor and P."""
    k = s.meta.top_k
    smallest = min(x.distance for x in s.scores)
    fig = Figure(figsize=(11, 4), layout="constrained", dpi=110)
    by_distance, by_layer = fig.subplots(1, 2)
    names = list(dict.fromkeys(x.predictor for x in s.scores))
    top_ps = list(dict.fromkeys(x.top_p for x in s.scores))
    for name in names:
        for p in top_ps:
            mine = [x for x in s.scores if (x.predictor, x.top_p) == (name, p)]
            style = dict(color=f"C{names.index(name) % 10}", marker="o",
                         linestyle=LINE_STYLES[top_ps.index(p) % len(LINE_STYLES)])
            by_distance.plot([x.distance for x in mine], [100 * x.recall(k)[-1] for x in mine],
                             label=f"{name}, P = {p}", **style)
            for x in mine:
                if x.distance == smallest:
                    shown = x.counts[:, STEPS] > 0
                    by_layer.plot(np.flatnonzero(shown), 100 * x.recall(k)[:-1][shown], **style)
    by_distance.set(xlabel="distance d (layers ahead)", ylabel=f"recall@{k} (%)",
                    title="all predicted layers")
    by_layer.set(xlabel="predicted layer l + d", ylabel=f"recall@{k} (%)",
                 title=f"per predicted layer, d = {smallest}")
    for ax in (by_distance, by_layer):
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.legend(loc="outside right center", fontsize=8)
    fig.suptitle(headline(s), fontsize=9)
    return fig


def as_json(s: Scores) -> dict:
    """Every score with its per-layer values (None where a layer was never predicted)."""
    k = s.meta.top_k

    def values(a: np.ndarray) -> list:
        return [None if math.isnan(v) else float(v) for v in a]

    return {
        "trace": s.trace, "model": s.meta.model, "num_layers": s.meta.num_layers,
        "num_experts": s.meta.num_experts, "top_k": k, "train_tokens": s.train_tokens,
        "scored_tokens": s.scored_tokens, "notes": s.notes,
        "scores": [{"predictor": x.predictor, "distance": x.distance, "top_p": x.top_p,
                    "recall": values(x.recall(k)[-1:])[0], "precision": values(x.precision()[-1:])[0],
                    "bytes_per_token": float(s.bytes_per_token(x, PREDICTED)[-1]),
                    "new_bytes_per_token": float(s.bytes_per_token(x, NEW)[-1]),
                    "per_layer": {"recall": values(x.recall(k)[:-1]),
                                  "precision": values(x.precision()[:-1]),
                                  "bytes_per_token": values(s.bytes_per_token(x, PREDICTED)[:-1]),
                                  "new_bytes_per_token": values(s.bytes_per_token(x, NEW)[:-1])}}
                   for x in s.scores],
    }


def write_outputs(s: Scores, out_dir: Path) -> list[Path]:
    """Write predict.md, predict.json and predict.png into ``out_dir``; returns their paths."""
    png = io.BytesIO()
    plot(s).savefig(png, format="png")
    files = {"predict.md": summary_text(s, detail=True).encode(),
             "predict.json": (json.dumps(as_json(s), indent=1) + "\n").encode(),
             "predict.png": png.getvalue()}
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"predict --out {out_dir}: exists and is not a directory; choose another DIR")
    with output_errors(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            atomic_write_bytes(out_dir / name, data)
    return [out_dir / name for name in files]


def predict_command(path: Path, *, predictors: list[str] | None, distances: list[int],
                    top_ps: list[int] | None, train_tokens: int | None, out: Path | None) -> None:
    """``moe-trace predict``: score, write the files (default ``runs/predict/<trace stem>``),
    print the tables."""
    scores = score_trace(cached_source(path), predictors=predictors, distances=distances,
                         top_ps=top_ps, train_tokens=train_tokens, trace=path.name)
    written = write_outputs(scores, out if out is not None else Path("runs") / "predict" / path.stem)
    print(summary_text(scores), end="")
    print(f"\nwrote {', '.join(str(p) for p in written)}")
