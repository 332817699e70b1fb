"""Plain-Python reference engine: docs/semantics.md, followed literally.

Slow and readable: the policies are the reference twins of :mod:`simulator.policies` (victims
found by scanning the pool instead of the kernel's lists and heaps). It is the semantic twin of
:mod:`simulator.engine.kernel` (the tests check that both agree exactly).

Tools drive it through its public API: :func:`simulator.engine.simulate` with an
:class:`Observer` (events in the order the engine produces them, and every step's decision), or
one step at a time::

    sim = ReferenceSimulator(params, meta)
    sim.begin_group(PHASE_DECODE)
    for layer in range(L):
        decision = sim.decode_step(layer, experts, gates, logits)
    sim.end_group()
    result = sim.result()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from simulator.engine.layout import Layout, frequency_fill, make_layout
from simulator.engine.link import ReferenceLink
from simulator.engine.params import CPU, FETCH, FORCED_FETCH, HIT, SUBSTITUTE, SimParams
from simulator.engine.state import ADMISSION, DEMAND, PREFETCH
from simulator.metrics import (
    LAYER,
    LAYER_SUMS,
    MASS_BINS,
    RUN,
    TOKEN,
    TOKEN_IDS,
    LayerCount,
    LayerSum,
    RunCount,
    build_result,
)
from simulator.policies import chosen, modules
from traces.format import PHASE_DECODE, PHASE_PREFILL, TraceChunk, TraceMeta

LFU_RENORMALISE_ABOVE = 1e100  # as simulator.engine.kernel
_GROUP_COUNTS = ("hits", "fetches", "substitutions", "cpu_calls")


class Event(NamedTuple):
    """One change of the simulated state, in engine order.

    ``kind``: ``insert`` (x became resident: a fetch, an admission or the warm fill), ``evict``,
    ``enqueue`` (queued for a background transfer at ``time_us``), ``transfer_start`` (a
    background transfer of x went on the link at ``time_us``, ending at ``end_us``),
    ``transfer_done`` (its completion was applied at a step's start; x becomes resident unless
    it already is), ``step`` (the step's body begins: completions are applied, selections come
    next). ``step`` is the step ordinal (-1 outside steps).
    """

    kind: str
    step: int
    x: int  # flat expert id (layer * E + expert); -1 for ``step``
    time_us: float = 0.0
    end_us: float = 0.0


class Observer:
    """What a tool built on the engine receives; override what you need."""

    def on_event(self, event: Event) -> None:
        """Every change of the cache, link and queue, in engine order."""

    def on_step(self, group: int, layer: int, decision: StepDecision) -> None:
        """Every step's decision, after the step."""


@dataclass
class StepDecision:
    """What one step did.

    Decode: one entry per rank, rank 0 first. Prefill: one entry per unique selected expert, in
    order of first appearance. Times in microseconds on the simulated clock.
    """

    experts: list[int]  # expert ids within the layer that the entries refer to
    codes: list[int]  # HIT, FETCH, FORCED_FETCH, SUBSTITUTE or CPU (simulator.engine.params)
    substitutes: list[int]  # expert id run in place of a SUBSTITUTE entry, else -1
    mass: float  # substituted gate mass of the step (sum of the substituted ranks' g)
    start_us: float
    stall_us: float  # waiting on synchronous fetches
    end_us: float


@dataclass
class _Group:
    phase: int
    num_tokens: int
    ordinal: int
    start_us: float
    seq: list[int]
    pos: list[int]
    domain: list[int]
    next_layer: int = 0
    stall_us: float = 0.0
    mass: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_GROUP_COUNTS, 0))


