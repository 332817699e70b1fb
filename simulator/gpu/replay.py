"""moe-replay: execute a policy for real on a GPU and compare its time per token with the simulator.

Three steps, each a subcommand:

``plan`` (anywhere; needs the moe-sim configs, so Hydra): for each policy and resident fraction,
run the reference engine (:class:`simulator.engine.reference.ReferenceSimulator`) one step at a
time over the trace, with the moe-sim config of that policy and the given hardware profile, and
record what it did: hits, synchronous fetches, substitutes, background transfers and their
completions, evictions. The decisions are turned into slot operations (which physical GPU slot an
expert lives in) and saved as one ``.npz`` plan. Decisions never depend on measured time, so
planning ahead is exact.

``run`` (the GPU host; plain argparse, numpy and torch only): execute a plan. Expert weights of
real size live in pinned host memory (``--host-layers`` layers of them; the trace's layer l reads
host layer ``l % host_layers``, because a whole model's experts rarely fit in host RAM); a GPU
array of expert slots holds the resident ones. Per step, on the compute stream: wait for the
background transfers the simulator completes at this step, the non-expert layer (the kernels
``moe-calibrate`` times), the synchronous fetches as real host-to-device copies, then the real
SwiGLU experts of every rank (hit, fetched or substitute): one grouped kernel per step that reads
the step's slot ids from GPU memory (``--expert-mode batched``, the default with Triton), or a
CUDA graph per slot. Background admissions are real copies on a second, lower-priority stream,
issued after the step's synchronous fetches. Time per token comes from CUDA events, synchronised
per token.

``compare`` (anywhere, CPU): simulate the same trace, policies, fractions and profile through
the moe-sim configs, and write docs/VALIDATION.md with measured against simulated ms per token.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simulator.gpu.calibrate import (
    MIB,
    BatchedExperts,
    ExpertKernel,
    ModelDims,
    NonExpertLayer,
    capture_graph,
    host_facts,
    import_torch,
    model_dims,
    resolve_device,
    tiny_dims,
)
from simulator.models import with_attention_shapes
from traces.atomic import atomic_output, atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import PHASE_DECODE

POLICIES = ("fetch_all", "rule015", "first_choice", "quality_first", "speed_first")
FRACTIONS = (0.10, 0.25, 0.50)
PLAN_VERSION = 1


def log(msg: str) -> None:
    print(f"[moe-replay {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- planning

# engine events, in the order the engine produced them
_ENQUEUE, _START, _COMPLETE, _INSERT, _EVICT, _BODY = range(6)
_EVENT_CODES = {"enqueue": _ENQUEUE, "transfer_start": _START, "transfer_done": _COMPLETE,
                "insert": _INSERT, "evict": _EVICT, "step": _BODY}


def _plan_recorder():
    """An engine observer that keeps the cache and link events and each step's decision."""
    from simulator.engine.reference import Observer

    class PlanRecorder(Observer):
        def __init__(self):
            self.initial: list[int] = []  # the warm fill, before the first step
            self.events: list[tuple[int, int]] = []  # (event code, x)
            self.steps: list[tuple[int, int, int, object]] = []  # (group, layer, first event, decision)
            self._first = 0

        def on_event(self, event):
            if event.step < 0:
                self.initial.append(event.x)
            else:
                self.events.append((_EVENT_CODES[event.kind], event.x))

        def on_step(self, group, layer, decision):
            self.steps.append((group, layer, self._first, decision))
            self._first = len(self.events)

    return PlanRecorder()


@dataclass
class StepOps:
    """What the GPU does in one step, in slot terms (slots index the GPU expert-slot array)."""

    group: int
    layer: int
    waits: list[int] = field(default_factory=list)  # background transfer ids to wait for first
    fetches: list[tuple[int, int]] = field(default_factory=list)  # (expert x, slot), in order
    background: list[tuple[int, int, int]] = field(default_factory=list)  # (x, slot, transfer id)
    experts: list[tuple[int, int]] = field(default_factory=list)  # (slot, expert x it must hold) per rank


class _Slots:
    """Physical GPU slots: a free list and the high-water mark."""

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


