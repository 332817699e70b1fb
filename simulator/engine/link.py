"""Transfers: the SSD, the PCIe link, host RAM and the background queue (docs/semantics.md, Link).

Two resources serve transfer stages one at a time, non-preemptively: the **SSD** (reads into
host RAM) and the **link** (host-to-device copies). An expert in host RAM needs one stage, a
copy; one that is not needs an SSD read, then the copy, so reads of one transfer overlap copies
of another. Host RAM is an LRU tier of ``host_ram_budget_bytes`` (-1: every expert is in RAM)
whose most recently used ``host_pinned_budget_bytes`` are pinned (-1: all of it); a copy from
pinned memory runs at the pinned bandwidth, from pageable memory at the pageable one. A copy
that starts on an idle link pays the idle latency, one that follows another back to back the
burst latency.

A step's synchronous fetches are issued together: their reads first, in order, then their copies
in order, each copy waiting for its read. How they meet background copies is the link's copy
order (``pcie.copy_order``): ``priority`` (the engine holds its background queue on the host and
submits a copy only when the link is idle): a synchronous copy goes ahead of every background
copy not yet started but waits for one already running; ``submission`` (the engine submits each
background copy to the device once it is queued and its read is done; the device serves
host-to-device copies in submission order whatever the stream priority, as measured on the
H200): a synchronous copy also waits for every background copy submitted before it.
Background transfers form one FIFO queue with two cursors: a read cursor (first stages: the
read, or for an expert in RAM nothing but the tier access) runs ahead of the copy cursor, so the
queue's reads overlap its copies.

Kernel side: :class:`LinkState` and the jitted functions (an expert is at most once in the
queue or in flight, so the rings hold L*E entries). Reference side: :class:`ReferenceLink`, the
same rules in plain Python.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.layout import Layout
from simulator.engine.params import SimParams
from simulator.engine.state import PREFETCH
from simulator.engine.structures import HEAD, Lists, list_append, list_unlink, make_lists
from simulator.jit import ix, jit
from simulator.metrics import RunCount

# LinkState.qstate[] entries: queue head, its length, how many entries passed their first
# stage (from the head), completions ring head and length, host RAM bytes (pinned, pageable),
# bytes of prefetches queued or in flight
Q_HEAD, Q_LEN, Q_STAGED, D_HEAD, D_LEN, PINNED_BYTES, PAGEABLE_BYTES, PREFETCH_BYTES = range(8)
# LinkState.tstate[] entries: when the link and the SSD finish what they were given
LINK_FREE, SSD_FREE = 0, 1
# where an expert is in host RAM (LinkState.where), and the tier's two LRU lists (Lists rows)
NOT_IN_RAM, PINNED, PAGEABLE = 0, 1, 2
# queue entry states (LinkState.q_state)
WAITING, STAGED, DROPPED = 0, 1, 2


class LinkState(NamedTuple):
    layer_of: np.ndarray  # int32[X]: the layer of expert x (Layout.layer_of)
    expert_bytes: np.ndarray  # int64[L]
    copy_us: np.ndarray  # float64[2, L]: bytes / bandwidth, pinned (row 0) and pageable (row 1)
    latency_us: np.ndarray  # float64[2]: a copy's latency back to back (0), on an idle link (1)
    ssd_us: np.ndarray  # float64[L]: ssd_latency_us + bytes / ssd_bytes_per_us
    ram_budget: int  # bytes of experts host RAM holds; -1 = all
    pinned_budget: int  # bytes of host RAM that are pinned; -1 = all
    cancel_stale: bool  # drop a queued prefetch once its target step has passed
    submission_order: bool  # pcie.copy_order = submission: queued copies go to the device at once
    pending: np.ndarray  # int8[X]: 0, or the source (ADMISSION, PREFETCH) of its queued or flying transfer
    q_x: np.ndarray  # int32[X] queue ring: expert
    q_enqueued: np.ndarray  # float64[X]: enqueue time
    q_ready: np.ndarray  # float64[X]: when its copy may start (its read's end)
    q_pageable: np.ndarray  # int8[X]: its copy reads pageable memory
    q_state: np.ndarray  # int8[X]: WAITING, STAGED, DROPPED
    q_deadline: np.ndarray  # int64[X]: a prefetch's target step (stale after it); -1 never
    done_x: np.ndarray  # int32[X] completions ring: expert
    done_t: np.ndarray  # float64[X]: end time
    qstate: np.ndarray  # int64[8]
    tstate: np.ndarray  # float64[2]
    ram: Lists  # list 0: pinned, list 1: pageable; least recently used at the head
    where: np.ndarray  # int8[X]: NOT_IN_RAM, PINNED, PAGEABLE
    fetch_x: np.ndarray  # int32[E]: a step's synchronous fetches, in order (at most E: of one layer, each once)
    fetch_ready: np.ndarray  # float64[E]: when each one's copy may start (with a host-RAM tier)
    fetch_pageable: np.ndarray  # int8[E]


def make_link_state(params: SimParams, layout: Layout, background: bool = True) -> LinkState:
    """The link's state. Arrays of what a run never touches are empty: the background queue's
    without ``background`` (nothing can queue a transfer: kernel_needs), the host-RAM tier's
    without a tier (no RAM or pinned budget)."""
    L, E = params.num_layers, params.num_experts
    tier = params.host_ram_budget_bytes >= 0 or params.host_pinned_budget_bytes >= 0
    X = L * E
    Q = X if background else 0
    R = X if tier else 0
    F = E if tier else 0
    eb = np.asarray(params.expert_bytes, dtype=np.float64)
    return LinkState(
        layer_of=layout.layer_of,
        expert_bytes=np.ascontiguousarray(params.expert_bytes, dtype=np.int64),
        copy_us=np.stack([eb / params.pcie_bytes_per_us, eb / params.pcie_pageable_bytes_per_us]),
        latency_us=np.array([params.pcie_latency_us, params.pcie_idle_latency_us]),
        ssd_us=layout.ssd_us,
        ram_budget=int(params.host_ram_budget_bytes),
        pinned_budget=int(params.host_pinned_budget_bytes),
        cancel_stale=bool(params.options.get("cancel_stale", True)),
        submission_order=params.pcie_copy_order == "submission",
        pending=np.zeros(Q, np.int8),
        q_x=np.zeros(Q, np.int32),
        q_enqueued=np.zeros(Q, np.float64),
        q_ready=np.zeros(Q, np.float64),
        q_pageable=np.zeros(Q, np.int8),
        q_state=np.zeros(Q, np.int8),
        q_deadline=np.zeros(Q, np.int64),
        done_x=np.zeros(Q, np.int32),
        done_t=np.zeros(Q, np.float64),
        qstate=np.zeros(8, np.int64),
        tstate=np.zeros(2, np.float64),
        ram=make_lists(R, 2),
        where=np.zeros(R, np.int8),
        fetch_x=np.zeros(E, np.int32),
        fetch_ready=np.zeros(F, np.float64),
        fetch_pageable=np.zeros(F, np.int8),
    )


# ---- host RAM tier -----------------------------------------------------------------------


@jit(allocates=False)
def _tier_insert_pinned(link, x, size):
    """x goes to the pinned segment's most recent end; its least recent spill to pageable."""
    st = link.qstate
    list_append(link.ram, x, PINNED - 1)
    link.where[x] = PINNED
    st[PINNED_BYTES] += size
    while st[PINNED_BYTES] > link.pinned_budget >= 0:
        y = link.ram.ends[HEAD, PINNED - 1]
        list_unlink(link.ram, y, PINNED - 1)
        list_append(link.ram, y, PAGEABLE - 1)
        link.where[y] = PAGEABLE
        ysize = link.expert_bytes[ix(link.layer_of[y])]
        st[PINNED_BYTES] -= ysize
        st[PAGEABLE_BYTES] += ysize


