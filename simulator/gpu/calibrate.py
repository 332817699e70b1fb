"""moe-calibrate: measure a host's hardware-model inputs and write a hardware profile.

Runs on the host being modelled (a GPU host; ``--device cpu`` is a tiny smoke run for tests).
It measures, with progress on stderr:

- host-to-device copies, 64 KiB to 512 MiB, pinned and pageable, one and several streams,
  fitted as ``fixed_us + bytes / bandwidth``;
- SSD reads with O_DIRECT (page cache bypassed, aligned buffers) at expert-sized blocks,
  sequential and random, queue depth 1 and higher, from a temporary file;
- one routed expert (SwiGLU gate/up/down) at batch 1: eager, one CUDA graph per expert, and a
  step's k experts in one grouped kernel (Triton, slot ids read from GPU memory); the non-expert
  part of a decoder layer (attention, router, shared expert) for each model's shapes; device
  times with the launch queue filled ahead, and the host's launch cost beside them;
- one routed expert on the CPU (torch, batch 1, the configured thread count).

It writes the profile YAML (the schema ``simulator.hardware`` validates) and the raw samples in
a JSON file beside it (``<profile>.samples.json``). The simulator only reads profiles.

The expert and non-expert kernels defined here are the ones ``moe-replay`` runs, so what the
profile says and what the replay executes are the same code.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import mmap
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from simulator.hardware import validate_profile
from simulator.models import preset, with_attention_shapes
from traces.atomic import atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError

__all__ = [
    "ModelDims",
    "model_dims",
    "Fit",
    "fit_fixed_plus_bandwidth",
    "validate_profile",
    "build_profile",
    "render_profile_yaml",
    "main",
]

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DIRECT_ALIGN = 4096  # O_DIRECT offset, length and buffer alignment


@dataclass(frozen=True)
class ModelDims:
    """Shapes of one MoE model's decoder layer (what the non-expert and expert kernels need)."""

    hidden: int
    expert_intermediate: int
    num_layers: int
    num_experts: int
    top_k: int
    shared_intermediate: int  # 0 = no shared expert
    heads: int  # full (gated) attention
    kv_heads: int
    head_dim: int
    full_attention_interval: int  # every n-th layer is full attention, the others linear; 1 = all
    linear_k_heads: int = 0  # Gated DeltaNet (linear attention) shapes
    linear_v_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 4
    gated_attention: bool = False  # attention output gated by sigmoid(q-side gate)

    def expert_bytes(self, itemsize: int = 2) -> int:
        return 3 * self.hidden * self.expert_intermediate * itemsize

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0


