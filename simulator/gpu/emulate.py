"""The moe-emulate app: a real MoE model run token by token under offloading strategies.

Quality ground truth for the simulator's substituted-mass proxy (docs/QUALITY.md). Every MoE
block of a Hugging Face model is replaced so that, after the router has scored the experts and
picked its top-k, the simulator's own reference engine decides each rank
(:class:`simulator.engine.reference.ReferenceSimulator`, one per strategy: one implementation of
the rules, two consumers). A hit, a fetch or a CPU call runs the selected expert; a substitution
runs the substitute the engine chose, with the missing expert's gate weight. The cache state
behind a decision depends on every earlier token's routing *under the same strategy*, so the
model runs one token at a time with a KV cache (closed loop). Strategies run side by side as
batch rows, each with its own KV cache and simulator: one forward per token for all of them.
Fetch latency is idealised (nothing waits); the simulator's clock still times background
admissions.

Per strategy the run records the teacher-forced NLL of every token and the router outputs the
model actually produced under that strategy (ids, weights, logits), so that replaying them in
the simulator with the same policy reproduces the emulation's mass exactly (checked per run).
The *open loop* comparison precomputes decisions from the unperturbed routing (the fetch_all
row) and applies them in one batched teacher-forced pass per window.

    moe-emulate --out runs/emulate                      # fixture model, held-out text
    moe-emulate --max-tokens 2000 --fractions 0.25 --workers 2 --out runs/emulate-small

Writes ``results.npz`` and ``open_loop.npz`` (per strategy x token arrays), ``emulation.json``
(strategies, model, checks, timings) and, with ``--traces``, one trace per strategy (``traces/<i>_<name>.parquet``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError:  # --help works without the capture extra; main() says what is missing
    torch = None

from simulator.engine import needs_next_use, simulate
from simulator.engine.params import FETCH, FORCED_FETCH, HIT, SUBSTITUTE, SimParams
from simulator.engine.reference import Observer, ReferenceSimulator
from simulator.run import CONF_DIR, build_params, resolve_path
from traces.atomic import atomic_output, atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import PHASE_DECODE, TraceMeta

FIXTURE_MODEL = "traces/fixtures/model"
FIXTURE_TEXT = "traces/samples/fixture.parquet"  # captured on the held-out split
DEFAULT_FRACTIONS = (0.10, 0.25, 0.50)
# Threshold sweeps. protect_ranks=1 always fetches the first choice (the mass hypothesis's set);
# protect_ranks=0 lets a first choice with g < tau be substituted (top-k=4: g_0 >= 0.25 always,
# so only taus above 0.25 differ from the protected sweep).
TAUS_PROTECTED = (0.05, 0.10, 0.20, 0.25, 0.30, 0.40, 0.50)
TAUS_UNPROTECTED = (0.30, 0.40, 0.50, 0.60, 0.80)
BETAS = (0.25, 1.0, 2.0)  # quality_first has beta = 0.5
OPEN = "open_"  # prefix of the open-loop arrays (open_loop.npz)
NOT_DECIDED = -1  # decision code of a warm-up token (init=frequency): not simulated, run exactly
SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "MixtralSparseMoeBlock")


# ---- strategies and their engine parameters ----------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """One batch row: a policy preset plus moe-sim overrides, at one resident fraction."""

    name: str  # policy label in results (policy.name)
    fraction: float  # cache.fraction: resident share of each layer's experts
    overrides: tuple[str, ...]  # moe-sim overrides, e.g. ("policy=rule015", "policy.tau=0.3")

    @property
    def label(self) -> str:
        return f"{self.name}@{self.fraction * 100:g}%"

    def config_overrides(self) -> list[str]:
        return [*self.overrides, f"cache.fraction={self.fraction}", f"policy.name={self.name}"]

    def with_overrides(self, extra: Sequence[str]) -> Strategy:
        return Strategy(self.name, self.fraction, (*self.overrides, *extra))


def default_strategies(fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[Strategy]:
    """Per fraction: the paper's strategies, both threshold sweeps, the beta sweep, and the two
    policies without admission. fetch_all runs the same experts at every fraction; its rows
    after the first show whether a row's numbers depend on what the other rows do."""
    out = []
    for f in fractions:
        for preset in ("fetch_all", "substitute_all", "rule015", "first_choice", "quality_first", "speed_first"):
            # every row starts cold, so all are scored on the same tokens; the substitute_all
            # preset starts warm (init=frequency): docs/QUALITY.md measures that in a run of its own
            cold = ("cache.init=cold",) if preset == "substitute_all" else ()
            out.append(Strategy(preset, f, (f"policy={preset}", *cold)))
        for tau in TAUS_PROTECTED:
            out.append(Strategy(f"tau{tau:g}_r1", f, ("policy=rule015", f"policy.tau={tau}")))
        for tau in TAUS_UNPROTECTED:
            out.append(Strategy(f"tau{tau:g}_r0", f, (
                "policy=rule015", "policy.protect_ranks=0", f"policy.tau={tau}")))
        out.append(Strategy("rule015_lfu", f, ("policy=quality_first", "admission.beta=null")))
        for beta in BETAS:
            out.append(Strategy(f"quality_first_beta{beta:g}", f, (
                "policy=quality_first", f"admission.beta={beta}")))
        out.append(Strategy("first_choice_lfu", f, ("policy=speed_first", "admission.beta=null")))
    return out


def parse_strategy(spec: str) -> Strategy:
    """``NAME@FRACTION OVERRIDE...``, e.g. ``tau0.3@0.25 policy=rule015 policy.tau=0.3``."""
    head, *overrides = spec.split()
    name, sep, fraction = head.partition("@")
    try:
        value = float(fraction)
    except ValueError:
        value = math.nan
    if not sep or not name or not 0.0 < value <= 1.0:
        raise InputError(f"strategy '{spec}': write NAME@FRACTION [OVERRIDE ...], e.g. "
                         "'rule015@0.25 policy=rule015'")
    return Strategy(name, value, tuple(overrides) or (f"policy={name}",))


