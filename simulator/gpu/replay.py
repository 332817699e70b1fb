"""moe-replay: execute a policy for real on a GPU and compare its time per token with the simulator.

Three steps, each a subcommand:

``plan`` (anywhere; needs the moe-sim configs, so Hydra): for each policy, resident fraction and
host-RAM size, run the reference engine (:class:`simulator.engine.reference.ReferenceSimulator`)
one step at a time over the trace, with the moe-sim config of that policy and the given hardware
profile, and record what it did: hits, synchronous fetches, substitutes, background transfers and
their completions, evictions, and for every transfer where its bytes come from (host RAM pinned
or pageable, or an SSD read first). The decisions are turned into slot operations (which
physical GPU slot, host-RAM buffer and disk block an expert lives in) and saved as one ``.npz``
plan. Decisions depend on simulated time only through when background transfers complete, so a
plan made with one profile executes what the simulator decides with it.

``run`` (the GPU host; plain argparse, numpy and torch only): execute a plan. A GPU array of
expert slots holds the resident experts. Without a host-RAM limit the experts live in pinned
host memory (``--host-layers`` layers of them; the trace's layer l reads host layer
``l % host_layers``, because a whole model's experts rarely fit in host RAM). With one, host RAM
is a tier of the plan's size, pinned and pageable buffers, and the experts beyond it are read
from an expert file (``--ssd-file``) with O_DIRECT into the tier's buffers by a reader thread,
one read after another in the plan's order, each not before the GPU reached the step that
decided it. Per step, on the compute stream: the non-expert layer (the kernels
``moe-calibrate`` times), then, as the simulator's expert phase begins, a wait for the
background transfers it completes by then (docs/semantics.md: completions by t1), the
synchronous fetches as real host-to-device copies (each after its read), then the real SwiGLU
experts of every rank (hit, fetched or substitute) in one grouped kernel per step (``batched``,
the default with Triton) or a CUDA graph per slot. Background transfers (every source the
engine queues, alike: its events do not say which queued them) are real copies on a second,
lower-priority stream, issued in queue order by a thread after the step that queued them and
after their read. Time per token comes from CUDA events, synchronised per token.

``compare`` (anywhere, CPU): simulate the same trace, policies, fractions, host-RAM sizes and
profile through the moe-sim configs, and write docs/VALIDATION.md with measured against
simulated ms per token, one section per plan (a shape and trace), the SSD rows apart.
``summary`` prints measured against the plan's own simulated times (no Hydra needed).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simulator.gpu.calibrate import disk_samples, host_facts, measure_disk_like
from simulator.gpu.kernels import (
    GIB,
    MIB,
    LayerStack,
    batched_available,
    import_torch,
    model_dims,
    resolve_device,
    tiny_dims,
)
from simulator.gpu.storage import DirectFile, HostBuffers, round_up, write_expert_file
from simulator.models import with_attention_shapes
from traces.atomic import atomic_output, atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import PHASE_DECODE

POLICIES = ("fetch_all", "rule015", "first_choice", "quality_first", "speed_first")
FRACTIONS = (0.10, 0.25, 0.50)
PLAN_VERSION = 2
SHAPE_TARGET = (0.03, 0.05)  # mean and max |error| per shape and trace (issue 12 item 7)
ROW_TOLERANCE = 0.10  # every row, the SSD rows too


def log(msg: str) -> None:
    print(f"[moe-replay {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- planning

# engine events, in the order the engine produced them; _TIER: a host-RAM tier access
_ENQUEUE, _START, _COMPLETE, _INSERT, _EVICT, _BODY, _TIER = range(7)
_EVENT_CODES = {"enqueue": _ENQUEUE, "transfer_start": _START, "transfer_done": _COMPLETE,
                "insert": _INSERT, "evict": _EVICT, "step": _BODY}
# where a copy's bytes are in host memory (plan columns ``src``): the no-tier host experts, or
# a buffer of the host-RAM tier
HOST, PINNED, PAGEABLE = 0, 1, 2


@dataclass(frozen=True)
class TierAccess:
    """One access of the host-RAM tier at a transfer's first stage, as the engine made it."""

    synchronous: bool  # a step's synchronous fetch (else a background transfer)
    needs_read: bool  # read from the SSD first
    pageable: bool  # its copy reads pageable memory
    left: tuple[int, ...]  # experts that left host RAM
    demoted: tuple[int, ...]  # other experts moved from the pinned to the pageable part
    ends_pageable: bool  # the accessed expert is in the pageable part afterwards


def _plan_recorder():
    """An engine observer that keeps the cache, link and tier events and each step's decision."""
    from simulator.engine.reference import Observer

    class PlanRecorder(Observer):
        def __init__(self):
            self.initial: list[int] = []  # the warm fill, before the first step
            self.events: list[tuple[int, int, TierAccess | None]] = []  # (event code, x, tier access)
            self.steps: list[tuple[int, int, int, object]] = []  # (group, layer, first event, decision)
            self.sync_left = 0  # tier accesses still to come from the step's synchronous fetches
            self._first = 0

        def on_event(self, event):
            if event.step < 0:
                self.initial.append(event.x)
            else:
                self.events.append((_EVENT_CODES[event.kind], event.x, None))

        def on_step(self, group, layer, decision):
            self.steps.append((group, layer, self._first, decision))
            self._first = len(self.events)

    return PlanRecorder()


@contextlib.contextmanager
def _tier_probe(rec):
    """Record every host-RAM tier access of the reference link into ``rec.events``.

    The engine's events do not say which transfers read from the SSD or copy from pageable
    memory, so the plan reads them off the reference link around its public ``tier_access``
    (its return value and the change of its pinned and pageable lists). The first
    ``len(xs)`` accesses inside ``sync_fetches(t1, xs)`` are the step's fetches, in order.
    """
    from simulator.engine.link import ReferenceLink

    access, sync = ReferenceLink.tier_access, ReferenceLink.sync_fetches

    def tier_access(link, x):
        tiered = link.ram_budget >= 0 or link.pinned_budget >= 0
        pinned, pageable = (set(link.pinned), set(link.pageable)) if tiered else (set(), set())
        needs_read, is_pageable = access(link, x)
        synchronous = rec.sync_left > 0
        rec.sync_left -= synchronous
        if tiered:
            left = tuple(sorted((pinned | pageable) - set(link.pinned) - set(link.pageable)))
            demoted = tuple(sorted((pinned & set(link.pageable)) - {x}))
            rec.events.append((_TIER, x, TierAccess(synchronous, needs_read, is_pageable, left, demoted,
                                                    x in link.pageable)))
        return needs_read, is_pageable

    def sync_fetches(link, t1, xs, *rest):
        rec.sync_left = len(xs)
        try:
            return sync(link, t1, xs, *rest)
        finally:
            rec.sync_left = 0

    ReferenceLink.tier_access, ReferenceLink.sync_fetches = tier_access, sync_fetches
    try:
        yield rec
    finally:
        ReferenceLink.tier_access, ReferenceLink.sync_fetches = access, sync


@dataclass
class StepOps:
    """What the GPU does in one step, in slot terms (slots index the GPU expert-slot array).

    A source is ``(src, buf)``: HOST (buf -1) or a PINNED / PAGEABLE tier buffer; ``read`` is
    the index of the SSD read that fills the buffer first (-1: none)."""

    group: int
    layer: int
    waits: list[int] = field(default_factory=list)  # background transfer ids to wait for first
    fetches: list[list[int]] = field(default_factory=list)  # [x, slot, src, buf, read], in order
    background: list[list[int]] = field(default_factory=list)  # [x, slot, transfer id, src, buf, read]
    experts: list[tuple[int, int]] = field(default_factory=list)  # (slot, expert x it must hold) per rank


class _Slots:
    """Physical slots (GPU or host buffers): a free list and the high-water mark."""

    def __init__(self):
        self.free: list[int] = []
        self.count = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.count += 1
        return self.count - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