@jit(allocates=False)
def _tier_evict_to_fit(link, size):
    """Evict least recently used experts (pageable ones first) until ``size`` more fit."""
    st = link.qstate
    for segment in (PAGEABLE, PINNED):
        held = PAGEABLE_BYTES if segment == PAGEABLE else PINNED_BYTES
        while (link.ram.ends[HEAD, segment - 1] >= 0
               and st[PINNED_BYTES] + st[PAGEABLE_BYTES] + size > link.ram_budget):
            y = link.ram.ends[HEAD, segment - 1]
            list_unlink(link.ram, y, segment - 1)
            link.where[y] = NOT_IN_RAM
            st[held] -= link.expert_bytes[ix(link.layer_of[y])]


@jit(allocates=False, inline=True)
def tier_access(run_counts, link, x):
    """The host RAM tier's part of a transfer of x, at its first stage.

    Returns ``(needs_read, pageable)``: whether x must first be read from the SSD (counted in
    ``ssd_reads``), and whether its copy reads pageable memory. Afterwards x is the most
    recently used expert of the pinned segment (an expert larger than the whole tier is read
    into pinned staging memory and not kept).
    """
    if untiered(link):  # all of RAM, pinned
        return False, False
    return _tier_access(run_counts, link, x)


@jit(allocates=False, inline=True)
def untiered(link):
    """Whether there is no host-RAM tier: every expert is in pinned host memory."""
    return link.pinned_budget < 0 and link.ram_budget < 0