def plain_config(overrides: Sequence[str]) -> dict:
    """The moe-sim config that ``overrides`` compose to, read from ``conf/`` without Hydra.

    The GPU host has no Hydra, so this follows the composition of conf/simulate.yaml for the
    parts the engine reads: groups ``policy``, ``cache``, ``hardware`` (a policy preset is
    ``@package _global_`` and may set ``cache.*`` and ``admission.*``), then dotted overrides of
    ``policy.*``, ``cache.*``, ``admission.*`` and ``seed``. The tests check it against
    :func:`simulator.run.compose`.
    """
    import yaml

    groups = {"policy": "fetch_all", "cache": "per_layer", "hardware": "h200_pcie5"}
    sets: list[tuple[str, str]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"override '{item}' is not KEY=VALUE")
        if key in groups:
            groups[key] = value
        else:
            sets.append((key, value))

    def load(group: str, name: str) -> dict:
        path = CONF_DIR / group / f"{name}.yaml"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
            raise InputError(f"'{group}={name}' is not a preset; choose one of: {known}")
        return yaml.safe_load(path.read_text()) or {}

    cfg: dict = {
        "policy": {},
        "cache": load("cache", groups["cache"]),
        "admission": {"beta": None},
        "hardware": load("hardware", groups["hardware"]),
        "model": None,  # sizes from the trace metadata (model=trace)
        "seed": 0,
    }
    for section, values in load("policy", groups["policy"]).items():
        cfg[section].update(values)
    for key, value in sets:
        parsed = yaml.safe_load(value)
        if key == "seed":
            cfg["seed"] = int(parsed)
            continue
        section, _, name = key.partition(".")
        if section not in ("policy", "cache", "admission") or name not in cfg[section]:
            raise InputError(f"override '{key}' is not a field of policy, cache or admission")
        cfg[section][name] = parsed
    return cfg


def strategy_params(strategy: Strategy, meta: TraceMeta) -> SimParams:
    """Engine parameters of one strategy for a model's trace metadata (moe-sim's own resolution)."""
    params, _ = build_params(plain_config(strategy.config_overrides()), meta)
    if needs_next_use(params):
        raise InputError(f"strategy {strategy.label}: eviction=belady needs the future routing, "
                         "which a closed-loop emulation does not have")
    return params


def warmup_tokens(params: SimParams) -> int:
    """Tokens run unperturbed before the strategy decides (init=frequency), else 0."""
    return params.warmup_tokens if params.init == "frequency" else 0


# ---- the model side ----------------------------------------------------------------------


def moe_sites(model) -> list:
    """The model's MoE routers (traces.capture.routers), checked for an emulated block type."""
    from traces.capture.routers import SOFTMAX_TOPK, find_routers

    sites = find_routers(model)
    for s in sites:
        block = type(s.moe_block).__name__
        if s.family is not SOFTMAX_TOPK or block not in SUPPORTED_BLOCKS:
            raise InputError(f"moe-emulate supports MoE blocks {', '.join(SUPPORTED_BLOCKS)}; "
                             f"layer {s.layer_id} has {block}")
    return sites


def emulation_meta(model, sites, name: str, domains: Sequence[str], extra: dict | None = None) -> TraceMeta:
    """Trace metadata of the emulated model: routing facts and expert sizes from the model."""
    from traces.capture.routers import routing_metadata

    info = routing_metadata(model, sites)
    same = ("num_experts", "top_k", "expert_bytes", "dtype", "score_function", "renormalize",
            "layer_ids", "dense_bytes")
    return TraceMeta(model=name, num_layers=len(sites), has_logits=True, has_residency=True,
                     domains=list(domains), source="emulate", extra={**info["extra"], **(extra or {})},
                     **{key: info[key] for key in same})


