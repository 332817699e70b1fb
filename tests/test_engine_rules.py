"""Each rule of docs/semantics.md on a hand-built trace with a known answer, on both engines.

Times: a PCIe transfer 10 us, an SSD read 32 us, non-expert compute 5 us, one GPU expert call
1 us, one CPU expert call 7 us (tests/engine_cases.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import (
    BYTES,
    CPU_US,
    NONEXPERT_US,
    PCIE_US,
    SSD_US,
    decide,
    params,
    residents_after,
    run_both,
    trace,
)

from simulator.engine import simulate
from simulator.engine.params import CPU, FETCH, FORCED_FETCH, HIT, SUBSTITUTE
from simulator.metrics import MASS_BINS
from traces.errors import InputError
from traces.format import PHASE_PREFILL

F, FF, S = FETCH, FORCED_FETCH, SUBSTITUTE


# ---- miss rules and substitutes ------------------------------------------------------------

# token 0 selects 4, 5, 6 into an empty cache of 3; token 1 selects 0, 1, 2 with residents
# 4, 5, 6 whose logits rank 5 > 6 > 4
RULE_EXPERTS = [[[4, 5, 6]], [[0, 1, 2]]]
RULE_GATES = [[[0.625, 0.25, 0.125]]] * 2
RULE_LOGITS = np.full((2, 1, 8), -5.0, np.float32)
RULE_LOGITS[1, 0, [4, 5, 6]] = [1.0, 3.0, 2.0]


@pytest.mark.parametrize(
    "rule, token0, token1, subs1, mass1",
    [
        ("fetch_all", [F, F, F], [F, F, F], [-1, -1, -1], 0.0),
        ("rule015", [F, F, FF], [F, F, S], [-1, -1, 5], 0.125),
        ("first_choice", [F, FF, FF], [F, S, S], [-1, 5, 6], 0.375),
        ("substitute_all", [FF, FF, FF], [S, S, S], [5, 6, 4], 1.0),
    ],
)
def test_miss_rules_fetch_or_substitute(rule, token0, token1, subs1, mass1):
    """Which misses each rule fetches; the highest-logit eligible resident substitutes, is not
    reused within the step, and a selected expert is never eligible (token 0: forced fetches)."""
    source = trace(RULE_EXPERTS, RULE_GATES, RULE_LOGITS)
    p = params(source.meta, rule=rule)
    _, steps = decide(source, p)
    assert steps[0][0].codes == token0
    assert steps[1][0].codes == token1
    assert steps[1][0].substitutes == subs1
    assert steps[1][0].mass == mass1

    r = run_both(source, p)
    codes = token0 + token1
    assert r.layer_calls.tolist() == [6]
    assert r.layer_fetches.tolist() == [codes.count(F) + codes.count(FF)]
    assert r.layer_forced_fetches.tolist() == [codes.count(FF)]
    assert r.layer_substitutions.tolist() == [codes.count(S)]
    assert r.layer_first_choice_substitutions.tolist() == [int(token1[0] == S)]
    assert r.mass.tolist() == [0.0, mass1]
    assert r.layer_mass.tolist() == [mass1]
    assert r.mass_hist[0] == 1 + (mass1 == 0.0)
    assert r.mass_hist[int(mass1 * MASS_BINS)] >= 1
    # token 1: non-expert compute, its fetches, then 3 expert calls on the GPU
    fetched1 = token1.count(F)
    assert r.time_us[1] == NONEXPERT_US + fetched1 * PCIE_US + 3.0
    assert r.stall_us[1] == fetched1 * PCIE_US


def test_substitute_by_logit_after_frequency_warmup():
    """init=frequency fills the cache by warm-up counts; logits pick the substitutes."""
    logits = np.zeros((4, 1, 8), np.float32)
    logits[3, 0, [4, 5, 6]] = [0.0, 1.0, 2.0]
    source = trace([[[4, 5]], [[4, 6]], [[4, 5]], [[0, 1]]], logits=logits)
    p = params(source.meta, rule="substitute_all", init="frequency", warmup_tokens=3)
    _, steps = decide(source, p)
    assert steps[0][0].codes == [S, S]
    assert steps[0][0].substitutes == [6, 5]
    r = run_both(source, p)
    assert r.pos.tolist() == [3]


def test_substitute_by_frequency_ties_to_lower_id():
    """Without logits the most frequently selected resident substitutes; ties go to the lower
    id (also in the warm fill: 6 is filled before 7)."""
    source = trace([[[4, 5, 6]], [[4, 5, 7]], [[0, 1, 2]]])
    p = params(source.meta, rule="substitute_all", init="frequency", warmup_tokens=2)
    assert p.substitute_by == "frequency"
    _, steps = decide(source, p)
    assert steps[0][0].substitutes == [4, 5, 6]
    run_both(source, p)


def test_logit_substitution_needs_logits():
    source = trace([[[0, 1]]])
    with pytest.raises(InputError, match="logits"):
        simulate(source, params(source.meta, rule="rule015", substitute_by="logit"))
    # no miss can be left unfetched: logits are not needed
    simulate(source, params(source.meta, rule="fetch_all", substitute_by="logit"))


# ---- background admission and the link ----------------------------------------------------


def test_background_admission_timing_and_reset():
    """acc reaching beta queues the expert at the step's t1 (32 us); the link starts it at
    once (32-42 us); it becomes resident at the first expert phase after 42 us (token 3's t1,
    41 + 5 = 46 us), where token 3 finds it resident and its admission evicts 4, the one
    resident token 3 does not select; the accumulator resets on admission."""
    g = [0.625, 0.375]
    source = trace(
        [[[4, 5]], [[0, 4]], [[4, 5]], [[0, 5]], [[0, 4]]],
        [[g]] * 5,
    )
    p = params(source.meta, budget_experts=2, rule="substitute_all", beta=0.5)
    sim, steps = decide(source, p)
    assert steps[0][0].codes == [FF, FF]  # 4 at 5-15 us, 5 at 15-25 us; token ends at 27
    assert [s[0].start_us for s in steps] == [0.0, 27.0, 34.0, 41.0, 48.0]
    assert steps[1][0].codes == [S, HIT] and steps[1][0].substitutes == [5, -1]
    assert steps[3][0].codes == [HIT, HIT]  # 0 arrived at 42 us, before token 3's expert phase
    assert steps[4][0].codes == [HIT, S] and steps[4][0].substitutes == [-1, 5]
    assert sim.admission.acc[0] == 0.0 and sim.admission.acc[4] == 0.375

    r = run_both(source, p)
    assert r.background_enqueued == 1
    assert r.background_admissions == 1
    assert r.layer_background_admissions.tolist() == [1]
    assert r.background_bytes == BYTES and r.bytes_fetched == 3 * BYTES
    assert r.evictions == 1  # the admission evicted 4, the least recently used other resident
    assert r.stall_us.tolist() == [20.0, 0.0, 0.0, 0.0, 0.0]  # background never stalls

    # the same trace cut before token 3: the transfer completed (42 us) but no expert phase
    # started after it (token 2's began at 39 us), so it is never applied
    r = run_both(trace([[[4, 5]], [[0, 4]], [[4, 5]]], [[g]] * 3), p)
    assert r.background_admissions == 0 and r.background_bytes == BYTES


def test_sync_fetch_waits_for_in_flight_and_overtakes_queued():
    """Token 1 queues 0 and 1 at 43 us. At token 2's start (46 us) 0 goes on the link (43-53);
    1 waits. Token 2's first choice is fetched at 51 us: it waits for 0 (53) and goes before 1
    (53-63), so its stall is 12 us. 1 then runs 63-73 and is admitted at the next step start
    after that."""
    w = [0.5, 0.25, 0.25]
    experts = [[[4, 5, 6]], [[4, 0, 1]], [[2, 4, 5]], [[4, 5, 0]], [[5, 0, 1]]]
    source = trace(experts, [[w]] * 5)
    p = params(source.meta, rule="first_choice", beta=0.25)
    _, steps = decide(source, p)
    assert [s[0].start_us for s in steps] == [0.0, 38.0, 46.0, 66.0, 74.0]
    assert steps[1][0].codes == [HIT, S, S]
    assert steps[2][0].codes == [F, HIT, HIT] and steps[2][0].stall_us == 12.0
    assert steps[3][0].codes == [HIT] * 3 and steps[4][0].codes == [HIT] * 3  # both admitted
    r = run_both(source, p)
    assert r.background_enqueued == 2
    assert r.background_admissions == 2  # 0 at 66 us, 1 at 74 us
    assert r.stall_us[2] == 12.0
    assert r.time_us[2] == NONEXPERT_US + 12.0 + 3.0
    # stopped after token 3 (ends 74 us, 1 completes at 73 us): only 0 was admitted
    r = run_both(trace(experts[:4], [[w]] * 4), p)
    assert r.background_admissions == 1


# ---- eviction ------------------------------------------------------------------------------

# B=2 A=1 A C=3 B, then D=4 arrives into a full cache of three; the future decides belady
A, B, C, D = 1, 2, 3, 4
VICTIM_EXPERTS = [[[B]], [[A]], [[A]], [[C]], [[B]], [[D]], [[C]], [[A]], [[B]]]


@pytest.mark.parametrize(
    "eviction, victim",
    [("fifo", B), ("lru", A), ("lfu", C), ("belady", B)],
)
def test_eviction_victims(eviction, victim):
    """fifo: first inserted; lru: least recently used; lfu: least frequent; belady: next use
    furthest away (C at 6, A at 7, B at 8)."""
    source = trace(VICTIM_EXPERTS)
    p = params(source.meta, eviction=eviction)
    assert residents_after(source, p, 6) == {A, B, C, D} - {victim}
    run_both(source, p)


def test_random_eviction_is_one_draw():
    source = trace(VICTIM_EXPERTS)
    p = params(source.meta, eviction="random", seed=7)
    left = residents_after(source, p, 6)
    assert D in left and len(left) == 3
    run_both(source, p)


@pytest.mark.parametrize("eviction", ["fifo", "belady"])
def test_residents_used_in_the_step_are_not_evicted(eviction):
    """[A, B] then [C, A] into a cache of two: A (hit) and C (fetched) are used, so B goes,
    although fifo would pick A (oldest) and belady A or C (never used again)."""
    source = trace([[[A, B]], [[C, A]], [[B, D]]])
    p = params(source.meta, budget_experts=2, eviction=eviction)
    assert residents_after(source, p, 2) == {A, C}
    run_both(source, p)


def test_all_used_then_policy_order_among_them():
    """Three fetches into a cache of two: the step's own residents go, least recent first."""
    source = trace([[[A, B, C]]])
    p = params(source.meta, budget_experts=2)
    assert residents_after(source, p, 1) == {B, C}
    assert run_both(source, p).evictions == 1