@jit(allocates=False)
def _tier_access(run_counts, link, x):
    size = link.expert_bytes[ix(link.layer_of[x])]
    w = link.where[x]
    st = link.qstate
    if w == PINNED:
        list_unlink(link.ram, x, PINNED - 1)
        st[PINNED_BYTES] -= size
        _tier_insert_pinned(link, x, size)
        return False, False
    if w == PAGEABLE:
        list_unlink(link.ram, x, PAGEABLE - 1)
        st[PAGEABLE_BYTES] -= size
        _tier_insert_pinned(link, x, size)
        return False, True
    if link.ram_budget < 0:  # every expert is in RAM, the unlisted ones pageable
        _tier_insert_pinned(link, x, size)
        return False, True
    run_counts[RunCount.SSD_READS] += 1
    if size <= link.ram_budget:
        _tier_evict_to_fit(link, size)
        _tier_insert_pinned(link, x, size)
        return True, link.where[x] == PAGEABLE
    return True, False


# ---- stages ------------------------------------------------------------------------------


@jit(allocates=False, inline=True)
def _copy(run_counts, link, x, ready, pageable):
    """Put the copy of x on the link at the earliest from ``ready``; returns its end. It starts
    at ``ready`` on an idle link (idle latency), else when the link is free (burst latency)."""
    layer = ix(link.layer_of[x])
    free = link.tstate[LINK_FREE]
    copy_us = link.copy_us[pageable, layer]
    if ready > free:
        end = ready + (link.latency_us[1] + copy_us)
    else:
        end = free + (link.latency_us[0] + copy_us)
    link.tstate[LINK_FREE] = end
    run_counts[RunCount.BYTES_FETCHED] += link.expert_bytes[layer]
    return end


@jit(allocates=False, inline=True)
def _read(link, x, ready):
    """Put the SSD read of x on the SSD at the earliest from ``ready``; returns its end."""
    start = max(ready, link.tstate[SSD_FREE])
    end = start + link.ssd_us[ix(link.layer_of[x])]
    link.tstate[SSD_FREE] = end
    return end


@jit(allocates=False, inline=True)
def _stale(link, i, step):
    return link.cancel_stale and 0 <= link.q_deadline[i] < step


@jit(allocates=False, inline=True)
def _leave(link, x):
    """x's background transfer is over (dropped or completed): it may be queued again."""
    if link.pending[x] == PREFETCH:
        link.qstate[PREFETCH_BYTES] -= link.expert_bytes[ix(link.layer_of[x])]
    link.pending[x] = 0


@jit(allocates=False, inline=True)
def _submitted_at(link, ready):
    """When the queue head whose copy may start at ``ready`` goes to the device: at once in
    submission order, else once the link is free too."""
    return ready if link.submission_order else max(link.tstate[LINK_FREE], ready)


@jit(allocates=False, inline=True)
def _ring(i, cap):
    """Ring position ``i`` (< 2 cap) wrapped into [0, cap): a compare, not a division."""
    return i - cap if i >= cap else i