class _TierBuffers:
    """The host-RAM tier's physical buffers, pinned and pageable, following the engine's tier."""

    def __init__(self):
        self.pools = {PINNED: _Slots(), PAGEABLE: _Slots()}
        self.where: dict[int, tuple[int, int]] = {}  # x -> (PINNED or PAGEABLE, buffer)

    def _drop(self, x: int) -> None:
        kind, buf = self.where.pop(x)
        self.pools[kind].give(buf)

    def access(self, x: int, a: TierAccess) -> tuple[int, int]:
        """Apply one tier access; the source ``(kind, buffer)`` its copy reads (after its read).

        An expert that changes part moves to a buffer of the other pool (no bytes move: the
        model charges nothing for it); one that stays keeps its buffer."""
        for y in a.left:
            self._drop(y)
        old = self.where.get(x)
        final = dict.fromkeys(a.demoted, PAGEABLE)
        final[x] = PAGEABLE if a.ends_pageable else PINNED
        movers = [y for y, kind in final.items() if self.where.get(y, (None,))[0] != kind]
        for y in movers:  # free first: the pools stay at the tier's size
            if y in self.where:
                self._drop(y)
        for y in movers:
            self.where[y] = (final[y], self.pools[final[y]].take())
        source = self.where[x] if a.needs_read else old
        if source is None or (source[0] == PAGEABLE) != a.pageable:
            raise ValueError(f"tier buffers out of step with the engine at expert {x}")
        return source


def _transferred_enqueues(events) -> set[int]:
    """Indices of ENQUEUE events whose background transfer the engine started (not dropped)."""
    last: dict[int, int] = {}
    out = set()
    for i, (code, x, _) in enumerate(events):
        if code == _ENQUEUE:
            last[x] = i
        elif code == _START:
            out.add(last.pop(x))
    return out


def _tier_event(st: dict, x: int, a: TierAccess, ops: StepOps, step: int, fetch_index: int) -> int:
    """A tier access: the source of its copy (and its read, if any) onto the fetch or the
    background transfer it belongs to; returns the next synchronous fetch's index."""
    src, buf = st["tier"].access(x, a)
    gate = step if a.synchronous else st["enqueued_at"][x]
    read = -1
    if a.needs_read:
        read = len(st["reads"])
        st["reads"].append((x, src, buf, gate))
    if a.synchronous:
        ops.fetches[fetch_index][2:] = [src, buf, read]
        return fetch_index + 1
    transfer = st["background_of"].get(x)
    if transfer is not None:
        transfer[3:] = [src, buf, read]
    return fetch_index


def _step_ops(step: int, group: int, layer: int, events, transferred, decision, E: int, st: dict) -> StepOps:
    """Turn one step's engine events and decision into slot operations (updates ``st``)."""
    from simulator.engine.params import CPU, FETCH, FORCED_FETCH, HIT, SUBSTITUTE

    slots: _Slots = st["slots"]
    slot_of: dict[int, int] = st["slot_of"]
    staging: dict[int, tuple[int, int]] = st["staging"]
    ops = StepOps(group, layer)
    n = len(events)
    i = 0
    fetch_index = 0
    # step start: background stages and completions (and the evictions their admission causes)
    while i < n and events[i][1] != _BODY:
        _, code, x, tier = events[i]
        if code == _COMPLETE:
            slot, tid = staging.pop(x)
            st["background_of"].pop(x, None)
            ops.waits.append(tid)
            if i + 1 < n and events[i + 1][1:3] == (_INSERT, x):
                slot_of[x] = slot
                i += 1
            else:  # already resident (fetched meanwhile): the copy is wasted, as in the model
                slots.give(slot)
        elif code == _EVICT:
            slots.give(slot_of.pop(x))
        elif code == _TIER:
            _tier_event(st, x, tier, ops, step, fetch_index)
        i += 1
    i += 1  # the BODY marker
    ends = []
    for idx, code, x, tier in events[i:]:
        if code == _INSERT:
            slot = slots.take()
            slot_of[x] = slot
            ops.fetches.append([x, slot, HOST, -1, -1])
        elif code == _ENQUEUE:
            st["enqueued_at"][x] = step
            if idx in transferred:
                slot = slots.take()
                tid = st["next_tid"]
                st["next_tid"] += 1
                staging[x] = (slot, tid)
                ops.background.append([x, slot, tid, HOST, -1, -1])
                st["background_of"][x] = ops.background[-1]
        elif code == _TIER:
            fetch_index = _tier_event(st, x, tier, ops, step, fetch_index)
        elif code == _EVICT:
            ends.append(x)
    base = layer * E
    for e, code, sub in zip(decision.experts, decision.codes, decision.substitutes, strict=True):
        if code in (HIT, FETCH, FORCED_FETCH):
            ops.experts.append((slot_of[base + e], base + e))
        elif code == SUBSTITUTE:
            ops.experts.append((slot_of[base + sub], base + sub))
        elif code == CPU:
            raise InputError("moe-replay executes GPU policies; policy.miss_action=cpu is not supported")
    for x in ends:  # the step-end trim
        slots.give(slot_of.pop(x))
    return ops


@dataclass
class RunPlan:
    """One policy at one resident fraction and host-RAM size: slot operations per step, the SSD
    reads in the order the SSD serves them, and the engine's times."""

    name: str
    policy: str
    fraction: float
    overrides: list[str]
    hardware: dict  # the profile fields this run sets (host_ram_bytes, host_pinned_bytes)
    steps: list[StepOps]
    reads: list[tuple[int, int, int, int]]  # (expert x, PINNED or PAGEABLE, buffer, gate step)
    initial: list[tuple[int, int]]  # (expert x, slot) resident before the first step
    group_phase: np.ndarray  # int8[G]
    sim_decode_us: np.ndarray  # float64[D]: the engine's decode-token times, trace order
    num_slots: int
    num_transfers: int
    tier_buffers: tuple[int, int]  # pinned and pageable host-RAM buffers the plan uses
    counts: dict


def plan_run(params, meta, chunk, name: str, policy: str, fraction: float, overrides: list[str],
             hardware: dict | None = None) -> RunPlan:
    """Run the reference engine over the trace and turn its decisions into a :class:`RunPlan`."""
    from simulator.engine import simulate
    from traces.format import ArraySource

    ram, pinned = int(params.host_ram_budget_bytes), int(params.host_pinned_budget_bytes)
    if ram < 0 <= pinned:
        raise InputError("moe-replay executes a pinned budget only inside a host-RAM limit: set "
                         "hardware.host_ram_bytes too (or drop hardware.host_pinned_bytes)")
    if 0 <= ram < int(np.max(params.expert_bytes)):
        raise InputError(f"hardware.host_ram_bytes={ram} holds no expert ({int(np.max(params.expert_bytes))} "
                         "bytes); give the tier room for one at least")
    rec = _plan_recorder()
    with _tier_probe(rec):
        r = simulate(ArraySource(meta, chunk), params, engine="reference", observer=rec)
    E = meta.num_experts
    st = dict(slots=_Slots(), slot_of={}, staging={}, next_tid=0, tier=_TierBuffers(), reads=[],
              enqueued_at={}, background_of={})
    initial = []  # (x, slot): the warm cache, copied in before timing starts
    for x in rec.initial:
        st["slot_of"][x] = slot = st["slots"].take()
        initial.append((x, slot))
    phase_of = dict(zip(chunk.group.tolist(), chunk.phase.tolist(), strict=True))
    events = rec.events
    transferred = _transferred_enqueues(events)
    steps, phases = [], []
    for j, (group, layer, first, d) in enumerate(rec.steps):
        if layer == 0:
            phases.append(phase_of[group])
        stop = rec.steps[j + 1][2] if j + 1 < len(rec.steps) else len(events)
        indexed = [(k, *events[k]) for k in range(first, stop)]
        steps.append(_step_ops(j, len(phases) - 1, layer, indexed, transferred, d, E, st))
    decode = r.phase == PHASE_DECODE
    counts = dict(
        hits=int(r.hits[decode].sum()), fetches=int(r.fetches[decode].sum()),
        substitutions=int(r.substitutions[decode].sum()),
        background_transfers=st["next_tid"], background_admissions=int(r.background_admissions),
        prefill_lookups=int(r.prefill_lookups), ssd_reads=int(r.ssd_reads),
    )
    if len(st["reads"]) != counts["ssd_reads"]:
        raise ValueError(f"{len(st['reads'])} planned reads but the engine counts {counts['ssd_reads']}")
    tier = st["tier"].pools
    return RunPlan(name=name, policy=policy, fraction=fraction, overrides=overrides, hardware=dict(hardware or {}),
                   steps=steps, reads=st["reads"], initial=initial, group_phase=np.array(phases, np.int8),
                   sim_decode_us=r.time_us[decode].copy(), num_slots=st["slots"].count,
                   num_transfers=st["next_tid"], tier_buffers=(tier[PINNED].count, tier[PAGEABLE].count),
                   counts=counts)