def test_prefill_looks_up_unique_experts_once():
    """A prompt of two tokens [A, B], [C, A]: A, B, C looked up once each and fetched (the pool
    holds three during the step), trimmed to two at the end; time split over the tokens."""
    source = trace([[[A, B]], [[C, A]], [[B, C]]], phase=[PHASE_PREFILL, PHASE_PREFILL, 1])
    p = params(source.meta, budget_experts=2, rule="substitute_all")
    assert residents_after(source, p, 2) == {B, C}
    r = run_both(source, p)
    assert r.prefill_lookups == 3 and r.prefill_hits == 0
    assert r.fetches.tolist() == [3, 0, 0] and r.hits.tolist() == [0, 0, 2]
    group_us = NONEXPERT_US + 3 * PCIE_US + 3.0
    assert r.time_us.tolist() == [group_us / 2, group_us / 2, NONEXPERT_US + 2.0]
    assert r.stall_us.tolist() == [15.0, 15.0, 0.0]
    assert r.layer_calls.tolist() == [2]  # decode calls only
    assert r.evictions == 1


# ---- tiers, CPU, warm-up, scope ------------------------------------------------------------


@pytest.mark.parametrize("ram_experts, ssd_reads", [(-1, 0), (1, 3), (2, 2)])
def test_ssd_tier(ram_experts, ssd_reads):
    """A, B, A through a GPU cache of one: the second A comes from RAM only if RAM holds two."""
    source = trace([[[A]], [[B]], [[A]]])
    ram = -1 if ram_experts < 0 else ram_experts * BYTES
    p = params(source.meta, budget_experts=1, host_ram_budget_bytes=ram)
    r = run_both(source, p)
    assert r.ssd_reads == ssd_reads
    from_ssd = [ram_experts >= 0, ram_experts >= 0, ram_experts == 1]
    assert r.time_us.tolist() == [NONEXPERT_US + PCIE_US + SSD_US * s + 1.0 for s in from_ssd]