def model_dims(name: str) -> ModelDims:
    """The decoder-layer shapes of a model preset (``conf/model/<name>.yaml``, its ``attention``
    block: the one registry of model shapes, shared with moe-sim)."""
    p = preset(name)
    a = p.get("attention")
    if not a:
        raise InputError(f"model '{name}' has no attention shapes in conf/model/{name}.yaml; "
                         f"known: {', '.join(with_attention_shapes())}")
    return ModelDims(
        hidden=p["hidden_size"], expert_intermediate=p["moe_intermediate_size"],
        num_layers=p["num_layers"], num_experts=p["num_experts"], top_k=p["top_k"],
        shared_intermediate=p.get("shared_intermediate_size") or 0, heads=a["heads"],
        kv_heads=a["kv_heads"], head_dim=a["head_dim"],
        full_attention_interval=a["full_attention_interval"],
        linear_k_heads=a.get("linear_k_heads", 0), linear_v_heads=a.get("linear_v_heads", 0),
        linear_head_dim=a.get("linear_head_dim", 0),
        gated_attention=bool(a.get("gated_attention", False)),
    )


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
    gpu_expert: Fit,
    layer_fixed_us: float,
    cpu_expert: Fit,
    compute: dict[str, dict[str, float]],
    samples_file: str | None,
    source: str = "measured",
    gpu_memory_bytes: int | None = None,
) -> dict:
    """A profile dict of the schema ``simulator.hardware`` reads; validated before return."""
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
    if gpu_memory_bytes:
        profile["gpu"]["memory_bytes"] = int(gpu_memory_bytes)
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
    lines = [f"# {h}" for h in header]
    lines += [
        f"name: {p['name']}",
        f"source: {p['source']}  # measured | datasheet",
        "host:",
        *(f"  {k}: {_q(str(v))}" for k, v in p["host"].items()),
        "pcie:",
        f"  latency_us: {p['pcie']['latency_us']}  # fixed cost per host-to-device copy (fit)",
        f"  bandwidth_gbps: {p['pcie']['bandwidth_gbps']}  # GB/s (1e9 bytes/s), pinned host memory (fit)",
    ]
    if p["pcie"].get("pageable_bandwidth_gbps") is not None:
        lines.append(
            f"  pageable_bandwidth_gbps: {p['pcie']['pageable_bandwidth_gbps']}"
            "  # informational: pageable copies at expert size"
        )
    lines += [
        "ssd:",
        f"  latency_us: {p['ssd']['latency_us']}  # O_DIRECT random reads at queue depth 1 (fit)",
        f"  bandwidth_gbps: {p['ssd']['bandwidth_gbps']}  # same fit; queue depth > 1 in the samples",
        f"host_ram_bytes: {'null' if p['host_ram_bytes'] is None else p['host_ram_bytes']}"
        "  # bytes of expert weights host RAM can hold; null = the whole model",
        "gpu:",
        f"  expert_fixed_us: {p['gpu']['expert_fixed_us']}  # per expert call at batch 1 (CUDA graph; fit over expert sizes)",
        f"  memory_bandwidth_gbps: {p['gpu']['memory_bandwidth_gbps']}  # effective GB/s streaming expert weights (same fit)",
        f"  layer_fixed_us: {p['gpu']['layer_fixed_us']}  # non-expert compute floor per layer (measured layer minus its bytes at that bandwidth)",
        *([f"  memory_bytes: {p['gpu']['memory_bytes']}  # the GPU's memory, as the driver reports it"]
          if "memory_bytes" in p["gpu"] else []),
        "cpu:",
        f"  expert_fixed_us: {p['cpu']['expert_fixed_us']}  # per expert call on the host CPU at batch 1 (fit)",
        f"  memory_bandwidth_gbps: {p['cpu']['memory_bandwidth_gbps']}  # effective GB/s the CPU streams expert weights at (fit)",
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


# --------------------------------------------------------------------------- kernels (shared with moe-replay)


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise InputError("PyTorch is not installed; moe-calibrate and moe-replay need it") from e
    return torch


def resolve_device(name: str):
    """``cuda`` (the default) needs a CUDA GPU; ``cpu`` is the tiny test path."""
    torch = import_torch()
    if name == "cpu":
        return torch.device("cpu")
    if not name.startswith("cuda"):
        raise InputError(f"--device {name}: choose cuda or cpu")
    if not torch.cuda.is_available():
        raise InputError(
            "no CUDA GPU found (torch.cuda.is_available() is False); run on a GPU host, or pass "
            "--device cpu for a small CPU-only test run"
        )
    return torch.device(name)


def expert_views(flat, hidden: int, intermediate: int):
    """(gate_up [2I, H], down [H, I]) views of one expert stored as one contiguous buffer."""
    n_gu = 2 * intermediate * hidden
    gate_up = flat[:n_gu].view(2 * intermediate, hidden)
    down = flat[n_gu : n_gu + hidden * intermediate].view(hidden, intermediate)
    return gate_up, down


class ExpertKernel:
    """One routed SwiGLU expert at batch 1: ``y += gate * down(silu(x W_g) * (x W_u))``.

    Static input/output buffers (``x``, ``y``, ``gate``) are shared by all experts run through one
    kernel object, so a CUDA graph captured per weight buffer replays without copies.
    """

    def __init__(self, hidden: int, intermediate: int, device, dtype):
        torch = import_torch()
        self.hidden, self.intermediate = hidden, intermediate
        self.device, self.dtype = device, dtype
        self.x = torch.randn(1, hidden, device=device, dtype=dtype)
        self.y = torch.zeros(1, hidden, device=device, dtype=dtype)
        self.gate = torch.full((1,), 0.1, device=device, dtype=dtype)
        self._gu = torch.empty(1, 2 * intermediate, device=device, dtype=dtype)
        self._act = torch.empty(1, intermediate, device=device, dtype=dtype)
        self._h = torch.empty(1, intermediate, device=device, dtype=dtype)
        self._o = torch.empty(1, hidden, device=device, dtype=dtype)

    def run(self, flat) -> None:
        """Run the expert whose weights are the flat buffer ``flat`` (3*H*I elements)."""
        torch = import_torch()
        gate_up, down = expert_views(flat, self.hidden, self.intermediate)
        i = self.intermediate
        torch.mm(self.x, gate_up.t(), out=self._gu)
        torch.ops.aten.silu.out(self._gu[:, :i], out=self._act)
        torch.mul(self._act, self._gu[:, i:], out=self._h)
        torch.mm(self._h, down.t(), out=self._o)
        self.y.addcmul_(self._o, self.gate)


def random_weights(n: int, numel: int, device, dtype, scale: float = 0.02):
    """n flat weight buffers of numel elements each (random: never time on zeros)."""
    torch = import_torch()
    return [torch.randn(numel, device=device, dtype=dtype) * scale for _ in range(n)]


def check_expert_kernel(hidden: int, intermediate: int, device, dtype, graph: bool = False) -> float:
    """Relative error of ExpertKernel (eager, or replayed as a CUDA graph) against float64."""
    torch = import_torch()
    k = ExpertKernel(hidden, intermediate, device, dtype)
    (w,) = random_weights(1, 3 * hidden * intermediate, device, dtype, scale=0.05)
    k.gate.fill_(1.0)
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            k.run(w)
        torch.cuda.synchronize()
        g = capture_graph(lambda: k.run(w), stream)
        k.x.copy_(torch.randn_like(k.x))  # fresh input after capture: the graph must read it
        k.y.fill_(float("nan"))  # poison, then clear: every element must be written
        k.y.zero_()
        g.replay()
        torch.cuda.synchronize()
    else:
        k.y.zero_()
        k.run(w)
    gu, down = (t.double().cpu() for t in expert_views(w, hidden, intermediate))
    x = k.x.double().cpu()
    g = x @ gu.t()
    ref = (torch.nn.functional.silu(g[:, :intermediate]) * g[:, intermediate:]) @ down.t()
    return float((k.y.double().cpu() - ref).norm() / ref.norm())


@functools.cache
def _triton_kernels():
    """The batched expert kernels (Triton), compiled on first use; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gate_up_kernel(slots, x, idx, count, counter, hbuf, numel, stride_idx,
                       H: tl.constexpr, INTER: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr):
        # program (j, block): rows of expert j's gate and up projections, then SwiGLU
        j = tl.program_id(0)
        step = tl.load(counter)
        n = tl.load(count + step)
        if j < n:
            slot = tl.load(idx + step * stride_idx + j).to(tl.int64)
            base = slots + slot * numel
            rows = tl.program_id(1) * BI + tl.arange(0, BI)
            acc_g = tl.zeros([BI], dtype=tl.float32)
            acc_u = tl.zeros([BI], dtype=tl.float32)
            for h0 in range(0, H, BH):
                cols = h0 + tl.arange(0, BH)
                xv = tl.load(x + cols).to(tl.float32)
                wg = tl.load(base + rows[:, None] * H + cols[None, :]).to(tl.float32)
                wu = tl.load(base + (rows[:, None] + INTER) * H + cols[None, :]).to(tl.float32)
                acc_g += tl.sum(wg * xv[None, :], axis=1)
                acc_u += tl.sum(wu * xv[None, :], axis=1)
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(hbuf + j * INTER + rows, act)

    @triton.jit
    def down_kernel(slots, hbuf, gates, idx, count, counter, y, numel, stride_idx,
                    H: tl.constexpr, INTER: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
        # program (block, j): output rows of expert j's down projection, added into y
        j = tl.program_id(1)
        step = tl.load(counter)
        n = tl.load(count + step)
        if j < n:
            slot = tl.load(idx + step * stride_idx + j).to(tl.int64)
            base = slots + slot * numel + 2 * INTER * H
            rows = tl.program_id(0) * BO + tl.arange(0, BO)
            acc = tl.zeros([BO], dtype=tl.float32)
            for i0 in range(0, INTER, BI):
                cols = i0 + tl.arange(0, BI)
                hv = tl.load(hbuf + j * INTER + cols)
                w = tl.load(base + rows[:, None] * INTER + cols[None, :]).to(tl.float32)
                acc += tl.sum(w * hv[None, :], axis=1)
            tl.atomic_add(y + rows, acc * tl.load(gates + j))

    return gate_up_kernel, down_kernel


def batched_available() -> bool:
    return _triton_kernels() is not None


class BatchedExperts:
    """All routed experts of one step in two kernel launches, reading slot ids from the device.

    ``slots``: [S, 3*H*INTER] expert weights (the layout of :func:`expert_views`). The ids of step
    ``counter`` are ``idx[counter, :count[counter]]``; :meth:`run` computes
    ``y += sum_j gate_j * expert_{idx_j}(x)`` and advances ``counter``, so one CUDA graph of it
    serves every step (a real engine's grouped expert kernel does the same work).
    ``y`` is float32 [1, H]; ``x`` is [1, H] in the weights' dtype.
    """

    BI, BH, BO, BI_DOWN = 16, 256, 32, 128

    def __init__(self, slots, hidden: int, intermediate: int, max_n: int, max_steps: int, x, y):
        torch = import_torch()
        kernels = _triton_kernels()
        if kernels is None:
            raise InputError("--expert-mode batched needs Triton (pip install triton); use graph or eager")
        self.blocks = dict(BI=min(self.BI, intermediate), BH=min(self.BH, hidden),
                           BO=min(self.BO, hidden), BI_DOWN=min(self.BI_DOWN, intermediate))
        for b in self.blocks.values():
            if b & (b - 1) or (hidden % b and intermediate % b):
                raise InputError(f"batched experts need power-of-two hidden and intermediate sizes, got "
                                 f"{hidden}x{intermediate}")
        dev = slots.device
        self.kernels, self.slots, self.x, self.y = kernels, slots, x, y
        self.hidden, self.intermediate, self.max_n = hidden, intermediate, max_n
        self.idx = torch.zeros((max_steps, max_n), dtype=torch.int32, device=dev)
        self.count = torch.zeros(max_steps, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.gates = torch.full((max_n,), 1.0 / max_n, dtype=torch.float32, device=dev)
        self.hbuf = torch.empty((max_n, intermediate), dtype=torch.float32, device=dev)

    def load(self, idx, count, gates=None) -> None:
        """Step rows: idx int[steps, <= max_n] slot ids, count int[steps]; resets the counter."""
        torch = import_torch()
        idx = torch.as_tensor(idx, dtype=torch.int32)
        self.idx.zero_()
        self.idx[: idx.shape[0], : idx.shape[1]].copy_(idx)
        self.count.zero_()
        self.count[: len(count)].copy_(torch.as_tensor(count, dtype=torch.int32))
        if gates is not None:
            self.gates.copy_(torch.as_tensor(gates, dtype=torch.float32))
        self.counter.zero_()

    def run(self) -> None:
        gate_up, down = self.kernels
        H, INTER = self.hidden, self.intermediate
        numel, stride = self.slots.shape[1], self.idx.shape[1]
        b = self.blocks
        gate_up[(self.max_n, INTER // b["BI"])](
            self.slots, self.x, self.idx, self.count, self.counter, self.hbuf, numel, stride,
            H=H, INTER=INTER, BI=b["BI"], BH=b["BH"])
        down[(H // b["BO"], self.max_n)](
            self.slots, self.hbuf, self.gates, self.idx, self.count, self.counter, self.y, numel, stride,
            H=H, INTER=INTER, BO=b["BO"], BI=b["BI_DOWN"])
        self.counter.add_(1)


def check_batched_experts(hidden: int, intermediate: int, n: int, device, dtype) -> float:
    """Relative error of BatchedExperts against float64 on random slots, inputs and gates."""
    torch = import_torch()
    numel = 3 * hidden * intermediate
    slots = torch.randn((2 * n + 1, numel), device=device, dtype=dtype) * 0.05
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    y = torch.zeros((1, hidden), device=device, dtype=torch.float32)
    b = BatchedExperts(slots, hidden, intermediate, n, 1, x, y)
    ids = torch.randperm(slots.shape[0])[:n]
    gates = torch.rand(n)
    b.load(ids[None, :], [n], gates)
    b.run()
    ref = torch.zeros(1, hidden, dtype=torch.float64)
    xd = x.double().cpu()
    for j, s in enumerate(ids.tolist()):
        gu, down = (t.double().cpu() for t in expert_views(slots[s], hidden, intermediate))
        g = xd @ gu.t()
        ref += gates[j].double() * ((torch.nn.functional.silu(g[:, :intermediate]) * g[:, intermediate:]) @ down.t())
    return float((y.double().cpu() - ref).norm() / ref.norm())


class NonExpertLayer:
    """The non-routed part of one decoder layer at batch 1 (decode), for timing.

    Full (optionally gated) attention over a KV cache of ``ctx`` tokens, or a Gated DeltaNet
    (linear attention) recurrent step; then the router (linear + softmax + top-k) and the shared
    SwiGLU expert. Reads ``hidden_state``, writes ``expert_input`` (the routed experts' input).
    Shapes follow the model; weights are random. Rotary embeddings are left out (elementwise).
    It first adds the previous layer's routed-expert output to the residual stream and clears it.
    """

    def __init__(self, dims: ModelDims, full_attention: bool, device, dtype, ctx: int = 1024,
                 expert_input=None, expert_output=None):
        torch = import_torch()
        self.dims, self.full = dims, full_attention
        H = dims.hidden

        def w(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.hidden_state = torch.randn(1, H, device=device, dtype=dtype)
        # the routed experts read expert_input and accumulate into expert_output (ExpertKernel.x, .y)
        self.expert_input = torch.empty(1, H, device=device, dtype=dtype) if expert_input is None else expert_input
        self.expert_output = torch.zeros(1, H, device=device, dtype=dtype) if expert_output is None else expert_output
        self.norm_w = torch.ones(H, device=device, dtype=dtype)
        if full_attention:
            q_out = dims.heads * dims.head_dim * (2 if dims.gated_attention else 1)
            self.w_q = w(q_out, H)
            self.w_k = w(dims.kv_heads * dims.head_dim, H)
            self.w_v = w(dims.kv_heads * dims.head_dim, H)
            self.w_o = w(H, dims.heads * dims.head_dim)
            self.k_cache = torch.randn(1, dims.kv_heads, ctx, dims.head_dim, device=device, dtype=dtype)
            self.v_cache = torch.randn(1, dims.kv_heads, ctx, dims.head_dim, device=device, dtype=dtype)
            self.pos = torch.tensor([ctx - 1], device=device)
        else:
            nk, nv, d = dims.linear_k_heads, dims.linear_v_heads, dims.linear_head_dim
            self.conv_dim = 2 * nk * d + nv * d
            self.w_qkvz = w(2 * nk * d + 2 * nv * d, H)
            self.w_ba = w(2 * nv, H)
            self.conv_w = w(self.conv_dim, dims.conv_kernel)
            self.conv_state = torch.randn(self.conv_dim, dims.conv_kernel, device=device, dtype=dtype)
            self.a_log = torch.zeros(nv, device=device, dtype=torch.float32)
            self.dt_bias = torch.zeros(nv, device=device, dtype=torch.float32)
            self.state = torch.zeros(nv, d, d, device=device, dtype=torch.float32)
            self.w_out = w(H, nv * d)
        self.w_router = w(dims.num_experts, H)
        if dims.shared_intermediate:
            self.w_shared_gu = w(2 * dims.shared_intermediate, H)
            self.w_shared_down = w(H, dims.shared_intermediate)
            self.w_shared_gate = w(1, H)

    @staticmethod
    def _rms(x, weight=None, eps: float = 1e-6):
        torch = import_torch()
        y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
        return y * weight if weight is not None else y

    def _attention(self, x):
        torch = import_torch()
        F = torch.nn.functional
        d = self.dims
        q = x @ self.w_q.t()
        gate = None
        if d.gated_attention:
            q, gate = q.view(d.heads, 2 * d.head_dim).split(d.head_dim, dim=-1)
        q = self._rms(q.reshape(1, d.heads, 1, d.head_dim))
        k = self._rms((x @ self.w_k.t()).view(1, d.kv_heads, 1, d.head_dim))
        v = (x @ self.w_v.t()).view(1, d.kv_heads, 1, d.head_dim)
        self.k_cache.index_copy_(2, self.pos, k)
        self.v_cache.index_copy_(2, self.pos, v)
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)
        o = o.reshape(d.heads, d.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return o.reshape(1, -1) @ self.w_o.t()

    def _linear_attention(self, x):
        torch = import_torch()
        F = torch.nn.functional
        d = self.dims
        nk, nv, hd = d.linear_k_heads, d.linear_v_heads, d.linear_head_dim
        qkvz = (x @ self.w_qkvz.t()).view(-1)
        mixed, z = qkvz[: self.conv_dim], qkvz[self.conv_dim :]
        b, a = (x @ self.w_ba.t()).view(-1).float().chunk(2)
        # causal depthwise conv, one new column
        self.conv_state.copy_(torch.roll(self.conv_state, -1, dims=1))
        self.conv_state[:, -1] = mixed
        mixed = F.silu((self.conv_state * self.conv_w).sum(-1))
        q, k, v = mixed.float().split([nk * hd, nk * hd, nv * hd])
        q = F.normalize(q.view(nk, hd), dim=-1).repeat_interleave(nv // nk, 0) * hd**-0.5
        k = F.normalize(k.view(nk, hd), dim=-1).repeat_interleave(nv // nk, 0)
        v = v.view(nv, hd)
        beta = torch.sigmoid(b)
        decay = torch.exp(-torch.exp(self.a_log) * F.softplus(a + self.dt_bias))
        self.state.mul_(decay.view(nv, 1, 1))
        kv_mem = torch.einsum("hk,hkv->hv", k, self.state)
        delta = (v - kv_mem) * beta.view(nv, 1)
        self.state.add_(k.unsqueeze(-1) * delta.unsqueeze(1))
        o = torch.einsum("hk,hkv->hv", q, self.state)
        o = self._rms(o).to(x.dtype) * F.silu(z.view(nv, hd))
        return o.reshape(1, -1) @ self.w_out.t()

    def run(self) -> None:
        torch = import_torch()
        F = torch.nn.functional
        d = self.dims
        h = self.hidden_state + self.expert_output.to(self.hidden_state.dtype)  # previous layer's experts
        self.expert_output.zero_()
        x = self._rms(h, self.norm_w)
        h = h + (self._attention(x) if self.full else self._linear_attention(x))
        x = self._rms(h, self.norm_w)
        probs = torch.softmax((x @ self.w_router.t()).float(), dim=-1)
        torch.topk(probs, d.top_k, dim=-1)
        if d.shared_intermediate:
            gu = x @ self.w_shared_gu.t()
            g, u = gu.chunk(2, dim=-1)
            s = (F.silu(g) * u) @ self.w_shared_down.t()
            h = h + torch.sigmoid(x @ self.w_shared_gate.t()) * s
        self.expert_input.copy_(x)
        # keep the residual stream bounded over many steps
        self.hidden_state.copy_(self._rms(h))


def capture_graph(fn: Callable[[], None], stream, pool=None):
    """A CUDA graph of ``fn`` captured on ``stream`` (no gc.collect per capture, unlike
    ``torch.cuda.graph``, which makes thousands of captures slow)."""
    torch = import_torch()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        g.capture_begin(pool=pool)
        try:
            fn()
        finally:
            g.capture_end()
    return g


# --------------------------------------------------------------------------- timing helpers


class Timer:
    """Device-side elapsed time: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device):
        self.torch = import_torch()
        self.cuda = device.type == "cuda"

    def time_us(self, fn: Callable[[], None], n: int = 1) -> float:
        """Microseconds per call of fn, over n back-to-back calls (synchronised around them)."""
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n

    def gpu_only_us(self, fn: Callable[[], None], n: int, lead_ms: float = 30.0) -> tuple[float, float]:
        """(device us per call, host issue us per call) of n back-to-back calls of fn.

        On a GPU a spin kernel of ``lead_ms`` runs first, so every call is queued before the
        first one starts: the device time excludes the host's launch cost (what a busy engine
        sees). On the CPU both numbers are the wall clock.
        """
        torch = self.torch
        if not self.cuda:
            t = self.time_us(fn, n)
            return t, t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(lead_ms * 1e-3 * 2.0e9))  # cycles at ~2 GHz; idle clocks only lengthen it
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        issue = (time.perf_counter() - t0) * 1e6 / n
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) * 1e3 / n
        if issue * n > lead_ms * 1e3 * 0.9:
            log(f"warning: issuing {n} calls took {issue * n / 1e3:.1f} ms, longer than the {lead_ms} ms lead")
        return gpu, issue

    def wall_us(self, fn: Callable[[], None]) -> float:
        """Wall-clock microseconds of fn including a device synchronisation."""
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6


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


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)  # anonymous mappings are page-aligned


