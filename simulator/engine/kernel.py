"""Numba engine: the steps of docs/semantics.md as one loop over the policies' hooks.

:func:`_run_chunk` is written once and compiled per choice of policy variants
(:func:`simulator.jit.specialise`): the names ``eviction``, ``miss_rule``, ``miss_action``,
``substitute`` and ``admission`` in its body are bound to the chosen modules of
:mod:`simulator.policies`, so every hook call is a direct call and the hot loop holds no branch
on a policy. State lives in the named containers of :mod:`simulator.engine.state` and
:mod:`simulator.engine.link`; :class:`KernelSimulator` is the thin Python wrapper that owns them
between chunks.
"""
from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import numpy as np

from simulator.engine.layout import Layout, frequency_fill, make_layout
from simulator.engine.link import (
    Q_LEN,
    advance_inline,
    make_link_state,
    next_completion,
    sync_fetches,
    untiered,
)
from simulator.engine.params import CPU, SimParams
from simulator.engine.state import (
    BUDGET,
    BYTES,
    CLOCK,
    FRESH,
    FRESH_SELECTED,
    INC,
    NO_STAMP,
    PREFETCH,
    PREFILL_FETCH_BYTES,
    STAMP,
    bin_masses,
    drop,
    kernel_array,
    list_resident,
    make_consts,
    make_core_state,
    make_resident,
    step_stamp,
    unlist_resident,
    used,
    wasted_background,
)
from simulator.jit import ix, jit, specialise
from simulator.metrics import (
    TOKEN,
    TOKEN_IDS,
    LayerCount,
    LayerSum,
    RunCount,
    build_result,
)
from simulator.policies import KernelNeeds, chosen, kernel_needs, modules
from traces.format import PHASE_DECODE, TraceChunk, TraceMeta

# The policy modules the kernels call, and the kernel's inlined steps; bound per compiled kernel by
# simulator.jit.specialise.
eviction = miss_rule = miss_action = substitute = admission = predictor = prefetch = None
_trim_step = _fetch_step = _use_step = _fresh_step = None
# What the chosen variants read (simulator.policies.KernelNeeds), bound per kernel: whether
# selections are counted in core.freq, whether a decode step runs its selection pass before its
# rank loop (else the pass runs at the step's first background arrival, if one comes, and
# otherwise each lookup counts and marks its expert as the rank loop reaches it), whether the
# layers' resident lists are kept, whether anything queues background transfers (else the queue,
# its completions and the use of background arrivals are never looked at), and whether the miss
# rule can leave a miss unfetched (else every miss is fetched without reading its gate), and
# whether the trim reads the marks each lookup leaves where the step was not marked before.
TRACK_FREQUENCY = SELECT_BEFORE_USE = LIST_RESIDENTS = BACKGROUND = LEAVES_MISSES = MARK_LOOKUPS = True
# Whether a prefetch variant can queue transfers (else no queued transfer is a prefetch that a
# miss would find late)
PREFETCHES = True
# Whether a decode step's trim can never reach a resident marked in the step (an eviction whose
# used residents are its last victims, every pool holding k experts: KernelNeeds.lookup_marks
# false): it then passes NO_STAMP, and a victim need not be tested for a mark.
UNMARKED_DECODE = False
# Whether the eviction tells a step's used residents by their last use (KernelNeeds.step_marks):
# its trims are passed the step (state.step_stamp) and no lookup is marked for them. Before a
# step's first background arrival, the selections' last use becomes the step (the arrival's trim
# must not evict them, and a fresh one among them becomes state.FRESH_SELECTED); an arrival is
# inserted (its last use: the step) and, after its own trim, FRESH_SELECTED if selected, else
# FRESH, which the victim search reads as not used in the step.
STEP_MARKS = False

# lfu_decay multiplies frequencies by d once per group as a growing increment (inc /= d); past
# this the increment and all frequencies are divided by it
LFU_RENORMALISE_ABOVE = 1e100


