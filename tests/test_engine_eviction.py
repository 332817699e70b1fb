"""Eviction invariants: pools within budget between steps, and the kernel's lists, heaps,
resident arrays, host RAM tier and queues consistent with each other and with the reference."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
from engine_cases import assert_same, random_params, random_trace, run_both, trace
from engine_cases import params as make_params

from simulator.engine import link as K
from simulator.engine import simulate, warmup_counts
from simulator.engine import state as S
from simulator.engine import structures as D
from simulator.engine.kernel import KernelSimulator
from simulator.engine.nextuse import NextUseFile, after_group
from simulator.engine.reference import ReferenceSimulator
from simulator.policies import kernel_needs
from simulator.policies.eviction import REGISTRY as EVICTIONS
from simulator.policies.eviction import _belady_scan as BELADY_SCAN
from simulator.policies.eviction import _lfu_scan as LFU_SCAN
from simulator.policies.eviction import _lru_scan as LRU_SCAN
from traces.format import PHASE_DECODE, slice_chunk


def _groups(chunk):
    bounds = np.flatnonzero(np.diff(chunk.group, prepend=-1, append=-1)).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _walk(lists, p):
    """The entries of list p, head to tail, checking the back links."""
    link, ends = lists.link, lists.ends
    out, prev, x = [], -1, int(ends[D.HEAD, p])
    while x >= 0:
        assert link[D.PREV, x] == prev
        out.append(x)
        prev, x = x, int(link[D.NEXT, x])
    assert ends[D.TAIL, p] == prev
    return out


def check_kernel_state(sim: KernelSimulator) -> set[int]:
    """Assert the kernel's structures agree with each other; return the resident set."""
    p_ = sim.params
    L, E = p_.num_layers, p_.num_experts
    core, link, st = sim.core, sim.link, sim.policy_states[0]
    expert_bytes = np.asarray(p_.expert_bytes)
    residents = set(np.flatnonzero(core.resident).tolist())
    # per-layer resident lists, kept where a substitute can act (else never filled)
    for layer in range(L if kernel_needs(p_).layer_residents else 0):
        n = int(core.layer_res_n[layer])
        listed = core.layer_res[layer, :n].tolist()
        assert sorted(listed) == sorted(x for x in residents if x // E == layer)
        assert all(core.res_pos[x] == i for i, x in enumerate(listed))
    pool_of = sim.layout.pool_of_layer
    policy = EVICTIONS[p_.eviction]
    for p in range(core.pools.shape[0]):
        members = sorted(x for x in residents if pool_of[x // E] == p)
        assert core.pools[p, S.BYTES] == sum(int(expert_bytes[x // E]) for x in members)
        assert core.pools[p, S.BYTES] <= core.pools[p, S.BUDGET]
        if isinstance(st, D.Lists):
            assert sorted(_walk(st, p)) == members
            continue
        if isinstance(getattr(st, "pool", None), D.Packed):  # packed keys (kernel_hooks)
            off, n = int(sim.layout.pool_offset[p]), int(st.pool.count[p])
            keys = st.pool.keys[off : off + n]
            # lfu's bit 0: a fresh arrival; belady's step of the last use below the id
            shift = 1 if hasattr(st, "freq_shift") else getattr(st, "id_shift", 0)
            ids = ((keys >> shift) & ((1 << st.id_bits) - 1)).tolist()
            assert sorted(ids) == members
            assert all(st.pool.slot[x] == off + i for i, x in enumerate(ids))
            spare = st.pool.keys.shape[0] - 1
            assert all(st.pool.slot[x] == spare for x in range(L * E) if pool_of[x // E] == p and x not in members)
            assert (keys >= 0).all() and (keys < D.PACKED_FLAG).all()
            if hasattr(st, "freq_shift"):  # lfu: the count as stored is the count
                assert ((keys >> st.freq_shift) == core.freq[ids].astype(np.int64)).all()
                assert ((keys & 1) == 1).tolist() == (core.fresh[ids] == S.FRESH).tolist()  # arrivals left fresh
            elif hasattr(st, "far"):  # belady: the next use as stored is the next use
                assert ((keys >> st.far_shift) == st.far[ids]).all()
            else:  # lru: ordinals are unique
                assert len(set((keys >> st.id_bits).tolist())) == n
            continue
        order = st.heap if hasattr(st, "heap") else st.slots
        off, n = int(sim.layout.pool_offset[p]), int(order.count[p])
        items = order.items[off : off + n].tolist()
        held = st.held[off : off + int(st.n_held[p])].tolist() if hasattr(st, "held") else []
        assert sorted(items + held) == members  # a resident is in the heap or held out of it
        assert all(order.slot[x] == i for i, x in enumerate(items))
        if not hasattr(st, "heap"):
            continue
        h = st.heap
        keys = [(h.hkey1[off + i], h.hkey2[off + i], x) for i, x in enumerate(items)]
        for i in range(1, n):
            assert keys[(i - 1) // 2] < keys[i]  # heap order of the stored keys
        key1, key2 = policy.heap_keys(core, st)
        for k1, k2, x in keys:
            actual = (key1[x], key2[x], x)
            if policy.LAZY_KEYS:
                assert (k1, k2, x) <= actual  # lazily refreshed: never ahead of the real key
            else:
                assert (k1, k2, x) == actual
    # host RAM tier: a pinned and a pageable LRU list, their bytes, where[]
    for segment, held in ((K.PINNED, K.PINNED_BYTES), (K.PAGEABLE, K.PAGEABLE_BYTES)):
        listed = _walk(link.ram, segment - 1)
        assert sorted(listed) == np.flatnonzero(link.where == segment).tolist()
        assert link.qstate[held] == sum(int(expert_bytes[x // E]) for x in listed)
    if p_.host_pinned_budget_bytes >= 0:
        assert link.qstate[K.PINNED_BYTES] <= p_.host_pinned_budget_bytes
    if p_.host_ram_budget_bytes >= 0:
        assert link.qstate[K.PINNED_BYTES] + link.qstate[K.PAGEABLE_BYTES] <= p_.host_ram_budget_bytes
    # queued or in flight <=> pending
    cap = L * E
    st_ = link.qstate
    queued = [int(link.q_x[(st_[K.Q_HEAD] + i) % cap]) for i in range(st_[K.Q_LEN])]
    flying = [int(link.done_x[(st_[K.D_HEAD] + i) % cap]) for i in range(st_[K.D_LEN])]
    assert sorted(queued + flying) == np.flatnonzero(link.pending).tolist()
    assert 0 <= st_[K.Q_STAGED] <= st_[K.Q_LEN]
    return residents


@pytest.mark.parametrize("seed", range(24))
def test_kernel_structures_stay_consistent(seed):
    """Group by group, the kernel's structures hold and its residents equal the reference's."""
    rng = np.random.default_rng(3 * 10**6 + seed)
    source = random_trace(rng)
    p = random_params(rng, source.meta, eviction=list(EVICTIONS)[seed % len(EVICTIONS)])
    chunk = source.chunk
    with contextlib.ExitStack() as stack:
        last_warmup_group = -1
        counts = None
        if p.init == "frequency":
            counts, last_warmup_group = warmup_counts(source, p)
        next_use = None
        if p.eviction == "belady":
            next_use = stack.enter_context(NextUseFile(source, last_warmup_group))
        first_use = None if next_use is None else next_use.first_use
        fast = KernelSimulator(p, source.meta, first_use, num_tokens=source.num_tokens)
        slow = ReferenceSimulator(p, source.meta, first_use)
        if counts is not None:
            fast.warm(counts)
            slow.warm(counts)
        chunk = after_group(chunk, last_warmup_group)
        check_kernel_state(fast)
        for a, b in _groups(chunk):
            part = slice_chunk(chunk, a, b)
            rows = None if next_use is None else next_use.rows(a, b)
            fast.run_chunk(part, rows)
            slow.run_chunk(part, rows)
            residents = check_kernel_state(fast)
            assert residents == {x for x, r in enumerate(slow.resident) if r}


def _hooks(p, source):
    from simulator.engine.layout import make_layout

    layout = make_layout(p, source.meta)
    return EVICTIONS[p.eviction].kernel_hooks(p, layout, kernel_needs(p, layout), source.num_tokens)


SCANS = {"lfu": LFU_SCAN, "lru": LRU_SCAN, "belady": BELADY_SCAN}


@pytest.mark.parametrize("eviction", list(SCANS))
@pytest.mark.parametrize("seed", range(12))
def test_packed_keys_give_the_same_results(eviction, seed, monkeypatch):
    """Where lfu (undecayed), lru (with misses left to the miss action, nothing in the
    background) or belady (nothing in the background) runs on packed keys (small per-layer
    pools: their kernel_hooks), the results equal the reference's and those of the heap or
    lists, field by field, with every miss rule and action, admissions and prefetches (lfu),
    warm starts, prompts, chunks of any size and pools down to one expert (a trim that must
    evict a resident the step used)."""
    rng = np.random.default_rng(5 * 10**6 + seed)
    source = random_trace(rng)
    rules = ["substitute_all", "rule015", "first_choice"] if eviction == "lru" else \
        ["fetch_all", "rule015", "substitute_all", "first_choice"]
    p = random_params(rng, source.meta, eviction=eviction, rule=rules[seed % len(rules)])
    p = dataclasses.replace(p, lfu_decay=1.0, scope="per_layer",
                            pool_budget_bytes=p.pool_budget_bytes[:1].repeat(source.meta.num_layers))
    if eviction != "lfu":  # their keys do not tell the residents a background arrival's trim must keep
        p = dataclasses.replace(p, beta=math.inf, prefetch="none")
    elif seed % 4 == 1:  # lfu with background arrivals: prefetches besides any admissions
        p = dataclasses.replace(p, prefetch="topp", predictor="previous")
    if _hooks(p, source) is None and eviction == "lru":  # top-1 under rule015 leaves no miss
        p = dataclasses.replace(p, protect_ranks=0, tau=math.inf)
    if seed % 3 == 0:  # one expert a pool: the step's used residents are evicted too
        p = dataclasses.replace(p, pool_budget_bytes=np.full_like(p.pool_budget_bytes, max(p.expert_bytes)))
    hooks = _hooks(p, source)
    assert hooks is not None and hooks[0] is SCANS[eviction]
    chunk_tokens = int(rng.integers(1, 20))
    scan = run_both(source, p, chunk_tokens=chunk_tokens)  # the reference's results
    monkeypatch.setattr(SCANS[eviction], "applies", lambda *args: False)
    assert _hooks(p, source) is None
    assert_same(scan, simulate(source, p, chunk_tokens=chunk_tokens))  # the heap's or the lists'


def test_packed_keys_only_where_they_apply():
    """The packed keys need the run's length, a pool per layer of at most SCAN_MAX_RESIDENTS
    experts and keys within 62 bits; lfu's also no decay, lru's and belady's nothing arriving
    in the background, lru's a miss rule that leaves misses (else the lists are faster)."""
    from simulator.engine.layout import make_layout
    from simulator.policies.eviction._base import SCAN_MAX_RESIDENTS

    rng = np.random.default_rng(17)
    source = random_trace(rng, logits=True)
    p = random_params(rng, source.meta, eviction="lfu", rule="substitute_all")
    p = dataclasses.replace(p, lfu_decay=1.0, beta=math.inf, prefetch="none", scope="per_layer", miss_action="substitute",
                            pool_budget_bytes=np.full(source.meta.num_layers, 2 * max(p.expert_bytes)))
    assert _hooks(dataclasses.replace(p, beta=0.5), source) is not None  # lfu: also with admissions
    assert _hooks(dataclasses.replace(p, eviction="lru", beta=0.5), source) is None
    assert _hooks(dataclasses.replace(p, eviction="belady", beta=0.5), source) is None
    for eviction in SCANS:
        q = dataclasses.replace(p, eviction=eviction)
        assert _hooks(q, source) is not None
        assert _hooks(dataclasses.replace(q, scope="global", pool_budget_bytes=q.pool_budget_bytes[:1]),
                      source) is None
        big = (SCAN_MAX_RESIDENTS + 1) * int(min(q.expert_bytes))
        assert _hooks(dataclasses.replace(q, pool_budget_bytes=np.full_like(q.pool_budget_bytes, big)),
                      source) is None
        layout = make_layout(q, source.meta)
        assert not SCANS[eviction].applies(q, layout, False, None)  # the length is not known
        assert not SCANS[eviction].applies(q, layout, False, 2**60)  # the keys would not fit
    assert _hooks(dataclasses.replace(p, lfu_decay=0.9), source) is None
    assert _hooks(dataclasses.replace(p, eviction="lru", protect_ranks=0, tau=0.0), source) is None  # fetch_all
    assert LFU_SCAN.key_widths(24576, 48, 2**19) is not None  # half a million tokens of Qwen3-Next
    assert LFU_SCAN.key_widths(24576, 48, 2**20) is None  # a million: the keys would not fit
    assert BELADY_SCAN.key_widths(24576, 48, 2**17) is not None  # 131,072 tokens of Qwen3-Next
    assert BELADY_SCAN.key_widths(24576, 48, 2**18) is None
    assert _hooks(dataclasses.replace(p, eviction="belady", protect_ranks=0, tau=0.0), source) is not None


def test_a_view_of_the_first_tokens_keeps_the_packed_keys(monkeypatch):
    """moe-sim's trace.max_tokens view bounds the run by the whole trace's tokens, so lfu keeps
    its packed keys there (same results as the reference)."""
    from simulator.engine import token_bound
    from traces.sources import LimitedSource

    source = random_trace(np.random.default_rng(29))
    view = LimitedSource(source, source.num_tokens // 2)
    assert token_bound(view) == source.num_tokens
    made = []
    monkeypatch.setattr(LFU_SCAN, "make_state", lambda *args, f=LFU_SCAN.make_state: made.append(1) or f(*args))
    run_both(view, make_params(source.meta, eviction="lfu"))
    assert made


def test_a_chunk_cut_from_a_longer_trace_keeps_its_group_ordinals(monkeypatch):
    """An in-memory source of a trace's later tokens (group ordinals above its token count) is
    bounded by its last ordinal: the packed keys fit, and the results are the reference's."""
    from simulator.engine import token_bound
    from traces.format import ArraySource, slice_chunk

    source = random_trace(np.random.default_rng(31))
    half = source.num_tokens // 2
    while source.chunk.group[half] == source.chunk.group[half - 1]:  # a whole group
        half += 1
    later = ArraySource(source.meta, slice_chunk(source.chunk, half, source.num_tokens))
    assert token_bound(later) == int(source.chunk.group[-1]) + 1 > later.num_tokens
    made = []
    monkeypatch.setattr(LFU_SCAN, "make_state", lambda *args, f=LFU_SCAN.make_state: made.append(1) or f(*args))
    run_both(later, make_params(source.meta, eviction="lfu"))
    assert made


def test_a_run_set_up_for_fewer_tokens_refuses_a_longer_chunk():
    source = random_trace(np.random.default_rng(23))
    p = make_params(source.meta, eviction="lfu")
    sim = KernelSimulator(p, source.meta, num_tokens=source.num_tokens - 1)
    with pytest.raises(RuntimeError, match="at most"):
        sim.run_chunk(source.chunk)


@pytest.mark.parametrize("eviction", list(EVICTIONS))
def test_pools_within_budget_after_every_step(eviction):
    """The reference engine, step by step: each pool is back within budget after every step,
    and its resident list, byte count and resident flags agree."""
    rng = np.random.default_rng(4 * 10**6 + len(eviction))
    source = random_trace(rng, logits=True)
    p = random_params(rng, source.meta, eviction=eviction, scope="global")
    p.init = "cold"
    chunk = source.chunk
    with contextlib.ExitStack() as stack:
        next_use = None
        if eviction == "belady":
            next_use = stack.enter_context(NextUseFile(source))
        sim = ReferenceSimulator(p, source.meta, None if next_use is None else next_use.first_use)
        for a, b in _groups(chunk):
            phase = int(chunk.phase[a])
            sim.begin_group(phase, b - a, int(chunk.group[a]))
            for layer in range(source.meta.num_layers):
                nu = None if next_use is None else next_use.rows(a, b)[:, layer]
                if phase == PHASE_DECODE:
                    sim.decode_step(layer, chunk.experts[a, layer], chunk.gates[a, layer],
                                    chunk.logits[a, layer], None if nu is None else nu[0])
                else:
                    sim.prefill_step(layer, chunk.experts[a:b, layer], nu)
                for q, members in enumerate(sim.members):
                    assert sim.pool_bytes[q] <= sim.layout.pool_budget_bytes[q]
                    assert sim.pool_bytes[q] == sum(sim.expert_size(x) for x in members)
                    assert sorted(members) == [
                        x for x, r in enumerate(sim.resident) if r and sim.pool_of(x) == q
                    ]
            sim.end_group()


def test_lfu_frequencies_renormalise():
    """With lfu_decay = 1e-4 the increment passes 1e100 after 25 groups; frequencies are folded
    back, the heap rebuilt, and both engines still agree."""
    experts = [[[t % 3, 3 + t % 2]] for t in range(60)]
    source = trace(experts)
    p = make_params(source.meta, budget_experts=2, eviction="lfu", lfu_decay=1e-4)
    run_both(source, p)
    sim = KernelSimulator(p, source.meta)
    sim.run_chunk(source.chunk)
    assert sim.core.fstate[S.INC] < 1e100
    assert np.isfinite(sim.core.freq).all()
    check_kernel_state(sim)


@pytest.mark.parametrize(("eviction", "rule", "budget", "scope", "marks"), [
    ("lru", "fetch_all", 2, "per_layer", False),  # every pool holds a step (k = 2)
    ("lru", "fetch_all", 1, "per_layer", True),  # one expert per layer: a trim may meet a used one
    ("lru", "rule015", 2, "global", False),  # substitutes mark themselves
    ("fifo", "fetch_all", 3, "per_layer", True),  # a hit does not move: used residents can lead
    ("fifo", "fetch_all", 2, "per_layer", True),
])
def test_lookups_are_marked_only_where_a_trim_can_meet_a_used_resident(eviction, rule, budget, scope, marks):
    """Without a marking pass, LRU trims never reach a resident used in the step when every pool
    holds k experts; the kernel then leaves lookups unmarked, with the same results."""
    from simulator.engine.layout import make_layout

    rng = np.random.default_rng(7)
    T, L, E = 60, 3, 6
    experts = np.stack([[rng.choice(E, 2, replace=False, p=np.arange(1, E + 1) / 21) for _ in range(L)]
                        for _ in range(T)])
    source = trace(experts, rng.random((T, L, 2)), rng.standard_normal((T, L, E)), num_experts=E)
    p = make_params(source.meta, eviction=eviction, rule=rule, budget_experts=budget, scope=scope)
    assert kernel_needs(p, make_layout(p, source.meta)).lookup_marks is marks
    assert kernel_needs(p).lookup_marks  # without the pools, the kernel marks
    run_both(source, p)


@pytest.mark.parametrize(("rule", "extra", "step_marks"), [
    ("fetch_all", {}, True),
    ("rule015", {}, True),  # substitutes' uses store their step too
    ("rule015", {"substitute_by": "frequency"}, True),  # marks the selections for the substitute
    # an arrival is inserted and, not selected, left fresh: still no marks
    ("rule015", {"beta": 0.3}, True),
    ("fetch_all", {"prefetch": "topp", "predictor": "previous"}, True),
])
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_lfu_tells_a_steps_used_residents_by_their_last_use(rule, extra, step_marks, budget):
    """Without background arrivals an LFU trim reads the step's uses from ``last_use`` instead
    of marks on every lookup; the engines agree either way, also where a trim must evict a used
    resident (one expert per layer) and under decay."""
    from simulator.engine.layout import make_layout

    rng = np.random.default_rng(19 + budget)
    T, L, E = 80, 3, 6
    experts = np.stack([[rng.choice(E, 2, replace=False, p=np.arange(1, E + 1) / 21) for _ in range(L)]
                        for _ in range(T)])
    source = trace(experts, rng.random((T, L, 2)), rng.standard_normal((T, L, E)), num_experts=E)
    p = make_params(source.meta, eviction="lfu", rule=rule, budget_experts=budget, lfu_decay=0.9, **extra)
    needs = kernel_needs(p, make_layout(p, source.meta))
    assert (needs.step_marks, needs.lookup_marks) == (step_marks, not step_marks)
    run_both(source, p)


@pytest.mark.parametrize(("eviction", "rule", "extra", "expected"), [
    ("lru", "fetch_all", {}, (False, False, False, False)),  # nothing read before the trim
    ("fifo", "substitute_all", {"miss_action": "cpu"}, (False, False, False, False)),  # nothing substitutes
    # frequency order: counted where first read (a background arrival's trim, else the step's)
    ("lfu", "fetch_all", {}, (True, False, False, False)),
    ("belady", "fetch_all", {}, (False, True, False, False)),  # on_select reads the step's selections
    # substitutes by logit: the walk never meets a selection; its rare scan marks them and tests
    # every expert of the layer
    ("lru", "rule015", {}, (False, False, False, False)),
    # admits in the background: an arrival's trim reads the marks, the pass runs there
    ("lru", "rule015", {"beta": 0.5}, (False, False, False, True)),
    ("lru", "rule015", {"substitute_by": "frequency"}, (True, True, True, False)),  # ranks the resident lists
])
def test_kernel_keeps_only_what_the_chosen_policies_read(eviction, rule, extra, expected):
    meta = trace(np.zeros((1, 2, 2)) + np.arange(2), logits=np.zeros((1, 2, 8))).meta
    needs = kernel_needs(make_params(meta, eviction=eviction, rule=rule, **extra))
    assert (needs.frequency, needs.selections, needs.layer_residents, needs.background) == expected


def test_moving_an_entry_to_the_tail_is_an_unlink_and_an_append():
    """list_to_tail (an LRU use) leaves every list as list_unlink then list_append would, also
    for the tail itself, the head and a list of one."""
    rng = np.random.default_rng(11)
    X, P = 12, 2
    moved, plain = D.make_lists(X, P), D.make_lists(X, P)
    members = [[], []]
    for x in range(X):
        p = x % P
        for lists in (moved, plain):
            D.list_append(lists, x, p)
        members[p].append(x)
    for _ in range(300):
        p = int(rng.integers(P))
        x = int(rng.choice(members[p]))
        D.list_to_tail(moved, x, p)
        D.list_unlink(plain, x, p)
        D.list_append(plain, x, p)
        assert np.array_equal(moved.link, plain.link) and np.array_equal(moved.ends, plain.ends)
    assert _walk(moved, 0)[-1] == _walk(plain, 0)[-1]
    one = D.make_lists(3, 1)
    D.list_append(one, 2, 0)
    D.list_to_tail(one, 2, 0)
    assert _walk(one, 0) == [2]


def test_a_victim_search_without_a_stamp_takes_the_head_unread():
    """list_victim with NO_STAMP takes the head without reading marks (here a mark array that
    would pin it); with the step's stamp it passes the marked head."""
    lists = D.make_lists(4, 1)
    for x in (2, 0, 3):
        D.list_append(lists, x, 0)
    mark = np.zeros(4, np.int64)
    mark[2] = 7
    assert D.list_victim(lists, mark, 0, 7) == 0
    assert D.list_victim(lists, mark, 0, S.NO_STAMP) == 2
    assert _walk(lists, 0) == [3]


@pytest.mark.parametrize(("scope", "sizes", "uniform", "largest"), [
    ("per_layer", [100, 300, 200], [100, 300, 200], [100, 300, 200]),
    ("global", [100, 100, 100], [100], [100]),
    ("global", [100, 300, 200], [0], [300]),  # sizes differ: the victim's layer says its size
])
def test_the_layout_knows_each_pools_expert_size(scope, sizes, uniform, largest):
    from simulator.engine.layout import make_layout

    source = trace(np.zeros((2, 3, 2), np.int16) + np.arange(2), num_experts=4, expert_bytes=sizes)
    p = make_params(source.meta, scope=scope, budget_experts=2)
    layout = make_layout(p, source.meta)
    assert layout.pool_expert_bytes.tolist() == uniform
    assert layout.pool_largest_bytes.tolist() == largest


@pytest.mark.parametrize("sizes", [[100, 300, 200], [100, 100, 100]])
def test_a_global_pool_of_mixed_sizes_evicts_by_each_victims_size(sizes):
    """fetch_all + LRU in one pool over layers of different expert sizes (the kernel reads each
    victim's layer) and of one size (it does not): both engines agree and the pool stays within
    its budget."""
    rng = np.random.default_rng(5)
    T, L, E = 80, 3, 6
    experts = np.stack([[rng.choice(E, 2, replace=False) for _ in range(L)] for _ in range(T)])
    source = trace(experts, num_experts=E, expert_bytes=sizes)
    p = make_params(source.meta, scope="global", budget_bytes=[1000])
    run_both(source, p)
    sim = KernelSimulator(p, source.meta)
    sim.run_chunk(source.chunk)
    assert 0 < sim.core.pools[0, S.BYTES] <= 1000
    assert sim.core.pools[0, S.BYTES] == sum(sizes[x // E] for x in np.flatnonzero(sim.core.resident))