Route = Callable[[int, "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def inference_mode(fn):
    """``torch.inference_mode()`` around ``fn``, entered at call time (so that the module, and
    ``moe-emulate --help``, load without torch)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


def _block_forward(block, j: int, route: Route):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        logits, weights, ids = block.gate(flat)
        # the experts run as the model would run them, on the ids the policy decided; the
        # weights stay the router's: a substitute carries the missing expert's gate weight
        return block.experts(flat, route(j, logits, weights, ids), weights).reshape(shape)

    return forward


@contextmanager
def routed(sites, route: Route):
    """Replace each MoE block's forward by router -> ``route(j, logits, weights, ids)`` -> experts.

    ``route`` gets the j-th MoE layer's router outputs for the N token slots of the forward
    (logits [N, E], weights [N, k], ids [N, k]) and returns the expert ids to run [N, k].
    """
    for j, site in enumerate(sites):
        site.moe_block.forward = _block_forward(site.moe_block, j, route)
    try:
        yield
    finally:
        for site in sites:
            del site.moe_block.forward


def normalised_gates(weights: np.ndarray) -> np.ndarray:
    """Gate weights [.., k] renormalised over the top-k, as traces.format.make_chunk does."""
    weights = weights.astype(np.float32)
    return weights / weights.sum(axis=-1, keepdims=True)


# ---- decisions: ReferenceSimulators, in this process or in worker processes --------------


@dataclass
class Decisions:
    """Per-rank outcome of decode steps: codes (HIT...CPU, or NOT_DECIDED), substitutes, mass."""

    codes: np.ndarray  # int8[..., k]
    subs: np.ndarray  # int16[..., k]: expert run in place of a SUBSTITUTE rank, else -1
    mass: np.ndarray  # float64[...]: substituted gate mass of the step


class RowSims:
    """The simulators of some lanes; every method takes and returns plain arrays."""

    def __init__(self, params: list[SimParams], meta: TraceMeta):
        self.params, self.meta = params, meta
        self.sims = [ReferenceSimulator(p, meta) for p in params]

    def warm(self, rows: list[int], counts: np.ndarray) -> None:
        """init=frequency: fill the caches of ``rows`` by selection counts int64[len(rows), L*E]."""
        for r, c in zip(rows, counts, strict=True):
            self.sims[r].warm(c)

    def step(self, rows, layer: int, experts, gates, logits, seq, pos, domain) -> Decisions:
        """One decode step of ``rows`` at ``layer`` (inputs indexed like ``rows``).

        A row's group opens at layer 0 and closes after the last layer.
        """
        n, k = len(rows), self.meta.top_k
        out = Decisions(np.empty((n, k), np.int8), np.empty((n, k), np.int16), np.empty(n))
        last = self.meta.num_layers - 1
        for i, r in enumerate(rows):
            sim = self.sims[r]
            if layer == 0:
                sim.begin_group(PHASE_DECODE, 1, seq=seq[i : i + 1], pos=pos[i : i + 1],
                                domain=domain[i : i + 1])
            d = sim.decode_step(layer, experts[i], gates[i], logits[i])
            if layer == last:
                sim.end_group()
            out.codes[i], out.subs[i], out.mass[i] = d.codes, d.substitutes, d.mass
        return out

    def replay(self, rows, warmup, spans, experts, gates, logits, seq, pos, domain) -> Decisions:
        """Each row's strategy replayed by the engine's loop (:func:`simulator.engine.simulate`)
        over the span ``spans[i]`` of one recorded routing (the open loop's decisions); returns
        decisions [n, span length, L, k].

        experts/gates [T, L, k], logits float16 [T, L, E], seq/pos/domain [T]; the first
        ``warmup[i]`` tokens of a span are not decided (init=frequency warms from them).
        """
        from traces.format import ArraySource, TraceChunk

        L, k = self.meta.num_layers, self.meta.top_k
        n, size = len(rows), spans[0][1] - spans[0][0]
        out = Decisions(np.full((n, size, L, k), NOT_DECIDED, np.int8),
                        np.full((n, size, L, k), -1, np.int16), np.zeros((n, size, L)))
        for i, (r, (a, b)) in enumerate(zip(rows, spans, strict=True)):
            if int(warmup[i]) != warmup_tokens(self.params[r]):
                raise ValueError(f"row {r}: warm-up {warmup[i]} is not its strategy's")
            T = b - a
            chunk = TraceChunk(
                seq=np.asarray(seq[a:b], np.int32), pos=np.asarray(pos[a:b], np.int32),
                phase=np.full(T, PHASE_DECODE, np.int8), group=np.arange(T, dtype=np.int64),
                domain=np.asarray(domain[a:b], np.int16), token_id=np.full(T, -1, np.int32),
                experts=np.ascontiguousarray(experts[a:b]), gates=np.ascontiguousarray(gates[a:b]),
                logits=np.asarray(logits[a:b], np.float32), residency=np.zeros((0, L, k), np.int8))
            steps = _StepRecorder()
            simulate(ArraySource(self.meta, chunk), self.params[r], engine="reference",
                     observer=steps)
            for t, layer, d in steps.decisions:
                out.codes[i, t, layer] = d.codes
                out.subs[i, t, layer] = d.substitutes
                out.mass[i, t, layer] = d.mass
        return out

    def check(self, rows, records: list[dict], engine: str, paths: list[str | None]) -> list[dict]:
        """Write each row's recorded routing as a trace, replay it with moe-sim's engine.

        Returns per row the simulator's per-token mass and counts (simulated tokens only).
        """
        from simulator.engine import simulate
        from traces.format import TraceWriter, open_trace

        results = []
        with tempfile.TemporaryDirectory() as tmp:
            for r, rec, path in zip(rows, records, paths, strict=True):
                path = path or str(Path(tmp) / f"row{r}.parquet")
                with TraceWriter(path, self.meta) as writer:  # weights as the model applied them
                    writer.write(**rec)
                with open_trace(path) as source:
                    res = simulate(source, self.params[r], engine=engine)
                results.append({"mass": res.mass, "substitutions": res.substitutions,
                                "hits": res.hits, "fetches": res.fetches})
        return results


class _StepRecorder(Observer):
    """Keeps every decode step's decision: (token, layer, StepDecision)."""

    def __init__(self):
        self.decisions: list[tuple[int, int, object]] = []

    def on_step(self, group, layer, decision):
        self.decisions.append((group, layer, decision))


def selection_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Router selections per flat expert id x = layer * E + e: int64[L*E] from experts [T, L, k]."""
    L = experts.shape[1]
    flat = experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * num_experts)[None, :, None]
    return np.bincount(flat.ravel(), minlength=L * num_experts)


def _serve(conn, params: list[SimParams], meta: TraceMeta) -> None:
    rows = RowSims(params, meta)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            conn.send((True, getattr(rows, method)(*args)))
        except Exception:  # reported to the parent, which raises it
            conn.send((False, traceback.format_exc()))


class DecisionPool:
    """The simulators of all lanes, split over ``workers`` processes (0: all in this process).

    Lanes are dealt round-robin; a call sends each worker its lanes' slice and merges the
    answers in lane order, so results do not depend on the number of workers.
    """

    def __init__(self, params: list[SimParams], meta: TraceMeta, workers: int = 0):
        self.num_rows = len(params)
        workers = max(0, min(workers, self.num_rows))
        self.groups = [list(range(w, self.num_rows, max(workers, 1))) for w in range(max(workers, 1))]
        self.local = RowSims(params, meta) if workers == 0 else None
        self._splits: dict[bytes, list] = {}
        self.conns, self.procs = [], []
        ctx = mp.get_context("spawn")  # never fork a process holding CUDA or OpenMP state
        for rows in self.groups if workers else []:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, [params[r] for r in rows], meta), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            conn.send(None)
            proc.join(timeout=10)
        self.conns, self.procs = [], []

    def __enter__(self) -> DecisionPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, per_group: list[tuple]) -> list:
        if self.local is not None:
            return [getattr(self.local, method)(*per_group[0])]
        for conn, args in zip(self.conns, per_group, strict=True):
            conn.send((method, args))
        out = []
        for conn in self.conns:
            ok, value = conn.recv()
            if not ok:
                raise RuntimeError(f"decision worker failed:\n{value}")
            out.append(value)
        return out

    def _split(self, rows: np.ndarray) -> list[tuple[np.ndarray, list[int]]]:
        """Per group: positions in ``rows`` of its rows, and their local indices."""
        key = rows.tobytes()
        if key not in self._splits:  # the active rows change only when a warm-up ends
            where = {int(r): i for i, r in enumerate(rows)}
            self._splits[key] = [(np.array([where[r] for r in g if r in where], dtype=np.int64),
                                  [j for j, r in enumerate(g) if r in where]) for g in self.groups]
        return self._splits[key]

    def _gather(self, rows: np.ndarray, method: str, args_of) -> list[tuple[np.ndarray, object]]:
        split = self._split(rows)
        parts = self._call(method, [args_of(pos, local) for pos, local in split])
        return [(pos, part) for (pos, _), part in zip(split, parts, strict=True)]

    def warm(self, rows: np.ndarray, counts: np.ndarray) -> None:
        self._gather(rows, "warm", lambda pos, local: (local, counts[pos]))

    def step(self, rows: np.ndarray, layer: int, experts, gates, logits, seq, pos, domain) -> Decisions:
        """Decisions of ``rows`` (lane ids, ascending) for one step; inputs indexed like rows."""
        return _merge(self._gather(rows, "step", lambda p, local: (
            local, layer, experts[p], gates[p], logits[p], seq[p], pos[p], domain[p])), len(rows))

    def replay(self, warmup: np.ndarray, spans: np.ndarray, experts, gates, logits, seq, pos, domain) -> Decisions:
        """Every lane's decisions on one recorded routing (see :meth:`RowSims.replay`)."""
        return _merge(self._gather(np.arange(self.num_rows), "replay", lambda p, local: (
            local, warmup[p], spans[p], experts, gates, logits, seq, pos, domain)), self.num_rows)

    def check(self, records: list[dict], engine: str, paths: list[str | None]) -> list[dict]:
        out: list = [None] * self.num_rows
        for p, part in self._gather(np.arange(self.num_rows), "check", lambda p, local: (
                local, [records[i] for i in p], engine, [paths[i] for i in p])):
            for i, value in zip(p, part, strict=True):
                out[i] = value
        return out


def _merge(parts: list[tuple[np.ndarray, Decisions]], n: int) -> Decisions:
    first = parts[0][1]
    out = Decisions(*(np.empty((n, *getattr(first, f).shape[1:]), getattr(first, f).dtype)
                      for f in ("codes", "subs", "mass")))
    for pos, part in parts:
        out.codes[pos], out.subs[pos], out.mass[pos] = part.codes, part.subs, part.mass
    return out


# ---- tokens and lanes --------------------------------------------------------------------


@dataclass
class Tokens:
    """The held-out token stream cut into windows of equal length (one KV cache, one trace
    sequence each) and into ``streams`` equal runs of whole windows. Arrays [T]."""

    token_id: np.ndarray  # int64
    domain: np.ndarray  # int16: index into the domain names, -1 none
    window_tokens: int
    streams: int = 1

    def __post_init__(self) -> None:
        T, w, s = len(self.token_id), self.window_tokens, self.streams
        if T == 0 or T % (w * s):
            raise InputError(f"{T} tokens do not make {s} stream(s) of whole {w}-token windows")
        self.seq = (np.arange(T) // w).astype(np.int32)
        self.pos = (np.arange(T) % w).astype(np.int32)
        self.stream = (np.arange(T) // (T // s)).astype(np.int32)

    @classmethod
    def from_documents(cls, docs: Sequence[np.ndarray], domains: Sequence[int], window_tokens: int,
                       max_tokens: int | None = None, streams: int = 1, separator: int | None = None) -> Tokens:
        """Documents (token ids) joined into one stream, each followed by ``separator`` (the
        model's end-of-text token, as in training), cut into whole windows: at most
        ``max_tokens`` tokens, a multiple of ``window_tokens * streams``."""
        sep = [] if separator is None else [separator]
        ids = np.concatenate([np.r_[np.asarray(d, np.int64), sep] for d in docs])
        dom = np.concatenate([np.full(len(d) + len(sep), x, np.int16) for d, x in zip(docs, domains, strict=True)])
        unit = window_tokens * streams
        T = min(len(ids), max_tokens or len(ids)) // unit * unit
        if T == 0:
            raise InputError(f"the text has {len(ids)} tokens, fewer than one window per stream "
                             f"({window_tokens} x {streams}); give more text or smaller windows")
        return cls(ids[:T], dom[:T], window_tokens, streams)

    def __len__(self) -> int:
        return int(self.token_id.shape[0])

    def windows(self) -> list[slice]:
        w = self.window_tokens
        return [slice(a, a + w) for a in range(0, len(self), w)]

    def first_steps(self, steps: int) -> tuple[Tokens, np.ndarray]:
        """The first ``steps`` tokens of every stream (whole windows), and their indices here."""
        keep = np.concatenate([np.arange(a, a + steps) for a, _ in self.spans()])
        return Tokens(self.token_id[keep], self.domain[keep], self.window_tokens, self.streams), keep

    def spans(self) -> np.ndarray:
        """int64[streams, 2]: the token range of each stream."""
        n = len(self) // self.streams
        return np.array([(s * n, (s + 1) * n) for s in range(self.streams)], np.int64)


@dataclass(frozen=True)
class Lanes:
    """Batch rows of the closed loop: lane = strategy * streams + stream."""

    strategy: np.ndarray  # int64[R*S]
    start: np.ndarray  # int64[R*S]: first token of the lane's stream
    stop: np.ndarray  # int64[R*S]

    @classmethod
    def of(cls, num_strategies: int, tokens: Tokens) -> Lanes:
        spans = np.tile(tokens.spans(), (num_strategies, 1))
        return cls(np.repeat(np.arange(num_strategies), tokens.streams), spans[:, 0], spans[:, 1])


# ---- closed loop -------------------------------------------------------------------------


class Recorder:
    """What each strategy's router produced and what it decided, per token and layer."""

    def __init__(self, R: int, T: int, L: int, k: int, E: int):
        self.experts = np.zeros((R, T, L, k), np.int16)
        self.weights = np.zeros((R, T, L, k), np.float32)
        self.logits = np.zeros((R, T, L, E), np.float16)
        self.codes = np.full((R, T, L, k), NOT_DECIDED, np.int8)
        self.subs = np.full((R, T, L, k), -1, np.int16)
        self.mass = np.zeros((R, T, L))

    def take(self, keep: np.ndarray) -> None:
        """Keep only the tokens ``keep``."""
        for name, value in vars(self).items():
            setattr(self, name, value[:, keep])


class ClosedLoop:
    """The route of the closed loop: each lane's simulator decides on that lane's own routing."""

    def __init__(self, pool: DecisionPool, lanes: Lanes, warmup: np.ndarray, tokens: Tokens,
                 num_strategies: int, L: int, k: int, E: int):
        self.pool, self.lanes, self.warmup, self.tokens = pool, lanes, warmup, tokens
        self.E, self.k = E, k
        self.rec = Recorder(num_strategies, len(tokens), L, k, E)
        self.u = -1  # step within the streams

    def next_token(self) -> None:
        self.u += 1
        warm_now = np.flatnonzero(self.warmup == self.u) if self.u else np.empty(0, np.int64)
        if warm_now.size:  # init=frequency: caches warmed by the unperturbed warm-up tokens
            ln = self.lanes
            counts = np.stack([selection_counts(self.rec.experts[ln.strategy[i], ln.start[i] : ln.start[i] + self.u],
                                                self.E) for i in warm_now])
            self.pool.warm(warm_now, counts)

    def __call__(self, j: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        E, k, rec, ln = self.E, self.k, self.rec, self.lanes
        t = ln.start + self.u
        # one device-to-host copy per layer: logits, weights and ids side by side
        host = torch.cat([logits.float(), weights.float(), ids.float()], dim=1).cpu().numpy()
        lg16 = host[:, :E].astype(np.float16)  # the trace stores float16 logits: decide on those
        w = host[:, E : E + k]
        experts = host[:, E + k :].astype(np.int64)
        rec.experts[ln.strategy, t, j], rec.weights[ln.strategy, t, j], rec.logits[ln.strategy, t, j] = experts, w, lg16
        active = np.flatnonzero(self.warmup <= self.u)
        if not active.size:
            return ids
        ta, tok = t[active], self.tokens
        d = self.pool.step(active, j, experts[active], normalised_gates(w[active]),
                           lg16[active].astype(np.float32), tok.seq[ta], tok.pos[ta], tok.domain[ta])
        ra = ln.strategy[active]
        rec.codes[ra, ta, j], rec.subs[ra, ta, j], rec.mass[ra, ta, j] = d.codes, d.subs, d.mass
        rows, ranks = np.nonzero(d.codes == SUBSTITUTE)
        if not rows.size:
            return ids
        run = experts.copy()
        run[active[rows], ranks] = d.subs[rows, ranks]
        return torch.from_numpy(run).to(ids.device, ids.dtype)


@inference_mode
def run_closed_loop(model, sites, tokens: Tokens, pool: DecisionPool, lanes: Lanes, warmup: np.ndarray,
                    num_strategies: int, observe: Callable[[int, torch.Tensor], None] | None = None,
                    progress: Callable[[int], None] | None = None,
                    deadline: float | None = None) -> tuple[np.ndarray, Recorder, int]:
    """Feed every stream one token at a time to all lanes, each lane with its own KV cache.

    Returns the NLL float32[strategies, T] (NaN at a window's first token: nothing predicts it),
    the recorded routing and decisions, and the steps done: all of them, or fewer when the
    ``deadline`` (a ``time.perf_counter()`` value) passed, checked before each new window.
    ``observe(u, logits)`` sees each step's LM logits [lanes, V]; ``progress(tokens done)`` is
    called after each step.
    """
    from traces.capture.capture import _cache_argument, _returned_cache

    device = next(model.parameters()).device
    first = sites[0]
    loop = ClosedLoop(pool, lanes, warmup, tokens, num_strategies, len(sites), first.top_k, first.num_experts)
    nll = torch.full((num_strategies, len(tokens)), math.nan, device=device)
    ids = torch.as_tensor(tokens.token_id, device=device)
    strategy = torch.as_tensor(lanes.strategy, device=device)
    start = torch.as_tensor(lanes.start, device=device)
    cache_argument = _cache_argument(model)
    steps = len(tokens) // tokens.streams
    out = None
    done = steps
    with routed(sites, loop):
        for u in range(steps):
            if u and tokens.pos[u] == 0 and deadline is not None and time.perf_counter() > deadline:
                done = u
                break
            loop.next_token()
            t = start + u
            # every lane starts a window (a fresh KV cache) at the same step
            past = {} if tokens.pos[u] == 0 else {cache_argument: _returned_cache(out)}
            out = model(input_ids=ids[t][:, None], use_cache=True, **past)
            if observe is not None:
                observe(u, out.logits[:, -1])
            if u + 1 < steps and tokens.pos[u + 1] != 0:
                nll[strategy, t + 1] = torch.nn.functional.cross_entropy(
                    out.logits[:, -1].float(), ids[t + 1], reduction="none")
            if progress is not None:
                progress((u + 1) * tokens.streams)
    return nll.cpu().numpy(), loop.rec, done


# ---- open loop ---------------------------------------------------------------------------


class OpenLoop:
    """The route of the open loop: decisions precomputed on the unperturbed routing.

    A missing expert keeps the substitute it got in the unperturbed replay: where the perturbed
    router selects an expert that the replay substituted at this token and layer, its substitute
    runs instead (unless the router now selects the substitute itself); experts the unperturbed
    router did not select run as selected.
    """

    def __init__(self, ref_experts: np.ndarray, decisions: Decisions):
        self.ref_experts = ref_experts.astype(np.int64)  # [T, L, k]
        self.decisions = decisions  # [R, T, L, k]
        self.window = slice(0, 0)
        self.applied_mass = np.zeros(decisions.mass.shape)

    def __call__(self, j: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        R, w, k = self.decisions.mass.shape[0], self.window, ids.shape[-1]
        e = ids.reshape(R, -1, k).cpu().numpy().astype(np.int64)
        ref = self.ref_experts[w, j][None]  # [1, n, k]
        codes = self.decisions.codes[:, w, j]  # [R, n, k]
        subs = self.decisions.subs[:, w, j].astype(np.int64)
        # match[r, t, i, m]: the current rank-i expert is the replay's rank-m expert, substituted
        match = (e[..., :, None] == ref[..., None, :]) & (codes[..., None, :] == SUBSTITUTE)
        sub = np.where(match.any(-1), np.take_along_axis(subs, match.argmax(-1), -1), -1)
        apply = (sub >= 0) & ~(sub[..., :, None] == e[..., None, :]).any(-1)
        if not apply.any():
            return ids
        g = normalised_gates(weights.float().reshape(R, -1, k).cpu().numpy())
        self.applied_mass[:, w, j] = np.where(apply, g, 0.0).sum(-1)
        return torch.from_numpy(np.where(apply, sub, e).reshape(-1, k)).to(ids.device, ids.dtype)


@inference_mode
def run_open_loop(model, sites, tokens: Tokens, ref_experts: np.ndarray,
                  decisions: Decisions) -> tuple[np.ndarray, np.ndarray]:
    """One batched teacher-forced forward per window, all strategies as rows, with decisions
    precomputed per strategy and token. Returns NLL float32[R, T] and the gate mass actually
    substituted float64[R, T, L]."""
    from traces.capture.capture import token_nll

    device = next(model.parameters()).device
    R = decisions.mass.shape[0]
    loop = OpenLoop(ref_experts, decisions)
    nll = np.full((R, len(tokens)), math.nan, np.float32)
    ids = torch.as_tensor(tokens.token_id, device=device)
    with routed(sites, loop):
        for w in tokens.windows():
            loop.window = w
            x = ids[w].expand(R, -1)
            nll[:, w] = token_nll(model(input_ids=x, use_cache=False).logits, x).cpu().numpy()
    return nll, loop.applied_mass


# ---- the whole run -----------------------------------------------------------------------


@dataclass
class Emulation:
    """Everything one run measured, per strategy r and token t (see summary_arrays)."""

    strategies: list[Strategy]
    params: list[SimParams]
    meta: TraceMeta
    tokens: Tokens
    nll: np.ndarray  # float32[R, T] closed loop
    rec: Recorder
    checks: list[dict] | None = None  # per lane: moe-sim's replay of the lane's own trace
    open_nll: np.ndarray | None = None  # float32[R, T]
    open_decisions: Decisions | None = None  # [R, T, L, k]
    open_applied_mass: np.ndarray | None = None  # float64[R, T, L]
    seconds: dict | None = None


def lane_records(rec: Recorder, r: int, span: slice, tokens: Tokens, nll: np.ndarray) -> dict:
    """Trace arrays of strategy r over one stream: the routing the model produced under it."""
    n = span.stop - span.start
    return {
        "seq": tokens.seq[span], "pos": tokens.pos[span], "phase": np.full(n, PHASE_DECODE, np.int8),
        "experts": rec.experts[r, span], "weights": rec.weights[r, span], "logits": rec.logits[r, span],
        "residency": (rec.codes[r, span] == HIT).astype(np.int8),
        "token_id": tokens.token_id[span].astype(np.int32), "domain": tokens.domain[span],
        "nll": nll[r, span],
    }


def emulate(model, sites, meta: TraceMeta, tokens: Tokens, strategies: Sequence[Strategy], *,
            workers: int = 0, check: bool = True, open_loop: bool = True, engine: str = "reference",
            trace_dir: Path | None = None, observe=None, max_seconds: float | None = None,
            log: Callable[[str], None] | None = None) -> Emulation:
    """Run ``strategies`` side by side over ``tokens`` (see the module docstring).

    ``max_seconds`` bounds the closed loop: past it, no new window starts, and the run goes on
    with the windows every stream finished.
    """
    log = log or (lambda s: None)
    strategies = list(strategies)
    R = len(strategies)
    params = [strategy_params(s, meta) for s in strategies]
    lanes = Lanes.of(R, tokens)
    warmup = np.array([warmup_tokens(params[r]) for r in lanes.strategy], np.int64)
    if (warmup >= len(tokens) // tokens.streams).any():
        raise InputError("cache.warmup_tokens must be below the tokens of one stream")
    seconds: dict[str, float] = {}
    with DecisionPool([params[r] for r in lanes.strategy], meta, workers) as pool:
        t0 = time.perf_counter()
        every = max(1, len(tokens) // 20)

        def progress(done: int) -> None:
            if done % every < tokens.streams or done == len(tokens):
                log(f"closed loop: {done}/{len(tokens)} tokens, {done / (time.perf_counter() - t0):.1f} tokens/s")

        deadline = None if max_seconds is None else t0 + max_seconds
        nll, rec, done = run_closed_loop(model, sites, tokens, pool, lanes, warmup, R, observe, progress, deadline)
        seconds["closed_loop"] = time.perf_counter() - t0
        if done < len(tokens) // tokens.streams:
            log(f"closed loop: stopped after {done} tokens per stream (--max-seconds {max_seconds:g})")
            tokens, keep = tokens.first_steps(done)
            nll = nll[:, keep]
            rec.take(keep)
            lanes = Lanes.of(R, tokens)
        em = Emulation(strategies, params, meta, tokens, nll, rec, seconds=seconds)
        spans = [slice(int(a), int(b)) for a, b in zip(lanes.start, lanes.stop, strict=True)]
        if check:
            t0 = time.perf_counter()
            paths: list[str | None] = [None] * len(spans)
            if trace_dir is not None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                paths = [str(trace_dir / f"{strategies[r].name}_f{strategies[r].fraction:g}_s{i % tokens.streams}.parquet")
                         for i, r in enumerate(lanes.strategy)]
            em.checks = pool.check([lane_records(rec, r, sp, tokens, nll) for r, sp in zip(lanes.strategy, spans, strict=True)],
                                   engine, paths)
            seconds["replay_check"] = time.perf_counter() - t0
            log(f"replay check: {seconds['replay_check']:.1f} s")
        if open_loop:
            ref = [i for i, s in enumerate(strategies) if s.name == "fetch_all"]
            if not ref:
                raise InputError("the open loop needs a fetch_all strategy (its unperturbed routing)")
            r0 = ref[0]
            t0 = time.perf_counter()
            lane_dec = pool.replay(warmup, np.stack([lanes.start, lanes.stop], 1), rec.experts[r0].astype(np.int32),
                                   normalised_gates(rec.weights[r0]), rec.logits[r0],
                                   tokens.seq, tokens.pos, tokens.domain)
            em.open_decisions = Decisions(np.empty_like(rec.codes), np.empty_like(rec.subs), np.empty_like(rec.mass))
            for i, (r, sp) in enumerate(zip(lanes.strategy, spans, strict=True)):
                em.open_decisions.codes[r, sp] = lane_dec.codes[i]
                em.open_decisions.subs[r, sp] = lane_dec.subs[i]
                em.open_decisions.mass[r, sp] = lane_dec.mass[i]
            seconds["open_loop_decisions"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            em.open_nll, em.open_applied_mass = run_open_loop(model, sites, tokens, rec.experts[r0], em.open_decisions)
            seconds["open_loop_forward"] = time.perf_counter() - t0
            log(f"open loop: {seconds['open_loop_decisions']:.1f} s decisions, "
                f"{seconds['open_loop_forward']:.1f} s forward")
    return em


def token_mass(mass: np.ndarray) -> np.ndarray:
    """Per-token substituted mass: step masses [.., T, L] summed over layers in layer order,
    as the simulator accumulates them (a cumulative sum is sequential by definition)."""
    return np.cumsum(mass, axis=-1)[..., -1]


def summary_arrays(em: Emulation) -> dict[str, np.ndarray]:
    """Per strategy x token arrays [R, T] and per-token arrays [T] (names: docs/QUALITY.md)."""
    codes = em.rec.codes
    tok = em.tokens
    arrays = {
        "token_id": tok.token_id.astype(np.int32), "seq": tok.seq, "pos": tok.pos,
        "domain": tok.domain, "stream": tok.stream,
        "simulated": codes[:, :, 0, 0] != NOT_DECIDED,
        "nll": em.nll,
        "mass": token_mass(em.rec.mass),
        "substitutions": (codes == SUBSTITUTE).sum((2, 3)).astype(np.int16),
        "first_choice_substitutions": (codes[..., 0] == SUBSTITUTE).sum(2).astype(np.int16),
        "hits": (codes == HIT).sum((2, 3)).astype(np.int16),
        "fetches": np.isin(codes, (FETCH, FORCED_FETCH)).sum((2, 3)).astype(np.int16),
        "forced_fetches": (codes == FORCED_FETCH).sum((2, 3)).astype(np.int16),
    }
    if em.open_nll is not None:
        arrays["open_nll"] = em.open_nll
        arrays["open_mass"] = token_mass(em.open_decisions.mass)
        arrays["open_applied_mass"] = token_mass(em.open_applied_mass)
        arrays["open_substitutions"] = (em.open_decisions.codes == SUBSTITUTE).sum((2, 3)).astype(np.int16)
    return arrays


def check_summary(em: Emulation, arrays: dict) -> list[dict]:
    """Per strategy: does moe-sim's replay of its traces reproduce the emulation exactly?"""
    if em.checks is None:
        return []
    lanes = Lanes.of(len(em.strategies), em.tokens)
    out = [{"label": s.label, "mass_equal": True, "counts_equal": True, "max_abs_mass_diff": 0.0}
           for s in em.strategies]
    for c, r, a, b in zip(em.checks, lanes.strategy, lanes.start, lanes.stop, strict=True):
        sim = arrays["simulated"][r, a:b]
        mass = arrays["mass"][r, a:b][sim]
        o = out[r]
        o["mass_equal"] &= bool(np.array_equal(c["mass"], mass))
        o["max_abs_mass_diff"] = max(o["max_abs_mass_diff"], float(np.max(np.abs(c["mass"] - mass), initial=0.0)))
        o["counts_equal"] &= all(np.array_equal(c[n], arrays[n][r, a:b][sim]) for n in ("substitutions", "hits", "fetches"))
    return out


def _number(v: float) -> float | str:
    """JSON has no infinity: write it as "inf" (the YAML presets say .inf)."""
    return "inf" if math.isinf(v) else v


def write_results(out: Path, em: Emulation, info: dict) -> list[dict]:
    """results.npz and emulation.json under ``out`` (atomically); returns the replay checks."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = summary_arrays(em)
    checks = check_summary(em, arrays)
    # float32 on disk keeps a 67-strategy x 12k-token run under 16 MiB a file; the exactness
    # check above ran on the float64 sums
    small = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()}
    for name, keys in (("results", [k for k in small if not k.startswith(OPEN)]),
                       (OPEN + "loop", [k for k in small if k.startswith(OPEN)])):
        if keys:
            with atomic_output(out / f"{name}.npz") as tmp, open(tmp, "wb") as f:
                np.savez_compressed(f, **{k: small[k] for k in keys})
    doc = {
        **info,
        "meta": asdict(em.meta),
        "tokens": len(em.tokens),
        "window_tokens": em.tokens.window_tokens,
        "streams": em.tokens.streams,
        "strategies": [
            {"label": s.label, "name": s.name, "fraction": s.fraction, "overrides": s.config_overrides(),
             "protect_ranks": p.protect_ranks, "tau": _number(p.tau), "beta": _number(p.beta),
             "eviction": p.eviction,
             "resident_per_layer": int(p.pool_budget_bytes[0] // p.expert_bytes[0]),
             "warmup_tokens": warmup_tokens(p)}
            for s, p in zip(em.strategies, em.params, strict=True)
        ],
        "checks": checks,
        "seconds": {k: round(v, 2) for k, v in (em.seconds or {}).items()},
    }
    atomic_write_text(out / "emulation.json", json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return checks


# ---- command line ------------------------------------------------------------------------


def load_tokens(path: str, tokenizer, window_tokens: int, max_tokens: int | None,
                streams: int) -> tuple[Tokens, list[str]]:
    """Held-out text as a token stream: documents from a file, folder or JSONL of {text, domain},
    or the token ids of a captured trace (``.parquet``, e.g. the bundled fixture trace)."""
    sep = tokenizer.eos_token_id
    source = resolve_path(path)
    if source.suffix == ".parquet":
        docs, doc_domains, names = trace_documents(source, strip=sep)
    else:
        from traces.capture.text import read_documents

        texts = read_documents([source])
        names = list(dict.fromkeys(d.domain for d in texts))
        docs = [np.asarray(tokenizer(d.text, add_special_tokens=False)["input_ids"], np.int64) for d in texts]
        doc_domains = [names.index(d.domain) for d in texts]
    return Tokens.from_documents(docs, doc_domains, window_tokens, max_tokens, streams, separator=sep), names


def trace_documents(path: Path, strip: int | None = None) -> tuple[list[np.ndarray], list[int], list[str]]:
    """The documents a trace was captured on: its sequences' token ids, a leading ``strip`` token
    (the capture's per-window BOS) removed, consecutive sequences of one domain joined (a
    document longer than a capture window spans several)."""
    from traces.format import read_trace

    meta, chunk = read_trace(path)
    if chunk.num_tokens == 0 or (chunk.token_id < 0).any():
        raise InputError(f"{path}: the trace has no token_id column to take the text from")
    bounds = np.flatnonzero(np.r_[True, chunk.seq[1:] != chunk.seq[:-1], True])
    docs: list[np.ndarray] = []
    domains: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        ids = chunk.token_id[a:b].astype(np.int64)
        if strip is not None and ids[0] == strip:
            ids = ids[1:]
        d = int(chunk.domain[a])
        if docs and domains[-1] == d:
            docs[-1] = np.r_[docs[-1], ids]
        else:
            docs.append(ids)
            domains.append(d)
    names = list(meta.domains) or ["text"]
    return docs, [max(d, 0) for d in domains], names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-emulate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=FIXTURE_MODEL, help="Hugging Face checkpoint folder")
    p.add_argument("--config", help="instead of --model: a config.json for a randomly initialised model")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model's)")
    p.add_argument("--text", default=FIXTURE_TEXT,
                   help="held-out text: file, folder, JSONL of {text, domain}, or a trace's token ids (.parquet)")
    p.add_argument("--max-tokens", type=int, default=12_288, help="tokens emulated (0: all the text)")
    p.add_argument("--window-tokens", type=int, default=0,
                   help="tokens per window: one KV cache, one trace sequence (0: the model's context, at most 512)")
    p.add_argument("--streams", type=int, default=1,
                   help="independent runs of whole windows, batched side by side (each starts cold)")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                   help="resident fractions of the default strategy set, comma-separated")
    p.add_argument("--strategy", action="append", default=[], metavar="'NAME@FRACTION OVERRIDE ...'",
                   help="a strategy instead of the default set (repeatable); the open loop needs a fetch_all one")
    p.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                   help="a moe-sim override for every strategy, e.g. cache.warmup_tokens=64 (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype) | bfloat16 | float32 ...")
    p.add_argument("--experts-implementation", help="transformers expert kernels: eager | batched_mm | grouped_mm")
    p.add_argument("--workers", type=int, default=0, help="processes running the simulators (0: this one)")
    p.add_argument("--max-seconds", type=float, help="closed-loop time limit: past it no new window starts, "
                   "and the run goes on with the windows done")
    p.add_argument("--no-check", action="store_true", help="skip replaying each strategy's trace in moe-sim's engine")
    p.add_argument("--no-open-loop", action="store_true", help="skip the open-loop comparison")
    p.add_argument("--traces", action="store_true", help="keep each strategy's traces under OUT/traces/")
    p.add_argument("--out", required=True, help="output folder (results.npz, open_loop.npz, emulation.json)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if torch is None:
        print("moe-emulate: error: needs torch and transformers; install the capture extra with a "
              "torch build for this host (pip install torch, then pip install -e '.[capture]')",
              file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)
    try:
        run_cli(args, sys.argv[1:] if argv is None else argv)
    except InputError as e:
        print(f"moe-emulate: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)


def run_cli(args, argv: list[str]) -> None:
    import transformers

    from traces.capture.config import ModelConfig
    from traces.capture.model import load_model

    def log(msg: str) -> None:
        print(f"moe-emulate: {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    strategies = [s.with_overrides(args.set) for s in (
        [parse_strategy(s) for s in args.strategy] if args.strategy
        else default_strategies([float(f) for f in args.fractions.split(",")]))]
    model_cfg = ModelConfig(path=None if args.config else str(resolve_path(args.model)),
                            config=args.config, tokenizer=args.tokenizer, dtype=args.dtype,
                            device=args.device)
    model, tokenizer, _, name = load_model(model_cfg)
    if args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    sites = moe_sites(model)
    window = args.window_tokens or min(512, int(model.config.max_position_embeddings))
    tokens, domains = load_tokens(args.text, tokenizer, window, args.max_tokens or None, args.streams)
    meta = emulation_meta(model, sites, name, domains, extra={"text": args.text})
    device = next(model.parameters()).device
    log(f"{name}: {len(sites)} MoE layers, {meta.num_experts} experts, top-{meta.top_k}; {len(tokens)} "
        f"tokens ({len(tokens.windows())} windows, {tokens.streams} streams); {len(strategies)} strategies on {device}")
    out = Path(args.out)
    em = emulate(model, sites, meta, tokens, strategies, workers=args.workers, check=not args.no_check,
                 open_loop=not args.no_open_loop, trace_dir=out / "traces" if args.traces else None,
                 max_seconds=args.max_seconds, log=log)
    info = {
        "command": "moe-emulate " + " ".join(argv),
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__},
        "torch_threads": torch.get_num_threads(),
        "workers": args.workers,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    checks = write_results(out, em, info)
    bad = [c["label"] for c in checks if not c["mass_equal"]]
    log(f"wrote {out} in {time.perf_counter() - t_start:.0f} s"
        + (f"; simulator mass differs for {', '.join(bad)}" if bad else ""))


if __name__ == "__main__":
    main()