class Chunk(NamedTuple):
    """One chunk's arrays as the kernel reads them: T tokens, L layers, k ranks, E experts."""

    experts: np.ndarray  # int16[T, L, k] (the trace's type: E <= 2**15 - 1)
    gates: np.ndarray  # float32[T, L, k]: normalised gate weights
    logits: np.ndarray  # float32[T, L, E], or [0, L, E] without logits or with logit_bits
    logit_bits: np.ndarray  # uint16[T, L, E]: the float16 logits' bits as stored, or [0, L, E]
    group: np.ndarray  # int64[T]
    phase: np.ndarray  # int8[T]
    next_use: np.ndarray  # int32[T, L, k] next-use group ordinals (belady), or [0, L, k]
    lookahead_ids: np.ndarray  # int32[T, L, D, R] look-ahead routing by logit, or [0, L, 0, 0]
    logit_order: np.ndarray  # int16[T, L, R] ids of the R highest unselected logits (ties: lower id), or [0, L, 0]


class TokenOut(NamedTuple):
    """Per-token outputs [T] (simulator.metrics.TOKEN)."""

    time_us: np.ndarray
    stall_us: np.ndarray
    mass: np.ndarray
    hits: np.ndarray
    fetches: np.ndarray
    substitutions: np.ndarray
    cpu_calls: np.ndarray


def _trim(core, ev, c, p, stamp):
    """Evict from pool p down to its budget: victims in the policy's order, residents marked
    ``stamp`` (used in the step, or the expert being admitted) last."""
    while core.pools[p, BYTES] > core.pools[p, BUDGET]:
        x = ix(eviction.victim(core, ev, c, p, stamp))
        if LIST_RESIDENTS:
            unlist_resident(core, x, c.layer_of[x])
        if BACKGROUND:
            drop(core, c, x, p)
        else:  # no background arrival: nothing resident is fresh (drop's other half)
            core.resident[x] = 0
            size = c.pool_expert_bytes[p]  # the victim's size without a load of its layer
            if size == 0:  # the pool's layers differ in size
                size = c.expert_bytes[ix(c.layer_of[x])]
            core.pools[p, BYTES] -= size
    eviction.end_trim(core, ev, c, p)


def _fetch(core, c, link, ev, x, layer, p, s, t1, n_fetch):
    """Decide a synchronous fetch of x: it is resident at once (its transfer is timed with the
    step's other fetches, simulator.engine.link.sync_fetches); returns the step's fetch count."""
    link.fetch_x[ix(n_fetch)] = x
    if BACKGROUND:
        make_resident(core, c, x, layer, p)
    else:  # no background arrival: every resident came on demand (src stays DEMAND, 0), none fresh
        core.resident[x] = 1
        core.pools[p, BYTES] += c.expert_bytes[layer]
    if LIST_RESIDENTS:
        list_resident(core, x, layer)
    eviction.on_insert(core, ev, c, x, p, s)
    return n_fetch + 1


def _use(core, ev, c, y, p, s):
    """Step marks: y is selected in step s, resident or not; its last use is the step, and a
    fresh arrival kept by the trims stays fresh until its hit, now as a selected one."""
    eviction.on_use(core, ev, c, y, p, s)
    if core.fresh[y] == FRESH:
        core.fresh[y] = FRESH_SELECTED


@jit(allocates=False, inline=True)
def _no_fresh(core, st, c, x, p):
    """An eviction's optional ``on_fresh`` where it has none."""