def _advance(resident, run_counts, link, t, step):
    """Start the background stages that can begin before t (at step ``step``, which makes
    prefetches for earlier steps stale); record completed copies."""
    st = link.qstate
    cap = link.q_x.shape[0]
    progressed = True
    while progressed and st[Q_LEN] > 0:
        progressed = False
        if st[Q_STAGED] < st[Q_LEN]:  # the first stage of the next entry
            i = _ring(st[Q_HEAD] + st[Q_STAGED], cap)
            x = link.q_x[i]
            if link.ram_budget < 0 or link.where[x] != NOT_IN_RAM:  # (where is empty without a tier)
                _, pageable = tier_access(run_counts, link, x)
                link.q_ready[i] = link.q_enqueued[i]
                link.q_pageable[i] = pageable
                link.q_state[i] = STAGED
                st[Q_STAGED] += 1
                progressed = True
            elif resident[x] or _stale(link, i, step):
                link.q_state[i] = DROPPED
                st[Q_STAGED] += 1
                progressed = True
            elif link.tstate[SSD_FREE] < t and max(link.tstate[SSD_FREE], link.q_enqueued[i]) < t:
                _, pageable = tier_access(run_counts, link, x)
                link.q_ready[i] = _read(link, x, link.q_enqueued[i])
                link.q_pageable[i] = pageable
                link.q_state[i] = STAGED
                st[Q_STAGED] += 1
                progressed = True
        if st[Q_STAGED] > 0 and (link.submission_order or link.tstate[LINK_FREE] < t):  # head's copy
            i = st[Q_HEAD]
            x = link.q_x[i]
            if link.q_state[i] == DROPPED or resident[x] or _stale(link, i, step):
                _leave(link, x)
            else:
                if _submitted_at(link, link.q_ready[i]) >= t:
                    continue
                end = _copy(run_counts, link, x, link.q_ready[i], link.q_pageable[i])
                size = link.expert_bytes[ix(link.layer_of[x])]
                run_counts[RunCount.BACKGROUND_BYTES] += size
                if link.pending[x] == PREFETCH:
                    run_counts[RunCount.PREFETCH_BYTES] += size
                d = _ring(st[D_HEAD] + st[D_LEN], cap)
                link.done_x[d] = x
                link.done_t[d] = end
                st[D_LEN] += 1
            st[Q_HEAD] = _ring(i + 1, cap)
            st[Q_LEN] -= 1
            st[Q_STAGED] -= 1
            progressed = True


# The kernel advances the queue at each step's expert phase, inlined: a call passes every array
# of the LinkState (over a hundred words on the stack), which cost quality_first about a tenth of
# its time. The copy that waits for its read (sync_fetches, host-RAM tier) calls it.
advance = jit(_advance, allocates=False)
advance_inline = jit(_advance, allocates=False, inline=True)


@jit(allocates=False, inline=True)
def sync_fetches(resident, run_counts, link, t1, n, step, layer):
    """The step's synchronous fetches ``link.fetch_x[:n]`` (experts of ``layer``), issued at t1;
    returns the clock at the end of the last copy (t1 without fetches).

    The background queue was advanced to t1 when the step's expert phase began (before its
    fetches became resident); a copy that waits for its read lets the queue advance to the read's
    end. Without a host-RAM tier every copy is ready at t1 and reads pinned memory: the first
    starts at t1 on an idle link (idle latency) or when the link is free (burst latency), and
    each later one follows the one before it back to back, the same sums in the same order as
    :func:`_copy`'s. The latency is chosen by a branch, not by an index into ``latency_us``: an
    index computed from the clock put a load on the chain of dependent float operations that
    carries the clock from step to step. These copies' bytes (``RunCount.BYTES_FETCHED``) are
    left to the kernel, which derives them after the run (kernel.derived_counts): the count's
    read-modify-write in every step cost fetch_all + LRU about a tenth of its time on Mixtral's
    shape.
    """
    if untiered(link):
        if n == 0:
            return t1
        copy_us = link.copy_us[0, layer]
        free = link.tstate[LINK_FREE]
        burst = link.latency_us[0] + copy_us
        if t1 > free:
            free = t1 + (link.latency_us[1] + copy_us)
        else:
            free = free + burst
        for _ in range(n - 1):
            free = free + burst
        link.tstate[LINK_FREE] = free
        return free
    for j in range(n):
        x = link.fetch_x[j]
        needs_read, pageable = tier_access(run_counts, link, x)
        link.fetch_pageable[j] = pageable
        link.fetch_ready[j] = _read(link, x, t1) if needs_read else t1
    clock = t1
    for j in range(n):
        ready = link.fetch_ready[j]
        if ready > t1 and link.qstate[Q_LEN] > 0:
            advance(resident, run_counts, link, ready, step)
        clock = _copy(run_counts, link, link.fetch_x[j], ready, link.fetch_pageable[j])
    return clock