def _transferred_enqueues(events: list[tuple[int, int]]) -> set[int]:
    """Indices of ENQUEUE events whose background transfer the engine started (not dropped)."""
    last: dict[int, int] = {}
    out = set()
    for i, (code, x) in enumerate(events):
        if code == _ENQUEUE:
            last[x] = i
        elif code == _START:
            out.add(last.pop(x))
    return out


def _step_ops(group: int, layer: int, events, transferred, decision, E: int, st: dict) -> StepOps:
    """Turn one step's engine events and decision into slot operations (updates ``st``)."""
    from simulator.engine.params import CPU, FETCH, FORCED_FETCH, HIT, SUBSTITUTE

    slots: _Slots = st["slots"]
    slot_of: dict[int, int] = st["slot_of"]
    staging: dict[int, tuple[int, int]] = st["staging"]
    ops = StepOps(group, layer)
    n = len(events)
    i = 0
    # step start: background completions (and the evictions their admission causes)
    while i < n and events[i][1] != _BODY:
        code, x = events[i][1:]
        if code == _COMPLETE:
            slot, tid = staging.pop(x)
            ops.waits.append(tid)
            if i + 1 < n and events[i + 1][1:] == (_INSERT, x):
                slot_of[x] = slot
                i += 1
            else:  # already resident (fetched meanwhile): the copy is wasted, as in the model
                slots.give(slot)
        elif code == _EVICT:
            slots.give(slot_of.pop(x))
        i += 1
    i += 1  # the BODY marker
    ends = []
    for idx, code, x in events[i:]:
        if code == _INSERT:
            slot = slots.take()
            slot_of[x] = slot
            ops.fetches.append((x, slot))
        elif code == _ENQUEUE and idx in transferred:
            slot = slots.take()
            tid = st["next_tid"]
            st["next_tid"] += 1
            staging[x] = (slot, tid)
            ops.background.append((x, slot, tid))
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
    """One policy at one resident fraction: slot operations per step and the engine's times."""

    name: str
    policy: str
    fraction: float
    overrides: list[str]
    steps: list[StepOps]
    initial: list[tuple[int, int]]  # (expert x, slot) resident before the first step
    group_phase: np.ndarray  # int8[G]
    sim_decode_us: np.ndarray  # float64[D]: the engine's decode-token times, trace order
    num_slots: int
    num_transfers: int
    counts: dict


def plan_run(params, meta, chunk, name: str, policy: str, fraction: float, overrides: list[str]) -> RunPlan:
    """Run the reference engine over the trace and turn its decisions into a :class:`RunPlan`."""
    from simulator.engine import simulate
    from traces.format import ArraySource

    rec = _plan_recorder()
    r = simulate(ArraySource(meta, chunk), params, engine="reference", observer=rec)
    E = meta.num_experts
    st = dict(slots=_Slots(), slot_of={}, staging={}, next_tid=0)
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
        steps.append(_step_ops(len(phases) - 1, layer, indexed, transferred, d, E, st))
    decode = r.phase == PHASE_DECODE
    counts = dict(
        hits=int(r.hits[decode].sum()), fetches=int(r.fetches[decode].sum()),
        substitutions=int(r.substitutions[decode].sum()),
        background_transfers=st["next_tid"], background_admissions=int(r.background_admissions),
        prefill_lookups=int(r.prefill_lookups),
    )
    return RunPlan(name=name, policy=policy, fraction=fraction, overrides=overrides, steps=steps, initial=initial,
                   group_phase=np.array(phases, np.int8), sim_decode_us=r.time_us[decode].copy(),
                   num_slots=st["slots"].count, num_transfers=st["next_tid"], counts=counts)


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
            ("fetches", [s.fetches for s in p.steps], 2),
            ("background", [s.background for s in p.steps], 3),
            ("experts", [s.experts for s in p.steps], 2),
        ):
            off, flat = _csr(lists, width)
            arrays[f"{k}.{name}_off"], arrays[f"{k}.{name}"] = off, flat
        arrays[f"{k}.initial"] = np.array(p.initial, np.int64).reshape(-1, 2)
        arrays[f"{k}.group_phase"] = p.group_phase
        arrays[f"{k}.sim_decode_us"] = p.sim_decode_us
        runs.append(dict(name=k, policy=p.policy, fraction=p.fraction, overrides=p.overrides,
                         num_slots=p.num_slots, num_transfers=p.num_transfers, counts=p.counts))
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
    """Check a plan's slot operations symbolically; raise ValueError on the first hazard.

    Every expert kernel must read a slot that holds the expert it stands for, written by a
    finished copy (synchronous, or background and waited for); no copy may target a slot whose
    background copy is still in flight.
    """
    holds: dict[int, int] = {int(slot): int(x) for x, slot in arrays["initial"]}
    in_flight: dict[int, tuple[int, int]] = {}  # transfer id -> (slot, x)
    busy: set[int] = set()  # slots with a background copy in flight
    w_off, w = arrays["waits_off"], arrays["waits"]
    f_off, f = arrays["fetches_off"], arrays["fetches"]
    b_off, b = arrays["background_off"], arrays["background"]
    e_off, e = arrays["experts_off"], arrays["experts"]
    for s in range(len(arrays["group"])):
        for (tid,) in w[w_off[s] : w_off[s + 1]]:
            slot, x = in_flight.pop(int(tid))
            busy.discard(slot)
            holds[slot] = x
        for x, slot in f[f_off[s] : f_off[s + 1]]:
            if slot in busy:
                raise ValueError(f"step {s}: fetch into slot {slot} while a background copy writes it")
            holds[int(slot)] = int(x)
        for x, slot, tid in b[b_off[s] : b_off[s + 1]]:
            if slot in busy:
                raise ValueError(f"step {s}: background copy into busy slot {slot}")
            holds.pop(int(slot), None)
            busy.add(int(slot))
            in_flight[int(tid)] = (int(slot), int(x))
        for slot, x in e[e_off[s] : e_off[s + 1]]:
            if holds.get(int(slot)) != int(x):
                raise ValueError(f"step {s}: expert {int(x)} runs from slot {int(slot)}, which holds "
                                 f"{holds.get(int(slot))}")


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