@pytest.mark.parametrize("gpu_us, token1_us", [(1.0, NONEXPERT_US + CPU_US), (10.0, 15.0)])
def test_cpu_miss_action_time(gpu_us, token1_us):
    """First choice fetched, other misses computed on the CPU while the GPU computes the rest:
    the expert phase lasts the longer of the two."""
    source = trace([[[A, B]], [[A, C]]])
    p = params(source.meta, budget_experts=2, rule="first_choice", miss_action="cpu",
               gpu_expert_us=np.array([gpu_us]))
    _, steps = decide(source, p)
    assert steps[0][0].codes == [F, CPU] and steps[1][0].codes == [HIT, CPU]
    r = run_both(source, p)
    assert r.cpu_calls.tolist() == [1, 1] and r.layer_substitutions.tolist() == [0]
    assert r.time_us.tolist() == [NONEXPERT_US + PCIE_US + max(gpu_us, CPU_US), token1_us]


@pytest.mark.parametrize("budget, hits", [(1, [0, 0]), (2, [0, 1])])
def test_frequency_warmup_skips_whole_groups(budget, hits):
    """warmup_tokens=1 on a three-token prompt skips the whole prompt; its counts (A 2, B 1)
    fill the cache; lru order is fill order reversed, so C evicts B before A."""
    source = trace([[[A]], [[A]], [[B]], [[C]], [[A]]], phase=[0, 0, 0, 1, 1])
    p = params(source.meta, budget_experts=budget, init="frequency", warmup_tokens=1)
    r = run_both(source, p)
    assert r.pos.tolist() == [3, 4]
    assert r.hits.tolist() == hits


