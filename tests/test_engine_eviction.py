"""Eviction invariants: pools within budget between steps, and the kernel's lists, heaps,
resident arrays, host RAM tier and queues consistent with each other and with the reference."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from engine_cases import params as make_params
from engine_cases import random_params, random_trace, run_both, trace

from simulator.engine import kernel as K
from simulator.engine import warmup_counts
from simulator.engine.kernel import KernelSimulator
from simulator.engine.nextuse import NextUseFile, after_group
from simulator.engine.params import EVICTIONS
from simulator.engine.reference import ReferenceSimulator
from simulator.policies.eviction import eviction_key
from traces.format import PHASE_DECODE, slice_chunk


def _groups(chunk):
    bounds = np.flatnonzero(np.diff(chunk.group, prepend=-1, append=-1)).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _walk(link, ends, p):
    """The entries of list p, head to tail, checking the back links."""
    out, prev, x = [], -1, int(ends[K.HEAD, p])
    while x >= 0:
        assert link[K.PREV, x] == prev
        out.append(x)
        prev, x = x, int(link[K.NEXT, x])
    assert ends[K.TAIL, p] == prev
    return out


def check_kernel_state(sim: KernelSimulator) -> set[int]:
    """Assert the kernel's structures agree with each other; return the resident set."""
    p_ = sim.params
    L, E = p_.num_layers, p_.num_experts
    expert_bytes = np.asarray(p_.expert_bytes)
    residents = set(np.flatnonzero(sim.resident).tolist())
    # per-layer resident lists
    for layer in range(L):
        n = int(sim.layer_res_n[layer])
        listed = sim.layer_res[layer, :n].tolist()
        assert sorted(listed) == sorted(x for x in residents if x // E == layer)
        assert all(sim.res_pos[x] == i for i, x in enumerate(listed))
    pool_of = sim.layout.pool_of_layer
    ev = p_.eviction
    for p in range(sim.pools.shape[0]):
        members = sorted(x for x in residents if pool_of[x // E] == p)
        assert sim.pools[p, K.BYTES] == sum(int(expert_bytes[x // E]) for x in members)
        assert sim.pools[p, K.BYTES] <= sim.pools[p, K.BUDGET]
        if ev in (EVICTIONS["lru"], EVICTIONS["fifo"]):
            assert sorted(_walk(sim.link, sim.ends, p)) == members
            continue
        off, n = int(sim.pools[p, K.OFFSET]), int(sim.pools[p, K.COUNT])
        items = sim.items[off : off + n].tolist()
        assert sorted(items) == members
        assert all(sim.slot[x] == i for i, x in enumerate(items))
        if ev == EVICTIONS["random"]:
            continue
        keys = [(sim.hkey1[off + i], sim.hkey2[off + i], x) for i, x in enumerate(items)]
        for i in range(1, n):
            assert keys[(i - 1) // 2] < keys[i]  # heap order of the stored keys
        for k1, k2, x in keys:
            actual = (*eviction_key(ev, sim.freq[x], sim.last_use[x], sim.next_step[x]), x)
            if ev == EVICTIONS["lfu"]:
                assert (k1, k2, x) <= actual  # lazily refreshed: never ahead of the real key
            else:
                assert (k1, k2, x) == actual
    # host RAM tier
    in_ram = np.flatnonzero(sim.in_ram).tolist()
    assert sorted(_walk(sim.ram_link, sim.ram_ends, 0)) == in_ram
    assert sim.istate[K.RAM_BYTES] == sum(int(expert_bytes[x // E]) for x in in_ram)
    if p_.host_ram_budget_bytes >= 0:
        assert sim.istate[K.RAM_BYTES] <= p_.host_ram_budget_bytes
    # queued or in flight <=> pending
    cap = L * E
    queued = [int(sim.ring_x[K.QUEUE, (sim.istate[K.Q_HEAD] + i) % cap])
              for i in range(sim.istate[K.Q_LEN])]
    flying = [int(sim.ring_x[K.DONE, (sim.istate[K.D_HEAD] + i) % cap])
              for i in range(sim.istate[K.D_LEN])]
    assert sorted(queued + flying) == np.flatnonzero(sim.pending).tolist()
    return residents


@pytest.mark.parametrize("seed", range(24))
def test_kernel_structures_stay_consistent(seed):
    """Group by group, the kernel's structures hold and its residents equal the reference's."""
    rng = np.random.default_rng(3 * 10**6 + seed)
    source = random_trace(rng)
    p = random_params(rng, source.meta, eviction=list(EVICTIONS)[seed % 5])
    chunk = source.chunk
    with contextlib.ExitStack() as stack:
        last_warmup_group = -1
        counts = None
        if p.init == 1:
            counts, last_warmup_group = warmup_counts(source, p)
        next_use = None
        if p.eviction == EVICTIONS["belady"]:
            next_use = stack.enter_context(NextUseFile(source, last_warmup_group))
        first_use = None if next_use is None else next_use.first_use
        fast = KernelSimulator(p, source.meta, first_use)
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


@pytest.mark.parametrize("eviction", list(EVICTIONS))
def test_pools_within_budget_after_every_step(eviction):
    """The reference engine, step by step: each pool is back within budget after every step,
    and its resident list, byte count and resident flags agree."""
    rng = np.random.default_rng(4 * 10**6 + len(eviction))
    source = random_trace(rng, logits=True)
    p = random_params(rng, source.meta, eviction=eviction, scope="global")
    p.init = 0
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
                    assert sim.pool_bytes[q] == sum(sim._bytes(x) for x in members)
                    assert sorted(members) == [
                        x for x, r in enumerate(sim.resident) if r and sim._pool(x) == q
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
    assert sim.fstate[K.INC] < 1e100
    assert np.isfinite(sim.freq).all()
    check_kernel_state(sim)