def _csr(lists: list[list], width: int) -> tuple[np.ndarray, np.ndarray]:
    off = np.zeros(len(lists) + 1, np.int64)
    off[1:] = np.cumsum([len(x) for x in lists])
    flat = np.array([v for x in lists for v in x], np.int64).reshape(-1, width) if off[-1] else np.zeros((0, width), np.int64)
    return off, flat


def save_plans(path: Path, header: dict, plans: list[RunPlan]) -> None:
    """Plans as one compressed npz (CSR arrays per run) with a JSON header."""
    arrays = {}
    runs = []
    for p in plans:
        k = p.name
        arrays[f"{k}.group"] = np.array([s.group for s in p.steps], np.int32)
        arrays[f"{k}.layer"] = np.array([s.layer for s in p.steps], np.int32)
        for name, lists, width in (
            ("waits", [[(t,) for t in s.waits] for s in p.steps], 1),
            ("fetches", [s.fetches for s in p.steps], 5),
            ("background", [s.background for s in p.steps], 6),
            ("experts", [s.experts for s in p.steps], 2),
        ):
            off, flat = _csr(lists, width)
            arrays[f"{k}.{name}_off"], arrays[f"{k}.{name}"] = off, flat
        arrays[f"{k}.reads"] = np.array(p.reads, np.int64).reshape(-1, 4)
        arrays[f"{k}.initial"] = np.array(p.initial, np.int64).reshape(-1, 2)
        arrays[f"{k}.group_phase"] = p.group_phase
        arrays[f"{k}.sim_decode_us"] = p.sim_decode_us
        runs.append(dict(name=k, policy=p.policy, fraction=p.fraction, overrides=p.overrides, hardware=p.hardware,
                         num_slots=p.num_slots, num_transfers=p.num_transfers, tier_buffers=list(p.tier_buffers),
                         counts=p.counts))
    header = dict(header, version=PLAN_VERSION, runs=runs)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_plans(path: Path) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """(header, {run name: arrays}) of a saved plan file."""
    if not path.exists():
        raise InputError(f"plan file {path} does not exist; make one with 'moe-replay plan'")
    z = np.load(path)
    header = json.loads(bytes(z["header"]).decode())
    if header.get("version") != PLAN_VERSION:
        raise InputError(f"{path}: plan version {header.get('version')!r}; re-plan with this moe-replay")
    runs = {}
    for r in header["runs"]:
        pre = r["name"] + "."
        runs[r["name"]] = {k[len(pre):]: z[k] for k in z.files if k.startswith(pre)}
    return header, runs


def verify_plan(arrays: dict[str, np.ndarray]) -> None:
    """Check a plan's slot and read operations symbolically; raise ValueError on the first hazard.

    Every expert kernel must read a slot that holds the expert it stands for, written by a
    finished copy (synchronous, or background and waited for); no copy may target a slot whose
    background copy is still in flight. A copy after a read must read the buffer the read
    filled, and every read must be released by a step the GPU has reached when it is due: a
    synchronous fetch's read at its step, and no read before it released by a later step.
    """
    holds: dict[int, int] = {int(slot): int(x) for x, slot in arrays["initial"]}
    in_flight: dict[int, tuple[int, int]] = {}  # transfer id -> (slot, x)
    busy: set[int] = set()  # slots with a background copy in flight
    reads = arrays["reads"]
    latest_gate = np.maximum.accumulate(reads[:, 3]) if len(reads) else reads[:, 3]
    w_off, w = arrays["waits_off"], arrays["waits"]
    f_off, f = arrays["fetches_off"], arrays["fetches"]
    b_off, b = arrays["background_off"], arrays["background"]
    e_off, e = arrays["experts_off"], arrays["experts"]

    def check_read(s: int, x: int, src: int, buf: int, read: int, synchronous: bool) -> None:
        if read < 0:
            return
        rx, kind, rbuf, gate = (int(v) for v in reads[read])
        if (rx, kind, rbuf) != (x, src, buf):
            raise ValueError(f"step {s}: expert {x} copies from {src}/{buf} but read {read} filled {kind}/{rbuf} "
                             f"with {rx}")
        if synchronous and (gate != s or latest_gate[read] > s):
            raise ValueError(f"step {s}: read {read} waits for step {int(latest_gate[read])}")

    for s in range(len(arrays["group"])):
        for (tid,) in w[w_off[s] : w_off[s + 1]]:
            slot, x = in_flight.pop(int(tid))
            busy.discard(slot)
            holds[slot] = x
        for x, slot, src, buf, read in f[f_off[s] : f_off[s + 1]].tolist():
            if slot in busy:
                raise ValueError(f"step {s}: fetch into slot {slot} while a background copy writes it")
            check_read(s, x, src, buf, read, True)
            holds[slot] = x
        for x, slot, tid, src, buf, read in b[b_off[s] : b_off[s + 1]].tolist():
            if slot in busy:
                raise ValueError(f"step {s}: background copy into busy slot {slot}")
            check_read(s, x, src, buf, read, False)
            holds.pop(slot, None)
            busy.add(slot)
            in_flight[tid] = (slot, x)
        for slot, x in e[e_off[s] : e_off[s + 1]].tolist():
            if holds.get(slot) != x:
                raise ValueError(f"step {s}: expert {x} runs from slot {slot}, which holds {holds.get(slot)}")


def compose_run_config(trace: str, policy: str, fraction: float, model: str | None, profile: dict,
                       extra: Sequence[str] = ()) -> tuple[dict, list[str]]:
    """The plain moe-sim config (and its overrides) for one run, hardware replaced by ``profile``."""
    from omegaconf import OmegaConf

    from simulator.run import compose

    overrides = [f"trace.path={trace}", f"policy={policy}", f"cache.fraction={fraction}", *extra]
    if model:
        overrides.append(f"model={model}")
    cfg = OmegaConf.to_container(compose(overrides), resolve=True)
    cfg["hardware"] = profile
    return cfg, overrides


def load_profile(path: str) -> dict:
    """A hardware profile YAML as a dict (validated)."""
    import yaml

    from simulator.hardware import validate_profile

    p = Path(path)
    if not p.exists():
        raise InputError(f"--profile {path} does not exist; give a profile YAML (conf/hardware/*.yaml)")
    profile = yaml.safe_load(p.read_text())
    validate_profile(profile, origin=f"hardware profile {path}")
    return profile


def host_ram_settings(host_ram_gib: str, pinned_share: float | None) -> list[dict]:
    """``--host-ram`` and ``--pinned-share`` as the profile fields each run sets ({}: no tier)."""
    out = []
    for part in _split(host_ram_gib):
        try:
            gib = float(part)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise InputError(f"--host-ram {host_ram_gib!r}: give sizes in GiB > 0, e.g. 2,4,8")
        ram = int(gib * GIB)
        out.append({"host_ram_bytes": ram, "host_pinned_bytes": None if pinned_share is None
                    else int(pinned_share * ram)})
    if pinned_share is not None and not 0.0 <= pinned_share <= 1.0:
        raise InputError(f"--pinned-share {pinned_share}: give a share of host RAM in [0, 1]")
    return out or [{}]


def run_name(policy: str, fraction: float, hardware: dict) -> str:
    ram = hardware.get("host_ram_bytes")
    return f"{policy}@{fraction:g}" + (f"+ram{ram / GIB:g}GiB" if ram is not None else "")


def _plan_one(job: tuple) -> tuple[RunPlan, dict]:
    """One run of ``moe-replay plan``: compose its config, read the trace, decide and record;
    with the trace's shape and the expert size for the plan file's header."""
    from simulator.run import build_params, open_source

    trace, policy, fraction, model, profile, hardware, extra = job
    cfg, overrides = compose_run_config(trace, policy, fraction, model, dict(profile, **hardware), extra)
    source = open_source(cfg["trace"])
    meta = source.meta
    params, _ = build_params(cfg, meta)
    t0 = time.perf_counter()
    plan = plan_run(params, meta, _whole(source), run_name(policy, fraction, hardware), policy, fraction,
                    overrides, hardware)
    log(f"planned {plan.name}: {len(plan.steps)} steps, {plan.num_slots} slots, "
        f"{plan.num_transfers} background transfers, {len(plan.reads)} SSD reads, simulated "
        f"{plan.sim_decode_us.mean() / 1e3:.3f} ms/token ({time.perf_counter() - t0:.1f} s)")
    shape = dict(model=model or meta.model, trace_model=meta.model, num_layers=meta.num_layers,
                 num_experts=meta.num_experts, top_k=meta.top_k, has_logits=bool(meta.has_logits),
                 expert_bytes=int(params.expert_bytes[0]))
    return plan, shape


