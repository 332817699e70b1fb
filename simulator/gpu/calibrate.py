"""moe-calibrate: measure a host's hardware-model inputs and write a hardware profile.

Runs on the host being modelled (a GPU host; ``--device cpu`` is a tiny smoke run for tests).
It measures, with progress on stderr:

- host-to-device copies, 64 KiB to 512 MiB, pinned and pageable, one and several streams,
  alone (on an idle link) and back to back, fitted as ``fixed_us + bytes / bandwidth``;
- SSD reads with O_DIRECT (page cache bypassed) into page-aligned, pinned buffers: every block
  size at queue depth 1, sequential and random, and expert-sized random reads at queue depths
  1..32 (``--ssd-qds``); read-then-copy pipelines (experts read back to back, each copied as
  soon as it is read) against the model's time for them;
- one routed expert (SwiGLU gate/up/down) at batch 1: eager, one CUDA graph per expert, and a
  step's k experts in one grouped kernel (Triton, slot ids read from GPU memory); the non-expert
  part of a decoder layer (attention, router, shared expert) for each model's shapes; device
  times with the launch queue filled ahead, and the host's launch cost beside them;
- the two fixed costs the engine charges besides them: per step, what the replay's sequence
  (non-expert graph, copies, expert launch) costs beyond its parts; per token, what timing a
  token between events on an idle device, synchronised after it, costs beyond its layers;
- one routed expert on the CPU (torch, batch 1, the configured thread count).

It writes the profile YAML (the schema ``simulator.hardware`` validates) and the raw samples in
a JSON file beside it (``<profile>.samples.json``), with the fits and the checks derived from
them (``--from-samples`` rebuilds both from the samples alone). ``--link-only`` measures the
copies and the disk alone and writes only their samples: a second calibration later on the same
host (at the end of a GPU lease, say), pooled with the first by ``--from-samples FIRST,SECOND``,
so that the link's drift over the time between them is in the fits. The simulator only reads
profiles. The kernels (:mod:`simulator.gpu.kernels`) and the disk reads
(:mod:`simulator.gpu.storage`) are the ones ``moe-replay`` executes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from simulator.gpu.kernels import (
    GIB,
    KIB,
    MIB,
    BatchedExperts,
    ExpertKernel,
    LayerStack,
    ModelDims,
    NonExpertLayer,
    Timer,
    batched_available,
    capture_graph,
    check_batched_experts,
    check_expert_kernel,
    import_torch,
    model_dims,
    random_weights,
    resolve_device,
    tiny_dims,
)
from simulator.gpu.storage import (
    DirectFile,
    HostBuffers,
    round_up,
    temporary_expert_file,
    write_expert_file,
)
from simulator.hardware import validate_profile
from simulator.models import with_attention_shapes
from traces.atomic import atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError

__all__ = [
    "Fit",
    "fit_fixed_plus_bandwidth",
    "build_profile",
    "render_profile_yaml",
    "profile_from_samples",
    "pool_samples",
    "read_copy_us",
    "main",
]


def log(msg: str) -> None:
    """Progress line on stderr."""
    print(f"[moe-calibrate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class Fit:
    """``time_us = fixed_us + bytes / (bandwidth_gbps * 1e3)``; max_rel_err over the samples fitted."""

    fixed_us: float
    bandwidth_gbps: float
    max_rel_err: float


def fit_fixed_plus_bandwidth(sizes_bytes: Sequence[float], times_us: Sequence[float]) -> Fit:
    """Least-squares fit of a fixed cost plus bytes over bandwidth, in relative error.

    Each sample is weighted by 1/time so that small copies (where the fixed cost shows) count as
    much as large ones (where the bandwidth shows). A negative intercept is clamped to 0 and the
    slope refitted through the origin. Sizes in bytes, times in microseconds, >= 2 distinct sizes.
    """
    xs = [float(s) for s in sizes_bytes]
    ts = [float(t) for t in times_us]
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise InputError("fit needs samples at two or more distinct sizes")
    if any(t <= 0 for t in ts) or any(x <= 0 for x in xs):
        raise InputError("fit needs positive sizes and times")
    w = [1.0 / t for t in ts]  # residual (t - a - b x) / t
    s_ww = sum(wi * wi for wi in w)
    s_wwx = sum(wi * wi * x for wi, x in zip(w, xs, strict=True))
    s_wwxx = sum(wi * wi * x * x for wi, x in zip(w, xs, strict=True))
    s_wwt = sum(wi * wi * t for wi, t in zip(w, ts, strict=True))
    s_wwxt = sum(wi * wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = s_ww * s_wwxx - s_wwx * s_wwx
    a = (s_wwxx * s_wwt - s_wwx * s_wwxt) / det
    b = (s_ww * s_wwxt - s_wwx * s_wwt) / det
    if a < 0:
        a, b = 0.0, s_wwxt / s_wwxx
    if b <= 0:
        raise InputError("fit found no positive bandwidth: times do not grow with size")
    err = max(abs(t - a - b * x) / t for x, t in zip(xs, ts, strict=True))
    return Fit(fixed_us=a, bandwidth_gbps=1.0 / b / 1e3, max_rel_err=err)


def fit_or_rate(sizes_bytes: Sequence[float], times_us: Sequence[float], what: str) -> Fit:
    """:func:`fit_fixed_plus_bandwidth`, or, where times do not grow with size (noise swamps a
    small range), no fixed cost and the rate of the largest sample, with a warning."""
    try:
        return fit_fixed_plus_bandwidth(sizes_bytes, times_us)
    except InputError as e:
        x, t = max(zip(sizes_bytes, times_us, strict=True))
        log(f"warning: {what}: {e}; using the rate at the largest size")
        return Fit(0.0, x / t / 1e3, float("nan"))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------- the profile


def build_profile(
    name: str,
    *,
    host: dict,
    h2d: Fit,
    pageable_gbps: float,
    ssd: Fit,
    idle_latency_us: float | None = None,
    gpu_expert: Fit,
    layer_fixed_us: float,
    cpu_expert: Fit,
    compute: dict[str, dict[str, float]],
    samples_file: str | None,
    source: str = "measured",
    gpu_memory_bytes: int | None = None,
    token_fixed_us: float | None = None,
    step_fixed_us: float | None = None,
    copy_order: str | None = None,
) -> dict:
    """A profile dict of the schema ``simulator.hardware`` reads; validated before return.
    Optional terms left as None stay out of it (the engine's defaults apply)."""
    profile = {
        "name": name,
        "source": source,
        "host": host,
        "pcie": {
            "latency_us": _sig(h2d.fixed_us),
            "bandwidth_gbps": _sig(h2d.bandwidth_gbps),
            "pageable_bandwidth_gbps": _sig(pageable_gbps),
        },
        "ssd": {"latency_us": _sig(ssd.fixed_us), "bandwidth_gbps": _sig(ssd.bandwidth_gbps)},
        "host_ram_bytes": None,
        "gpu": {
            "expert_fixed_us": _sig(gpu_expert.fixed_us),
            "memory_bandwidth_gbps": _sig(gpu_expert.bandwidth_gbps),
            "layer_fixed_us": _sig(layer_fixed_us),
        },
        "cpu": {
            "expert_fixed_us": _sig(cpu_expert.fixed_us),
            "memory_bandwidth_gbps": _sig(cpu_expert.bandwidth_gbps),
        },
        "compute": {m: {k: _sig(v) for k, v in t.items()} for m, t in compute.items()},
    }
    if idle_latency_us is not None:
        profile["pcie"]["idle_latency_us"] = _sig(idle_latency_us)
    if copy_order is not None:
        profile["pcie"]["copy_order"] = copy_order
    if gpu_memory_bytes:
        profile["gpu"]["memory_bytes"] = int(gpu_memory_bytes)
    for field, value in (("token_fixed_us", token_fixed_us), ("step_fixed_us", step_fixed_us)):
        if value is not None:
            profile["gpu"][field] = _sig(value)
    if samples_file:
        profile["samples"] = samples_file
    validate_profile(profile, origin=f"calibrated profile '{name}'")
    return profile


def _sig(v: float, digits: int = 4) -> float:
    """v rounded to ``digits`` significant digits (profiles hold measurements, not noise)."""
    return float(f"{v:.{digits}g}")


def _q(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def render_profile_yaml(profile: dict, header: Sequence[str] = ()) -> str:
    """The profile as commented YAML (fields in the order and with the help of the presets)."""
    p = profile

    def field(section: str, name: str, comment: str) -> list[str]:
        block = p if section == "" else p[section]
        if name not in block:
            return []
        value = "null" if block[name] is None else block[name]
        return [f"{'' if section == '' else '  '}{name}: {value}  # {comment}"]

    lines = [f"# {h}" for h in header]
    lines += [
        f"name: {p['name']}",
        f"source: {p['source']}  # measured | datasheet",
        "host:",
        *(f"  {k}: {_q(str(v))}" for k, v in p["host"].items()),
        "pcie:",
        *field("pcie", "latency_us", "fixed cost of a host-to-device copy back to back (burst fit)"),
        *field("pcie", "idle_latency_us", "the same for a copy on an idle link (isolated copies at expert size)"),
        *field("pcie", "bandwidth_gbps", "GB/s (1e9 bytes/s), pinned host memory (burst fit)"),
        *field("pcie", "pageable_bandwidth_gbps", "copies from pageable host memory (isolated, at expert size)"),
        *field("pcie", "copy_order", "a synchronous copy behind background copies on a low-priority stream "
               "waits for them (submission) or overtakes them (priority)"),
        "ssd:",
        *field("ssd", "latency_us", "O_DIRECT reads of expert size back to back (read-then-copy "
               "pipelines; without them random QD1 reads of 1 MiB and more)"),
        *field("ssd", "bandwidth_gbps", "same fit; QD1..32 random reads in the samples"),
        *field("", "host_ram_bytes", "bytes of expert weights host RAM can hold; null = the whole model"),
        *field("", "host_pinned_bytes", "of host_ram_bytes, the most recently used bytes pinned; null = all"),
        "gpu:",
        *field("gpu", "expert_fixed_us", "per expert call at batch 1 (CUDA graph; fit over expert sizes)"),
        *field("gpu", "memory_bandwidth_gbps", "effective GB/s streaming expert weights (same fit)"),
        *field("gpu", "layer_fixed_us",
               "non-expert compute floor per layer (measured layer minus its bytes at that bandwidth)"),
        *field("gpu", "memory_bytes", "the GPU's memory, as the driver reports it"),
        *field("gpu", "token_fixed_us", "per token: a synchronised token's time beyond its layers"),
        *field("gpu", "step_fixed_us", "per step: the layer sequence's time beyond its parts"),
        "cpu:",
        *field("cpu", "expert_fixed_us", "per expert call on the host CPU at batch 1 (fit)"),
        *field("cpu", "memory_bandwidth_gbps", "effective GB/s the CPU streams expert weights at (fit)"),
    ]
    if p["compute"]:
        lines.append("compute:  # measured per model; wins over the fits above")
        for model, times in p["compute"].items():
            lines.append(f"  {model}:")
            lines += [f"    {k}: {v}" for k, v in times.items()]
    else:
        lines.append("compute: {}")
    if p.get("samples"):
        lines.append(f"samples: {_q(p['samples'])}  # raw samples and fits, beside this file")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- measurements


def copy_sizes(lo: int, hi: int, extra: Sequence[int] = ()) -> list[int]:
    """Powers of two from lo to hi (bytes), plus the extra sizes, sorted."""
    sizes, s = set(extra), lo
    while s <= hi:
        sizes.add(s)
        s *= 2
    return sorted(x for x in sizes if lo <= x <= hi)


def measure_h2d(device, sizes: Sequence[int], reps: int, streams: int = 4) -> list[dict]:
    """Host-to-device copy samples: pinned/pageable x isolated/burst/several streams.

    isolated: one copy between events (time per copy). burst: 8 back-to-back copies on one
    stream (time per copy, as a run of synchronous fetches issues them). streams: one copy of
    the size on each of ``streams`` streams at once (wall time, aggregate bandwidth).
    On the CPU the "device" is host memory (a test path only).
    """
    torch = import_torch()
    timer = Timer(device)
    cuda = device.type == "cuda"
    top = max(sizes)
    burst = 8
    span = top * max(streams, 1)
    dst = torch.empty(span, dtype=torch.uint8, device=device)
    out = []
    for pinned in (True, False) if cuda else (False,):
        src = torch.randint(0, 255, (span,), dtype=torch.uint8)
        if pinned:
            src = src.pin_memory()
        kind = "pinned" if pinned else "pageable"
        timed = timer.time_us if pinned else timer.wall_us
        sides = [torch.cuda.Stream() for _ in range(streams)] if cuda else []
        for size in sizes:
            n_reps = reps if size <= 16 * MIB else max(3, reps // 4)
            if not pinned:
                n_reps = max(3, n_reps // 2)

            def one(size=size, pinned=pinned, src=src):
                dst[:size].copy_(src[:size], non_blocking=pinned)

            one()
            iso = [timed(one) for _ in range(n_reps)]
            out.append(dict(kind=kind, mode="isolated", streams=1, bytes=size, times_us=iso))
            if size * burst <= span:

                def run_burst(size=size, pinned=pinned, src=src):
                    for j in range(burst):
                        dst[j * size : (j + 1) * size].copy_(src[j * size : (j + 1) * size], non_blocking=pinned)

                ts = [timed(run_burst) / burst for _ in range(max(3, n_reps // 2))]
                out.append(dict(kind=kind, mode="burst", streams=1, bytes=size, times_us=ts))
            if cuda and size >= MIB:

                def multi(size=size, pinned=pinned, src=src, sides=sides):
                    for j, s in enumerate(sides):
                        with torch.cuda.stream(s):
                            dst[j * size : (j + 1) * size].copy_(src[j * size : (j + 1) * size], non_blocking=pinned)

                multi()
                ts = [timer.wall_us(multi) for _ in range(max(3, n_reps // 2))]
                out.append(dict(kind=kind, mode="streams", streams=streams, bytes=size, times_us=ts))
            t = median(iso)
            log(f"h2d {kind:8s} {size / MIB:9.3f} MiB: {t:9.1f} us  ({size / t / 1e3:6.1f} GB/s)")
        del src
    return out


COPY_ORDER_QUEUED = 4  # background copies submitted ahead of the synchronous one


def measure_copy_order(device, size: int, reps: int, queued: int = COPY_ORDER_QUEUED) -> dict | None:
    """How a synchronous host-to-device copy meets background copies already submitted.

    Per repetition: ``queued`` copies of ``size`` bytes on a low-priority stream, then one on a
    high-priority stream, all submitted at once after a marker event; the times (us from the
    marker) at which the last background copy and the synchronous copy end, and the synchronous
    copy alone. ``pcie.copy_order`` is ``submission`` where the synchronous copy ends after the
    background copies (the device served them in submission order, whatever the stream
    priority), ``priority`` where it overtook them. None on the CPU (no device queue).
    """
    if device.type != "cuda":
        return None
    torch = import_torch()
    src = torch.empty((queued + 1) * size, dtype=torch.uint8).pin_memory()
    dst = torch.empty((queued + 1) * size, dtype=torch.uint8, device=device)
    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)

    def event(stream):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def part(j):
        return slice(j * size, (j + 1) * size)

    rows = []
    for rep in range(reps + 1):  # the first one warms up
        torch.cuda.synchronize()
        mark = event(high)
        low.wait_event(mark)
        with torch.cuda.stream(low):
            for j in range(queued):
                dst[part(j)].copy_(src[part(j)], non_blocking=True)
            low_end = event(low)
        with torch.cuda.stream(high):
            dst[part(queued)].copy_(src[part(queued)], non_blocking=True)
            high_end = event(high)
        torch.cuda.synchronize()
        with torch.cuda.stream(high):
            alone0 = event(high)
            dst[part(queued)].copy_(src[part(queued)], non_blocking=True)
            alone1 = event(high)
        torch.cuda.synchronize()
        if rep:
            rows.append((mark.elapsed_time(low_end) * 1e3, mark.elapsed_time(high_end) * 1e3,
                         alone0.elapsed_time(alone1) * 1e3))
    out = dict(bytes=size, queued=queued, background_end_us=[r[0] for r in rows],
               sync_end_us=[r[1] for r in rows], sync_alone_us=[r[2] for r in rows])
    out["order"] = copy_order_of(out)
    log(f"copy order: {queued} background copies of {size / MIB:.2f} MiB end at "
        f"{median(out['background_end_us']):.0f} us, the synchronous copy behind them at "
        f"{median(out['sync_end_us']):.0f} us (alone {median(out['sync_alone_us']):.0f} us): {out['order']}")
    return out


def copy_order_of(sample: dict) -> str:
    """``submission`` if the synchronous copy ended after the background ones (medians), else
    ``priority``."""
    return "submission" if median(sample["sync_end_us"]) > median(sample["background_end_us"]) else "priority"


def measure_ssd_reads(path: Path, block: int, pattern: str, qd: int, seconds: float, max_reads: int,
                      pinned: bool = False, seed: int = 0) -> dict:
    """O_DIRECT reads of ``block`` bytes (a multiple of the page), ``sequential`` or ``random``,
    by ``qd`` threads (queue depth), each into its own page-aligned (optionally pinned) buffer.

    Returns per-read latencies (us) and the aggregate bandwidth (GB/s) over the run.
    """
    bufs = HostBuffers(qd, block, pinned).arrays
    lat: list[float] = []
    lock = threading.Lock()
    counter = [0]
    with DirectFile(path, block) as f:
        order = list(range(f.blocks))
        if pattern == "random":
            random.Random(seed).shuffle(order)
        deadline = time.perf_counter() + seconds

        def worker(buf) -> None:
            mine = []
            while True:
                with lock:
                    i = counter[0]
                    counter[0] += 1
                if i >= max_reads or time.perf_counter() > deadline:
                    break
                t0 = time.perf_counter()
                f.read(order[i % len(order)], buf)
                mine.append((time.perf_counter() - t0) * 1e6)
            with lock:
                lat.extend(mine)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(bufs[j],)) for j in range(qd)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    lat.sort()
    keep = lat[:: max(1, len(lat) // 100)]  # about 100 evenly spaced quantiles, not every read
    return dict(block_bytes=block, pattern=pattern, qd=qd, pinned=pinned, reads=len(lat), median_us=median(lat),
                p90_us=lat[int(0.9 * (len(lat) - 1))], gbps=len(lat) * block / wall / 1e9,
                times_us=[round(t, 2) for t in keep])


def measure_ssd(path: Path, blocks: Sequence[int], expert_blocks: Sequence[int], qds: Sequence[int],
                seconds: float, pinned: bool) -> list[dict]:
    """Reads at queue depth 1 of every block size, sequential and random; random reads of the
    expert-sized blocks at every queue depth of ``qds``."""
    size = os.path.getsize(path)
    runs = [(pattern, 1, b) for pattern in ("sequential", "random") for b in blocks]
    runs += [("random", qd, b) for qd in qds if qd > 1 for b in expert_blocks]
    out = []
    for pattern, qd, block in runs:
        s = measure_ssd_reads(path, block, pattern, qd, seconds, max(64, size // block), pinned)
        out.append(s)
        log(f"ssd {pattern:10s} qd{qd:<3d} {block / KIB:8.0f} KiB: median {s['median_us']:9.1f} us/read, "
            f"{s['gbps']:.3f} GB/s")
    return out


def measure_read_copy(device, path: Path, expert_bytes: int, n: int, reps: int, seed: int = 0) -> list[dict]:
    """Read-then-copy pipelines: a reader thread reads n experts back to back (O_DIRECT, random
    blocks) into their own buffers while the main thread copies each one to the device as soon
    as its read is done, pinned and (on a GPU) pageable buffers. Wall time from the first read
    to the last copy's end, and when each read ended (us from the start)."""
    torch = import_torch()
    cuda = device.type == "cuda"
    block = round_up(expert_bytes)
    dst = torch.empty((n, expert_bytes), dtype=torch.uint8, device=device)
    rng = random.Random(seed)
    out = []
    with DirectFile(path, block) as f:
        for pinned in (True, False) if cuda else (False,):
            bufs = HostBuffers(n, block, pinned)
            views = bufs.arrays
            stream = torch.cuda.Stream() if cuda else None
            totals, read_ends = [], []
            for _ in range(reps):
                order = [rng.randrange(f.blocks) for _ in range(n)]
                done = [threading.Event() for _ in range(n)]
                ends = [0.0] * n

                def reader(order=order, done=done, ends=ends, views=views):
                    for i, b in enumerate(order):
                        f.read(b, views[i])
                        ends[i] = time.perf_counter()
                        done[i].set()

                if cuda:
                    torch.cuda.synchronize()
                thread = threading.Thread(target=reader)
                t0 = time.perf_counter()
                thread.start()
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for i in range(n):
                        done[i].wait()
                        dst[i].copy_(bufs[i][:expert_bytes], non_blocking=cuda)
                if cuda:
                    stream.synchronize()
                totals.append((time.perf_counter() - t0) * 1e6)
                thread.join()
                read_ends.append([round((e - t0) * 1e6, 1) for e in ends])
            kind = "pinned" if pinned else "pageable"
            out.append(dict(kind=kind, bytes=expert_bytes, n=n, total_us=totals, read_end_us=read_ends))
            log(f"read-then-copy {kind:8s} {n} x {expert_bytes / MIB:.2f} MiB: {median(totals) / 1e3:.2f} ms")
            del bufs, views
    return out


def read_copy_us(n: int, read_us: float, copy_us: float, idle_latency_us: float, latency_us: float) -> float:
    """The model's time for a step's n synchronous fetches that all read from the SSD
    (docs/semantics.md, Link): reads back to back, each copy after its read and the copy
    before it, paying the idle latency on an idle link and the burst latency back to back."""
    link_free = -math.inf
    end = 0.0
    for i in range(n):
        ready = (i + 1) * read_us
        start = max(ready, link_free)
        end = start + (idle_latency_us if start > link_free else latency_us) + copy_us
        link_free = end
    return end


def measure_fixed_costs(device, dtype, model: str, dims: ModelDims, reps: int, ctx: int,
                        copies: Sequence[int] = (1, 3), passes: int = 4, tokens: int = 8) -> dict:
    """The replay's step sequence timed against its parts (per layer), and its tokens timed as
    the replay times them (per token).

    A pass runs the model's L layers: the layer's non-expert graph, ``c`` expert-sized copies
    on the same stream (c = 0 and each of ``copies``), the step's grouped expert launch. With
    the launch queue filled ahead: the non-expert graphs alone, the expert launches alone and
    the sequence (us per layer). Then passes one at a time between events on an idle device,
    synchronised after each, as the replay times a token (us per token).
    """
    torch = import_torch()
    timer = Timer(device)
    cuda = device.type == "cuda"
    L, k = dims.num_layers, dims.top_k
    numel = 3 * dims.hidden * dims.expert_intermediate
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n_slots = max(4 * k, math.ceil((512 * MIB if cuda else 4 * MIB) / (numel * itemsize)))
    slots = torch.randn((n_slots, numel), device=device, dtype=dtype) * 0.02
    mode = "batched" if cuda and batched_available() else ("graph" if cuda else "eager")
    steps = max(passes, tokens) * L
    stack = LayerStack(dims, slots, device, dtype, ctx, mode, k, steps)
    stack.load([torch.randperm(n_slots)[:k].tolist() for _ in range(steps)])
    expert_bytes = numel * itemsize
    top = max(copies)
    src = HostBuffers(top, expert_bytes, pinned=cuda)
    dst = torch.empty((top, expert_bytes), dtype=torch.uint8, device=device)
    state = {"step": 0}

    def layers(nonexpert: bool = True, experts: bool = True, c: int = 0):
        def run():
            for layer in range(L):
                if nonexpert:
                    stack.nonexpert(layer)()
                for j in range(c):
                    dst[j].copy_(src[j][:expert_bytes], non_blocking=cuda)
                if experts:
                    stack.experts(state["step"])
                    state["step"] += 1
        return run

    def per_layer(fn) -> float:
        stack.rewind()
        state["step"] = 0
        return timer.gpu_only_us(fn, passes)[0] / L

    series = {"nonexpert_us": layers(experts=False), "experts_us": layers(nonexpert=False),
              "sequence_us": layers(), **{f"sequence_{c}_copies_us": layers(c=c) for c in copies}}
    for fn in series.values():  # warm: cuBLAS, the copy engines, first replays
        per_layer(fn)
    res = dict(model=model, layers=L, top_k=k, mode=mode, copy_bytes=expert_bytes, copies=list(copies),
               **{name: [per_layer(fn) for _ in range(reps)] for name, fn in series.items()})
    stack.rewind()
    state["step"] = 0
    one = layers()
    res["token_us"] = [timer.time_us(one) for _ in range(tokens)]
    log(f"fixed costs {model}: per layer non-expert {median(res['nonexpert_us']):.1f} + experts "
        f"{median(res['experts_us']):.1f} us alone, {median(res['sequence_us']):.1f} us in sequence; per token "
        f"{median(res['token_us']):.1f} us synchronised ({L} layers)")
    return res


def _rotating_expert(hidden: int, intermediate: int, device, dtype, max_n: int, rotate_bytes: int):
    """(kernel, weights, step): ``step()`` runs the next of n experts, n chosen so that their
    weights exceed ``rotate_bytes`` (past the caches, like a real layer's experts); warmed up."""
    torch = import_torch()
    numel = 3 * hidden * intermediate
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = max(2, min(max_n, math.ceil(rotate_bytes / (numel * itemsize))))
    kern = ExpertKernel(hidden, intermediate, device, dtype)
    weights = random_weights(n, numel, device, dtype)
    state = {"i": 0}

    def step():
        kern.run(weights[state["i"] % n])
        state["i"] += 1

    for _ in range(2):
        step()
    return kern, weights, step


def measure_gpu_expert(device, dtype, hidden: int, intermediate: int, reps: int, rotate_bytes: int = 256 * MIB) -> dict:
    """Time of one routed expert at batch 1, eager and (on a GPU) as one CUDA graph per expert.

    Rotates over enough experts that their weights exceed the L2 cache, like a real layer does.
    """
    torch = import_torch()
    timer = Timer(device)
    kern, weights, eager = _rotating_expert(hidden, intermediate, device, dtype, 64, rotate_bytes)
    n = len(weights)
    inner = max(1, 4 * n)
    res = dict(hidden=hidden, intermediate=intermediate, dtype=str(dtype).removeprefix("torch."),
               bytes=weights[0].numel() * weights[0].element_size(), rotated=n,
               eager_us=[timer.time_us(eager, inner) for _ in range(reps)])
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for w in weights:
                kern.run(w)  # warm cuBLAS on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        graphs = [capture_graph(lambda w=w: kern.run(w), stream, pool) for w in weights]
        res["capture_ms_per_graph"] = (time.perf_counter() - t0) * 1e3 / n
        state = {"i": 0}

        def replay():
            graphs[state["i"] % n].replay()
            state["i"] += 1

        for _ in range(n):  # the first replay of each graph uploads it
            replay()
        res["graph_issue_us"] = [timer.time_us(replay, inner) for _ in range(reps)]
        both = [timer.gpu_only_us(replay, inner) for _ in range(reps)]
        res["graph_gpu_us"] = [g for g, _ in both]
        res["graph_launch_us"] = [i for _, i in both]
    nan = float("nan")
    log(f"expert {hidden}x{intermediate} {res['dtype']} ({res['bytes'] / MIB:.2f} MiB): eager "
        f"{median(res['eager_us']):.1f} us; graph: {median(res.get('graph_issue_us', [nan])):.1f} us issue-bound, "
        f"{median(res.get('graph_gpu_us', [nan])):.1f} us on the GPU, launch {median(res.get('graph_launch_us', [nan])):.1f} us")
    return res


def measure_batched(device, dtype, hidden: int, intermediate: int, top_k: int, reps: int,
                    rotate_bytes: int = 512 * MIB) -> dict:
    """Time of one step's experts through :class:`BatchedExperts` (CUDA graph), n = 1 and top_k.

    Slot ids are random over enough experts to exceed the L2 cache; device time with the queue
    pre-filled, and the host's launch cost per step.
    """
    torch = import_torch()
    timer = Timer(device)
    numel = 3 * hidden * intermediate
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n_slots = max(4 * top_k, math.ceil(rotate_bytes / (numel * itemsize)))
    slots = torch.randn((n_slots, numel), device=device, dtype=dtype) * 0.02
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    y = torch.zeros(1, hidden, device=device, dtype=torch.float32)
    calls = 64
    res = dict(hidden=hidden, intermediate=intermediate, top_k=top_k, dtype=str(dtype).removeprefix("torch."),
               rotated=n_slots, gpu_us={}, launch_us={})
    for n in sorted({1, top_k}):
        b = BatchedExperts(slots, hidden, intermediate, top_k, calls + 8, x, y)
        ids = torch.stack([torch.randperm(n_slots)[:top_k] for _ in range(calls + 8)])
        b.load(ids, [n] * (calls + 8))
        b.run()  # compile
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            g = capture_graph(b.run, stream)
            step = g.replay
        else:
            step = b.run
        gpu, launch = [], []
        for _ in range(reps):
            b.counter.zero_()
            step()
            t_gpu, t_launch = timer.gpu_only_us(step, calls)
            gpu.append(t_gpu)
            launch.append(t_launch)
        res["gpu_us"][n], res["launch_us"][n] = gpu, launch
        log(f"batched experts {hidden}x{intermediate}, {n} per step: {median(gpu):.1f} us on the GPU "
            f"({median(gpu) / n:.2f} us per expert), launch {median(launch):.1f} us")
    return res


def measure_nonexpert(device, dtype, model: str, dims: ModelDims, reps: int, ctx: int, rotate: int = 4) -> dict:
    """Time of the non-expert part of one decoder layer per layer kind, eager and graph."""
    torch = import_torch()
    timer = Timer(device)
    kinds = sorted({dims.is_full_attention(layer) for layer in range(dims.num_layers)})
    res = dict(model=model, ctx=ctx, kinds={})
    for full in kinds:
        layers = [NonExpertLayer(dims, full, device, dtype, ctx) for _ in range(rotate)]
        nbytes = sum(
            t.numel() * t.element_size() for n_, t in vars(layers[0]).items() if n_.startswith("w_")
        )
        state = {"i": 0}

        def eager(layers=layers, state=state):
            layers[state["i"] % rotate].run()
            state["i"] += 1

        for _ in range(3):
            eager()
        kind = dict(weight_bytes=nbytes, eager_us=[timer.time_us(eager, 2 * rotate) for _ in range(reps)])
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for layer in layers:
                    layer.run()
            torch.cuda.current_stream().wait_stream(stream)
            pool = torch.cuda.graph_pool_handle()
            graphs = [capture_graph(layer.run, stream, pool) for layer in layers]
            state["i"] = 0

            def replay(graphs=graphs, state=state):
                graphs[state["i"] % rotate].replay()
                state["i"] += 1

            for _ in range(rotate):
                replay()
            kind["graph_issue_us"] = [timer.time_us(replay, 4 * rotate) for _ in range(reps)]
            both = [timer.gpu_only_us(replay, 8 * rotate) for _ in range(reps)]
            kind["graph_gpu_us"] = [g for g, _ in both]
            kind["graph_launch_us"] = [i for _, i in both]
        name = "full_attention" if full else "linear_attention"
        res["kinds"][name] = kind
        nan = [float("nan")]
        log(f"non-expert {model} {name}: eager {median(kind['eager_us']):.1f} us; graph "
            f"{median(kind.get('graph_issue_us', nan)):.1f} us issue-bound, {median(kind.get('graph_gpu_us', nan)):.1f} us "
            f"on the GPU, launch {median(kind.get('graph_launch_us', nan)):.1f} us ({nbytes / 1e6:.1f} MB weights)")
        del layers
    return res


def nonexpert_layer_us(dims: ModelDims, res: dict, key: str) -> float:
    """Mean non-expert time over the model's layers (its mix of layer kinds); ``key``: the series."""
    per = {k: median(v[key]) for k, v in res["kinds"].items()}
    total = sum(
        per["full_attention" if dims.is_full_attention(layer) else "linear_attention"]
        for layer in range(dims.num_layers)
    )
    return total / dims.num_layers


def measure_cpu_expert(hidden: int, intermediate: int, dtype, threads: int, reps: int, rotate_bytes: int = 256 * MIB) -> dict:
    """Time of one routed expert on the host CPU at batch 1 (torch, ``threads`` threads)."""
    torch = import_torch()
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    _, weights, one = _rotating_expert(hidden, intermediate, dev, dtype, 16, rotate_bytes)
    ts = [Timer(dev).time_us(one, len(weights)) for _ in range(reps)]
    log(f"cpu expert {hidden}x{intermediate} ({threads} threads): {median(ts):.1f} us")
    return dict(hidden=hidden, intermediate=intermediate, dtype=str(dtype).removeprefix("torch."),
                threads=threads, bytes=weights[0].numel() * weights[0].element_size(), times_us=ts)


# --------------------------------------------------------------------------- host facts


def gpu_memory_bytes(facts: dict) -> int | None:
    """The GPU's memory from the host facts ("NAME (N MiB), driver ..."), or None on a CPU run."""
    match = re.search(r"\((\d+) MiB\)", str(facts.get("gpu", "")))
    return int(match.group(1)) * MIB if match else None


def host_facts(device) -> dict:
    """GPU, driver, PCIe link and CPU of this host (nvidia-smi where present)."""
    torch = import_torch()
    facts = dict(cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                 torch=torch.__version__, python=platform.python_version(), kernel=platform.release())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device.type != "cuda":
        facts.update(gpu="none (CPU test run)", pcie="n/a")
        return facts
    q = "name,memory.total,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    try:
        row = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.splitlines()[0]
        name, mem, driver, gen, gen_max, width, width_max = (s.strip() for s in row.split(","))
        facts.update(gpu=f"{name} ({mem} MiB), driver {driver}", driver=driver,
                     pcie=f"gen{gen_max} x{width_max}", pcie_current=f"gen{gen} x{width}")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=f"{props.name} ({props.total_memory // MIB} MiB)", pcie="unknown",
                     nvidia_smi_error=str(e))
    return facts


# --------------------------------------------------------------------------- the command


def _fit_series(samples: list[dict], **match) -> Fit:
    rows = [s for s in samples if all(s.get(k) == v for k, v in match.items())]
    return fit_or_rate([r["bytes"] for r in rows], [median(r["times_us"]) for r in rows], f"copy fit {match}")


def parse_models(text: str) -> list[tuple[str, int | None]]:
    """``--models``: comma-separated presets, each optionally ``name:k`` for a model that a
    trace routes at top-k other than its preset's (the step's grouped kernel is timed at k)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, k = part.partition(":")
        if name not in with_attention_shapes():
            raise InputError(f"--models: unknown model '{name}'; known: {', '.join(with_attention_shapes())}")
        if k and not (k.isdigit() and int(k) >= 1):
            raise InputError(f"--models: '{part}' needs a top-k >= 1 after the colon, e.g. qwen3_30b_a3b:6")
        out.append((name, int(k) if k else None))
    if not out:
        raise InputError("--models is empty; name one or more presets, e.g. qwen3_next_80b_a3b")
    return out


def measure_all(args) -> dict:
    """Run every measurement; return the samples (raw times, host facts, checks)."""
    torch = import_torch()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"--dtype {args.dtype}: not a torch dtype (e.g. bfloat16, float16)")
    cpu = device.type == "cpu"
    models = parse_models(args.models)
    qds = _parse_ints(args.ssd_qds, "--ssd-qds")
    dims = {}
    for m, k in models:
        d = model_dims(m)
        d = tiny_dims(d) if cpu else d  # tiny shapes: the test path exercises the code, not the host
        dims[m] = dataclasses.replace(d, top_k=k) if k else d
    if cpu:
        expert_shapes = cpu_shapes = [(64, 32), (128, 64), (256, 64)]
        torch.set_num_threads(1)  # threads only contend at these sizes (CPU experts set their own)
    else:
        model_shapes = {(d.hidden, d.expert_intermediate) for d in dims.values()}
        expert_shapes = sorted(model_shapes | set(_parse_shapes(args.expert_shapes)))
        cpu_shapes = sorted(model_shapes | set(_parse_shapes(args.cpu_expert_shapes)))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expert_sizes = sorted({d.expert_bytes(itemsize) for d in dims.values()})
    facts = host_facts(device)
    log(f"host: {facts.get('gpu')}, PCIe {facts.get('pcie')}, CPU {facts.get('cpu')} x{facts.get('cpu_count')}")
    threads = args.cpu_threads or os.cpu_count() or 1
    batched = device.type == "cuda" and batched_available()
    samples: dict = dict(host=facts, args=vars(args).copy(), checks={}, date=_dt.date.today().isoformat(),
                         models={m: d.__dict__ for m, d in dims.items()}, expert_bytes=expert_sizes,
                         cpu_threads=threads, max_copy_bytes=4 * MIB if cpu else args.max_copy_mib * MIB)
    for d in ([] if args.link_only else dims.values()):
        checks = [("eager", lambda d=d: check_expert_kernel(d.hidden, d.expert_intermediate, device, dtype))]
        if device.type == "cuda":
            checks.append(("graph", lambda d=d: check_expert_kernel(d.hidden, d.expert_intermediate, device, dtype, True)))
        if batched:
            checks.append(("batched", lambda d=d: check_batched_experts(d.hidden, d.expert_intermediate, d.top_k, device, dtype)))
        for label, check in checks:
            try:
                err = check()
            except Exception as e:  # a broken Triton install must not cost the other measurements
                if label != "batched":
                    raise
                log(f"warning: batched experts unavailable ({type(e).__name__}: {e}); measuring without them")
                batched = False
                continue
            samples["checks"][f"expert_{d.hidden}x{d.expert_intermediate}_{label}_rel_err"] = err
            log(f"expert kernel {d.hidden}x{d.expert_intermediate} {label}: relative error {err:.2e} against float64")
            if not err < 2e-2:
                raise InputError(f"expert kernel check failed: relative error {err:.3g} against float64")

    lo, hi = 64 * KIB, samples["max_copy_bytes"]
    samples["h2d"] = measure_h2d(device, copy_sizes(lo, hi, expert_sizes), args.reps)
    samples["copy_order"] = measure_copy_order(device, max(expert_sizes), args.reps)

    samples["ssd"], samples["read_copy"], ssd_note = [], [], "not measured (--skip-ssd)"
    if not args.skip_ssd:
        expert_blocks = sorted({round_up(s) for s in expert_sizes})
        blocks = sorted({4 * KIB, 64 * KIB, MIB, 2 * MIB, 4 * MIB, *expert_blocks})
        file_bytes = (16 if cpu else args.ssd_file_mib) * MIB
        seconds = 0.05 if cpu else args.ssd_seconds
        try:
            with _expert_file(args.ssd_file, args.ssd_dir, file_bytes) as path:
                log(f"ssd: {os.path.getsize(path) / GIB:.2f} GiB expert file at {path}")
                samples["ssd"] = measure_ssd(path, blocks, expert_blocks, qds, seconds, pinned=not cpu)
                samples["read_copy"] = [r for b in expert_sizes
                                        for r in measure_read_copy(device, path, b, args.read_copy_experts, 3)]
                ssd_note = f"O_DIRECT reads of {path}"
        except (InputError, OSError) as e:
            ssd_note = f"not measured ({e})"
            log(f"ssd: {ssd_note}")
    samples["ssd_note"] = ssd_note
    samples["ssd_fallback"] = [float(v) for v in args.ssd_fallback]
    if args.link_only:
        return samples

    samples["gpu_expert"] = [measure_gpu_expert(device, dtype, h, i, args.reps) for h, i in expert_shapes]
    if batched:
        samples["batched"] = [measure_batched(device, dtype, d.hidden, d.expert_intermediate, d.top_k, args.reps)
                              for d in dims.values()]
    samples["nonexpert"] = {m: measure_nonexpert(device, dtype, m, d, args.reps, 64 if cpu else args.ctx)
                            for m, d in dims.items()}
    samples["fixed"] = {m: measure_fixed_costs(device, dtype, m, d, args.reps, 64 if cpu else args.ctx)
                        for m, d in dims.items()}
    samples["cpu_expert"] = [measure_cpu_expert(h, i, dtype, threads, max(3, args.reps // 2)) for h, i in cpu_shapes]
    return samples


@contextlib.contextmanager
def _expert_file(path: str | None, directory: str, size_bytes: int):
    """The SSD test file: ``path`` (created at ``size_bytes`` if missing, kept), or a temporary
    file in ``directory`` (or, if O_DIRECT fails there, the working directory), removed after."""
    if path:
        yield write_expert_file(Path(path), size_bytes)
        return
    error = None
    for d in dict.fromkeys([directory, os.getcwd()]):
        try:
            tmp = temporary_expert_file(d, size_bytes)
        except (InputError, OSError) as e:
            error = e
            continue
        try:
            yield tmp
        finally:
            tmp.unlink()
        return
    raise error


EXPERT_SERIES = {  # --expert-mode -> (per-expert series of one expert, non-expert series)
    "batched": ("graph_gpu_us", "graph_gpu_us"),
    "graph": ("graph_gpu_us", "graph_gpu_us"),
    "graph-issue": ("graph_issue_us", "graph_issue_us"),
    "eager": ("eager_us", "eager_us"),
}


def _ssd_fit(ssd: list[dict], fallback: Sequence[float]) -> Fit:
    """Random reads at queue depth 1 (the model's SSD serves one read at a time), fitted over
    the blocks of 1 MiB and more where there are two such sizes (experts are that large; the
    small blocks only pin a fixed cost that expert reads never see), else over all blocks."""
    rnd = [s for s in ssd if s["pattern"] == "random" and s["qd"] == 1]
    if not rnd:
        return Fit(*fallback, float("nan"))
    large = [s for s in rnd if s["block_bytes"] >= MIB]
    rows = large if len({s["block_bytes"] for s in large}) >= 2 else rnd
    return fit_or_rate([s["block_bytes"] for s in rows], [s["median_us"] for s in rows], "ssd fit")


def _ssd_back_to_back_fit(read_copy: list[dict]) -> Fit | None:
    """The disk's time per read when reads follow one another, as the model's SSD serves them
    in an SSD-bound step: from the read-then-copy pipelines (reads back to back into their own
    buffers), each read's interval after the one before it (the first, which pays the thread's
    start, left out), median per buffer kind and size, fitted over the sizes. None without two
    sizes."""
    points: dict[tuple[str, int], list[float]] = {}
    for r in read_copy:
        for ends in r["read_end_us"]:
            points.setdefault((r["kind"], r["bytes"]), []).extend(
                b - a for a, b in zip(ends, ends[1:], strict=False))
    if len({b for _, b in points}) < 2:
        return None
    keys = sorted(points)
    return fit_or_rate([b for _, b in keys], [median(points[k]) for k in keys], "ssd back-to-back fit")


def _idle_latency_us(h2d: list[dict], kind: str, sizes: Sequence[int], fit: Fit) -> float:
    """A copy's fixed cost on an idle link: isolated copies at the expert sizes minus their
    bytes at the fit's bandwidth (the model has one bandwidth and two latencies)."""
    iso = {s["bytes"]: median(s["times_us"]) for s in h2d if s["kind"] == kind and s["mode"] == "isolated"}
    near = [min(iso, key=lambda b, size=size: abs(b - size)) for size in sizes]
    return max(0.0, statistics.mean(iso[b] - b / (fit.bandwidth_gbps * 1e3) for b in near))


def _read_copy_checks(samples: dict, profile: dict) -> list[dict]:
    """Each read-then-copy pipeline's measured time against :func:`read_copy_us` with the
    profile's SSD and copy terms (and against reads and copies one after the other)."""
    pcie, ssd = profile["pcie"], profile["ssd"]
    out = []
    for r in samples.get("read_copy", []):
        b, n = r["bytes"], r["n"]
        read = ssd["latency_us"] + b / (ssd["bandwidth_gbps"] * 1e3)
        gbps = pcie["bandwidth_gbps"] if r["kind"] == "pinned" else pcie["pageable_bandwidth_gbps"]
        copy = b / (gbps * 1e3)
        predicted = read_copy_us(n, read, copy, pcie["idle_latency_us"], pcie["latency_us"])
        measured = median(r["total_us"])
        out.append(dict(kind=r["kind"], bytes=b, n=n, measured_us=measured, predicted_us=predicted,
                        serial_us=n * (read + pcie["idle_latency_us"] + copy),
                        rel_err=(predicted - measured) / measured))
    return out


def _fixed_costs(samples: dict, compute: dict) -> dict:
    """Per model: the step's hand-over (the sequence per layer minus the profile's non-expert
    and expert times), the token's synchronisation (a synchronised token minus L sequences),
    and what c copies in the sequence add beyond the non-expert and expert parts."""
    out = {}
    for m, f in samples.get("fixed", {}).items():
        c = compute[m]
        seq = median(f["sequence_us"])
        out[m] = dict(
            step_fixed_us=seq - (c["nonexpert_layer_us"] + f["top_k"] * c["gpu_expert_us"]),
            token_fixed_us=median(f["token_us"]) - f["layers"] * seq,
            parts_us=dict(nonexpert=median(f["nonexpert_us"]), experts=median(f["experts_us"]), sequence=seq),
            copies_us={str(n): median(f[f"sequence_{n}_copies_us"]) - seq for n in f["copies"]},
        )
    return out


# The samples of the link and the disk, which --from-samples pools over calibrations; each
# section's entries are matched by these fields (the others are measurements)
LINK_SECTIONS = {"h2d": ("kind", "mode", "streams", "bytes"), "copy_order": ("bytes", "queued"),
                 "ssd": ("block_bytes", "pattern", "qd", "pinned"), "read_copy": ("kind", "bytes", "n")}
COMPUTE_SECTIONS = ("gpu_expert", "nonexpert", "fixed", "cpu_expert")
SAME_HOST = ("gpu", "pcie", "cpu")  # host facts that must agree between pooled calibrations


def pool_entry(a: dict, b: dict) -> dict:
    """One measurement's samples from two calibrations: every ``*_us`` list concatenated; the
    SSD summary (median, p90 over the kept quantiles; reads; bandwidth) recomputed."""
    out = dict(a)
    for k, v in b.items():
        if k.endswith("_us") and isinstance(v, list) and isinstance(a.get(k), list):
            out[k] = a[k] + v
    if "reads" in out and "times_us" in out:  # an SSD entry
        t = sorted(out["times_us"])
        out.update(reads=a["reads"] + b["reads"], median_us=median(t), p90_us=t[int(0.9 * (len(t) - 1))],
                   gbps=statistics.mean([a["gbps"], b["gbps"]]), times_us=t)
    return out


def measure_disk_like(device, path: Path, calibration: dict, seed: int) -> list[dict]:
    """The read-then-copy pipelines of ``calibration`` (a samples JSON) measured again on the
    expert file ``path``: its expert sizes and pipeline length, 3 repetitions each."""
    n = int(calibration["args"]["read_copy_experts"])
    return [r for b in calibration["expert_bytes"] for r in measure_read_copy(device, path, b, n, 3, seed)]


def disk_samples(calibration: dict, host: dict, rounds: Sequence[tuple[float, list[dict]]]) -> dict:
    """Disk samples taken in rounds (``(seconds from the first, read_copy entries)``) as one
    samples JSON that ``--from-samples`` pools with ``calibration``: its sizes, these entries
    pooled, and per round the back-to-back fit, so that the disk's drift is on record."""
    pooled: dict[tuple, dict] = {}
    for _, entries in rounds:
        for e in entries:
            key = tuple(e.get(f) for f in LINK_SECTIONS["read_copy"])
            pooled[key] = pool_entry(pooled[key], e) if key in pooled else e
    per_round = []
    for t, entries in rounds:
        fit = _ssd_back_to_back_fit(entries)
        per_round.append(dict(at_s=round(t, 1), ssd_back_to_back=asdict(fit) if fit else None))
    return dict(host=host, date=_dt.date.today().isoformat(), args=dict(calibration["args"], link_only=True,
                disk_only=True), expert_bytes=calibration["expert_bytes"],
                max_copy_bytes=calibration["max_copy_bytes"], models=calibration.get("models", {}),
                read_copy=list(pooled.values()), rounds=per_round,
                ssd_note=f"read-then-copy pipelines only, in {len(rounds)} rounds")


def pool_samples(runs: Sequence[dict], names: Sequence[str] = ()) -> dict:
    """The samples of several calibrations of one host as one set: the link's and the disk's
    measurements (``LINK_SECTIONS``) pooled entry by entry, so every fit and median is taken
    over all of them; the compute measurements from the first calibration that has them (a
    ``--link-only`` calibration has none). Raises InputError when the hosts or the measured
    sizes differ."""
    if not runs:
        raise InputError("--from-samples: name at least one samples JSON")
    out = json.loads(json.dumps(runs[0]))
    for i, run in enumerate(runs[1:], 1):
        what = names[i] if i < len(names) else f"calibration {i + 1}"
        for key in SAME_HOST:
            if run["host"].get(key) != out["host"].get(key):
                raise InputError(f"--from-samples: {what} has host {key} {run['host'].get(key)!r}, the first "
                                 f"{out['host'].get(key)!r}; pool calibrations of one host only")
        if run["expert_bytes"] != out["expert_bytes"] or run["max_copy_bytes"] != out["max_copy_bytes"]:
            raise InputError(f"--from-samples: {what} measured other sizes (expert_bytes, max_copy_bytes); "
                             f"calibrate both with the same --models and --max-copy-mib")
        for section, fields in LINK_SECTIONS.items():
            theirs = run.get(section)
            if not theirs:
                continue
            if isinstance(theirs, dict):  # one entry (copy_order)
                mine = out.get(section)
                out[section] = pool_entry(mine, theirs) if mine else theirs
                continue
            index = {tuple(e.get(f) for f in fields): j for j, e in enumerate(out.get(section) or [])}
            pooled = out.setdefault(section, [])
            for e in theirs:
                j = index.get(tuple(e.get(f) for f in fields))
                if j is None:
                    pooled.append(e)
                else:
                    pooled[j] = pool_entry(pooled[j], e)
        for section in COMPUTE_SECTIONS:
            if section not in out and section in run:
                out[section] = run[section]
                if "batched" in run:
                    out["batched"] = run["batched"]
    missing = [s for s in COMPUTE_SECTIONS if s not in out]
    if missing:
        raise InputError(f"--from-samples: no {', '.join(missing)} samples (only --link-only calibrations); "
                         f"name a full calibration's samples too")
    if len(runs) > 1:
        out["pooled"] = [dict(samples=names[i] if i < len(names) else None, date=r.get("date"),
                              link_only=bool(r.get("args", {}).get("link_only")))
                         for i, r in enumerate(runs)]
    out.pop("fits", None)
    return out


def profile_from_samples(samples: dict, name: str, samples_file: str | None, expert_mode: str = "batched",
                         copy_fit: str = "burst") -> tuple[dict, dict]:
    """The profile (and the fits and checks behind it) that a set of samples gives.

    ``expert_mode`` says how the engine being modelled runs experts: ``batched`` (one grouped
    kernel per step; device time, the host's launches hidden), ``graph`` (one CUDA graph per
    expert, device time), ``graph-issue`` (the same, bound by the host's launch rate) or
    ``eager``. The generic ``gpu`` fit uses the per-expert series of that mode. Terms whose
    samples are missing (older samples) are left out of the profile (the engine takes 0, or the
    back-to-back latency for the idle one).
    """
    if expert_mode not in EXPERT_SERIES:
        raise InputError(f"--expert-mode {expert_mode}: choose one of {', '.join(EXPERT_SERIES)}")
    h2d = samples["h2d"]
    kind = "pinned" if any(s["kind"] == "pinned" for s in h2d) else "pageable"
    fit_iso = _fit_series(h2d, kind=kind, mode="isolated")
    fit_burst = _fit_series(h2d, kind=kind, mode="burst")
    h2d_fit = fit_burst if copy_fit == "burst" else fit_iso
    expert_sizes = samples["expert_bytes"]
    idle_latency = _idle_latency_us(h2d, kind, expert_sizes, h2d_fit)
    pageable = [s for s in h2d if s["kind"] == "pageable" and s["mode"] == "isolated"]
    at_expert = min(pageable, key=lambda s: abs(s["bytes"] - max(expert_sizes)))
    # a pageable copy on an idle link costs the idle latency plus its bytes at this bandwidth
    pageable_gbps = at_expert["bytes"] / max(1e-9, median(at_expert["times_us"]) - idle_latency) / 1e3
    ssd_qd1 = _ssd_fit(samples["ssd"], samples["ssd_fallback"])
    ssd_b2b = _ssd_back_to_back_fit(samples.get("read_copy", []))
    ssd_fit = ssd_b2b or ssd_qd1  # the disk as an SSD-bound step sees it, where measured
    experts = samples["gpu_expert"]
    expert_key, nonexpert_key = EXPERT_SERIES[expert_mode]
    if not all(expert_key in e for e in experts):  # a CPU run has no graphs
        expert_key = nonexpert_key = "eager_us"
    gpu_fit = fit_or_rate([e["bytes"] for e in experts], [median(e[expert_key]) for e in experts], "gpu expert fit")
    cpu_runs = samples["cpu_expert"]
    cpu_fit = fit_or_rate([c["bytes"] for c in cpu_runs], [median(c["times_us"]) for c in cpu_runs], "cpu expert fit")
    batched = {(b["hidden"], b["intermediate"]): b for b in samples.get("batched", [])}
    if expert_mode == "batched" and not batched and expert_key != "eager_us":
        log("warning: the samples have no batched-expert timings (no Triton there); the profile uses "
            "--expert-mode graph")
        expert_mode = "graph"
    compute, floors = {}, []
    for m, raw in samples["models"].items():
        d = ModelDims(**raw)
        ne = nonexpert_layer_us(d, samples["nonexpert"][m], nonexpert_key)
        kinds = samples["nonexpert"][m]["kinds"]
        nbytes = statistics.mean(
            kinds["full_attention" if d.is_full_attention(layer) else "linear_attention"]["weight_bytes"]
            for layer in range(d.num_layers)
        )
        floors.append(max(0.0, ne - nbytes / (gpu_fit.bandwidth_gbps * 1e3)))
        shape = (d.hidden, d.expert_intermediate)
        if expert_mode == "batched" and shape in batched:
            b = batched[shape]
            k = d.top_k
            gpu_expert = median(b["gpu_us"][k] if k in b["gpu_us"] else b["gpu_us"][str(k)]) / k
        else:
            e = next(x for x in experts if (x["hidden"], x["intermediate"]) == shape)
            gpu_expert = median(e[expert_key])
        c = next(x for x in cpu_runs if (x["hidden"], x["intermediate"]) == shape)
        compute[m] = dict(gpu_expert_us=gpu_expert, nonexpert_layer_us=ne, cpu_expert_us=median(c["times_us"]))
    fixed = _fixed_costs(samples, compute)
    facts = samples["host"]
    cuda = facts.get("pcie") != "n/a"
    method = (
        f"moe-calibrate: host-to-device copies timed with {'CUDA events' if cuda else 'the wall clock'} "
        f"({copy_fit} fit over 64 KiB-{samples['max_copy_bytes'] // MIB} MiB, {kind}; idle latency: isolated "
        f"copies at expert size"
        + ("; copy order: a synchronous copy behind background copies on a low-priority stream"
           if samples.get("copy_order") else "")
        + "); SSD "
        + ("reads back to back (read-then-copy pipelines, fit over expert sizes)" if ssd_b2b
           else "random QD1 fit")
        + f", {samples['ssd_note']}; experts {expert_mode} ({expert_key}: "
        + ("one grouped kernel per step, device time" if expert_mode == "batched" else "per expert call")
        + f", weights rotated past L2); non-expert layer as a CUDA graph ({nonexpert_key}); "
        + ("token and step fixed costs: the replay's step sequence against its parts; " if fixed else "")
        + f"CPU {facts.get('cpu')} x{samples['cpu_threads']} threads; torch {facts.get('torch')}"
    )
    pooled = samples.get("pooled")
    if pooled:
        method += (f"; copies and disk pooled over {len(pooled)} calibrations of this host ("
                   + ", ".join(f"{p['samples'] or 'unnamed'}{' (copies and disk only)' if p['link_only'] else ''}"
                               for p in pooled) + ")")
    host = dict(gpu=facts["gpu"], pcie=facts["pcie"], date=samples["date"], method=method)
    profile = build_profile(
        name, host=host, h2d=h2d_fit, idle_latency_us=idle_latency, pageable_gbps=pageable_gbps, ssd=ssd_fit,
        gpu_expert=gpu_fit, layer_fixed_us=statistics.mean(floors), cpu_expert=cpu_fit, compute=compute,
        samples_file=samples_file, gpu_memory_bytes=gpu_memory_bytes(facts),
        token_fixed_us=statistics.mean(max(0.0, f["token_fixed_us"]) for f in fixed.values()) if fixed else None,
        step_fixed_us=statistics.mean(max(0.0, f["step_fixed_us"]) for f in fixed.values()) if fixed else None,
        copy_order=copy_order_of(samples["copy_order"]) if samples.get("copy_order") else None,
    )
    pcie = profile["pcie"]
    for m, f in fixed.items():  # what the model charges for the copies the sequence added
        per_copy = samples["fixed"][m]["copy_bytes"] / (pcie["bandwidth_gbps"] * 1e3)
        f["copies_model_us"] = {c: pcie["idle_latency_us"] + (int(c) - 1) * pcie["latency_us"] + int(c) * per_copy
                                for c in f["copies_us"]}
    fits = dict(h2d_isolated=asdict(fit_iso), h2d_burst=asdict(fit_burst), h2d_used=copy_fit,
                h2d_idle_latency_us=idle_latency, ssd_random_qd1=asdict(ssd_qd1),
                ssd_back_to_back=asdict(ssd_b2b) if ssd_b2b else None,
                ssd_used="back_to_back" if ssd_b2b else "random_qd1", gpu_expert=asdict(gpu_fit),
                gpu_expert_series=expert_key, cpu_expert=asdict(cpu_fit), expert_mode=expert_mode,
                compute=compute, fixed=fixed, read_copy=_read_copy_checks(samples, profile))
    return profile, fits


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            h, i = (int(v) for v in part.lower().split("x"))
        except ValueError as e:
            raise InputError(f"--expert-shapes: '{part}' is not HIDDENxINTERMEDIATE, e.g. 2048x512") from e
        shapes.append((h, i))
    return shapes


def _parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InputError(f"{option} {text!r}: give comma-separated integers >= 1, e.g. 1,2,4,8,16,32")
    return values


def write_profile(profile: dict, samples: dict, out: Path) -> tuple[Path, Path]:
    """Write the profile YAML and its samples JSON (atomically, each via a temporary file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    side = out.with_suffix(".samples.json")
    header = [
        f"{profile['host']['gpu']}, PCIe {profile['host']['pcie']}. Measured by moe-calibrate on "
        f"{profile['host']['date']}; raw samples and fits: {side.name}.",
        "Regenerate on the host you model: moe-calibrate --out conf/hardware/<name>.yaml",
    ]
    for path, text in ((out, render_profile_yaml(profile, header)), (side, json.dumps(samples, indent=1, default=str) + "\n")):
        atomic_write_text(path, text)
    return out, side


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="conf/hardware/measured.yaml", help="profile YAML to write (samples go beside it)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--device", default="cuda", help="cuda (a GPU host) or cpu (tiny test run)")
    p.add_argument("--dtype", default="bfloat16", help="expert weight dtype (torch name)")
    p.add_argument("--models", default="qwen3_next_80b_a3b,qwen3_30b_a3b",
                   help="models to time: presets of conf/model/ with an attention block, each as NAME or NAME:K "
                        "(K: the top-k a trace routes it at, where that differs from the preset's)")
    p.add_argument("--expert-shapes", default="2048x512,2048x768,4096x14336", help="extra HIDDENxINTERMEDIATE expert shapes for the gpu/cpu fits")
    p.add_argument("--cpu-expert-shapes", default="2048x512,4096x1536", help="extra expert shapes for the cpu fit")
    p.add_argument("--expert-mode", choices=tuple(EXPERT_SERIES), default="batched",
                   help="how the modelled engine runs experts (which timing the profile uses)")
    p.add_argument("--from-samples", default=None,
                   help="rebuild the profile from a samples JSON, measuring nothing; several, comma-separated: "
                        "their copy and disk samples pooled (e.g. a calibration and a later --link-only one)")
    p.add_argument("--link-only", action="store_true",
                   help="measure only the host-to-device copies and the disk and write only their samples "
                        "(<out>.samples.json), to pool with a full calibration by --from-samples")
    p.add_argument("--copy-fit", choices=("burst", "isolated"), default="burst", help="copy series the pcie fit uses")
    p.add_argument("--max-copy-mib", type=int, default=512, help="largest host-to-device copy (MiB)")
    p.add_argument("--reps", type=int, default=12, help="repetitions per measurement (medians are used)")
    p.add_argument("--ctx", type=int, default=1024, help="KV-cache length for full-attention layers")
    p.add_argument("--cpu-threads", type=int, default=0, help="CPU threads for CPU expert compute (0 = all cores)")
    p.add_argument("--ssd-dir", default="/var/tmp", help="directory on the disk to test (a temporary file is written there)")
    p.add_argument("--ssd-file", default=None,
                   help="expert file to read instead (used as it is if it exists, else created at --ssd-file-mib; kept: "
                        "moe-replay reads it too)")
    p.add_argument("--ssd-file-mib", type=int, default=2048, help="size of the SSD test file (MiB)")
    p.add_argument("--ssd-seconds", type=float, default=0.4, help="seconds per SSD configuration")
    p.add_argument("--ssd-qds", default="1,2,4,8,16,32", help="queue depths (reading threads) of the expert-sized reads")
    p.add_argument("--read-copy-experts", type=int, default=16, help="experts per read-then-copy pipeline")
    p.add_argument("--skip-ssd", action="store_true", help="don't measure the disk; use --ssd-fallback")
    p.add_argument("--ssd-fallback", nargs=2, default=(37.0, 2.3), metavar=("LATENCY_US", "GBPS"), help="ssd values with --skip-ssd")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        if args.from_samples:
            paths = [Path(p) for p in args.from_samples.split(",") if p]
            for path in paths:
                if not path.exists():
                    raise InputError(f"--from-samples {path} does not exist")
            runs = [json.loads(path.read_text()) for path in paths]
            samples = pool_samples(runs, [p.name for p in paths]) if len(runs) > 1 else runs[0]
        else:
            samples = measure_all(args)
            if args.link_only:
                side = out.with_suffix(".samples.json")
                side.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(side, json.dumps(samples, indent=1, default=str) + "\n")
                log(f"wrote {side} (copies and disk only; pool it: --from-samples FULL.samples.json,{side})")
                return
        profile, samples["fits"] = profile_from_samples(
            samples, args.name or out.stem, out.with_suffix(".samples.json").name, args.expert_mode, args.copy_fit)
        out, side = write_profile(profile, samples, out)
    except InputError as e:
        print(f"moe-calibrate: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)
    log(f"wrote {out} and {side}")
    print(render_profile_yaml(profile), end="")


if __name__ == "__main__":
    main()