@pytest.mark.parametrize(
    "scope, budget_bytes, left",
    [("global", [500], {1, 11}), ("per_layer", [200, 300], {0, 1, 11})],
)
def test_scope_with_layer_sizes(scope, budget_bytes, left):
    """Layer 0 experts of 100 bytes, layer 1 of 300. Global (500 bytes): fetching D in layer 1
    evicts A (layer 0) and C across layers. Per layer (200, 300): only C goes."""
    source = trace([[[0], [2]], [[1], [3]]], expert_bytes=[100, 300])
    p = params(source.meta, scope=scope, budget_bytes=budget_bytes)
    assert residents_after(source, p, 2) == left
    r = run_both(source, p)
    assert r.bytes_fetched == 800
    layer0_us, layer1_us = NONEXPERT_US + 11.0 + 1.0, NONEXPERT_US + 31.0 + 1.0
    assert r.time_us.tolist() == [layer0_us + layer1_us] * 2


def test_progress_reports_tokens_read():
    source = trace([[[A]]] * 5)
    seen = []
    simulate(source, params(source.meta), progress=seen.append, chunk_tokens=2)
    assert seen == [2, 4, 5]


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("bad", [-1, 8, -32768])
def test_expert_ids_out_of_range_are_refused_in_any_id_type(dtype, bad):
    """check_chunk reads the ids as unsigned in one pass: a negative id must fail like one >= E."""
    from simulator.engine import check_chunk

    source = trace([[[0, 7]], [[3, 4]]])
    p = params(source.meta)
    chunk = source.chunk
    chunk.experts = np.asarray(chunk.experts, dtype=dtype)
    check_chunk(chunk, p)  # ids 0..7 of 8 experts
    chunk.experts = chunk.experts.copy()
    chunk.experts[1, 0, 1] = bad
    with pytest.raises(InputError, match=r"expert ids must lie in \[0, 8\)"):
        check_chunk(chunk, p)


def test_the_kernel_result_takes_the_runs_arrays_and_ends_the_run():
    """KernelSimulator.result() hands its own arrays to the result instead of copying them, so a
    chunk after it is refused rather than written into a result already returned; one chunk's
    outputs and several chunks' agree."""
    from simulator.engine.kernel import KernelSimulator

    source = trace([[[0, 7]], [[3, 4]], [[0, 3]], [[5, 6]]])
    p = params(source.meta)
    whole = KernelSimulator(p, source.meta)
    whole.run_chunk(source.chunk)
    one = whole.result()
    with pytest.raises(RuntimeError, match="result\\(\\) took its arrays"):
        whole.run_chunk(source.chunk)
    parts = KernelSimulator(p, source.meta)
    for chunk in source.iter_chunks(2):
        parts.run_chunk(chunk)
    two = parts.result()
    for name in ("time_us", "hits", "fetches", "seq", "pos", "mass_hist", "layer_hits"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert not np.shares_memory(one.seq, source.chunk.seq)  # ids copied out of the chunk