def cmd_plan(args) -> None:
    from simulator.run import build_params, open_source

    profile = load_profile(args.profile)
    runs = []
    header = None
    for policy in _split(args.policies):
        for fraction in (float(f) for f in _split(args.fractions)):
            cfg, overrides = compose_run_config(args.trace, policy, fraction, args.model, profile, args.override)
            source = open_source(cfg["trace"])
            meta = source.meta
            chunk = _whole(source)
            params, _ = build_params(cfg, meta)
            t0 = time.perf_counter()
            name = f"{policy}@{fraction:g}"
            plan = plan_run(params, meta, chunk, name, policy, fraction, overrides)
            log(f"planned {name}: {len(plan.steps)} steps, {plan.num_slots} slots, "
                f"{plan.num_transfers} background transfers, simulated "
                f"{plan.sim_decode_us.mean() / 1e3:.3f} ms/token ({time.perf_counter() - t0:.1f} s)")
            runs.append(plan)
            if header is None:
                header = dict(trace=args.trace, profile=args.profile, profile_name=profile.get("name"),
                              model=args.model or meta.model, trace_model=meta.model,
                              num_layers=meta.num_layers, num_experts=meta.num_experts, top_k=meta.top_k,
                              expert_bytes=int(params.expert_bytes[0]), extra_overrides=list(args.override))
    save_plans(Path(args.out), header, runs)
    _, saved = load_plans(Path(args.out))
    for arrays in saved.values():
        verify_plan(arrays)
    log(f"verified the slot operations of {len(saved)} runs")
    log(f"wrote {args.out}")


def _whole(source):
    from traces.format import concat_chunks

    chunks = list(source.iter_chunks())
    return chunks[0] if len(chunks) == 1 else concat_chunks(chunks)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------- execution