def _run_chunk(ch, c, core, link, ev, rule, act, sub, adm, pr, pf, out):
    """Simulate every group of one chunk, updating the state in place (docs/semantics.md).

    ``ch``: Chunk; ``c``: Consts; ``core``: CoreState; ``link``: LinkState; ``ev``, ``rule``,
    ``act``, ``sub``, ``adm``, ``pr`` (predictor), ``pf`` (prefetch): the chosen variants'
    states; ``out``: TokenOut.
    """
    experts, gates, group, phase = ch.experts, ch.gates, ch.group, ch.phase
    T, L, K = experts.shape
    E = c.num_experts
    X = L * E
    lc, lsum, rc = core.layer_counts, core.layer_sums, core.run_counts
    # the clock and the step stamp live in locals during the chunk (no hook reads them from the
    # state) and are stored back at its end
    clock_us = core.fstate[CLOCK]
    stamp = core.istate[STAMP]
    n_mass = 0  # step masses buffered in core.mass_buf
    a = 0
    while a < T:
        g = group[a]
        b = a + 1
        while b < T and group[b] == g:
            b += 1
        decode = phase[a] == PHASE_DECODE
        ua = ix(a)  # a and the token ids below index without the negative wrap (simulator.jit.ix)
        inc = core.fstate[INC]
        if TRACK_FREQUENCY:
            inc = inc / c.lfu_decay
            if inc > LFU_RENORMALISE_ABOVE:
                for x in range(X):
                    core.freq[x] = core.freq[x] / inc
                inc = inc / inc
                eviction.on_rescale(core, ev, c)
            core.fstate[INC] = inc
        eviction.on_group(core, ev, c, ch, a, b)
        group_start = clock_us
        clock_us += c.token_fixed_us
        group_stall = 0.0
        group_mass = 0.0
        group_hits = 0
        group_fetches = 0
        group_substitutions = 0
        group_cpu_calls = 0

        for layer in range(L):
            s = g * L + layer
            base = layer * E
            p = ix(c.pool_of_layer[layer])
            t0 = clock_us
            stamp += 1

            # selections: frequency and the policy's view advance; selected experts are marked
            # (a prefill step's unique experts listed). Without SELECT_BEFORE_USE nothing reads
            # them before the step's first background arrival, or else before its trim: a decode
            # step then runs the pass at that arrival, or counts and marks each lookup's expert
            # as the rank loop reaches it (a decode step's k selections are distinct).
            n_unique = 0
            counted = SELECT_BEFORE_USE or not decode  # the pass ran (decode: lazily, below)
            if counted:
                for t in range(a, b):
                    for i in range(K):
                        x = ix(base + experts[ix(t), layer, i])
                        if TRACK_FREQUENCY:
                            core.freq[x] += inc
                        eviction.on_select(core, ev, c, ch, t, layer, i, x, p, s)
                        if core.mark[x] != stamp:
                            core.mark[x] = stamp
                            if not decode:
                                core.uniq[n_unique] = x
                                n_unique += 1

            t1 = t0 + c.nonexpert_us[layer]
            # the expert phase starts: background transfers completed by t1 become resident,
            # each admitted expert evicted after every other resident not selected in the step
            # (all of it under the constant: Numba drops the block, and the trim inlined in it,
            # from the kernels without background transfers before it compiles them)
            x, source = -1, 0
            stored = False
            if BACKGROUND:
                if link.qstate[Q_LEN] > 0:
                    advance_inline(core.resident, rc, link, t1, s)
                x, source = next_completion(link, t1)
                while x >= 0:
                    if not counted:  # the step's selections, before its first arrival's trim
                        for i in range(K):
                            y = ix(base + experts[ua, layer, i])
                            if TRACK_FREQUENCY:
                                core.freq[y] += inc
                            core.mark[y] = stamp
                            if STEP_MARKS:
                                _use_step(core, ev, c, y, p, s)
                        counted = True
                        stored = True
                    if STEP_MARKS and not stored:  # the selections' last use (the pass ran before)
                        for j in range(K if decode else n_unique):
                            y = ix(base + experts[ua, layer, j]) if decode else ix(core.uniq[j])
                            _use_step(core, ev, c, y, p, s)
                        stored = True
                    lx = ix(c.layer_of[x])
                    if core.resident[x]:  # fetched meanwhile: the copy served nothing
                        wasted_background(rc, source, c.expert_bytes[lx])
                    else:
                        px = c.pool_of_layer[lx]
                        selected = core.mark[x] == stamp
                        if not STEP_MARKS:
                            core.mark[x] = stamp
                        make_resident(core, c, x, lx, px)
                        if LIST_RESIDENTS:
                            list_resident(core, x, lx)
                        core.src[x] = source
                        if not STEP_MARKS:
                            core.fresh[x] = FRESH
                        eviction.on_insert(core, ev, c, x, px, s)
                        if core.pools[px, BYTES] > core.pools[px, BUDGET]:
                            _trim_step(core, ev, c, px, step_stamp(s) if STEP_MARKS else stamp)
                        if STEP_MARKS:  # last used in the step: kept by its own trim, then fresh
                            if not core.resident[x]:  # its own trim evicted it (all else was kept)
                                wasted_background(rc, source, c.expert_bytes[lx])
                            elif selected:
                                core.fresh[x] = FRESH_SELECTED
                            else:
                                core.fresh[x] = FRESH
                                _fresh_step(core, ev, c, x, px)
                        elif not selected:  # it may serve as a substitute in this step
                            core.mark[x] = stamp - 1
                        rc[RunCount.BACKGROUND_ADMISSIONS] += 1
                        lc[lx, LayerCount.BACKGROUND_ADMISSIONS] += 1
                    x, source = next_completion(link, t1)
            if decode:
                hits = 0
                fetches = 0
                forced = 0
                substitutions = 0
                cpu_calls = 0
                m = 0.0
                n_cand = -1
                next_cand = 0
                n_fetch = 0
                for i in range(K):
                    x = ix(base + experts[ua, layer, i])
                    if not counted:
                        if TRACK_FREQUENCY:
                            core.freq[x] += inc
                        if MARK_LOOKUPS:
                            core.mark[x] = stamp
                    if core.resident[x]:
                        hits += 1
                        eviction.on_use(core, ev, c, x, p, s)
                        if BACKGROUND:
                            used(core, x)
                        continue
                    if PREFETCHES and link.pending[x] == PREFETCH:
                        rc[RunCount.LATE_PREFETCHES] += 1
                    if LEAVES_MISSES:
                        gate = np.float64(gates[ua, layer, i])
                        if not miss_rule.fetch(rule, i, gate):
                            if miss_action.serve(act, i, gate) == CPU:
                                cpu_calls += 1
                                continue
                            y, n_cand, next_cand = substitute.choose(
                                core, sub, c, ch, ua, layer, K - i, stamp, n_cand, next_cand)
                            if y >= 0:
                                y = ix(y)
                                substitutions += 1
                                if i == 0:
                                    lc[layer, LayerCount.FIRST_CHOICE_SUBSTITUTIONS] += 1
                                core.mark[y] = stamp
                                eviction.on_use(core, ev, c, y, p, s)
                                if BACKGROUND:
                                    used(core, y)
                                m += gate
                                admission.on_substitute(core, adm, c, link, x, gate, t1)
                                continue
                            forced += 1
                    fetches += 1
                    n_fetch = _fetch_step(core, c, link, ev, x, layer, p, s, t1, n_fetch)
                clock = sync_fetches(core.resident, core.run_counts, link, t1, n_fetch, s, layer)
                stall = clock - t1
                if LEAVES_MISSES:
                    gpu_phase = (hits + fetches + substitutions) * c.gpu_expert_us[layer]
                    cpu_phase = cpu_calls * c.cpu_expert_us[layer]
                    end = clock + max(gpu_phase, cpu_phase)
                else:  # every call a hit or a fetch: k experts on the GPU
                    end = clock + c.decode_gpu_us[layer]
                # calls (k per step), hits (the calls left), the mass histogram's zero-mass
                # steps and, without a host-RAM tier, the fetches' bytes are completed from the
                # decode steps by derived_counts
                lc[layer, LayerCount.FETCHES] += fetches
                if forced:
                    lc[layer, LayerCount.FORCED_FETCHES] += forced
                if substitutions:
                    lc[layer, LayerCount.SUBSTITUTIONS] += substitutions
                if cpu_calls:
                    lc[layer, LayerCount.CPU_CALLS] += cpu_calls
                if m > 0.0:
                    lsum[layer, LayerSum.MASS] += m
                    core.mass_buf[ix(n_mass)] = m  # binned in batches (state.MASS_BUFFER)
                    n_mass += 1
                    if n_mass == core.mass_buf.shape[0]:
                        bin_masses(core.mass_hist, core.mass_buf, n_mass)
                        n_mass = 0
                group_mass += m
                group_substitutions += substitutions
                group_cpu_calls += cpu_calls
            else:
                # prefill: each unique expert looked up once, misses fetched
                hits = 0
                n_fetch = 0
                for j in range(n_unique):
                    x = ix(core.uniq[j])
                    if core.resident[x]:
                        hits += 1
                        eviction.on_use(core, ev, c, x, p, s)
                        used(core, x)
                    else:
                        n_fetch = _fetch_step(core, c, link, ev, x, layer, p, s, t1, n_fetch)
                clock = sync_fetches(core.resident, core.run_counts, link, t1, n_fetch, s, layer)
                fetches = n_unique - hits
                core.istate[PREFILL_FETCH_BYTES] += fetches * c.expert_bytes[layer]
                stall = clock - t1
                end = clock + n_unique * c.gpu_expert_us[layer]
                rc[RunCount.PREFILL_LOOKUPS] += n_unique
                rc[RunCount.PREFILL_HITS] += hits
            if core.pools[p, BYTES] > core.pools[p, BUDGET]:
                # one call site: Numba compiles an inlined function again at each
                _trim_step(core, ev, c, p, step_stamp(s) if STEP_MARKS
                           else (NO_STAMP if UNMARKED_DECODE and decode else stamp))
            if decode:
                if pf.top_p > 0 and layer + pf.distance < L:
                    n = predictor.predict(core, pr, c, ch, a, layer, pf.distance, pf.top_p, pf.buf)
                    prefetch.issue(core, pf, c, link, n, t1, s)
                predictor.observe(core, pr, c, ch, a, layer)
            clock_us = end
            group_stall += stall
            group_hits += hits
            group_fetches += fetches

        # per-token outputs; a prefill group's lookups are counted on its first token
        n = b - a
        group_time = clock_us - group_start
        for t in range(a, b):
            out.time_us[t] = group_time / n
            out.stall_us[t] = group_stall / n
            out.mass[t] = group_mass
            out.hits[t] = group_hits if t == a else 0
            out.fetches[t] = group_fetches if t == a else 0
            out.substitutions[t] = group_substitutions
            out.cpu_calls[t] = group_cpu_calls
        a = b
    bin_masses(core.mass_hist, core.mass_buf, n_mass)
    core.fstate[CLOCK] = clock_us
    core.istate[STAMP] = stamp