@jit(allocates=False, inline=True)
def enqueue(run_counts, link, x, t, source, deadline):
    """Queue x for a background transfer at time t by ``source`` (ADMISSION, PREFETCH; a
    prefetch is stale after step ``deadline``, -1 never), unless it is queued or in flight."""
    if link.pending[x]:
        return
    link.pending[x] = source
    st = link.qstate
    q = _ring(st[Q_HEAD] + st[Q_LEN], link.q_x.shape[0])
    link.q_x[q] = x
    link.q_enqueued[q] = t
    link.q_state[q] = WAITING
    link.q_deadline[q] = deadline
    st[Q_LEN] += 1
    if source == PREFETCH:
        st[PREFETCH_BYTES] += link.expert_bytes[ix(link.layer_of[x])]
        run_counts[RunCount.PREFETCHES] += 1
    else:
        run_counts[RunCount.BACKGROUND_ENQUEUED] += 1


@jit(allocates=False, inline=True)
def next_completion(link, t0):
    """Pop the next recorded completion with end <= t0: ``(x, source)``, or (-1, 0) if none."""
    st = link.qstate
    if st[D_LEN] == 0 or link.done_t[st[D_HEAD]] > t0:
        return -1, 0
    x = link.done_x[st[D_HEAD]]
    st[D_HEAD] = _ring(st[D_HEAD] + 1, link.done_x.shape[0])
    st[D_LEN] -= 1
    source = link.pending[x]
    _leave(link, x)
    return x, source


# ---- the reference twin ------------------------------------------------------------------


class _Entry:
    __slots__ = ("x", "enqueued", "deadline", "ready", "pageable", "state")

    def __init__(self, x: int, enqueued: float, deadline: int):
        self.x, self.enqueued, self.deadline = x, enqueued, deadline
        self.ready, self.pageable, self.state = 0.0, False, WAITING