class Executor:
    """GPU (or, for tests, CPU) state for executing plans: host experts, slots, kernels, streams."""

    def __init__(self, dims: ModelDims, device, dtype, num_slots: int, host_layers: int,
                 num_experts: int, expert_mode: str, ctx: int, max_steps: int = 0, max_n: int = 0,
                 rotate: int = 4):
        torch = import_torch()
        self.torch, self.device, self.dtype = torch, device, dtype
        self.cuda = device.type == "cuda"
        self.dims = dims
        self.E = num_experts
        self.host_layers = host_layers
        numel = 3 * dims.hidden * dims.expert_intermediate
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.expert_bytes = numel * itemsize
        t0 = time.perf_counter()
        # host experts, pinned, in chunks of <= 2 GiB (the pinned allocator rounds sizes up)
        n_host = host_layers * num_experts
        per_chunk = max(1, (2 << 30) // self.expert_bytes)
        self.host = []
        for start in range(0, n_host, per_chunk):
            n = min(per_chunk, n_host - start)
            block = torch.empty((n, numel), dtype=dtype, pin_memory=self.cuda)
            fill = torch.randn((min(n, 64), numel), device=device, dtype=dtype) * 0.02
            for j in range(0, n, fill.shape[0]):
                m = min(fill.shape[0], n - j)
                block[j : j + m].copy_(fill[:m])
            self.host.extend(block.unbind(0))
        log(f"host: {n_host} experts ({n_host * self.expert_bytes / 2**30:.1f} GiB{' pinned' if self.cuda else ''}, "
            f"{host_layers} layers x {num_experts}) in {time.perf_counter() - t0:.1f} s")
        self.slots_mem = torch.empty((num_slots, numel), dtype=dtype, device=device)
        self.slots = list(self.slots_mem.unbind(0))
        log(f"gpu: {num_slots} expert slots ({num_slots * self.expert_bytes / 2**30:.1f} GiB)")
        self.kern = ExpertKernel(dims.hidden, dims.expert_intermediate, device, dtype)
        self.mode = expert_mode if (self.cuda or expert_mode == "batched") else "eager"
        self.batched = None
        expert_output = self.kern.y
        if self.mode == "batched":
            expert_output = torch.zeros(1, dims.hidden, device=device, dtype=torch.float32)
            self.batched = BatchedExperts(self.slots_mem, dims.hidden, dims.expert_intermediate, max_n,
                                          max_steps, self.kern.x, expert_output)
        kinds = {dims.is_full_attention(layer) for layer in range(dims.num_layers)}
        self.nonexpert = {
            full: [NonExpertLayer(dims, full, device, dtype, ctx, self.kern.x, expert_output) for _ in range(rotate)]
            for full in kinds
        }
        self.rotate = rotate
        if self.cuda:
            self.compute = torch.cuda.Stream(priority=-1)
            self.background = torch.cuda.Stream(priority=0)
            self._capture()
        else:
            self.compute = self.background = None

    def _capture(self) -> None:
        torch = self.torch
        cap = torch.cuda.Stream()
        cap.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cap):
            for layers in self.nonexpert.values():
                for layer in layers:
                    layer.run()
            self.kern.run(self.slots[0])
            if self.batched is not None:
                self.batched.load([[0]], [1])
                self.batched.run()  # compiles the kernels
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.nonexpert_graphs = {
            full: [capture_graph(layer.run, cap, pool) for layer in layers] for full, layers in self.nonexpert.items()
        }
        if self.batched is not None:
            self.batched_graph = capture_graph(self.batched.run, cap, pool)
            self.batched_graph.replay()  # upload; load() resets the step counter before a run
        self.expert_graphs = []
        if self.mode == "graph":
            t0 = time.perf_counter()
            for s, w in enumerate(self.slots):
                self.expert_graphs.append(capture_graph(lambda w=w: self.kern.run(w), cap, pool))
                if (s + 1) % 2000 == 0:
                    log(f"captured {s + 1}/{len(self.slots)} expert graphs")
            log(f"captured {len(self.slots)} expert graphs in {time.perf_counter() - t0:.1f} s")
        torch.cuda.synchronize()
        # first replays upload the graphs: do them before anything is timed
        with torch.cuda.stream(self.compute):
            for g in self.expert_graphs:
                g.replay()
            for gs in self.nonexpert_graphs.values():
                for g in gs:
                    g.replay()
        torch.cuda.synchronize()

    def _nonexpert(self, layer: int):
        full = self.dims.is_full_attention(layer)
        i = layer % self.rotate
        if self.cuda:
            return self.nonexpert_graphs[full][i].replay
        return self.nonexpert[full][i].run

    def execute(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Run one plan; returns the measured time of every group in microseconds."""
        torch = self.torch
        E, HL, L = self.E, self.host_layers, self.dims.num_layers
        host, slots = self.host, self.slots
        group, layer_of = arrays["group"].tolist(), arrays["layer"].tolist()
        w_off, w = arrays["waits_off"].tolist(), arrays["waits"][:, 0].tolist()
        f_off, f = arrays["fetches_off"].tolist(), arrays["fetches"].tolist()
        b_off, b = arrays["background_off"].tolist(), arrays["background"].tolist()
        e_off, e = arrays["experts_off"].tolist(), arrays["experts"][:, 0].tolist()  # column 1: the expert
        num_groups = len(arrays["group_phase"])
        nonexpert = [self._nonexpert(layer) for layer in range(L)]
        run_step = None
        if self.batched is not None:  # one grouped launch per step; slot ids go up front
            counts = np.diff(arrays["experts_off"])
            rows = np.zeros((len(counts), self.batched.max_n), np.int32)
            for s_, (a, b_) in enumerate(zip(arrays["experts_off"][:-1], arrays["experts_off"][1:], strict=True)):
                rows[s_, : b_ - a] = arrays["experts"][a:b_, 0]
            self.batched.load(rows, counts)
            run_step = self.batched_graph.replay if self.cuda else self.batched.run
        elif self.cuda and self.mode == "graph":
            run_expert = [g.replay for g in self.expert_graphs]
        else:
            kern = self.kern
            run_expert = [lambda s=s: kern.run(s) for s in slots]

        def src(x: int):
            return host[(x // E) % HL * E + x % E]

        for x, slot in arrays["initial"].tolist():  # the warm cache, untimed
            slots[slot].copy_(src(x), non_blocking=True)
        if self.cuda:
            torch.cuda.synchronize()
        cuda = self.cuda
        events: dict[int, object] = {}
        times = np.zeros(num_groups)
        Event = torch.cuda.Event if cuda else None
        ctx = torch.cuda.stream(self.compute) if cuda else _Null()
        n = len(group)
        with ctx:
            s = 0
            while s < n:
                g = group[s]
                if cuda:
                    start, end = Event(enable_timing=True), Event(enable_timing=True)
                    start.record()
                else:
                    t0 = time.perf_counter()
                while s < n and group[s] == g:
                    for k in range(w_off[s], w_off[s + 1]):
                        ev = events.pop(w[k])
                        if cuda:
                            self.compute.wait_event(ev)
                    nonexpert[layer_of[s]]()
                    for k in range(f_off[s], f_off[s + 1]):
                        x, slot = f[k]
                        slots[slot].copy_(src(x), non_blocking=True)
                    if b_off[s] < b_off[s + 1]:
                        if cuda:
                            after_sync = Event()
                            after_sync.record(self.compute)
                            self.background.wait_event(after_sync)
                            with torch.cuda.stream(self.background):
                                for k in range(b_off[s], b_off[s + 1]):
                                    x, slot, tid = b[k]
                                    slots[slot].copy_(src(x), non_blocking=True)
                                    done = Event()
                                    done.record(self.background)
                                    events[tid] = done
                        else:
                            for k in range(b_off[s], b_off[s + 1]):
                                x, slot, tid = b[k]
                                slots[slot].copy_(src(x))
                                events[tid] = None
                    if run_step is not None:
                        run_step()
                    else:
                        for k in range(e_off[s], e_off[s + 1]):
                            run_expert[e[k]]()
                    s += 1
                if cuda:
                    end.record()
                    end.synchronize()
                    times[g] = start.elapsed_time(end) * 1e3
                else:
                    times[g] = (time.perf_counter() - t0) * 1e6
        if cuda:
            torch.cuda.synchronize()
        return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cmd_run(args) -> None:
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
    num_slots = max(r["num_slots"] for r in selected)
    host_layers = min(args.host_layers, header["num_layers"])
    facts = host_facts(device)
    log(f"host: {facts.get('gpu')}; {len(selected)} runs; model {model}; {host_layers} host layers")
    max_steps = max(len(runs[r["name"]]["group"]) for r in selected)
    max_n = max(int(np.diff(runs[r["name"]]["experts_off"]).max()) for r in selected)
    mode = args.expert_mode
    if mode == "auto":
        from simulator.gpu.calibrate import batched_available

        mode = "batched" if device.type == "cuda" and batched_available() else ("graph" if device.type == "cuda" else "eager")
    ex = None
    try:
        ex = Executor(dims, device, dtype, num_slots, host_layers, header["num_experts"], mode, args.ctx,
                      max_steps=max_steps, max_n=max_n)
    except Exception as e:
        if mode != "batched" or device.type != "cuda":
            raise
        log(f"warning: batched experts failed ({type(e).__name__}: {e}); falling back to --expert-mode graph")
    if ex is None:  # outside the except block, so the failed attempt's memory is released first
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        ex = Executor(dims, device, dtype, num_slots, host_layers, header["num_experts"], "graph", args.ctx)
    out = dict(header={k: v for k, v in header.items() if k != "runs"}, host=facts, device=str(device),
               host_layers=host_layers, expert_mode=ex.mode, dims=dims.__dict__, repeats=args.repeats,
               dtype=args.dtype, runs=[])
    rows = []
    for r in selected:
        arrays = runs[r["name"]]
        decode = arrays["group_phase"] == PHASE_DECODE
        reps = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            times = ex.execute(arrays)
            reps.append(times[decode])
            log(f"{r['name']:>20s} rep {rep}: measured {times[decode].mean() / 1e3:8.3f} ms/token, "
                f"simulated {arrays['sim_decode_us'].mean() / 1e3:8.3f} ({time.perf_counter() - t0:.1f} s)")
        measured = np.mean(reps, axis=0)
        per_group = np.zeros((3, len(arrays["group_phase"])), np.int64)
        steps_group = arrays["group"]
        for row, name in enumerate(("fetches", "background", "waits")):
            np.add.at(per_group[row], steps_group, np.diff(arrays[f"{name}_off"]))
        out["runs"].append(dict(
            name=r["name"], policy=r["policy"], fraction=r["fraction"], overrides=r["overrides"],
            counts=r["counts"], num_slots=r["num_slots"],
            measured_ms_per_token=float(measured.mean() / 1e3),
            simulated_ms_per_token=float(arrays["sim_decode_us"].mean() / 1e3),
            repeat_ms_per_token=[float(t.mean() / 1e3) for t in reps],
            measured_us=[round(float(v), 2) for v in measured],
            simulated_us=[round(float(v), 2) for v in arrays["sim_decode_us"]],
            fetches_per_token=per_group[0][decode].tolist(),
            background_per_token=per_group[1][decode].tolist(),
            waits_per_token=per_group[2][decode].tolist(),
        ))
        rows.append(out["runs"][-1])
        _write_results(Path(args.out), out, rows)  # after every run: a cut-off run keeps the rest
    log(f"wrote {Path(args.out) / 'replay.json'} and {Path(args.out) / 'replay.csv'}")


def _write_results(outdir: Path, out: dict, rows: list[dict]) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    wr = csv.writer(buf)
    wr.writerow(["policy", "fraction", "measured_ms_per_token", "simulated_ms_per_token"])
    for row in rows:
        wr.writerow([row["policy"], row["fraction"], f"{row['measured_ms_per_token']:.4f}",
                     f"{row['simulated_ms_per_token']:.4f}"])
    for name, text in (("replay.json", json.dumps(out) + "\n"), ("replay.csv", buf.getvalue())):
        atomic_write_text(outdir / name, text)


# --------------------------------------------------------------------------- comparison


def compare_runs(measured: dict, profile: dict, simulate) -> list[dict]:
    """Per run: measured and simulated ms per token and the per-token gap.

    ``simulate(overrides, profile) -> (summary, simulated decode-token times in us)``.
    """
    rows = []
    for r in measured["runs"]:
        summary, sim_us = simulate(r["overrides"], profile)
        meas_us = np.asarray(r["measured_us"], dtype=np.float64)
        if len(sim_us) != len(meas_us):
            raise InputError(f"run {r['name']}: {len(meas_us)} measured decode tokens but the simulator "
                             f"gives {len(sim_us)}; compare with the trace and overrides the plan used")
        sim, meas = summary["ms_per_token"], r["measured_ms_per_token"]
        rows.append(dict(name=r["name"], policy=r["policy"], fraction=r["fraction"], measured_ms=meas,
                         simulated_ms=sim, rel_err=(sim - meas) / meas, stall_ms=summary.get("stall_ms_per_token"),
                         gap_us=(meas_us - np.asarray(sim_us)).tolist(),
                         fetches=r.get("fetches_per_token"), background=r.get("background_per_token")))
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


def render_validation(measured: dict, profile: dict, profile_path: str, rows: list[dict], speed: list[dict],
                      engine: str, tolerance: float = 0.10) -> str:
    """docs/VALIDATION.md: the measured-vs-simulated table, the speedups and the per-token gap."""
    h = measured["header"]
    host = measured.get("host", {})
    dims = measured.get("dims", {})
    cuda = str(measured.get("device", "")).startswith("cuda")
    out = io.StringIO()
    w = out.write
    w("# Validation: simulated against measured time per token\n\n")
    w("Written by `moe-replay compare` from the measurements of `moe-replay run` (commands below).\n\n")
    w("## Set-up\n\n")
    w(f"- Host: {host.get('gpu', '?')}, PCIe {host.get('pcie', '?')}, CPU {host.get('cpu', '?')} "
      f"x{host.get('cpu_count', '?')}, torch {host.get('torch', '?')}.\n")
    w(f"- Hardware profile `{profile_path}` ({profile.get('source')}, {profile['host'].get('date')}): a copy costs "
      f"{profile['pcie']['latency_us']} us + bytes / {profile['pcie']['bandwidth_gbps']} GB/s.")
    comp = (profile.get("compute") or {}).get(h.get("model"), {})
    if comp:
        w(f" For `{h.get('model')}`: {comp.get('gpu_expert_us')} us per expert call, "
          f"{comp.get('nonexpert_layer_us')} us of non-expert compute per layer.")
    w("\n")
    n_tokens = len(measured["runs"][0].get("measured_us", []))
    w(f"- Trace `{h.get('trace')}`: {h.get('num_layers')} layers x {h.get('num_experts')} experts, "
      f"top-{h.get('top_k')}, full router logits; {n_tokens} decode tokens timed per run; moe-sim overrides "
      f"`{' '.join(measured['runs'][0]['overrides'][3:])}` besides trace, policy and fraction.\n")
    w(f"- Replay: expert {dims.get('hidden')}x{dims.get('expert_intermediate')} SwiGLU in "
      f"{measured.get('dtype', 'bfloat16')} ({h.get('expert_bytes', 0) / MIB:.2f} MiB); "
      f"{measured.get('host_layers')} layers of experts in pinned host memory, trace layer l reading host layer "
      f"l mod {measured.get('host_layers')}; experts run `{measured.get('expert_mode')}`; "
      f"{measured.get('repeats')} execution(s) per run; time per token from "
      f"{'CUDA events' if cuda else 'the wall clock'}, synchronised per token.\n")
    w(f"- Simulated: moe-sim (`engine={engine}`) on the same trace, policy preset, `cache.fraction`, overrides "
      "and profile.\n\n")
    w("## Time per decode token\n\n")
    w("| policy | resident | measured ms/token | simulated ms/token | error | within 10 % |\n")
    w("|---|---:|---:|---:|---:|:---:|\n")
    for r in rows:
        ok = abs(r["rel_err"]) <= tolerance
        w(f"| {r['policy']} | {r['fraction']:.0%} | {r['measured_ms']:.3f} | {r['simulated_ms']:.3f} | "
          f"{r['rel_err']:+.1%} | {'yes' if ok else '**no**'} |\n")
    errs = [abs(r["rel_err"]) for r in rows]
    w(f"\nMean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}; "
      f"{sum(e <= tolerance for e in errs)} of {len(errs)} rows within {tolerance:.0%}.\n\n")
    w("## Speedup over fetch_all\n\n")
    w("| policy | resident | measured | simulated | error | within 10 % |\n|---|---:|---:|---:|---:|:---:|\n")
    for s in sorted(speed, key=lambda s: (s["policy"] not in ("quality_first", "speed_first"), s["policy"])):
        ok = abs(s["rel_err"]) <= tolerance
        w(f"| {s['policy']} | {s['fraction']:.0%} | {s['measured']:.2f}x | {s['simulated']:.2f}x | "
          f"{s['rel_err']:+.1%} | {'yes' if ok else '**no**'} |\n")
    fit = gap_fit(rows)
    if fit:
        per_copy = profile["pcie"]["latency_us"] + h.get("expert_bytes", 0) / (profile["pcie"]["bandwidth_gbps"] * 1e3)
        w("\n## Where the gap is\n\n")
        w("Per decode token, measured minus simulated time, fitted over all tokens of all runs as a constant plus "
          "a cost per synchronous fetch and per background transfer issued in the token:\n\n")
        w(f"- {fit['per_token_us']:.0f} us per token ({fit['per_token_us'] / max(1, h.get('num_layers', 1)):.1f} us "
          "per layer) that the model does not have;\n")
        w(f"- {fit['per_fetch_us']:+.1f} us per synchronous fetch (the profile charges {per_copy:.1f} us per expert "
          "copy);\n")
        w(f"- {fit['per_background_us']:+.1f} us per background transfer.\n\n")
        w("| run | mean gap (us/token) | fetches/token | background/token |\n|---|---:|---:|---:|\n")
        for r in rows:
            w(f"| {r['name']} | {statistics.mean(r['gap_us']):.0f} | {statistics.mean(r['fetches']):.1f} | "
              f"{statistics.mean(r['background']):.1f} |\n")
    return out.getvalue()


def cmd_compare(args) -> None:
    path = Path(args.measured)
    if not path.is_file():
        raise InputError(f"measured file {path} does not exist; give the replay.json that 'moe-replay run' wrote")
    try:
        measured = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e}); give the replay.json that 'moe-replay run' wrote") from None
    profile = load_profile(args.profile)
    rows = compare_runs(measured, profile, lambda o, p: simulate_with_profile(o, p, args.engine))
    text = render_validation(measured, profile, args.profile, rows, speedups(rows), args.engine)
    out = Path(args.out)
    notes = "\n"
    if out.exists() and NOTES_MARKER in out.read_text():
        notes = out.read_text().split(NOTES_MARKER, 1)[1]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n" + NOTES_MARKER + notes)
    for r in rows:
        print(f"{r['policy']:>14s} {r['fraction']:.2f}: measured {r['measured_ms']:8.3f}  "
              f"simulated {r['simulated_ms']:8.3f}  error {r['rel_err']:+.1%}")
    log(f"wrote {out}")


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-replay", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="decide with the reference engine, save slot operations")
    pl.add_argument("--trace", required=True, help="trace file (Parquet)")
    pl.add_argument("--profile", required=True, help="hardware profile YAML the decisions are timed with")
    pl.add_argument("--policies", default=",".join(POLICIES), help="policy presets (conf/policy)")
    pl.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS), help="resident fractions")
    pl.add_argument("--model", default="qwen3_next_80b_a3b", help="model preset (conf/model); '' = from the trace")
    pl.add_argument("--override", action="append", default=[], help="extra moe-sim override (repeatable)")
    pl.add_argument("--out", required=True, help="plan file to write (.npz)")
    rn = sub.add_parser("run", help="execute a plan on the GPU and time every token")
    rn.add_argument("--plan", required=True, help="plan file from 'moe-replay plan'")
    rn.add_argument("--out", required=True, help="directory for replay.json and replay.csv")
    rn.add_argument("--device", default="cuda", help="cuda, or cpu (tiny shapes, for tests)")
    rn.add_argument("--tiny", action="store_true", help="tiny expert and layer shapes (tests)")
    rn.add_argument("--dtype", default="bfloat16")
    rn.add_argument("--host-layers", type=int, default=8, help="layers of experts held in pinned host memory")
    rn.add_argument("--expert-mode", choices=("auto", "batched", "graph", "eager"), default="auto",
                    help="batched: one grouped Triton kernel per step (auto on a GPU with Triton); graph: a CUDA "
                         "graph per expert slot; eager: plain torch calls")
    rn.add_argument("--ctx", type=int, default=1024, help="KV-cache length of full-attention layers")
    rn.add_argument("--repeats", type=int, default=1, help="executions per run (times averaged per token)")
    rn.add_argument("--only", default="", help="comma-separated run names to execute (default: all)")
    cp = sub.add_parser("compare", help="simulate the same runs and write docs/VALIDATION.md")
    cp.add_argument("measured", help="replay.json from 'moe-replay run'")
    cp.add_argument("--profile", required=True, help="hardware profile YAML")
    cp.add_argument("--out", default="docs/VALIDATION.md")
    cp.add_argument("--engine", default="numba", choices=("numba", "reference"))
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        {"plan": cmd_plan, "run": cmd_run, "compare": cmd_compare}[args.cmd](args)
    except InputError as e:
        print(f"moe-replay: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)


if __name__ == "__main__":
    main()
