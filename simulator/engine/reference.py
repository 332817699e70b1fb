"""Plain-Python reference engine: docs/semantics.md, followed literally.

Slow and readable: eviction victims are found by scanning the pool instead of the kernel's
lists and heaps. It is the semantic twin of :mod:`simulator.engine.kernel` (the tests check
that both agree exactly), and the model emulator drives it one step at a time::

    sim = ReferenceSimulator(params, meta)
    sim.begin_group(PHASE_DECODE)
    for layer in range(L):
        decision = sim.decode_step(layer, experts, gates, logits)
    sim.end_group()
    result = sim.result()
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from simulator.engine.layout import frequency_fill, make_layout
from simulator.engine.params import (
    CPU,
    FETCH,
    FORCED_FETCH,
    HIT,
    MASS_BINS,
    MISS_ACTIONS,
    SUBSTITUTE,
    SUBSTITUTE_BY,
    SimParams,
    SimResult,
)
from simulator.policies.admission import accumulate_substituted
from simulator.policies.eviction import (
    BELADY,
    FIFO,
    LFU_RENORMALISE_ABOVE,
    LRU,
    NEVER_STEP,
    RANDOM,
    eviction_key,
    next_use_step,
    splitmix64,
)
from simulator.policies.miss_rule import fetch_on_miss
from traces.format import PHASE_DECODE, PHASE_PREFILL, TraceChunk, TraceMeta

TOKEN_FIELDS = (
    "seq", "pos", "phase", "domain", "time_us", "stall_us", "mass",
    "hits", "fetches", "substitutions", "cpu_calls",
)  # fmt: skip


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
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("hits", "fetches", "substitutions", "cpu_calls"), 0)
    )


class ReferenceSimulator:
    """The simulator state, advanced one group and one step at a time (docs/semantics.md).

    ``first_use``: for ``eviction=belady``, int32[L*E] group ordinal of each expert's first
    selection (``NEVER_GROUP`` for never); each step then needs its next-use rows.
    """

    def __init__(self, params: SimParams, meta: TraceMeta, first_use: np.ndarray | None = None):
        self.params = params
        self.layout = make_layout(params, meta)
        L, E = params.num_layers, params.num_experts
        X = L * E
        self._num_pools = len(self.layout.pool_budget_bytes)
        self._expert_bytes = [int(b) for b in params.expert_bytes]
        self._pool_of_layer = [int(p) for p in self.layout.pool_of_layer]
        self._budget = [int(b) for b in self.layout.pool_budget_bytes]
        self._pcie_us = [float(v) for v in self.layout.pcie_us]
        self._ssd_us = [float(v) for v in self.layout.ssd_us]
        self._nonexpert_us = [float(v) for v in params.nonexpert_us]
        self._gpu_expert_us = [float(v) for v in params.gpu_expert_us]
        self._cpu_expert_us = [float(v) for v in params.cpu_expert_us]

        # GPU cache
        self.resident = [False] * X
        self.members: list[list[int]] = [[] for _ in range(self._num_pools)]  # swap-removed
        self.pool_bytes = [0] * self._num_pools
        self._tick = 0  # orders uses and insertions for lru / fifo
        self._used_tick = [0] * X
        self._inserted_tick = [0] * X
        self.last_use = [0] * X  # step ordinal of the last use (lfu)
        self.freq = [0.0] * X
        self.inc = 1.0
        self.next_step = [NEVER_STEP] * X  # belady
        if first_use is not None:
            for x in range(X):
                self.next_step[x] = next_use_step(int(first_use[x]), x // E, L)
        self.rng_state = int(params.seed) % 2**64
        # background admission and the link
        self.acc = [0.0] * X
        self.queue: deque[tuple[int, float]] = deque()  # (x, enqueue time)
        self.completions: deque[tuple[float, int]] = deque()  # (end time, x)
        self.pending: set[int] = set()  # queued or in flight
        self.link_free_us = 0.0
        self.clock_us = 0.0
        # host RAM tier: x -> None, least recently used first
        self.ram: OrderedDict[int, None] = OrderedDict()
        self.ram_bytes = 0

        self.counters = dict.fromkeys(
            (
                "prefill_lookups",
                "prefill_hits",
                "bytes_fetched",
                "background_bytes",
                "background_admissions",
                "background_enqueued",
                "ssd_reads",
                "evictions",
            ),
            0,
        )
        self.layer_counts = {
            name: [0] * L
            for name in (
                "calls",
                "hits",
                "fetches",
                "forced_fetches",
                "substitutions",
                "first_choice_substitutions",
                "cpu_calls",
                "background_admissions",
            )
        }
        self.layer_mass = [0.0] * L
        self.mass_hist = [0] * (MASS_BINS + 1)
        self._tokens: dict[str, list] = {name: [] for name in TOKEN_FIELDS}
        self._group: _Group | None = None
        self._last_group = -1

    # ---- cache -------------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _pool(self, x: int) -> int:
        return self._pool_of_layer[x // self.params.num_experts]

    def _bytes(self, x: int) -> int:
        return self._expert_bytes[x // self.params.num_experts]

    def _use(self, x: int, step: int) -> None:
        self._used_tick[x] = self._next_tick()
        self.last_use[x] = step

    def _insert(self, x: int, step: int) -> None:
        """Make x resident; an insertion is a use."""
        p = self._pool(x)
        self.resident[x] = True
        self.members[p].append(x)
        self.pool_bytes[p] += self._bytes(x)
        self._inserted_tick[x] = self._next_tick()
        self._use(x, step)

    def _evict(self, x: int) -> None:
        p = self._pool(x)
        members = self.members[p]
        i = members.index(x)
        members[i] = members[-1]
        members.pop()
        self.resident[x] = False
        self.pool_bytes[p] -= self._bytes(x)
        self.counters["evictions"] += 1

    def _victim(self, p: int, pinned: set[int]) -> int:
        """The next victim of pool p: policy order among unpinned residents, else among all."""
        members = self.members[p]
        eviction = self.params.eviction
        if eviction == RANDOM:
            self.rng_state, z = splitmix64(self.rng_state)
            n = len(members)
            j = z % n
            for d in range(n):
                y = members[(j + d) % n]
                if y not in pinned:
                    return y
            return members[j]
        candidates = [y for y in members if y not in pinned] or members
        if eviction == LRU:
            return min(candidates, key=lambda y: self._used_tick[y])
        if eviction == FIFO:
            return min(candidates, key=lambda y: self._inserted_tick[y])
        return min(
            candidates,
            key=lambda y: (
                *eviction_key(eviction, self.freq[y], self.last_use[y], self.next_step[y]),
                y,
            ),
        )

    def _trim(self, p: int, pinned: set[int]) -> None:
        while self.pool_bytes[p] > self._budget[p]:
            self._evict(self._victim(p, pinned))

    def _select(self, x: int, layer: int, next_group: int | None) -> None:
        """A router selection: frequency and (belady) next use advance."""
        self.freq[x] += self.inc
        if next_group is not None:
            self.next_step[x] = next_use_step(int(next_group), layer, self.params.num_layers)
        elif self.params.eviction == BELADY:
            raise ValueError("eviction=belady needs next-use rows for every step")

    def _substitute(self, layer: int, selected: list[int], substituted: set[int], logits) -> int:
        """The eligible resident of the layer with the highest score (ties: lower id), or -1."""
        E = self.params.num_experts
        base = layer * E
        if self.params.substitute_by == SUBSTITUTE_BY["logit"]:
            if logits is None:
                raise ValueError("substitute_by=logit needs the step's router logits")
            scores = [float(v) for v in logits]
        else:
            scores = self.freq[base : base + E]
        best, best_score = -1, 0.0
        for e in range(E):
            x = base + e
            if self.resident[x] and x not in selected and x not in substituted:
                if best < 0 or scores[e] > best_score:
                    best, best_score = x, scores[e]
        return best

    # ---- link and host tiers -----------------------------------------------------------

    def _transfer_us(self, x: int) -> float:
        """Duration of one transfer of x; the source read updates the host RAM tier."""
        layer = x // self.params.num_experts
        ram_budget = self.params.host_ram_budget_bytes
        if ram_budget < 0:
            return self._pcie_us[layer]
        if x in self.ram:
            self.ram.move_to_end(x)
            return self._pcie_us[layer]
        self.counters["ssd_reads"] += 1
        size = self._expert_bytes[layer]
        while self.ram and self.ram_bytes + size > ram_budget:
            y, _ = self.ram.popitem(last=False)
            self.ram_bytes -= self._bytes(y)
        if self.ram_bytes + size <= ram_budget:
            self.ram[x] = None
            self.ram_bytes += size
        return self._ssd_us[layer] + self._pcie_us[layer]

    def _advance_link(self, t: float) -> None:
        """Start queued background transfers that can begin before t."""
        while self.queue and self.link_free_us < t:
            x, enqueued_us = self.queue[0]
            if self.resident[x]:
                self.queue.popleft()
                self.pending.discard(x)
                continue
            start = max(self.link_free_us, enqueued_us)
            if start >= t:
                break
            self.queue.popleft()
            end = start + self._transfer_us(x)
            self.link_free_us = end
            self.counters["bytes_fetched"] += self._bytes(x)
            self.counters["background_bytes"] += self._bytes(x)
            self.completions.append((end, x))

    def _sync_fetch(self, clock_us: float, x: int, step: int) -> float:
        """Fetch x on the critical path starting at clock_us; returns the clock after it."""
        self._advance_link(clock_us)
        start = max(clock_us, self.link_free_us)
        end = start + self._transfer_us(x)
        self.link_free_us = end
        self.counters["bytes_fetched"] += self._bytes(x)
        self._insert(x, step)
        return end

    def _apply_completions(self, t0: float, step: int) -> None:
        while self.completions and self.completions[0][0] <= t0:
            _, x = self.completions.popleft()
            self.pending.discard(x)
            if self.resident[x]:
                continue
            self._insert(x, step)
            self._trim(self._pool(x), pinned={x})
            self.counters["background_admissions"] += 1
            self.layer_counts["background_admissions"][x // self.params.num_experts] += 1

    # ---- groups and steps --------------------------------------------------------------

    def warm(self, counts: np.ndarray) -> None:
        """init=frequency: fill each pool by the warm-up tokens' selection counts (int64[L*E])."""
        counts = np.asarray(counts, dtype=np.int64)
        self.freq = [float(c) for c in counts]
        for fill in frequency_fill(counts, self.params, self.layout):
            for i in reversed(range(len(fill))):  # most frequent inserted last: most recent
                self._insert(int(fill[i]), -1 - i)

    def begin_group(
        self,
        phase: int,
        num_tokens: int = 1,
        group: int | None = None,
        seq=None,
        pos=None,
        domain=None,
    ) -> None:
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

        def per_token(values):
            return [-1] * num_tokens if values is None else [int(v) for v in values]

        self._group = _Group(
            phase=int(phase),
            num_tokens=num_tokens,
            ordinal=ordinal,
            start_us=self.clock_us,
            seq=per_token(seq),
            pos=per_token(pos),
            domain=per_token(domain),
        )

    def _begin_step(self, layer: int, phase: int) -> tuple[int, float]:
        g = self._group
        if g is None or g.phase != phase:
            raise RuntimeError("begin_group() with this step's phase first")
        if layer != g.next_layer:
            raise ValueError(f"layers run in order; expected layer {g.next_layer}, got {layer}")
        g.next_layer += 1
        step = g.ordinal * self.params.num_layers + layer
        t0 = self.clock_us
        self._advance_link(t0)
        self._apply_completions(t0, step)
        return step, t0

    def decode_step(self, layer: int, experts, gates, logits=None, next_use=None) -> StepDecision:
        """One decode token at one layer.

        ``experts``: int[k] selected expert ids (rank order); ``gates``: float[k] normalised gate
        weights; ``logits``: float[E] router logits (needed for substitute_by=logit);
        ``next_use``: int[k] next-use group ordinals (belady).
        """
        p = self.params
        E = p.num_experts
        step, t0 = self._begin_step(layer, PHASE_DECODE)
        base = layer * E
        xs = [base + int(e) for e in experts]
        gs = [float(g) for g in gates]
        for i, x in enumerate(xs):
            self._select(x, layer, None if next_use is None else next_use[i])

        t1 = t0 + self._nonexpert_us[layer]
        clock = t1
        used: set[int] = set()
        substituted: set[int] = set()
        codes, subs = [], []
        mass = 0.0
        for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
            sub = -1
            if self.resident[x]:
                code = HIT
                self._use(x, step)
            elif fetch_on_miss(i, g, p.protect_ranks, p.tau):
                code = FETCH
            elif p.miss_action == MISS_ACTIONS["cpu"]:
                code = CPU
            else:
                y = self._substitute(layer, xs, substituted, logits)
                if y < 0:
                    code = FORCED_FETCH
                else:
                    code = SUBSTITUTE
                    sub = y - base
                    substituted.add(y)
                    used.add(y)
                    self._use(y, step)
                    mass += g
                    self.acc[x], admit = accumulate_substituted(self.acc[x], g, p.beta)
                    if admit and x not in self.pending:
                        self.pending.add(x)
                        self.queue.append((x, t1))
                        self.counters["background_enqueued"] += 1
            if code in (FETCH, FORCED_FETCH):
                clock = self._sync_fetch(clock, x, step)
            if code in (HIT, FETCH, FORCED_FETCH):
                used.add(x)
            codes.append(code)
            subs.append(sub)

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
        self.clock_us = end

        lc = self.layer_counts
        lc["calls"][layer] += len(xs)
        lc["hits"][layer] += hits
        lc["fetches"][layer] += fetches
        lc["forced_fetches"][layer] += forced
        lc["substitutions"][layer] += substitutions
        lc["first_choice_substitutions"][layer] += int(bool(codes) and codes[0] == SUBSTITUTE)
        lc["cpu_calls"][layer] += cpu_calls
        self.layer_mass[layer] += mass
        self.mass_hist[min(int(mass * MASS_BINS), MASS_BINS)] += 1
        g = self._group
        g.stall_us += stall
        g.mass += mass
        for name, n in (
            ("hits", hits),
            ("fetches", fetches),
            ("substitutions", substitutions),
            ("cpu_calls", cpu_calls),
        ):
            g.counts[name] += n
        return StepDecision(
            experts=[x - base for x in xs],
            codes=codes,
            substitutes=subs,
            mass=mass,
            start_us=t0,
            stall_us=stall,
            end_us=end,
        )

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
                self._select(x, layer, None if next_use is None else next_use[t][i])
        unique = list(dict.fromkeys(x for row in rows for x in row))

        t1 = t0 + self._nonexpert_us[layer]
        clock = t1
        codes = []
        for x in unique:
            if self.resident[x]:
                codes.append(HIT)
                self._use(x, step)
            else:
                codes.append(FETCH)
                clock = self._sync_fetch(clock, x, step)
        stall = clock - t1
        end = clock + len(unique) * self._gpu_expert_us[layer]
        self._trim(self._pool_of_layer[layer], set(unique))
        self.clock_us = end

        hits = codes.count(HIT)
        self.counters["prefill_lookups"] += len(unique)
        self.counters["prefill_hits"] += hits
        g = self._group
        g.stall_us += stall
        g.counts["hits"] += hits
        g.counts["fetches"] += len(unique) - hits
        return StepDecision(
            experts=[x - base for x in unique],
            codes=codes,
            substitutes=[-1] * len(unique),
            mass=0.0,
            start_us=t0,
            stall_us=stall,
            end_us=end,
        )

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
            self.begin_group(
                phase, b - a, chunk.group[a], chunk.seq[a:b], chunk.pos[a:b], chunk.domain[a:b]
            )
            for layer in range(L):
                nu = None if next_use is None else next_use[a:b, layer]
                if phase == PHASE_DECODE:
                    self.decode_step(
                        layer,
                        chunk.experts[a, layer],
                        chunk.gates[a, layer],
                        chunk.logits[a, layer] if has_logits else None,
                        None if nu is None else nu[0],
                    )
                else:
                    self.prefill_step(layer, chunk.experts[a:b, layer], nu)
            self.end_group()
            a = b

    def result(self) -> SimResult:
        """The run's outputs so far (closed groups only)."""
        tok = self._tokens
        lc = self.layer_counts

        def layer(name):
            return np.array(lc[name], dtype=np.int64)

        return SimResult(
            seq=np.array(tok["seq"], dtype=np.int32),
            pos=np.array(tok["pos"], dtype=np.int32),
            phase=np.array(tok["phase"], dtype=np.int8),
            domain=np.array(tok["domain"], dtype=np.int16),
            time_us=np.array(tok["time_us"], dtype=np.float64),
            stall_us=np.array(tok["stall_us"], dtype=np.float64),
            mass=np.array(tok["mass"], dtype=np.float64),
            hits=np.array(tok["hits"], dtype=np.int32),
            fetches=np.array(tok["fetches"], dtype=np.int32),
            substitutions=np.array(tok["substitutions"], dtype=np.int32),
            cpu_calls=np.array(tok["cpu_calls"], dtype=np.int32),
            layer_calls=layer("calls"),
            layer_hits=layer("hits"),
            layer_fetches=layer("fetches"),
            layer_forced_fetches=layer("forced_fetches"),
            layer_substitutions=layer("substitutions"),
            layer_first_choice_substitutions=layer("first_choice_substitutions"),
            layer_cpu_calls=layer("cpu_calls"),
            layer_mass=np.array(self.layer_mass, dtype=np.float64),
            layer_background_admissions=layer("background_admissions"),
            mass_hist=np.array(self.mass_hist, dtype=np.int64),
            sim_end_us=self.clock_us,
            **self.counters,
        )