class ReferenceLink:
    """The same link, tiers and queue in plain Python; counters and events go through ``sim``."""

    def __init__(self, sim, params: SimParams, layout: Layout):
        self.sim = sim
        eb = [int(b) for b in params.expert_bytes]
        self.expert_bytes = eb
        self.copy_us = [[b / params.pcie_bytes_per_us for b in np.asarray(eb, np.float64)],
                        [b / params.pcie_pageable_bytes_per_us for b in np.asarray(eb, np.float64)]]
        self.latency_us = [float(params.pcie_latency_us), float(params.pcie_idle_latency_us)]
        self.ssd_us = [float(v) for v in layout.ssd_us]
        self.ram_budget = int(params.host_ram_budget_bytes)
        self.pinned_budget = int(params.host_pinned_budget_bytes)
        self.cancel_stale = bool(params.options.get("cancel_stale", True))
        self.submission_order = params.pcie_copy_order == "submission"
        self.prefetch_bytes = 0  # of prefetches queued or in flight
        self.queue: list[_Entry] = []  # from the head; entries before ``staged`` passed stage one
        self.staged = 0
        self.completions: list[tuple[float, int]] = []  # (end time, x), in order
        self.pending: dict[int, int] = {}  # x -> source of its queued or flying transfer
        self.link_free_us = 0.0
        self.ssd_free_us = 0.0
        self.pinned: dict[int, None] = {}  # least recently used first
        self.pageable: dict[int, None] = {}
        self.pinned_bytes = self.pageable_bytes = 0

    def _size(self, x: int) -> int:
        return self.expert_bytes[x // self.sim.params.num_experts]

    def in_ram(self, x: int) -> bool:
        return x in self.pinned or x in self.pageable

    def _insert_pinned(self, x: int) -> None:
        self.pinned[x] = None
        self.pinned_bytes += self._size(x)
        while self.pinned_budget >= 0 and self.pinned_bytes > self.pinned_budget:
            y = next(iter(self.pinned))
            del self.pinned[y]
            self.pinned_bytes -= self._size(y)
            self.pageable[y] = None
            self.pageable_bytes += self._size(y)

    def tier_access(self, x: int) -> tuple[bool, bool]:
        """As the kernel's: ``(needs_read, pageable)``."""
        if self.pinned_budget < 0 and self.ram_budget < 0:
            return False, False
        size = self._size(x)
        if x in self.pinned:
            del self.pinned[x]
            self.pinned_bytes -= size
            self._insert_pinned(x)
            return False, False
        if x in self.pageable:
            del self.pageable[x]
            self.pageable_bytes -= size
            self._insert_pinned(x)
            return False, True
        if self.ram_budget < 0:
            self._insert_pinned(x)
            return False, True
        self.sim.count(RunCount.SSD_READS)
        if size <= self.ram_budget:
            for segment in (self.pageable, self.pinned):
                while segment and self.pinned_bytes + self.pageable_bytes + size > self.ram_budget:
                    y = next(iter(segment))
                    del segment[y]
                    if segment is self.pinned:
                        self.pinned_bytes -= self._size(y)
                    else:
                        self.pageable_bytes -= self._size(y)
            self._insert_pinned(x)
            return True, x in self.pageable
        return True, False

    def _copy(self, x: int, ready: float, pageable: bool) -> tuple[float, float]:
        layer = x // self.sim.params.num_experts
        free = self.link_free_us
        start = max(ready, free)
        end = start + (self.latency_us[1 if start > free else 0] + self.copy_us[int(pageable)][layer])
        self.link_free_us = end
        self.sim.count(RunCount.BYTES_FETCHED, self._size(x))
        return start, end

    def _read(self, x: int, ready: float) -> float:
        start = max(ready, self.ssd_free_us)
        end = start + self.ssd_us[x // self.sim.params.num_experts]
        self.ssd_free_us = end
        return end

    def _stale(self, e: _Entry, step: int) -> bool:
        return self.cancel_stale and 0 <= e.deadline < step

    def _leave(self, x: int) -> int:
        source = self.pending.pop(x)
        if source == PREFETCH:
            self.prefetch_bytes -= self._size(x)
        return source

    def advance(self, t: float, step: int) -> None:
        """Start the background stages that can begin before t (at step ``step``)."""
        progressed = True
        while progressed and self.queue:
            progressed = False
            if self.staged < len(self.queue):
                e = self.queue[self.staged]
                if self.in_ram(e.x) or self.ram_budget < 0:
                    _, e.pageable = self.tier_access(e.x)
                    e.ready, e.state = e.enqueued, STAGED
                    self.staged += 1
                    progressed = True
                elif self.sim.resident[e.x] or self._stale(e, step):
                    e.state = DROPPED
                    self.staged += 1
                    progressed = True
                elif self.ssd_free_us < t and max(self.ssd_free_us, e.enqueued) < t:
                    _, e.pageable = self.tier_access(e.x)
                    e.ready, e.state = self._read(e.x, e.enqueued), STAGED
                    self.staged += 1
                    progressed = True
            if self.staged > 0 and (self.submission_order or self.link_free_us < t):
                e = self.queue[0]
                if e.state == DROPPED or self.sim.resident[e.x] or self._stale(e, step):
                    self._leave(e.x)
                else:
                    submitted = e.ready if self.submission_order else max(self.link_free_us, e.ready)
                    if submitted >= t:
                        continue
                    start, end = self._copy(e.x, e.ready, e.pageable)
                    self.sim.count(RunCount.BACKGROUND_BYTES, self._size(e.x))
                    if self.pending[e.x] == PREFETCH:
                        self.sim.count(RunCount.PREFETCH_BYTES, self._size(e.x))
                    self.completions.append((end, e.x))
                    self.sim.emit("transfer_start", e.x, start, end)
                self.queue.pop(0)
                self.staged -= 1
                progressed = True

    def sync_fetches(self, t1: float, xs: list[int], step: int) -> float:
        """The step's synchronous fetches of ``xs``, issued at t1; the clock after the last (the
        queue was advanced to t1 before they became resident)."""
        staged = []
        for x in xs:
            needs_read, pageable = self.tier_access(x)
            staged.append((x, self._read(x, t1) if needs_read else t1, pageable))
        clock = t1
        for x, ready, pageable in staged:
            if ready > t1:
                self.advance(ready, step)
            clock = self._copy(x, ready, pageable)[1]
        return clock

    def enqueue(self, x: int, t: float, source: int, deadline: int = -1) -> None:
        if x in self.pending:
            return
        self.pending[x] = source
        self.queue.append(_Entry(x, t, deadline))
        if source == PREFETCH:
            self.prefetch_bytes += self._size(x)
            self.sim.count(RunCount.PREFETCHES)
        else:
            self.sim.count(RunCount.BACKGROUND_ENQUEUED)
        self.sim.emit("enqueue", x, t)

    def next_completion(self, t0: float) -> tuple[int, int] | None:
        """Pop the next recorded completion with end <= t0: ``(x, source)``."""
        if not self.completions or self.completions[0][0] > t0:
            return None
        end, x = self.completions.pop(0)
        source = self._leave(x)
        self.sim.emit("transfer_done", x, end)
        return x, source