def _warm(fill, p, c, core, ev):
    """init=frequency: insert a pool's fill, least frequent first; last use -1 - fill index."""
    for i in range(fill.shape[0] - 1, -1, -1):
        x = fill[i]
        layer = x // c.num_experts
        make_resident(core, c, x, layer, p)
        if LIST_RESIDENTS:
            list_resident(core, x, layer)
        eviction.on_insert(core, ev, c, x, p, -1 - i)


class Kernels(NamedTuple):
    run_chunk: object
    warm: object


@functools.cache
def kernels(names: tuple[tuple[str, str], ...], needs: KernelNeeds, eviction: str | None = None) -> Kernels:
    """The kernels compiled for one choice of variants (``(family, variant)`` pairs) and what
    they read (``needs``: simulator.policies.kernel_needs); ``eviction``: the module whose hooks
    stand in for the eviction variant's (its ``kernel_hooks``), None: the variant's own."""
    chosen_modules = modules(dict(names))
    if eviction is not None:
        chosen_modules["eviction"] = importlib.import_module(eviction)
    bound = dict(chosen_modules, TRACK_FREQUENCY=bool(needs.frequency),
                 SELECT_BEFORE_USE=bool(needs.selections), LIST_RESIDENTS=bool(needs.layer_residents),
                 BACKGROUND=bool(needs.background), LEAVES_MISSES=bool(needs.leaves_misses),
                 MARK_LOOKUPS=bool(needs.lookup_marks or needs.selections),
                 PREFETCHES=bool(needs.prefetches))
    bound["UNMARKED_DECODE"] = not needs.lookup_marks and not needs.step_marks
    bound["STEP_MARKS"] = bool(needs.step_marks)
    steps = {"_trim_step": specialise(_trim, bound, inline=True),
             "_fetch_step": specialise(_fetch, bound, inline=True),
             "_use_step": specialise(_use, bound, inline=True),
             "_fresh_step": getattr(chosen_modules["eviction"], "on_fresh", _no_fresh)}
    return Kernels(specialise(_run_chunk, dict(bound, **steps)), specialise(_warm, bound))


