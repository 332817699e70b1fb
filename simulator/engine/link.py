"""The PCIe link, the background queue and the host RAM tier (docs/semantics.md, Link).

One link carries synchronous fetches and background transfers; a synchronous fetch goes ahead
of every queued background transfer but waits for one already on the link. A transfer of an
expert that is not in host RAM reads the SSD first, on the same critical path. Host RAM is a
global LRU tier of ``host_ram_budget_bytes`` (-1: everything is in RAM).

Kernel side: :class:`LinkState` and the jitted functions; the background queue and the recorded
completions are ring buffers of capacity L*E (an expert is at most once in either). Reference
side: :class:`ReferenceLink`, the same rules on deques and an ordered dict.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

import numpy as np

from simulator.engine.layout import Layout
from simulator.engine.params import SimParams
from simulator.engine.structures import HEAD, Lists, list_append, list_unlink, make_lists
from simulator.jit import jit
from simulator.metrics import RunCount

# rows of LinkState.ring_x / ring_t
QUEUE, DONE = 0, 1
# LinkState.lstate[] entries
Q_HEAD, Q_LEN, D_HEAD, D_LEN, RAM_BYTES = range(5)
# LinkState.tstate[] entries
LINK_FREE = 0


class LinkState(NamedTuple):
    pcie_us: np.ndarray  # float64[L]: pcie_latency_us + bytes / pcie_bytes_per_us
    ssd_us: np.ndarray  # float64[L]: ssd_latency_us + bytes / ssd_bytes_per_us
    ram_budget: int  # bytes of experts host RAM holds; -1 = all
    pending: np.ndarray  # int8[X]: queued or in flight
    ring_x: np.ndarray  # int32[2, X]
    ring_t: np.ndarray  # float64[2, X]: enqueue time (QUEUE), end time (DONE)
    lstate: np.ndarray  # int64[5]
    tstate: np.ndarray  # float64[1]
    ram: Lists  # one list: host RAM, least recently used at the head
    in_ram: np.ndarray  # int8[X]


def make_link_state(params: SimParams, layout: Layout) -> LinkState:
    X = params.num_layers * params.num_experts
    return LinkState(
        pcie_us=layout.pcie_us,
        ssd_us=layout.ssd_us,
        ram_budget=int(params.host_ram_budget_bytes),
        pending=np.zeros(X, np.int8),
        ring_x=np.zeros((2, X), np.int32),
        ring_t=np.zeros((2, X), np.float64),
        lstate=np.zeros(5, np.int64),
        tstate=np.zeros(1, np.float64),
        ram=make_lists(X, 1),
        in_ram=np.zeros(X, np.int8),
    )


@jit(allocates=False)
def transfer_us(core, c, link, x, layer):
    """Duration of one transfer of x; the source read updates the host RAM tier."""
    if link.ram_budget < 0:
        return link.pcie_us[layer]
    if link.in_ram[x]:
        list_unlink(link.ram, x, 0)
        list_append(link.ram, x, 0)
        return link.pcie_us[layer]
    core.run_counts[RunCount.SSD_READS] += 1
    size = c.expert_bytes[layer]
    st = link.lstate
    while link.ram.ends[HEAD, 0] >= 0 and st[RAM_BYTES] + size > link.ram_budget:
        y = link.ram.ends[HEAD, 0]
        list_unlink(link.ram, y, 0)
        link.in_ram[y] = 0
        st[RAM_BYTES] -= c.expert_bytes[y // c.num_experts]
    if st[RAM_BYTES] + size <= link.ram_budget:
        list_append(link.ram, x, 0)
        link.in_ram[x] = 1
        st[RAM_BYTES] += size
    return link.ssd_us[layer] + link.pcie_us[layer]


@jit(allocates=False)
def advance(core, c, link, t):
    """Start queued background transfers that can begin before t; record their completions."""
    st = link.lstate
    cap = link.ring_x.shape[1]
    while st[Q_LEN] > 0 and link.tstate[LINK_FREE] < t:
        h = st[Q_HEAD]
        x = link.ring_x[QUEUE, h]
        if core.resident[x]:
            st[Q_HEAD] = (h + 1) % cap
            st[Q_LEN] -= 1
            link.pending[x] = 0
            continue
        start = max(link.tstate[LINK_FREE], link.ring_t[QUEUE, h])
        if start >= t:
            break
        st[Q_HEAD] = (h + 1) % cap
        st[Q_LEN] -= 1
        layer = x // c.num_experts
        size = c.expert_bytes[layer]
        end = start + transfer_us(core, c, link, x, layer)
        link.tstate[LINK_FREE] = end
        core.run_counts[RunCount.BYTES_FETCHED] += size
        core.run_counts[RunCount.BACKGROUND_BYTES] += size
        d = (st[D_HEAD] + st[D_LEN]) % cap
        link.ring_x[DONE, d] = x
        link.ring_t[DONE, d] = end
        st[D_LEN] += 1


@jit(allocates=False)
def sync_fetch(core, c, link, clock, x, layer):
    """A synchronous fetch of x from ``clock``; returns the clock at its end."""
    if link.lstate[Q_LEN] > 0:
        advance(core, c, link, clock)
    start = max(clock, link.tstate[LINK_FREE])
    end = start + transfer_us(core, c, link, x, layer)
    link.tstate[LINK_FREE] = end
    core.run_counts[RunCount.BYTES_FETCHED] += c.expert_bytes[layer]
    return end


@jit(allocates=False)
def enqueue(core, link, x, t):
    """Queue x for a background transfer at time t, unless it is queued or in flight."""
    if link.pending[x]:
        return
    link.pending[x] = 1
    st = link.lstate
    q = (st[Q_HEAD] + st[Q_LEN]) % link.ring_x.shape[1]
    link.ring_x[QUEUE, q] = x
    link.ring_t[QUEUE, q] = t
    st[Q_LEN] += 1
    core.run_counts[RunCount.BACKGROUND_ENQUEUED] += 1


@jit(allocates=False)
def next_completion(link, t0):
    """Pop the next recorded completion with end <= t0: its expert, or -1 if there is none."""
    st = link.lstate
    if st[D_LEN] == 0 or link.ring_t[DONE, st[D_HEAD]] > t0:
        return -1
    x = link.ring_x[DONE, st[D_HEAD]]
    st[D_HEAD] = (st[D_HEAD] + 1) % link.ring_x.shape[1]
    st[D_LEN] -= 1
    link.pending[x] = 0
    return x


class ReferenceLink:
    """The same link and tiers in plain Python; counters and events go through ``sim``."""

    def __init__(self, sim, params: SimParams, layout: Layout):
        self.sim = sim
        self.pcie_us = [float(v) for v in layout.pcie_us]
        self.ssd_us = [float(v) for v in layout.ssd_us]
        self.ram_budget = int(params.host_ram_budget_bytes)
        self.queue: deque[tuple[int, float]] = deque()  # (x, enqueue time)
        self.completions: deque[tuple[float, int]] = deque()  # (end time, x)
        self.pending: set[int] = set()  # queued or in flight
        self.link_free_us = 0.0
        self.ram: OrderedDict[int, None] = OrderedDict()  # x -> None, least recently used first
        self.ram_bytes = 0

    def transfer_us(self, x: int) -> float:
        layer = x // self.sim.params.num_experts
        if self.ram_budget < 0:
            return self.pcie_us[layer]
        if x in self.ram:
            self.ram.move_to_end(x)
            return self.pcie_us[layer]
        self.sim.count(RunCount.SSD_READS)
        size = self.sim.expert_size(x)
        while self.ram and self.ram_bytes + size > self.ram_budget:
            y, _ = self.ram.popitem(last=False)
            self.ram_bytes -= self.sim.expert_size(y)
        if self.ram_bytes + size <= self.ram_budget:
            self.ram[x] = None
            self.ram_bytes += size
        return self.ssd_us[layer] + self.pcie_us[layer]

    def advance(self, t: float) -> None:
        """Start queued background transfers that can begin before t."""
        while self.queue and self.link_free_us < t:
            x, enqueued_us = self.queue[0]
            if self.sim.resident[x]:
                self.queue.popleft()
                self.pending.discard(x)
                continue
            start = max(self.link_free_us, enqueued_us)
            if start >= t:
                break
            self.queue.popleft()
            end = start + self.transfer_us(x)
            self.link_free_us = end
            size = self.sim.expert_size(x)
            self.sim.count(RunCount.BYTES_FETCHED, size)
            self.sim.count(RunCount.BACKGROUND_BYTES, size)
            self.completions.append((end, x))
            self.sim.emit("transfer_start", x, start, end)

    def sync_fetch(self, clock_us: float, x: int) -> float:
        """Fetch x on the critical path from ``clock_us``; returns the clock after it."""
        self.advance(clock_us)
        start = max(clock_us, self.link_free_us)
        end = start + self.transfer_us(x)
        self.link_free_us = end
        self.sim.count(RunCount.BYTES_FETCHED, self.sim.expert_size(x))
        return end

    def enqueue(self, x: int, t: float) -> None:
        if x in self.pending:
            return
        self.pending.add(x)
        self.queue.append((x, t))
        self.sim.count(RunCount.BACKGROUND_ENQUEUED)
        self.sim.emit("enqueue", x, t)

    def next_completion(self, t0: float) -> int | None:
        """Pop the next recorded completion with end <= t0: its expert (no longer pending)."""
        if not self.completions or self.completions[0][0] > t0:
            return None
        end, x = self.completions.popleft()
        self.pending.discard(x)
        self.sim.emit("transfer_done", x, end)
        return x