def _direct_flag() -> int:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise InputError("this platform has no O_DIRECT; SSD reads can't bypass the page cache")
    return flag


def make_direct_file(directory: str, size: int) -> str:
    """A temporary file of ``size`` random bytes that O_DIRECT can read (InputError if not)."""
    fd, path = tempfile.mkstemp(prefix="moe-calibrate-", suffix=".bin", dir=directory)
    os.close(fd)
    chunk = 64 * MIB
    block = os.urandom(chunk)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(block[: min(chunk, left)])
            left -= chunk
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | _direct_flag())
        buf = _aligned(DIRECT_ALIGN)
        os.preadv(fd, [buf], 0)
        os.close(fd)
    except OSError as e:
        os.unlink(path)
        raise InputError(f"O_DIRECT reads fail in {directory} ({e.strerror}); pass --ssd-dir on a real disk") from e
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return path


def measure_ssd_reads(path: str, block: int, pattern: str, qd: int, seconds: float, max_reads: int, seed: int = 0) -> dict:
    """O_DIRECT reads of ``block`` bytes, ``sequential`` or ``random``, with ``qd`` threads.

    Returns per-read latencies (us) and the aggregate bandwidth (GB/s) over the run.
    """
    import random

    size = os.path.getsize(path)
    nblocks = size // block
    fd = os.open(path, os.O_RDONLY | _direct_flag())
    lat: list[float] = []
    lock = threading.Lock()
    counter = [0]
    rng = random.Random(seed)
    order = list(range(nblocks))
    if pattern == "random":
        rng.shuffle(order)
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        buf = _aligned(block)
        mine = []
        while True:
            with lock:
                i = counter[0]
                counter[0] += 1
            if i >= max_reads or time.perf_counter() > deadline:
                break
            off = order[i % nblocks] * block
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            mine.append((time.perf_counter() - t0) * 1e6)
        with lock:
            lat.extend(mine)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    os.close(fd)
    lat.sort()
    keep = lat[:: max(1, len(lat) // 100)]  # about 100 evenly spaced quantiles, not every read
    return dict(block_bytes=block, pattern=pattern, qd=qd, reads=len(lat), median_us=median(lat),
                p90_us=lat[int(0.9 * (len(lat) - 1))], gbps=len(lat) * block / wall / 1e9,
                times_us=[round(t, 2) for t in keep])


def measure_ssd(directory: str, file_bytes: int, blocks: Sequence[int], qds: Sequence[int], seconds: float) -> list[dict]:
    path = make_direct_file(directory, file_bytes)
    log(f"ssd: {file_bytes / GIB:.2f} GiB test file at {path}")
    out = []
    try:
        for pattern in ("sequential", "random"):
            for qd in qds:
                for block in blocks:
                    s = measure_ssd_reads(path, block, pattern, qd, seconds, max_reads=max(64, file_bytes // block))
                    out.append(s)
                    log(f"ssd {pattern:10s} qd{qd:<3d} {block / KIB:8.0f} KiB: median {s['median_us']:9.1f} us/read, {s['gbps']:.3f} GB/s")
    finally:
        os.unlink(path)
    return out


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


def measure_all(args) -> dict:
    """Run every measurement; return the samples (raw times, host facts, checks)."""
    torch = import_torch()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"--dtype {args.dtype}: not a torch dtype (e.g. bfloat16, float16)")
    cpu = device.type == "cpu"
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in with_attention_shapes():
            raise InputError(f"--models: unknown model '{m}'; known: {', '.join(with_attention_shapes())}")
    if cpu:  # tiny shapes: the test path exercises the code, not the host
        dims = {m: tiny_dims(model_dims(m)) for m in models}
        expert_shapes = cpu_shapes = [(64, 32), (128, 64), (256, 64)]
        torch.set_num_threads(1)  # threads only contend at these sizes (CPU experts set their own)
    else:
        dims = {m: model_dims(m) for m in models}
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
    for d in dims.values():
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

    ssd_samples, ssd_note = [], "not measured (--skip-ssd)"
    if not args.skip_ssd:
        blocks = sorted({4 * KIB, 64 * KIB, MIB} | {-(-s // DIRECT_ALIGN) * DIRECT_ALIGN for s in expert_sizes})
        for directory in dict.fromkeys([args.ssd_dir, os.getcwd()]):
            try:
                ssd_samples = measure_ssd(directory, (16 * MIB if cpu else args.ssd_file_mib * MIB), blocks,
                                          [1, args.ssd_qd], 0.05 if cpu else args.ssd_seconds)
                ssd_note = f"O_DIRECT reads in {directory}"
                break
            except (InputError, OSError) as e:
                ssd_note = f"not measured ({e})"
                log(f"ssd: {ssd_note}")
    samples["ssd"], samples["ssd_note"] = ssd_samples, ssd_note
    samples["ssd_fallback"] = [float(v) for v in args.ssd_fallback]

    samples["gpu_expert"] = [measure_gpu_expert(device, dtype, h, i, args.reps) for h, i in expert_shapes]
    if batched:
        samples["batched"] = [measure_batched(device, dtype, d.hidden, d.expert_intermediate, d.top_k, args.reps)
                              for d in dims.values()]
    samples["nonexpert"] = {m: measure_nonexpert(device, dtype, m, d, args.reps, 64 if cpu else args.ctx)
                            for m, d in dims.items()}
    samples["cpu_expert"] = [measure_cpu_expert(h, i, dtype, threads, max(3, args.reps // 2)) for h, i in cpu_shapes]
    return samples


EXPERT_SERIES = {  # --expert-mode -> (per-expert series of one expert, non-expert series)
    "batched": ("graph_gpu_us", "graph_gpu_us"),
    "graph": ("graph_gpu_us", "graph_gpu_us"),
    "graph-issue": ("graph_issue_us", "graph_issue_us"),
    "eager": ("eager_us", "eager_us"),
}


def profile_from_samples(samples: dict, name: str, samples_file: str | None, expert_mode: str = "batched",
                         copy_fit: str = "burst") -> tuple[dict, dict]:
    """The profile (and the fits behind it) that a set of samples gives.

    ``expert_mode`` says how the engine being modelled runs experts: ``batched`` (one grouped
    kernel per step; device time, the host's launches hidden), ``graph`` (one CUDA graph per
    expert, device time), ``graph-issue`` (the same, bound by the host's launch rate) or
    ``eager``. The generic ``gpu`` fit uses the per-expert series of that mode.
    """
    if expert_mode not in EXPERT_SERIES:
        raise InputError(f"--expert-mode {expert_mode}: choose one of {', '.join(EXPERT_SERIES)}")
    h2d = samples["h2d"]
    kind = "pinned" if any(s["kind"] == "pinned" for s in h2d) else "pageable"
    fit_iso = _fit_series(h2d, kind=kind, mode="isolated")
    fit_burst = _fit_series(h2d, kind=kind, mode="burst")
    h2d_fit = fit_burst if copy_fit == "burst" else fit_iso
    expert_sizes = samples["expert_bytes"]
    pageable = [s for s in h2d if s["kind"] == "pageable" and s["mode"] == "isolated"]
    at_expert = min(pageable, key=lambda s: abs(s["bytes"] - max(expert_sizes)))
    pageable_gbps = at_expert["bytes"] / median(at_expert["times_us"]) / 1e3
    if samples["ssd"]:
        rnd = [s for s in samples["ssd"] if s["pattern"] == "random" and s["qd"] == 1]
        ssd_fit = fit_or_rate([s["block_bytes"] for s in rnd], [s["median_us"] for s in rnd], "ssd fit")
    else:
        ssd_fit = Fit(*samples["ssd_fallback"], float("nan"))
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
    fits = dict(h2d_isolated=asdict(fit_iso), h2d_burst=asdict(fit_burst), h2d_used=copy_fit,
                ssd_random_qd1=asdict(ssd_fit), gpu_expert=asdict(gpu_fit), gpu_expert_series=expert_key,
                cpu_expert=asdict(cpu_fit), expert_mode=expert_mode, compute=compute)
    facts = samples["host"]
    cuda = facts.get("pcie") != "n/a"
    method = (
        f"moe-calibrate: host-to-device copies timed with {'CUDA events' if cuda else 'the wall clock'} "
        f"({copy_fit} fit over 64 KiB-{samples['max_copy_bytes'] // MIB} MiB, {kind}); SSD random QD1 fit, "
        f"{samples['ssd_note']}; experts {expert_mode} ({expert_key}: "
        + ("one grouped kernel per step, device time" if expert_mode == "batched" else "per expert call")
        + f", weights rotated past L2); non-expert layer as a CUDA graph ({nonexpert_key}); "
        f"CPU {facts.get('cpu')} x{samples['cpu_threads']} threads; torch {facts.get('torch')}"
    )
    host = dict(gpu=facts["gpu"], pcie=facts["pcie"], date=samples["date"], method=method)
    profile = build_profile(
        name, host=host, h2d=h2d_fit, pageable_gbps=pageable_gbps, ssd=ssd_fit, gpu_expert=gpu_fit,
        layer_fixed_us=statistics.mean(floors), cpu_expert=cpu_fit, compute=compute, samples_file=samples_file,
        gpu_memory_bytes=gpu_memory_bytes(facts),
    )
    return profile, fits


def tiny_dims(d: ModelDims) -> ModelDims:
    """Tiny shapes of the same layer structure (CPU test runs)."""
    return ModelDims(
        hidden=64, expert_intermediate=32, num_layers=4, num_experts=16, top_k=2,
        shared_intermediate=32 if d.shared_intermediate else 0, heads=4, kv_heads=2, head_dim=16,
        full_attention_interval=d.full_attention_interval, linear_k_heads=2 if d.linear_k_heads else 0,
        linear_v_heads=4 if d.linear_v_heads else 0, linear_head_dim=16 if d.linear_head_dim else 0,
        gated_attention=d.gated_attention,
    )


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            h, i = (int(v) for v in part.lower().split("x"))
        except ValueError as e:
            raise InputError(f"--expert-shapes: '{part}' is not HIDDENxINTERMEDIATE, e.g. 2048x512") from e
        shapes.append((h, i))
    return shapes


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
    p.add_argument("--models", default="qwen3_next_80b_a3b,qwen3_30b_a3b", help="models to time: presets of conf/model/ with an attention block")
    p.add_argument("--expert-shapes", default="2048x512,2048x768,4096x14336", help="extra HIDDENxINTERMEDIATE expert shapes for the gpu/cpu fits")
    p.add_argument("--cpu-expert-shapes", default="2048x512,4096x1536", help="extra expert shapes for the cpu fit")
    p.add_argument("--expert-mode", choices=tuple(EXPERT_SERIES), default="batched",
                   help="how the modelled engine runs experts (which timing the profile uses)")
    p.add_argument("--from-samples", default=None, help="rebuild the profile from a samples JSON, measuring nothing")
    p.add_argument("--copy-fit", choices=("burst", "isolated"), default="burst", help="copy series the pcie fit uses")
    p.add_argument("--max-copy-mib", type=int, default=512, help="largest host-to-device copy (MiB)")
    p.add_argument("--reps", type=int, default=12, help="repetitions per measurement (medians are used)")
    p.add_argument("--ctx", type=int, default=1024, help="KV-cache length for full-attention layers")
    p.add_argument("--cpu-threads", type=int, default=0, help="CPU threads for CPU expert compute (0 = all cores)")
    p.add_argument("--ssd-dir", default="/var/tmp", help="directory on the disk to test (a temporary file is written there)")
    p.add_argument("--ssd-file-mib", type=int, default=2048, help="size of the temporary SSD test file (MiB)")
    p.add_argument("--ssd-seconds", type=float, default=0.4, help="seconds per SSD configuration")
    p.add_argument("--ssd-qd", type=int, default=8, help="the higher queue depth (threads) besides 1")
    p.add_argument("--skip-ssd", action="store_true", help="don't measure the disk; use --ssd-fallback")
    p.add_argument("--ssd-fallback", nargs=2, default=(37.0, 2.3), metavar=("LATENCY_US", "GBPS"), help="ssd values with --skip-ssd")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        if args.from_samples:
            path = Path(args.from_samples)
            if not path.exists():
                raise InputError(f"--from-samples {path} does not exist")
            samples = json.loads(path.read_text())
        else:
            samples = measure_all(args)
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