class ReferenceSimulator:
    """The simulator state, advanced one group and one step at a time (docs/semantics.md).

    ``first_use``: for ``eviction=belady``, int32[L*E] group ordinal of each expert's first
    selection (``NEVER_GROUP`` for never); each step then needs its next-use rows.
    ``observer``: an :class:`Observer` that sees every event and decision. ``layout``: the
    constants :func:`simulator.engine.check_params` derived for ``params`` (else derived here).
    """

    def __init__(self, params: SimParams, meta: TraceMeta, first_use: np.ndarray | None = None,
                 observer: Observer | None = None, layout: Layout | None = None):
        self.params = params
        self.layout = make_layout(params, meta) if layout is None else layout
        self.first_use = first_use
        self.observer = observer
        L, E = params.num_layers, params.num_experts
        X = L * E
        self._expert_bytes = [int(b) for b in params.expert_bytes]
        self._pool_of_layer = [int(p) for p in self.layout.pool_of_layer]
        self._budget = [int(b) for b in self.layout.pool_budget_bytes]
        self._nonexpert_us = [float(v) + float(params.step_fixed_us) for v in params.nonexpert_us]
        self._gpu_expert_us = [float(v) for v in params.gpu_expert_us]
        self._cpu_expert_us = [float(v) for v in params.cpu_expert_us]

        # GPU cache
        self.resident = [False] * X
        self.members: list[list[int]] = [[] for _ in self._budget]  # swap-removed
        self.pool_bytes = [0] * len(self._budget)
        self.freq = [0.0] * X
        self.src = [DEMAND] * X  # what made a resident resident
        self.fresh = [False] * X  # a background arrival not used yet
        self.inc = 1.0
        self.clock_us = 0.0
        self._step = -1
        # counters, in the layout of simulator.metrics
        self.layer_counts = np.zeros((L, len(LAYER)), np.int64)
        self.layer_sums = np.zeros((L, len(LAYER_SUMS)), np.float64)
        self.run_counts = np.zeros(len(RUN), np.int64)
        self.mass_hist = np.zeros(MASS_BINS + 1, np.int64)
        # policies and the link
        mods = modules(chosen(params))
        self.eviction = mods["eviction"].Reference(self)
        self.miss_rule = mods["miss_rule"].Reference(self)
        self.miss_action = mods["miss_action"].Reference(self)
        self.substitute = mods["substitute"].Reference(self)
        self.admission = mods["admission"].Reference(self)
        self.predictor = mods["predictor"].Reference(self)
        self.prefetch = mods["prefetch"].Reference(self)
        self._prefetch_state = mods["prefetch"].make_state(params)
        self.link = ReferenceLink(self, params, self.layout)

        self._tokens: dict[str, list] = {m.name: [] for m in (*TOKEN_IDS, *TOKEN)}
        self._group: _Group | None = None
        self._last_group = -1

    # ---- services the policies and the link use ------------------------------------------

    def count(self, counter: RunCount, n: int = 1) -> None:
        self.run_counts[counter] += n

    def expert_size(self, x: int) -> int:
        return self._expert_bytes[x // self.params.num_experts]

    def pool_of(self, x: int) -> int:
        return self._pool_of_layer[x // self.params.num_experts]

    def emit(self, kind: str, x: int, time_us: float = 0.0, end_us: float = 0.0) -> None:
        if self.observer is not None:
            self.observer.on_event(Event(kind, self._step, x, time_us, end_us))

    # ---- cache -------------------------------------------------------------------------

    def _insert(self, x: int, step: int) -> None:
        """Make x resident; an insertion is a use."""
        p = self.pool_of(x)
        self.resident[x] = True
        self.members[p].append(x)
        self.pool_bytes[p] += self.expert_size(x)
        self.src[x], self.fresh[x] = DEMAND, False
        self.eviction.on_insert(x, step)
        self.emit("insert", x, self.clock_us)

    def _evict(self, x: int) -> None:
        p = self.pool_of(x)
        members = self.members[p]
        i = members.index(x)
        members[i] = members[-1]
        members.pop()
        self.resident[x] = False
        self.pool_bytes[p] -= self.expert_size(x)
        self.count(RunCount.EVICTIONS)
        if self.fresh[x]:
            self.fresh[x] = False
            self._wasted(self.src[x], self.expert_size(x))
        self.eviction.on_evict(x)
        self.emit("evict", x, self.clock_us)

    def _trim(self, p: int, pinned: set[int]) -> None:
        while self.pool_bytes[p] > self._budget[p]:
            self._evict(self.eviction.victim(p, pinned))

    def _select(self, x: int, layer: int, step: int, token: int, next_group) -> None:
        """A router selection (``token``: index in the group): frequency and the eviction
        policy's view advance."""
        self.freq[x] += self.inc
        self.eviction.on_select(x, layer, step, token, next_group)

    def _fetch(self, x: int, step: int, t1: float, fetched: list[int]) -> None:
        """A synchronous fetch of x: resident at once, timed with the step's other fetches."""
        fetched.append(x)
        self._insert(x, step)

    def _wasted(self, source: int, size: int) -> None:
        """The copied bytes of a background transfer that served no use."""
        if source == ADMISSION:
            self.count(RunCount.WASTED_ADMISSIONS)
            self.count(RunCount.WASTED_ADMISSION_BYTES, size)
        else:
            self.count(RunCount.WASTED_PREFETCH_BYTES, size)

    def _used(self, x: int, step: int) -> None:
        """A hit or substitute use of resident x."""
        self.eviction.on_use(x, step)
        if self.fresh[x]:
            self.fresh[x] = False
            if self.src[x] == PREFETCH:
                self.count(RunCount.USEFUL_PREFETCHES)

    def _prefetch(self, chunk, row: int, layer: int, t1: float, step: int) -> None:
        """After a decode step: the predictor's experts for layer + distance, to prefetch."""
        pf = self._prefetch_state
        if pf.top_p > 0 and layer + pf.distance < self.params.num_layers:
            if chunk is None:
                raise ValueError("prefetch needs the step's chunk and row (decode_step(chunk=, row=))")
            self.prefetch.issue(self.predictor.predict(chunk, row, layer, pf.distance, pf.top_p),
                                t1, step)
        if chunk is not None:
            self.predictor.observe(chunk, row, layer)

    def _expert_phase(self, t1: float, step: int, selected: set[int]) -> None:
        """The step's expert phase starts at t1: background transfers completed by then become
        resident, each admitted expert evicted after every other resident not ``selected``."""
        self.link.advance(t1, step)
        done = self.link.next_completion(t1)
        while done is not None:
            x, source = done
            if self.resident[x]:  # fetched meanwhile: the copy served nothing
                self._wasted(source, self.expert_size(x))
            else:
                self._insert(x, step)
                self.src[x], self.fresh[x] = source, True
                self._trim(self.pool_of(x), pinned=selected | {x})
                self.count(RunCount.BACKGROUND_ADMISSIONS)
                self.layer_counts[x // self.params.num_experts,
                                  LayerCount.BACKGROUND_ADMISSIONS] += 1
            done = self.link.next_completion(t1)
        self.emit("step", -1, t1)

    # ---- groups and steps --------------------------------------------------------------

    def train_predictor(self, experts, max_distance: int) -> None:
        """Train the prefetch predictor on the selections int[N, L, k] of its training tokens."""
        self.predictor.train(experts, max_distance)

    def warm(self, counts: np.ndarray) -> None:
        """init=frequency: fill each pool by the warm-up tokens' selection counts (int64[L*E])."""
        counts = np.asarray(counts, dtype=np.int64)
        self.freq = [float(c) for c in counts]
        for fill in frequency_fill(counts, self.params, self.layout):
            for i in reversed(range(len(fill))):  # most frequent inserted last: most recent
                self._insert(int(fill[i]), -1 - i)

    def begin_group(self, phase: int, num_tokens: int = 1, group: int | None = None, seq=None,
                    pos=None, domain=None) -> None:
        """Start a group: one decode token, or ``num_tokens`` prefill tokens of one sequence.

        ``group`` is the group ordinal (default: the previous one + 1); ``seq``, ``pos``,
        ``domain`` are per-token values for the result (default -1, -1, -1).
        """
        if self._group is not None:
            raise RuntimeError("end_group() the current group first")
        if phase == PHASE_DECODE and num_tokens != 1:
            raise ValueError("a decode group is one token")
        ordinal = self._last_group + 1 if group is None else int(group)
        self.inc /= self.params.lfu_decay
        if self.inc > LFU_RENORMALISE_ABOVE:
            self.freq = [f / self.inc for f in self.freq]
            self.inc = self.inc / self.inc
            self.eviction.on_rescale()
        self.eviction.on_group(num_tokens)

        def per_token(values):
            return [-1] * num_tokens if values is None else [int(v) for v in values]

        self._group = _Group(phase=int(phase), num_tokens=num_tokens, ordinal=ordinal,
                             start_us=self.clock_us, seq=per_token(seq), pos=per_token(pos),
                             domain=per_token(domain))
        self.clock_us += float(self.params.token_fixed_us)

    def _begin_step(self, layer: int, phase: int) -> tuple[int, float]:
        g = self._group
        if g is None or g.phase != phase:
            raise RuntimeError("begin_group() with this step's phase first")
        if layer != g.next_layer:
            raise ValueError(f"layers run in order; expected layer {g.next_layer}, got {layer}")
        g.next_layer += 1
        step = g.ordinal * self.params.num_layers + layer
        self._step = step
        return step, self.clock_us

    def _end_step(self, layer: int, decision: StepDecision) -> StepDecision:
        if self.observer is not None:
            self.observer.on_step(self._group.ordinal, layer, decision)
        self._step = -1
        return decision

    def decode_step(self, layer: int, experts, gates, logits=None, next_use=None, chunk=None,
                    row: int = -1) -> StepDecision:
        """One decode token at one layer.

        ``experts``: int[k] selected expert ids (rank order); ``gates``: float[k] normalised gate
        weights; ``logits``: float[E] router logits (needed for substitute_by=logit);
        ``next_use``: int[k] next-use group ordinals (belady); ``chunk``, ``row``: the TraceChunk
        and the token's row in it, which predictors read (prefetch).
        """
        E = self.params.num_experts
        step, t0 = self._begin_step(layer, PHASE_DECODE)
        base = layer * E
        xs = [base + int(e) for e in experts]
        gs = [float(g) for g in gates]
        for i, x in enumerate(xs):
            self._select(x, layer, step, 0, None if next_use is None else next_use[i])

        t1 = t0 + self._nonexpert_us[layer]
        self._expert_phase(t1, step, set(xs))
        fetched: list[int] = []
        used: set[int] = set()
        substituted: set[int] = set()
        codes, subs = [], []
        mass = 0.0
        for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
            sub = -1
            if not self.resident[x] and self.link.pending.get(x) == PREFETCH:
                self.count(RunCount.LATE_PREFETCHES)  # missed while its prefetch is on the way
            if self.resident[x]:
                code = HIT
                self._used(x, step)
            elif self.miss_rule.fetch(i, g):
                code = FETCH
            elif self.miss_action.serve(i, g) == CPU:
                code = CPU
            else:
                y = self.substitute.choose(layer, xs, substituted, logits)
                if y < 0:
                    code = FORCED_FETCH
                else:
                    code = SUBSTITUTE
                    sub = y - base
                    substituted.add(y)
                    used.add(y)
                    self._used(y, step)
                    mass += g
                    self.admission.on_substitute(x, g, t1)
            if code in (FETCH, FORCED_FETCH):
                self._fetch(x, step, t1, fetched)
            if code in (HIT, FETCH, FORCED_FETCH):
                used.add(x)
            codes.append(code)
            subs.append(sub)

        clock = self.link.sync_fetches(t1, fetched, step)
        hits = codes.count(HIT)
        forced = codes.count(FORCED_FETCH)
        fetches = codes.count(FETCH) + forced
        substitutions = codes.count(SUBSTITUTE)
        cpu_calls = codes.count(CPU)
        stall = clock - t1
        gpu_us = (hits + fetches + substitutions) * self._gpu_expert_us[layer]
        cpu_us = cpu_calls * self._cpu_expert_us[layer]
        end = clock + max(gpu_us, cpu_us)
        self._trim(self._pool_of_layer[layer], used)
        self._prefetch(chunk, row, layer, t1, step)
        self.clock_us = end

        lc = self.layer_counts[layer]
        lc[LayerCount.CALLS] += len(xs)
        lc[LayerCount.HITS] += hits
        lc[LayerCount.FETCHES] += fetches
        lc[LayerCount.FORCED_FETCHES] += forced
        lc[LayerCount.SUBSTITUTIONS] += substitutions
        lc[LayerCount.FIRST_CHOICE_SUBSTITUTIONS] += int(bool(codes) and codes[0] == SUBSTITUTE)
        lc[LayerCount.CPU_CALLS] += cpu_calls
        self.layer_sums[layer, LayerSum.MASS] += mass
        self.mass_hist[min(int(mass * MASS_BINS), MASS_BINS)] += 1
        g = self._group
        g.stall_us += stall
        g.mass += mass
        for name, n in zip(_GROUP_COUNTS, (hits, fetches, substitutions, cpu_calls), strict=True):
            g.counts[name] += n
        return self._end_step(layer, StepDecision(
            experts=[x - base for x in xs], codes=codes, substitutes=subs, mass=mass,
            start_us=t0, stall_us=stall, end_us=end))

    def prefill_step(self, layer: int, experts, next_use=None) -> StepDecision:
        """One prefill group at one layer: every unique selected expert is looked up once.

        ``experts``: int[n, k] selected experts of the group's tokens; ``next_use``: int[n, k]
        next-use group ordinals (belady).
        """
        E = self.params.num_experts
        step, t0 = self._begin_step(layer, PHASE_PREFILL)
        base = layer * E
        rows = [[base + int(e) for e in row] for row in experts]
        for t, row in enumerate(rows):
            for i, x in enumerate(row):
                self._select(x, layer, step, t, None if next_use is None else next_use[t][i])
        unique = list(dict.fromkeys(x for row in rows for x in row))

        t1 = t0 + self._nonexpert_us[layer]
        self._expert_phase(t1, step, set(unique))
        fetched: list[int] = []
        codes = []
        for x in unique:
            if self.resident[x]:
                codes.append(HIT)
                self._used(x, step)
            else:
                codes.append(FETCH)
                self._fetch(x, step, t1, fetched)
        clock = self.link.sync_fetches(t1, fetched, step)
        stall = clock - t1
        end = clock + len(unique) * self._gpu_expert_us[layer]
        self._trim(self._pool_of_layer[layer], set(unique))
        self.clock_us = end

        hits = codes.count(HIT)
        self.count(RunCount.PREFILL_LOOKUPS, len(unique))
        self.count(RunCount.PREFILL_HITS, hits)
        g = self._group
        g.stall_us += stall
        g.counts["hits"] += hits
        g.counts["fetches"] += len(unique) - hits
        return self._end_step(layer, StepDecision(
            experts=[x - base for x in unique], codes=codes, substitutes=[-1] * len(unique),
            mass=0.0, start_us=t0, stall_us=stall, end_us=end))

    def end_group(self) -> None:
        """Close the group after its last layer and record its tokens."""
        g = self._group
        if g is None or g.next_layer != self.params.num_layers:
            raise RuntimeError("a group ends after its last layer")
        n = g.num_tokens
        time_us = self.clock_us - g.start_us
        tok = self._tokens
        tok["seq"] += g.seq
        tok["pos"] += g.pos
        tok["domain"] += g.domain
        tok["phase"] += [g.phase] * n
        if g.phase == PHASE_DECODE:
            tok["time_us"].append(time_us)
            tok["stall_us"].append(g.stall_us)
            tok["mass"].append(g.mass)
            for name, count in g.counts.items():
                tok[name].append(count)
        else:
            tok["time_us"] += [time_us / n] * n
            tok["stall_us"] += [g.stall_us / n] * n
            tok["mass"] += [0.0] * n
            for name, count in g.counts.items():  # the group's lookups, on its first token
                tok[name] += [count] + [0] * (n - 1)
        self._last_group = g.ordinal
        self._group = None

    def run_chunk(self, chunk: TraceChunk, next_use: np.ndarray | None = None) -> None:
        """Simulate every group of a chunk; ``next_use``: int32[T, L, k] rows (belady)."""
        L = self.params.num_layers
        has_logits = chunk.logits.shape[0] > 0
        T = chunk.num_tokens
        a = 0
        while a < T:
            b = a + 1
            while b < T and chunk.group[b] == chunk.group[a]:
                b += 1
            phase = int(chunk.phase[a])
            self.begin_group(phase, b - a, chunk.group[a], chunk.seq[a:b], chunk.pos[a:b],
                             chunk.domain[a:b])
            for layer in range(L):
                nu = None if next_use is None else next_use[a:b, layer]
                if phase == PHASE_DECODE:
                    self.decode_step(layer, chunk.experts[a, layer], chunk.gates[a, layer],
                                     chunk.logits[a, layer] if has_logits else None,
                                     None if nu is None else nu[0], chunk, a)
                else:
                    self.prefill_step(layer, chunk.experts[a:b, layer], nu)
            self.end_group()
            a = b

    def result(self):
        """The run's outputs so far (closed groups only; a simulator.metrics.SimResult)."""
        return build_result(self._tokens, self.layer_counts, self.layer_sums, self.run_counts,
                            self.mass_hist, self.clock_us)
