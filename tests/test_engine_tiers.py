"""The SSD, the link and host RAM as separate resources (docs/semantics.md, Link): reads overlap
copies, pinned and pageable copies, idle and back-to-back latencies, fixed costs per token and
step; hand-built traces with known times, on both engines.

An expert of BYTES = 90 bytes: a pinned copy 1 + 90 / 10 = 10 us, an SSD read 2 + 90 / 3 = 32 us
(tests/engine_cases.py); non-expert compute 5 us, one GPU expert call 1 us.
"""
from __future__ import annotations

import numpy as np
import pytest
from engine_cases import BYTES, NONEXPERT_US, PCIE_US, SSD_US, params, run_both, trace

from simulator.engine import simulate
from simulator.engine.reference import Observer
from traces.errors import InputError

A, B, C, D = 0, 1, 2, 3


def test_reads_of_a_step_overlap_its_copies():
    """Three misses read from the SSD (RAM keeps nothing): reads back to back from t1 = 5, each
    copy as soon as its read is done: the step's fetches end at 5 + 3 x 32 + 10 = 111 (one read
    and one copy after another would end at 5 + 3 x 42 = 131)."""
    source = trace([[[A, B, C]]])
    r = run_both(source, params(source.meta, host_ram_budget_bytes=0))
    assert r.ssd_reads == 3
    assert r.stall_us.tolist() == [3 * SSD_US + PCIE_US]
    assert r.time_us.tolist() == [NONEXPERT_US + 3 * SSD_US + PCIE_US + 3.0]


def test_host_ram_keeps_what_it_read():
    """A, B, A through a GPU cache of one with RAM for two: A's second fetch is a copy only."""
    source = trace([[[A]], [[B]], [[A]]])
    r = run_both(source, params(source.meta, budget_experts=1, host_ram_budget_bytes=2 * BYTES))
    assert r.ssd_reads == 2
    assert r.time_us.tolist() == [NONEXPERT_US + SSD_US + PCIE_US + 1.0] * 2 + [
        NONEXPERT_US + PCIE_US + 1.0]


def test_pinned_and_pageable_copies():
    """Every expert in RAM, two of them pinned, pageable copies at 5 bytes/us (1 + 90 / 5 = 19
    us): A and B start pageable; A's second fetch finds it pinned (10 us)."""
    source = trace([[[A]], [[B]], [[A]]])
    p = params(source.meta, budget_experts=1, host_pinned_budget_bytes=2 * BYTES,
               pcie_pageable_bytes_per_us=5.0)
    r = run_both(source, p)
    assert r.ssd_reads == 0
    assert r.time_us.tolist() == [NONEXPERT_US + 19.0 + 1.0] * 2 + [NONEXPERT_US + PCIE_US + 1.0]
    p.host_pinned_budget_bytes = BYTES  # room for one: B's fetch demotes A, which comes back slow
    assert run_both(source, p).time_us.tolist() == [NONEXPERT_US + 19.0 + 1.0] * 3


def test_idle_link_latency():
    """Idle latency 4 us: the first copy of a step starts on an idle link (4 + 9 = 13 us), the
    second follows it back to back (1 + 9 = 10 us)."""
    source = trace([[[A, B]]])
    r = run_both(source, params(source.meta, pcie_idle_latency_us=4.0))
    assert r.stall_us.tolist() == [13.0 + 10.0]


def test_fixed_costs_per_token_and_step():
    """3.5 us per token, 1.25 us per step (two layers): a hit-only token costs 3.5 + 2 x (5 +
    1.25 + 1)."""
    source = trace([[[A], [A]], [[A], [A]]])
    p = params(source.meta, token_fixed_us=3.5, step_fixed_us=1.25)
    r = run_both(source, p)
    assert r.time_us.tolist()[1] == 3.5 + 2 * (NONEXPERT_US + 1.25 + 1.0)