def cmd_plan(args) -> None:
    if args.jobs < 1:
        raise InputError(f"--jobs {args.jobs}: give the number of runs to plan at once, at least 1")
    profile = load_profile(args.profile)
    jobs = [(args.trace, policy, fraction, args.model, profile, hardware, list(args.override))
            for policy in _split(args.policies)
            for fraction in (float(f) for f in _split(args.fractions))
            for hardware in host_ram_settings(args.host_ram, args.pinned_share)]
    # the first run here, so that a bad trace or override stops with its one line before any fork
    first, shape = _plan_one(jobs[0])
    runs = [first]
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(args.jobs, len(jobs) - 1), mp_context=fork) as pool:
            runs += [plan for plan, _ in pool.map(_plan_one, jobs[1:])]
    else:
        runs += [_plan_one(job)[0] for job in jobs[1:]]
    header = dict(trace=args.trace, label=args.label, profile=args.profile, profile_name=profile.get("name"),
                  profile_date=profile.get("host", {}).get("date"), **shape, extra_overrides=list(args.override))
    save_plans(Path(args.out), header, runs)
    _, saved = load_plans(Path(args.out))
    for arrays in saved.values():
        verify_plan(arrays)
    log(f"verified the slot and read operations of {len(saved)} runs")
    log(f"wrote {args.out}")


def _whole(source):
    from traces.format import concat_chunks

    chunks = list(source.iter_chunks())
    return chunks[0] if len(chunks) == 1 else concat_chunks(chunks)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------- execution


class _Progress:
    """What the executing threads tell each other, under one condition variable: how many SSD
    reads are done, which steps the GPU work was issued for (with the event that marks them),
    which background copies were issued (with the event of their end), and a thread's error."""

    def __init__(self):
        self.cond = threading.Condition()
        self.reads_done = 0
        self.nonexpert_done: dict[int, object] = {}  # step -> event after its non-expert part
        self.fetches_issued: dict[int, object] = {}  # step -> event after its synchronous copies
        self.copied: dict[int, object] = {}  # background transfer id -> event at its copy's end
        self.error: BaseException | None = None

    def put(self, table: dict, key: int, value) -> None:
        with self.cond:
            table[key] = value
            self.cond.notify_all()

    def read_done(self, read: int) -> None:
        with self.cond:
            self.reads_done = read + 1
            self.cond.notify_all()

    def wait(self, ready: Callable[[], bool]) -> None:
        with self.cond:
            while not ready():
                if self.error is not None:
                    raise RuntimeError("a replay thread failed") from self.error
                self.cond.wait()

    def get(self, table: dict, key: int):
        self.wait(lambda: key in table)
        return table[key]

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = self.error or error
            self.cond.notify_all()