class KernelSimulator:
    """Owns the kernel's state between chunks; feeds it one chunk at a time (same protocol as
    :class:`simulator.engine.reference.ReferenceSimulator`: ``warm``, ``run_chunk``, ``result``).
    ``layout``: the constants :func:`simulator.engine.check_params` derived for ``params``
    (else derived here).
    """

    def __init__(self, params: SimParams, meta: TraceMeta, first_use: np.ndarray | None = None,
                 layout: Layout | None = None, num_tokens: int | None = None):
        self.params = params
        self.layout = make_layout(params, meta) if layout is None else layout
        names = chosen(params)
        needs = kernel_needs(params, self.layout)
        mods = modules(names)
        # an eviction may run this choice with other hooks of the same victims (``kernel_hooks``)
        hooks = getattr(mods["eviction"], "kernel_hooks", None)
        hooks = hooks(params, self.layout, needs, num_tokens, first_use) if hooks is not None else None
        self.kernels = kernels(tuple(names.items()), needs, hooks[0].__name__ if hooks else None)
        self.num_tokens = num_tokens  # the most tokens run_chunk may see (the hooks' bound)
        self._seen_tokens = 0
        self.consts = make_consts(params, self.layout)
        self.core = make_core_state(params, self.layout)
        self.link = make_link_state(params, self.layout, background=needs.background)
        self.policy_states = (
            hooks[1] if hooks else mods["eviction"].make_state(params, self.layout, first_use),
            mods["miss_rule"].make_state(params),
            mods["miss_action"].make_state(params),
            mods["substitute"].make_state(params),
            mods["admission"].make_state(params),
            mods["predictor"].make_state(params, self.layout),
            mods["prefetch"].make_state(params),
        )
        L, E, K = params.num_layers, params.num_experts, params.top_k
        self._no_logits = np.zeros((0, L, E), np.float32)
        self._no_bits = np.zeros((0, L, E), np.uint16)
        self._no_next_use = np.zeros((0, L, K), np.int32)
        self._no_lookahead = np.zeros((0, L, 0, 0), np.int32)
        self._no_order = np.zeros((0, L, 0), np.int16)
        self._tokens: list[dict[str, np.ndarray]] = []
        self.decode_tokens = 0  # decode tokens run so far (derived_counts)
        self.warm_inserts = 0  # experts the warm-up made resident (derived_counts)
        self._ended = False  # result() hands the run's arrays over: no chunk after it

    @property
    def resident(self) -> np.ndarray:
        return self.core.resident

    def warm(self, counts: np.ndarray) -> None:
        """init=frequency: fill each pool by the warm-up tokens' selection counts (int64[L*E])."""
        counts = np.asarray(counts, dtype=np.int64)
        self.core.freq[:] = counts
        for p, fill in enumerate(frequency_fill(counts, self.params, self.layout)):
            self.kernels.warm(fill, p, self.consts, self.core, self.policy_states[0])
            self.warm_inserts += len(fill)

    def train_predictor(self, experts: np.ndarray, max_distance: int) -> None:
        """Train the prefetch predictor on the selections int[N, L, k] of its training tokens."""
        *others, predictor, prefetch = self.policy_states
        module = modules(chosen(self.params))["predictor"]
        self.policy_states = (*others, module.train(predictor, experts, max_distance), prefetch)

    def run_chunk(self, chunk: TraceChunk, next_use: np.ndarray | None = None) -> None:
        """Simulate every group of a chunk; ``next_use``: int32[T, L, k] rows (belady)."""
        if self._ended:
            raise RuntimeError("this simulator's run has ended: result() took its arrays")
        T = chunk.num_tokens
        self._seen_tokens += T
        if self.num_tokens is not None and (self._seen_tokens > self.num_tokens
                                            or (T and int(chunk.group[-1]) >= self.num_tokens)):
            raise RuntimeError(f"the run was set up for at most {self.num_tokens} tokens (groups below it); "
                               f"this chunk goes past them")
        out = TokenOut(*(np.empty(T, m.dtype) for m in TOKEN))
        logits, bits = self._no_logits, self._no_bits
        if chunk.logits.shape[0] and chunk.logits.dtype == np.float16:  # converted row by row
            bits = np.ascontiguousarray(chunk.logits).view(np.uint16)
        elif chunk.logits.shape[0]:
            logits = chunk.logits
        ch = Chunk(
            experts=kernel_array(chunk.experts, np.int16),
            gates=kernel_array(chunk.gates, np.float32),
            logits=kernel_array(logits, np.float32),
            logit_bits=kernel_array(bits, np.uint16),
            group=kernel_array(chunk.group, np.int64),
            phase=kernel_array(chunk.phase, np.int8),
            next_use=self._no_next_use if next_use is None else kernel_array(next_use, np.int32),
            lookahead_ids=(self._no_lookahead if chunk.lookahead_ids is None
                           else kernel_array(chunk.lookahead_ids, np.int32)),
            logit_order=(self._no_order if chunk.logit_order is None or chunk.logit_order.shape[0] != T
                         else kernel_array(chunk.logit_order, np.int16)),
        )
        self.kernels.run_chunk(ch, self.consts, self.core, self.link, *self.policy_states, out)
        self.decode_tokens += int(np.count_nonzero(ch.phase == PHASE_DECODE))
        tokens = out._asdict()
        for name in ("seq", "pos", "phase", "domain"):  # copies: the chunk's may be a trace cache's views
            tokens[name] = np.array(getattr(chunk, name))
        self._tokens.append(tokens)

    def result(self):
        """The run's outputs (a simulator.metrics.SimResult); this ends the run.

        The result takes the simulator's own arrays instead of copies (the per-token outputs of
        a one-chunk run, the 0.8 MB mass histogram: fresh memory costs about a millisecond per
        run on some hosts), so no chunk may follow."""
        self._ended = True
        tokens = {}
        for m in (*TOKEN_IDS, *TOKEN):
            parts = [t[m.name] for t in self._tokens]
            tokens[m.name] = parts[0] if len(parts) == 1 else np.concatenate(parts or [np.zeros(0)])
        core = self.core
        layer_counts, run_counts, zero_mass = derived_counts(
            core.layer_counts, core.run_counts, int(core.mass_hist.sum()), self.decode_tokens,
            self.params.top_k, self.warm_inserts - int(np.count_nonzero(core.resident)),
            self.consts.expert_bytes if untiered.py_func(self.link) else None,
            int(core.istate[PREFILL_FETCH_BYTES]))
        result = build_result(tokens, layer_counts, core.layer_sums, run_counts,
                              core.mass_hist, float(core.fstate[CLOCK]), own_mass_hist=True)
        result.mass_hist[0] += zero_mass
        return result