class _Copies(Observer):
    def __init__(self):
        self.events = []

    def on_event(self, event):
        if event.kind in ("enqueue", "transfer_start", "transfer_done"):
            self.events.append((event.kind, event.x, event.time_us, event.end_us))


def test_background_read_overlaps_a_synchronous_copy():
    """First-choice rule, every substitution admitted (beta 0.1), RAM keeps nothing.

    Token 0 [A, B]: both fetched (B forced: nothing to substitute), reads 5-37 and 37-69, copies
    37-47 and 69-79; the token ends at 81. Token 1 [C, D] from t1 = 86: C fetched (read 86-118,
    copy 118-128), D substituted and queued at 86. D's read waits for the SSD (free at 118), then
    runs 118-150 while C's copy holds the link; D's copy follows at 150-160 (started by the
    token from 151; hit-only tokens [A, C] take 7 us) and D is admitted at the step from 165,
    evicting A, which that token then reads back (the fifth read).
    """
    gates = [[[0.6, 0.4]]] * 8
    source = trace([[[A, B]], [[C, D]]] + [[[A, C]]] * 6, gates)
    p = params(source.meta, budget_experts=2, rule="first_choice", beta=0.1,
               host_ram_budget_bytes=0, substitute_by="frequency")
    run_both(source, p)
    seen = _Copies()
    r = simulate(source, p, "reference", observer=seen)
    assert seen.events == [("enqueue", D, 86.0, 0.0), ("transfer_start", D, 150.0, 160.0),
                           ("transfer_done", D, 160.0, 0.0)]
    assert r.ssd_reads == 5 and r.background_bytes == BYTES and r.background_admissions == 1
    assert r.time_us.tolist()[:2] == [81.0, 5.0 + SSD_US + PCIE_US + 2.0]


def test_tier_off_is_one_resource():
    """Without a RAM limit, fetches and copies are the same thing: a step's copies run back to
    back from t1 (3 x 10 us) and no SSD read happens."""
    source = trace([[[A, B, C]], [[D, A, B]]])
    r = run_both(source, params(source.meta, budget_experts=3))
    assert r.ssd_reads == 0
    assert r.stall_us.tolist() == [3 * PCIE_US, PCIE_US]
    assert np.all(r.time_us >= r.stall_us)


def test_copy_order_priority_or_submission():
    """First-choice rule, every substitution admitted. Token 0 [A, B, C]: all fetched (nothing to
    substitute yet), copies 5-35, the token ends at 38. Token 1 [D, E, F] from t1 = 43: D fetched
    (43-53), E and F substituted and queued at 43. Token 2 from t1 = 61 fetches G while E's copy
    runs (53-63). ``priority``: G's copy goes ahead of F, which has not started (63-73, stall
    12), F follows 73-83. ``submission``: F was submitted to the device at 43, so it runs first
    (63-73) and G after it (73-83, stall 22)."""
    E, F, G = 4, 5, 6
    source = trace([[[A, B, C]], [[D, E, F]], [[G, D, A]], [[D, G, A]]], [[[0.5, 0.3, 0.2]]] * 4)
    starts = {}
    for order, stall in (("priority", 12.0), ("submission", 22.0)):
        p = params(source.meta, budget_experts=3, rule="first_choice", beta=0.1,
                   substitute_by="frequency", pcie_copy_order=order)
        r = run_both(source, p)
        assert r.stall_us.tolist()[:3] == [30.0, 10.0, stall]
        seen = _Copies()
        simulate(source, p, "reference", observer=seen)
        starts[order] = [(x, t, end) for kind, x, t, end in seen.events if kind == "transfer_start"]
    assert starts["priority"] == [(E, 53.0, 63.0), (F, 73.0, 83.0)]
    assert starts["submission"] == [(E, 53.0, 63.0), (F, 63.0, 73.0)]


def test_copy_order_is_checked():
    source = trace([[[A]]])
    with pytest.raises(InputError, match="pcie_copy_order must be priority or submission"):
        simulate(source, params(source.meta, pcie_copy_order="fifo"))