class Executor:
    """GPU (or, for tests, CPU) state for executing plans: host experts, the host-RAM tier, the
    expert file, slots, kernels, streams."""

    def __init__(self, dims, device, dtype, num_slots: int, host_layers: int, num_experts: int,
                 expert_mode: str, ctx: int, max_launches: int, max_n: int,
                 tier_buffers: tuple[int, int] = (0, 0), ssd_file: Path | None = None):
        torch = import_torch()
        self.torch, self.device, self.dtype = torch, device, dtype
        self.cuda = device.type == "cuda"
        self.dims = dims
        self.E = num_experts
        self.host_layers = host_layers
        numel = 3 * dims.hidden * dims.expert_intermediate
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.expert_bytes = numel * itemsize
        self.host = self._host_experts(host_layers * num_experts, numel) if host_layers else []
        n_pinned, n_pageable = tier_buffers
        self.tier = {PINNED: HostBuffers(n_pinned, self.expert_bytes, pinned=self.cuda),
                     PAGEABLE: HostBuffers(n_pageable, self.expert_bytes, pinned=False)}
        if n_pinned or n_pageable:
            log(f"host RAM tier: {n_pinned} pinned and {n_pageable} pageable expert buffers "
                f"({(n_pinned + n_pageable) * self.expert_bytes / GIB:.1f} GiB)")
        self.disk = DirectFile(ssd_file, round_up(self.expert_bytes)) if ssd_file else None
        self.slots_mem = torch.empty((num_slots, numel), dtype=dtype, device=device)
        self.slot_bytes = self.slots_mem.view(torch.uint8)
        log(f"gpu: {num_slots} expert slots ({num_slots * self.expert_bytes / GIB:.1f} GiB)")
        self.mode = expert_mode if (self.cuda or expert_mode == "batched") else "eager"
        self.background_from = "thread"  # or "compute": the compute thread issues them (--background-from)
        t0 = time.perf_counter()
        self.stack = LayerStack(dims, self.slots_mem, device, dtype, ctx, self.mode, max_n, max_launches)
        log(f"layer stack ({self.mode}) ready in {time.perf_counter() - t0:.1f} s")
        if self.cuda:
            self.compute = torch.cuda.Stream(priority=-1)
            self.background = torch.cuda.Stream(priority=0)
        else:
            self.compute = self.background = None

    def _host_experts(self, n_host: int, numel: int) -> list:
        """n_host experts of random weights in host memory (pinned on a GPU host), as bytes."""
        torch = self.torch
        t0 = time.perf_counter()
        per_chunk = max(1, (2 << 30) // self.expert_bytes)  # the pinned allocator rounds sizes up
        rows = []
        for start in range(0, n_host, per_chunk):
            n = min(per_chunk, n_host - start)
            block = torch.empty((n, numel), dtype=self.dtype, pin_memory=self.cuda)
            fill = torch.randn((min(n, 64), numel), device=self.device, dtype=self.dtype) * 0.02
            for j in range(0, n, fill.shape[0]):
                m = min(fill.shape[0], n - j)
                block[j : j + m].copy_(fill[:m])
            rows.extend(block.view(torch.uint8).unbind(0))
        log(f"host: {n_host} experts ({n_host * self.expert_bytes / GIB:.1f} GiB{' pinned' if self.cuda else ''}, "
            f"{self.host_layers} layers x {self.E}) in {time.perf_counter() - t0:.1f} s")
        return rows

    def _source(self, x: int, src: int, buf: int):
        """The host bytes a copy of expert x reads."""
        if src == HOST:
            return self.host[(x // self.E) % self.host_layers * self.E + x % self.E]
        return self.tier[src][buf][: self.expert_bytes]

    def _event(self, stream):
        """A CUDA event recorded on ``stream`` now (None on the CPU, where work is synchronous)."""
        if not self.cuda:
            return None
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev

    def _reader(self, reads: list, progress: _Progress) -> None:
        """The SSD: read after read, in the plan's order, each once the GPU reached its step."""
        for r, (x, kind, buf, gate) in enumerate(reads):
            ev = progress.get(progress.nonexpert_done, gate)
            if ev is not None:
                ev.synchronize()
            self.disk.read(x, self.tier[kind].arrays[buf])
            progress.read_done(r)

    def _background(self, transfers: list, progress: _Progress) -> None:
        """The background queue: copies in transfer order on the low-priority stream, each after
        the synchronous copies of the step that queued it and after its read."""
        torch = self.torch
        ctx = torch.cuda.stream(self.background) if self.cuda else contextlib.nullcontext()
        with ctx:
            for step, (x, slot, tid, src, buf, read) in transfers:
                after = progress.get(progress.fetches_issued, step)
                if read >= 0:
                    progress.wait(lambda read=read: progress.reads_done > read)
                if after is not None:
                    self.background.wait_event(after)
                self.slot_bytes[slot].copy_(self._source(x, src, buf), non_blocking=self.cuda)
                progress.put(progress.copied, tid, self._event(self.background))

    def execute(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Run one plan; returns the measured time of every group in microseconds."""
        torch = self.torch
        group, layer_of = arrays["group"].tolist(), arrays["layer"].tolist()
        w_off, w = arrays["waits_off"].tolist(), arrays["waits"][:, 0].tolist()
        f_off, f = arrays["fetches_off"].tolist(), arrays["fetches"].tolist()
        b_off, b = arrays["background_off"].tolist(), arrays["background"].tolist()
        e_off = arrays["experts_off"].tolist()
        reads = arrays["reads"].tolist()
        if reads and self.disk is None:
            raise InputError("this plan reads experts from the SSD: give --ssd-file")
        n = len(group)
        self.stack.load([arrays["experts"][e_off[s] : e_off[s + 1], 0] for s in range(n)])
        nonexpert = [self.stack.nonexpert(layer) for layer in range(self.dims.num_layers)]
        gates = {r[3] for r in reads}
        queued = {s for s in range(n) if b_off[s] < b_off[s + 1]}
        transfers = [(s, b[k]) for s in range(n) for k in range(b_off[s], b_off[s + 1])]
        for x, slot in arrays["initial"].tolist():  # the warm cache, untimed
            if self.host:
                self.slot_bytes[slot].copy_(self._source(x, HOST, -1), non_blocking=True)
        if self.cuda:
            torch.cuda.synchronize()
        progress = _Progress()
        inline = self.background_from == "compute"
        if inline and reads:
            raise InputError("--background-from compute needs a plan without SSD reads")
        by_step: dict[int, list] = {}
        for step, t in transfers if inline else ():
            by_step.setdefault(step, []).append(t)
        threads = [threading.Thread(target=_guarded(fn, progress), args=(work, progress), daemon=True)
                   for fn, work in ((self._reader, reads), (self._background, [] if inline else transfers))
                   if work]
        times = np.zeros(len(arrays["group_phase"]))
        ctx = torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)  # a thread a read or a copy woke must not wait 5 ms for the GIL
        try:
            for t in threads:
                t.start()
            with ctx:
                s = 0
                while s < n:
                    g = group[s]
                    if self.cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    else:
                        t0 = time.perf_counter()
                    while s < n and group[s] == g:
                        nonexpert[layer_of[s]]()
                        if s in gates:
                            progress.put(progress.nonexpert_done, s, self._event(self.compute))
                        # the expert phase: the background copies the simulator completes by now
                        for k in range(w_off[s], w_off[s + 1]):
                            ev = progress.get(progress.copied, w[k])
                            if ev is not None:
                                self.compute.wait_event(ev)
                        for k in range(f_off[s], f_off[s + 1]):
                            x, slot, src, buf, read = f[k]
                            if read >= 0:
                                progress.wait(lambda read=read: progress.reads_done > read)
                            self.slot_bytes[slot].copy_(self._source(x, src, buf), non_blocking=True)
                        if s in queued:
                            ev = self._event(self.compute)
                            progress.put(progress.fetches_issued, s, ev)
                            if inline:  # the same copies, in queue order, issued from this thread
                                with torch.cuda.stream(self.background) if self.cuda else contextlib.nullcontext():
                                    self.background.wait_event(ev) if self.cuda else None
                                    for x, slot, tid, src, buf, _ in by_step.get(s, ()):
                                        self.slot_bytes[slot].copy_(self._source(x, src, buf), non_blocking=self.cuda)
                                        progress.put(progress.copied, tid, self._event(self.background))
                        self.stack.experts(s)
                        s += 1
                    if self.cuda:
                        end.record()
                        end.synchronize()
                        times[g] = start.elapsed_time(end) * 1e3
                    else:
                        times[g] = (time.perf_counter() - t0) * 1e6
        except BaseException as e:
            progress.fail(e)
            raise
        finally:
            for t in threads:
                t.join()
            sys.setswitchinterval(switch)
        if progress.error is not None:
            raise RuntimeError("a replay thread failed") from progress.error
        if self.cuda:
            torch.cuda.synchronize()
        return times


def _guarded(fn, progress: _Progress):
    """``fn`` for a thread: an error is handed to the others instead of lost."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as e:
            progress.fail(e)
    return run


def cmd_run(args) -> None:
    if args.repeats < 1:
        raise InputError(f"--repeats {args.repeats}: executions per run must be at least 1")
    torch = import_torch()
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only contend
    header, runs = load_plans(Path(args.plan))
    model = header.get("model")
    if args.tiny or device.type == "cpu":
        dims = tiny_dims(model_dims(model if model in with_attention_shapes() else "qwen3_next_80b_a3b"))
    else:
        dims = model_dims(model)
    dims = dataclasses.replace(dims, num_layers=header["num_layers"], num_experts=header["num_experts"],
                               top_k=header["top_k"])
    dtype = getattr(torch, args.dtype)
    if not (args.tiny or device.type == "cpu") and dims.expert_bytes(2) != header["expert_bytes"]:
        log(f"warning: trace expert_bytes {header['expert_bytes']} != {model} expert "
            f"{dims.expert_bytes(2)} bytes; timing the model's shapes")
    selected = [r for r in header["runs"] if not args.only or r["name"] in _split(args.only)]
    if not selected:
        raise InputError(f"--only {args.only!r} names no run of {args.plan}; its runs: "
                         f"{', '.join(r['name'] for r in header['runs'])}")
    num_slots = max(r["num_slots"] for r in selected)
    tiered = [r for r in selected if r.get("hardware", {}).get("host_ram_bytes") is not None]
    host_layers = min(args.host_layers, header["num_layers"]) if len(tiered) < len(selected) else 0
    tier_buffers = tuple(max((r["tier_buffers"][j] for r in tiered), default=0) for j in (0, 1))
    ssd_file = None
    if any(len(runs[r["name"]]["reads"]) for r in selected):
        if not args.ssd_file:
            raise InputError(f"{args.plan} reads experts from the SSD: give --ssd-file (an expert file on the disk "
                             "to test; created if missing)")
        ssd_file = write_expert_file(Path(args.ssd_file), args.ssd_file_mib * MIB)
    facts = host_facts(device)
    sample_disk = _disk_sampler(args, device, ssd_file, facts)
    log(f"host: {facts.get('gpu')}; {len(selected)} runs; model {model}; {host_layers} host layers"
        + (f"; expert file {ssd_file}" if ssd_file else ""))
    max_n = header["top_k"]
    max_launches = max(int(np.maximum(1, -(-np.diff(runs[r["name"]]["experts_off"]) // max_n)).sum())
                       for r in selected)
    mode = args.expert_mode
    if mode == "auto":
        mode = "batched" if device.type == "cuda" and batched_available() else ("graph" if device.type == "cuda" else "eager")

    def executor(mode):
        return Executor(dims, device, dtype, num_slots, host_layers, header["num_experts"], mode, args.ctx,
                        max_launches, max_n, tier_buffers, ssd_file)

    ex = None
    try:
        ex = executor(mode)
    except Exception as e:
        if mode != "batched" or device.type != "cuda":
            raise
        log(f"warning: batched experts failed ({type(e).__name__}: {e}); falling back to --expert-mode graph")
    if ex is None:  # outside the except block, so the failed attempt's memory is released first
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        ex = executor("graph")
    ex.background_from = args.background_from
    out = dict(header={k: v for k, v in header.items() if k != "runs"}, host=facts, device=str(device),
               host_layers=host_layers, expert_mode=ex.mode, background_from=args.background_from,
               dims=dims.__dict__, repeats=args.repeats,
               dtype=args.dtype, ssd_file=str(ssd_file) if ssd_file else None, runs=[])
    # Repeats go round the runs (run 1, 2, ..., then run 1 again): a host whose disk or link drifts
    # over the minutes of a lease moves every run alike instead of one run's repeats.
    reps: dict[str, list[np.ndarray]] = {r["name"]: [] for r in selected}
    for rep in range(args.repeats):
        sample_disk()
        for r in selected:
            arrays = runs[r["name"]]
            decode = arrays["group_phase"] == PHASE_DECODE
            t0 = time.perf_counter()
            times = ex.execute(arrays)
            reps[r["name"]].append(times[decode])
            log(f"{r['name']:>28s} rep {rep}: measured {times[decode].mean() / 1e3:8.3f} ms/token, "
                f"simulated {arrays['sim_decode_us'].mean() / 1e3:8.3f} ({time.perf_counter() - t0:.1f} s)")
            # after every execution: a cut-off replay keeps what it measured
            out["runs"] = [_run_result(q, runs[q["name"]], reps[q["name"]]) for q in selected if reps[q["name"]]]
            _write_results(Path(args.out), out)
    sample_disk()
    log(f"wrote {Path(args.out) / 'replay.json'}")


def _disk_sampler(args, device, ssd_file: Path | None, facts: dict) -> Callable[[], None]:
    """With ``--disk-samples CALIBRATION``: a call that measures the calibration's read-then-copy
    pipelines on the expert file and rewrites ``disk.samples.json`` beside replay.json with every
    round so far (the runs call it before each round and after the last); else a no-op."""
    if not args.disk_samples:
        return lambda: None
    path = Path(args.disk_samples)
    try:
        calibration = json.loads(path.read_text())
        calibration["args"]["read_copy_experts"], calibration["expert_bytes"], calibration["max_copy_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"--disk-samples {path}: not the samples JSON of a moe-calibrate run; give the "
                         "<profile>.samples.json it wrote") from None
    if ssd_file is None:
        raise InputError("--disk-samples needs a plan that reads from the SSD (and --ssd-file)")
    rounds: list[tuple[float, list[dict]]] = []
    t0 = time.perf_counter()

    def sample() -> None:
        rounds.append((time.perf_counter() - t0, measure_disk_like(device, ssd_file, calibration, len(rounds))))
        fit = disk_samples(calibration, facts, rounds[-1:])["rounds"][0]["ssd_back_to_back"]
        log(f"disk round {len(rounds)}: " + (f"{fit['bandwidth_gbps']:.3f} GB/s back to back" if fit else "measured"))
        out = Path(args.out) / "disk.samples.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(disk_samples(calibration, facts, rounds), indent=1) + "\n")

    return sample


def _run_result(r: dict, arrays: dict[str, np.ndarray], reps: list[np.ndarray]) -> dict:
    """One run's entry of replay.json: per decode token the mean over its repeats, and each repeat's mean."""
    measured = np.mean(reps, axis=0)
    return dict(
        name=r["name"], policy=r["policy"], fraction=r["fraction"], overrides=r["overrides"],
        hardware=r.get("hardware", {}), counts=r["counts"], num_slots=r["num_slots"],
        measured_ms_per_token=float(measured.mean() / 1e3),
        simulated_ms_per_token=float(arrays["sim_decode_us"].mean() / 1e3),
        repeat_ms_per_token=[float(t.mean() / 1e3) for t in reps],
        measured_us=[round(float(v), 2) for v in measured],
        simulated_us=[round(float(v), 2) for v in arrays["sim_decode_us"]],
        **per_token_counts(arrays),
    )


def per_token_counts(arrays: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """Per decode token of a plan: synchronous fetches, background transfers issued, waits for
    background completions, SSD reads (by the step that released them)."""
    decode = arrays["group_phase"] == PHASE_DECODE
    steps_group = arrays["group"]
    out = {}
    for key, name in (("fetches_per_token", "fetches"), ("background_per_token", "background"),
                      ("waits_per_token", "waits")):
        counts = np.zeros(len(decode), np.int64)
        np.add.at(counts, steps_group, np.diff(arrays[f"{name}_off"]))
        out[key] = counts[decode].tolist()
    reads = np.zeros(len(decode), np.int64)
    np.add.at(reads, steps_group[arrays["reads"][:, 3]], 1)
    out["ssd_reads_per_token"] = reads[decode].tolist()
    return out


def _write_results(outdir: Path, out: dict) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(outdir / "replay.json", json.dumps(out) + "\n")


# --------------------------------------------------------------------------- comparison

DECISION_COUNTS = ("fetches", "substitutions", "background_admissions", "ssd_reads")


def compare_runs(measured: dict, profile: dict, simulate) -> list[dict]:
    """Per run: measured and simulated ms per token, the per-token gap, and which decision
    counts of the plan the simulator no longer reproduces with ``profile`` (background
    completions move with the profile's times).

    ``simulate(overrides, profile) -> (summary, simulated decode-token times in us)``; a run's
    ``hardware`` fields (its host-RAM size) are set on the profile first.
    """
    rows = []
    for r in measured["runs"]:
        hardware = r.get("hardware") or {}
        summary, sim_us = simulate(r["overrides"], dict(profile, **hardware))
        meas_us = np.asarray(r["measured_us"], dtype=np.float64)
        if len(sim_us) != len(meas_us):
            raise InputError(f"run {r['name']}: {len(meas_us)} measured decode tokens but the simulator "
                             f"gives {len(sim_us)}; compare with the trace and overrides the plan used")
        sim, meas = summary["ms_per_token"], r["measured_ms_per_token"]
        counts = r.get("counts") or {}
        changed = {k: (counts[k], summary[k]) for k in DECISION_COUNTS
                   if k in counts and k in summary and counts[k] != summary[k]}
        rows.append(dict(name=r["name"], policy=r["policy"], fraction=r["fraction"], hardware=hardware,
                         measured_ms=meas, simulated_ms=sim, rel_err=(sim - meas) / meas,
                         stall_ms=summary.get("stall_ms_per_token"), gap_us=(meas_us - np.asarray(sim_us)).tolist(),
                         fetches=r.get("fetches_per_token"), background=r.get("background_per_token"),
                         ssd_reads=r.get("ssd_reads_per_token"), repeats_ms=r.get("repeat_ms_per_token") or [],
                         plan_simulated_ms=r.get("simulated_ms_per_token"),
                         changed=changed))
    return rows


def speedups(rows: list[dict], baseline: str = "fetch_all") -> list[dict]:
    """Speedup of each policy over the baseline at the same fraction, measured and simulated."""
    base = {r["fraction"]: r for r in rows if r["policy"] == baseline}
    out = []
    for r in rows:
        b = base.get(r["fraction"])
        if b is None or r["policy"] == baseline:
            continue
        m = b["measured_ms"] / r["measured_ms"]
        s = b["simulated_ms"] / r["simulated_ms"]
        out.append(dict(policy=r["policy"], fraction=r["fraction"], measured=m, simulated=s, rel_err=(s - m) / m))
    return out


def simulate_with_profile(overrides: list[str], profile: dict, engine: str = "numba") -> tuple[dict, np.ndarray]:
    """moe-sim's summary and decode-token times (us) for these overrides, hardware = ``profile``."""
    from omegaconf import OmegaConf

    from simulator.run import compose, simulate_config

    cfg = OmegaConf.to_container(compose(list(overrides) + [f"engine={engine}"]), resolve=True)
    cfg["hardware"] = profile
    summary, result = simulate_config(cfg)
    return summary, result.time_us[result.phase == PHASE_DECODE]


def gap_fit(rows: list[dict]) -> dict | None:
    """Least squares over every decode token of every run: measured - simulated (us) =
    per_token + per_fetch * synchronous fetches + per_background * background transfers issued."""
    A, y = [], []
    for r in rows:
        if not r.get("fetches") or not r.get("background"):
            return None
        A += [[1.0, f, b] for f, b in zip(r["fetches"], r["background"], strict=True)]
        y += r["gap_us"]
    if len(A) < 3:
        return None
    coef, *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    return dict(per_token_us=float(coef[0]), per_fetch_us=float(coef[1]), per_background_us=float(coef[2]))


NOTES_MARKER = "<!-- notes: kept when moe-replay compare rewrites this file -->"


def _tiered(row: dict) -> bool:
    return row["hardware"].get("host_ram_bytes") is not None


def _prefetching(measured: dict) -> bool:
    """Whether a section's runs prefetch (their rows are held to every row <= ROW_TOLERANCE too)."""
    return any(o.startswith("prefetch.predictor=") and o != "prefetch.predictor=none"
               for r in measured["runs"] for o in r["overrides"])


def _error_stats(rows: list[dict]) -> tuple[float, float]:
    errs = [abs(r["rel_err"]) for r in rows]
    return statistics.mean(errs), max(errs)


def section_title(measured: dict) -> str:
    """A measured file's shape and trace, as its section heads it."""
    h = measured["header"]
    shape = f"{h.get('num_layers')} layers x {h.get('num_experts')} experts, top-{h.get('top_k')}"
    return f"{h['label']} ({shape})" if h.get("label") else f"`{h.get('model')}` on `{h.get('trace')}` ({shape})"


def _profile_terms(profile: dict, model: str | None) -> str:
    pcie, gpu = profile["pcie"], profile["gpu"]
    text = (f"a copy costs {pcie['latency_us']} us back to back"
            + (f" ({pcie['idle_latency_us']} us on an idle link)" if "idle_latency_us" in pcie else "")
            + f" + bytes / {pcie['bandwidth_gbps']} GB/s"
            + (f" (pageable: {pcie['pageable_bandwidth_gbps']} GB/s)" if "pageable_bandwidth_gbps" in pcie else "")
            + f"; an SSD read {profile['ssd']['latency_us']} us + bytes / {profile['ssd']['bandwidth_gbps']} GB/s; "
            + f"{gpu.get('token_fixed_us', 0)} us per token and {gpu.get('step_fixed_us', 0)} us per step fixed.")
    comp = (profile.get("compute") or {}).get(model, {})
    if comp:
        text += (f" For `{model}`: {comp.get('gpu_expert_us')} us per expert call, "
                 f"{comp.get('nonexpert_layer_us')} us of non-expert compute per layer.")
    return text


def _render_section(w, measured: dict, profile: dict, profile_path: str, rows: list[dict], engine: str) -> None:
    """One measured file's section: set-up, the time table, speedups, the gap; SSD rows apart."""
    h = measured["header"]
    dims = measured.get("dims", {})
    cuda = str(measured.get("device", "")).startswith("cuda")
    flat = [r for r in rows if not _tiered(r)]
    tiered = [r for r in rows if _tiered(r)]
    n_tokens = len(measured["runs"][0].get("measured_us", []))
    w(f"## {section_title(measured)}\n\n### Set-up\n\n")
    w(f"- Trace `{h.get('trace')}`: {h.get('num_layers')} layers x {h.get('num_experts')} experts, "
      f"top-{h.get('top_k')}, {'full router logits' if h.get('has_logits', True) else 'no router logits'}; "
      f"{n_tokens} decode tokens timed per run; moe-sim overrides "
      f"`{' '.join(measured['runs'][0]['overrides'][3:])}` besides trace, policy and fraction.\n")
    same = sum(math.isclose(r["simulated_ms"], r["plan_simulated_ms"], rel_tol=1e-9) for r in rows
               if r.get("plan_simulated_ms") is not None)
    planned = (f"; the plan was made with `{h.get('profile')}` ({h.get('profile_name')}, {h.get('profile_date')}), "
               f"and re-simulated here {same} of {len(rows)} runs take the plan's own times")
    w(f"- Profile `{profile_path}`{planned}: {_profile_terms(profile, h.get('model'))}\n")
    where = (f"{measured.get('host_layers')} layers of experts in pinned host memory, trace layer l reading host "
             f"layer l mod {measured.get('host_layers')}" if measured.get("host_layers") else "")
    if tiered:
        where += ("; " if where else "") + ("with a host-RAM limit, a tier of the plan's size (pinned and pageable "
                                            "buffers) and the rest read from an expert file with O_DIRECT")
    w(f"- Replay: expert {dims.get('hidden')}x{dims.get('expert_intermediate')} SwiGLU in "
      f"{measured.get('dtype', 'bfloat16')} ({h.get('expert_bytes', 0) / MIB:.2f} MiB); {where}; experts run "
      f"`{measured.get('expert_mode')}`; {measured.get('repeats')} execution(s) per run; time per token from "
      f"{'CUDA events' if cuda else 'the wall clock'}, synchronised per token.\n")
    w(f"- Simulated: moe-sim (`engine={engine}`) on the same trace, policy preset, `cache.fraction`, overrides, "
      "host-RAM size and profile.\n\n")
    if flat:
        _render_times(w, flat, SHAPE_TARGET)
    if tiered:
        _render_ssd(w, tiered)
    changed = [r for r in rows if r["changed"]]
    if changed:
        w("Runs whose decisions the profile moves (plan -> now; background completions depend on the times): "
          + "; ".join(f"{r['name']}: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in r["changed"].items())
                      for r in changed) + ".\n\n")


def _render_times(w, rows: list[dict], target: tuple[float, float]) -> None:
    w("### Time per decode token\n\n")
    w("| policy | resident | measured ms/token | simulated ms/token | error | within 10 % |\n")
    w("|---|---:|---:|---:|---:|:---:|\n")
    for r in rows:
        ok = abs(r["rel_err"]) <= ROW_TOLERANCE
        w(f"| {r['policy']} | {r['fraction']:.0%} | {r['measured_ms']:.3f} | {r['simulated_ms']:.3f} | "
          f"{r['rel_err']:+.1%} | {'yes' if ok else '**no**'} |\n")
    mean, worst = _error_stats(rows)
    met = mean <= target[0] and worst <= target[1]
    w(f"\nMean |error| {mean:.1%}, max {worst:.1%} (target: mean <= {target[0]:.0%}, max <= {target[1]:.0%}: "
      f"{'met' if met else '**not met**'}); {sum(abs(r['rel_err']) <= ROW_TOLERANCE for r in rows)} of "
      f"{len(rows)} rows within {ROW_TOLERANCE:.0%}.\n\n")
    speed = speedups(rows)
    if speed:
        w("### Speedup over fetch_all\n\n")
        w("| policy | resident | measured | simulated | error | within 10 % |\n|---|---:|---:|---:|---:|:---:|\n")
        for s in sorted(speed, key=lambda s: (s["policy"] not in ("quality_first", "speed_first"), s["policy"])):
            ok = abs(s["rel_err"]) <= ROW_TOLERANCE
            w(f"| {s['policy']} | {s['fraction']:.0%} | {s['measured']:.2f}x | {s['simulated']:.2f}x | "
              f"{s['rel_err']:+.1%} | {'yes' if ok else '**no**'} |\n")
        w("\n")
    fit = gap_fit(rows)
    if fit:
        w("### Where the gap is\n\n")
        w("Per decode token, measured minus simulated time, fitted over all tokens of all runs as a constant plus "
          "a cost per synchronous fetch and per background transfer issued in the token:\n\n")
        w(f"- {fit['per_token_us']:+.0f} us per token that the model does not have;\n")
        w(f"- {fit['per_fetch_us']:+.1f} us per synchronous fetch;\n")
        w(f"- {fit['per_background_us']:+.1f} us per background transfer.\n\n")
        w("| run | mean gap (us/token) | fetches/token | background/token |\n|---|---:|---:|---:|\n")
        for r in rows:
            w(f"| {r['name']} | {statistics.mean(r['gap_us']):.0f} | {statistics.mean(r['fetches']):.1f} | "
              f"{statistics.mean(r['background']):.1f} |\n")
        w("\n")


def repeat_spread(repeats_ms: list[float]) -> float | None:
    """(slowest - fastest) / mean of a run's repeats; None for fewer than two."""
    if len(repeats_ms) < 2:
        return None
    return (max(repeats_ms) - min(repeats_ms)) / statistics.mean(repeats_ms)


def _render_ssd(w, rows: list[dict]) -> None:
    w("### The SSD path: host RAM limited, the rest read from disk\n\n")
    spreads = [repeat_spread(r["repeats_ms"]) for r in rows]
    spread = all(s is not None for s in spreads)
    w("| policy | resident | host RAM (pinned) | SSD reads/token | measured ms/token | simulated ms/token | error "
      "| within 10 % |" + (" repeats, ms/token | spread |" if spread else "")
      + "\n|---|---:|---:|---:|---:|---:|---:|:---:|" + ("---|---:|" if spread else "") + "\n")
    for r, sp in zip(rows, spreads, strict=True):
        hw = r["hardware"]
        pinned = hw.get("host_pinned_bytes")
        ram = f"{hw['host_ram_bytes'] / GIB:g} GiB ({'all' if pinned is None else f'{pinned / GIB:g} GiB'})"
        reads = f"{statistics.mean(r['ssd_reads']):.1f}" if r.get("ssd_reads") else "-"
        ok = abs(r["rel_err"]) <= ROW_TOLERANCE
        w(f"| {r['policy']} | {r['fraction']:.0%} | {ram} | {reads} | {r['measured_ms']:.3f} | {r['simulated_ms']:.3f} "
          f"| {r['rel_err']:+.1%} | {'yes' if ok else '**no**'} |"
          + (f" {', '.join(f'{t:.1f}' for t in r['repeats_ms'])} | {sp:.1%} |" if spread else "") + "\n")
    mean, worst = _error_stats(rows)
    w(f"\nMean |error| {mean:.1%}, max {worst:.1%}; {sum(abs(r['rel_err']) <= ROW_TOLERANCE for r in rows)} of "
      f"{len(rows)} rows within {ROW_TOLERANCE:.0%}.")
    if spread:
        w(f" Measured is the mean of {len(rows[0]['repeats_ms'])} executions per run, taken in rounds over the "
          f"runs; *spread*: (slowest - fastest) / mean of a run's executions, median {statistics.median(spreads):.1%}, "
          f"max {max(spreads):.1%}.")
    w("\n\n")


def render_validation(sections: list[tuple[dict, list[dict], dict, str]], engine: str) -> str:
    """docs/VALIDATION.md: a summary per shape and trace, then per measured file its set-up,
    measured-vs-simulated table, speedups, the per-token gap and its SSD rows. ``sections``:
    (measured, compared rows, profile, profile path) per measured file."""
    out = io.StringIO()
    w = out.write
    w("# Validation: simulated against measured time per token\n\n")
    w("Written by `moe-replay compare` from the measurements of `moe-replay run` (commands below).\n\n")
    hosts = {_host_line(measured.get("host", {})) for measured, *_ in sections}
    profiles = {(path, profile.get("source"), profile["host"].get("date")) for _, _, profile, path in sections}
    w("".join(f"- Host: {h}.\n" for h in sorted(hosts)))
    if len(profiles) == 1:
        (path, source, date), = profiles
        w(f"- Hardware profile `{path}` ({source}, {date}).\n\n")
    else:
        w("- Hardware profiles, per section: " + "; ".join(
            f"{section_title(measured)}: `{path}` ({profile.get('source')}, {profile['host'].get('date')})"
            for measured, _, profile, path in sections) + ".\n\n")
    w("## Summary\n\n| shape and trace | rows | mean abs. error | max abs. error | target | met |\n"
      "|---|---:|---:|---:|---|:---:|\n")
    for measured, rows, *_ in sections:
        flat = [r for r in rows if not _tiered(r)]
        every_row = (ROW_TOLERANCE, ROW_TOLERANCE)
        for label, part, target in (("", flat, SHAPE_TARGET),
                                    (", prefetch rows", flat if _prefetching(measured) else [], every_row),
                                    (", SSD path", [r for r in rows if _tiered(r)], every_row)):
            if not part:
                continue
            mean, worst = _error_stats(part)
            goal = (f"mean <= {target[0]:.0%}, max <= {target[1]:.0%}" if target[0] != target[1]
                    else f"every row <= {target[1]:.0%}")
            w(f"| {section_title(measured)}{label} | {len(part)} | {mean:.1%} | {worst:.1%} | {goal} | "
              f"{'yes' if mean <= target[0] and worst <= target[1] else '**no**'} |\n")
    w("\n")
    for measured, rows, profile, path in sections:
        _render_section(w, measured, profile, path, rows, engine)
    return out.getvalue()


def _host_line(host: dict) -> str:
    return (f"{host.get('gpu', '?')}, PCIe {host.get('pcie', '?')}, CPU {host.get('cpu', '?')} "
            f"x{host.get('cpu_count', '?')}, torch {host.get('torch', '?')}")


def cmd_compare(args) -> None:
    if len(args.profile) not in (1, len(args.measured)):
        raise InputError(f"--profile given {len(args.profile)} times for {len(args.measured)} measured files; "
                         "give one profile for all, or one per measured file in their order")
    paths = args.profile * len(args.measured) if len(args.profile) == 1 else args.profile
    profiles = {path: load_profile(path) for path in paths}
    sections = []
    for name, path in zip(args.measured, paths, strict=True):
        measured = _read_measured(name)
        profile = profiles[path]
        rows = compare_runs(measured, profile, lambda o, p: simulate_with_profile(o, p, args.engine))
        sections.append((measured, rows, profile, path))
    text = render_validation(sections, args.engine)
    out = Path(args.out)
    notes = "\n"
    if out.exists() and NOTES_MARKER in out.read_text():
        notes = out.read_text().split(NOTES_MARKER, 1)[1]
    atomic_write_text(out, text + NOTES_MARKER + notes)
    for measured, rows, *_ in sections:
        print(section_title(measured))
        for r in rows:
            print(f"  {r['name']:>28s}: measured {r['measured_ms']:8.3f}  simulated {r['simulated_ms']:8.3f}  "
                  f"error {r['rel_err']:+.1%}")
    log(f"wrote {out}")


def _read_measured(name: str) -> dict:
    path = Path(name)
    if not path.is_file():
        raise InputError(f"measured file {path} does not exist; give the replay.json that 'moe-replay run' wrote")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e}); give the replay.json that 'moe-replay run' wrote") from None


def cmd_summary(args) -> None:
    """Measured against the times the plan simulated (with the planning profile), as a table:
    a first look where moe-sim (Hydra) is not installed; compare re-simulates with the new one."""
    for name in args.measured:
        measured = _read_measured(name)
        rows = [dict(r, rel_err=(r["simulated_ms_per_token"] - r["measured_ms_per_token"]) / r["measured_ms_per_token"])
                for r in measured["runs"]]
        if not rows:
            continue
        print(f"{section_title(measured)}: measured vs simulated with the planning profile "
              f"{measured['header'].get('profile_name')}")
        for r in rows:
            print(f"  {r['name']:>28s}  measured {r['measured_ms_per_token']:9.3f}  simulated "
                  f"{r['simulated_ms_per_token']:9.3f} ms/token  {r['rel_err']:+6.1%}")
        mean, worst = _error_stats(rows)
        print(f"  mean |error| {mean:.1%}, max {worst:.1%}")


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-replay", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="decide with the reference engine, save slot and read operations")
    pl.add_argument("--trace", required=True, help="trace file (Parquet)")
    pl.add_argument("--profile", required=True, help="hardware profile YAML the decisions are timed with")
    pl.add_argument("--policies", default=",".join(POLICIES), help="policy presets (conf/policy)")
    pl.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS), help="resident fractions")
    pl.add_argument("--host-ram", default="",
                    help="host-RAM sizes in GiB (hardware.host_ram_bytes), one run each; '' = the profile's")
    pl.add_argument("--pinned-share", type=float, default=None,
                    help="share of host RAM that is pinned (hardware.host_pinned_bytes); default: all")
    pl.add_argument("--model", default="qwen3_next_80b_a3b", help="model preset (conf/model); '' = from the trace")
    pl.add_argument("--label", default="", help="the shape and trace in words, for compare's section title")
    pl.add_argument("--override", action="append", default=[], help="extra moe-sim override (repeatable)")
    pl.add_argument("--out", required=True, help="plan file to write (.npz)")
    pl.add_argument("--jobs", type=int, default=1, help="runs planned at once, in worker processes")
    rn = sub.add_parser("run", help="execute a plan on the GPU and time every token")
    rn.add_argument("--plan", required=True, help="plan file from 'moe-replay plan'")
    rn.add_argument("--out", required=True, help="directory for replay.json")
    rn.add_argument("--device", default="cuda", help="cuda, or cpu (tiny shapes, for tests)")
    rn.add_argument("--tiny", action="store_true", help="tiny expert and layer shapes (tests)")
    rn.add_argument("--dtype", default="bfloat16")
    rn.add_argument("--host-layers", type=int, default=8,
                    help="layers of experts held in pinned host memory (runs without a host-RAM limit)")
    rn.add_argument("--ssd-file", default=None,
                    help="expert file the SSD reads come from (used as it is if it exists, else created at --ssd-file-mib)")
    rn.add_argument("--ssd-file-mib", type=int, default=4096, help="size of a new expert file (MiB)")
    rn.add_argument("--background-from", choices=("thread", "compute"), default="thread",
                    help="who issues the background copies: a copy thread (default), or the compute "
                         "thread right after the step that queued them (plans without SSD reads; "
                         "tells the replay's thread from the hardware's cost)")
    rn.add_argument("--expert-mode", choices=("auto", "batched", "graph", "eager"), default="auto",
                    help="batched: one grouped Triton kernel per step (auto on a GPU with Triton); graph: a CUDA "
                         "graph per expert slot; eager: plain torch calls")
    rn.add_argument("--ctx", type=int, default=1024, help="KV-cache length of full-attention layers")
    rn.add_argument("--repeats", type=int, default=1, help="executions per run (times averaged per token)")
    rn.add_argument("--only", default="", help="comma-separated run names to execute (default: all)")
    rn.add_argument("--disk-samples", default=None, metavar="CALIBRATION",
                    help="a calibration's samples JSON: measure its read-then-copy pipelines on the expert file "
                         "before each round and after the last, into disk.samples.json beside replay.json (pool "
                         "them with moe-calibrate --from-samples CALIBRATION,DISK)")
    cp = sub.add_parser("compare", help="simulate the same runs and write docs/VALIDATION.md")
    cp.add_argument("measured", nargs="+", help="replay.json files from 'moe-replay run', one section each")
    cp.add_argument("--profile", required=True, action="append",
                    help="hardware profile YAML: once for all measured files, or once per file in their order")
    cp.add_argument("--out", default="docs/VALIDATION.md")
    cp.add_argument("--engine", default="numba", choices=("numba", "reference"))
    sm = sub.add_parser("summary", help="measured against the plan's simulated times (no Hydra needed)")
    sm.add_argument("measured", nargs="+", help="replay.json files from 'moe-replay run'")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        {"plan": cmd_plan, "run": cmd_run, "compare": cmd_compare, "summary": cmd_summary}[args.cmd](args)
    except InputError as e:
        print(f"moe-replay: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)


if __name__ == "__main__":
    main()