def derived_counts(layer_counts: np.ndarray, run_counts: np.ndarray, mass_steps: int, decode_tokens: int,
                   top_k: int, warm_minus_resident: int, fetch_bytes: np.ndarray | None = None,
                   prefill_fetch_bytes: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """The counters the kernel leaves to be derived, completed: every decode step of a layer
    makes k calls, each a hit, a fetch, a substitution or a CPU call; every expert made resident
    (warm-up, fetches, background arrivals) is resident now or was evicted
    (``warm_minus_resident``: the warm-up's experts less the residents now); without a host-RAM
    tier (``fetch_bytes``: each layer's expert bytes), the bytes of the synchronous fetches,
    which link.sync_fetches leaves uncounted: the decode steps' from their layers' fetch counts,
    the prefill steps' as the kernel summed them (``prefill_fetch_bytes``). Also the decode
    steps with no substituted mass, which belong in the mass histogram's first bin: the kernel
    records only the ``mass_steps`` others."""
    runs = run_counts.copy()
    if fetch_bytes is not None:
        runs[RunCount.BYTES_FETCHED] += (int(layer_counts[:, LayerCount.FETCHES] @ fetch_bytes)
                                         + prefill_fetch_bytes)
    runs[RunCount.EVICTIONS] = (warm_minus_resident + int(layer_counts[:, LayerCount.FETCHES].sum())
                                + runs[RunCount.PREFILL_LOOKUPS] - runs[RunCount.PREFILL_HITS]
                                + runs[RunCount.BACKGROUND_ADMISSIONS])
    counts = layer_counts.copy()
    calls = decode_tokens * top_k
    counts[:, LayerCount.CALLS] = calls
    counts[:, LayerCount.HITS] = calls - counts[:, LayerCount.FETCHES] - counts[:, LayerCount.SUBSTITUTIONS] \
        - counts[:, LayerCount.CPU_CALLS]
    return counts, runs, decode_tokens * layer_counts.shape[0] - mass_steps
