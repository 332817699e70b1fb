"""The GPU work the tools time and execute: one routed expert, a step's experts in one grouped
kernel, the non-expert part of a decoder layer, and a layer stack that runs them in the order a
decode step does. ``moe-calibrate`` times exactly these kernels and ``moe-replay`` executes them,
so what the profile says and what the replay runs are the same code.

Shapes come from the model presets (``conf/model/<name>.yaml``, their ``attention`` block); the
CPU is a test path at tiny shapes (:func:`tiny_dims`).
"""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from simulator.models import preset, with_attention_shapes
from traces.errors import InputError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


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


def tiny_dims(d: ModelDims) -> ModelDims:
    """Tiny shapes of the same layer structure (CPU test runs)."""
    return ModelDims(
        hidden=64, expert_intermediate=32, num_layers=4, num_experts=16, top_k=2,
        shared_intermediate=32 if d.shared_intermediate else 0, heads=4, kv_heads=2, head_dim=16,
        full_attention_interval=d.full_attention_interval, linear_k_heads=2 if d.linear_k_heads else 0,
        linear_v_heads=4 if d.linear_v_heads else 0, linear_head_dim=16 if d.linear_head_dim else 0,
        gated_attention=d.gated_attention,
    )


# --------------------------------------------------------------------------- kernels


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


class LayerStack:
    """Decode steps' GPU work in the replay's order: the non-expert part of the step's layer,
    then the step's routed experts, read from the slot array ``slots`` [S, 3*H*I].

    The non-expert part is one of ``rotate`` instances per layer kind (a CUDA graph on a GPU).
    ``mode``: ``batched`` (one grouped launch per ``max_n`` experts, slot ids read from the
    device; a CUDA graph on a GPU), ``graph`` (a CUDA graph per slot) or ``eager``. The experts
    read what the non-expert part wrote and add into what the next layer's non-expert part
    reads, so consecutive work depends on each other as in the model. :meth:`load` gives the
    slot ids of every step before a run; ``max_launches`` bounds the grouped launches of one
    run (a step of more than ``max_n`` experts takes several).
    """

    def __init__(self, dims: ModelDims, slots, device, dtype, ctx: int, mode: str, max_n: int,
                 max_launches: int, rotate: int = 4):
        torch = import_torch()
        self.dims, self.slots, self.mode, self.rotate, self.max_n = dims, slots, mode, rotate, max(1, max_n)
        self.cuda = device.type == "cuda"
        self.kern = ExpertKernel(dims.hidden, dims.expert_intermediate, device, dtype)
        expert_output = self.kern.y
        self.batched = None
        if mode == "batched":
            expert_output = torch.zeros(1, dims.hidden, device=device, dtype=torch.float32)
            self.batched = BatchedExperts(slots, dims.hidden, dims.expert_intermediate, self.max_n,
                                          max(1, max_launches), self.kern.x, expert_output)
        kinds = {dims.is_full_attention(layer) for layer in range(dims.num_layers)}
        self.layers = {
            full: [NonExpertLayer(dims, full, device, dtype, ctx, self.kern.x, expert_output) for _ in range(rotate)]
            for full in kinds
        }
        self.step_slots: list[list[int]] = []
        self.launches: list[int] = []
        self.graphs: dict[bool, list] = {}
        self.expert_graphs: list = []
        self.batched_graph = None
        if self.cuda:
            self._capture()

    def _capture(self) -> None:
        torch = import_torch()
        cap = torch.cuda.Stream()
        cap.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cap):
            for layers in self.layers.values():
                for layer in layers:
                    layer.run()
            self.kern.run(self.slots[0])
            if self.batched is not None:
                self.batched.load([[0]], [1])
                self.batched.run()  # compiles the kernels
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.graphs = {full: [capture_graph(layer.run, cap, pool) for layer in layers]
                       for full, layers in self.layers.items()}
        if self.batched is not None:
            self.batched_graph = capture_graph(self.batched.run, cap, pool)
        if self.mode == "graph":
            for w in self.slots:
                self.expert_graphs.append(capture_graph(lambda w=w: self.kern.run(w), cap, pool))
        torch.cuda.synchronize()
        # a graph's first replay uploads it: before anything is timed
        for g in [*self.expert_graphs, *(g for gs in self.graphs.values() for g in gs)]:
            g.replay()
        if self.batched_graph is not None:
            self.batched_graph.replay()
        torch.cuda.synchronize()

    def nonexpert(self, layer: int) -> Callable[[], None]:
        """The non-expert part of ``layer`` (a graph replay on a GPU)."""
        full = self.dims.is_full_attention(layer)
        i = layer % self.rotate
        return self.graphs[full][i].replay if self.cuda else self.layers[full][i].run

    def load(self, step_slots: Sequence[Sequence[int]]) -> None:
        """The slot ids each step's experts read, one list per step in execution order; rewinds."""
        self.step_slots = [list(map(int, s)) for s in step_slots]
        self.launches = [max(1, -(-len(s) // self.max_n)) for s in self.step_slots]
        if self.batched is not None:
            rows, counts = [], []
            for s in self.step_slots:
                for a in range(0, max(1, len(s)), self.max_n):
                    part = s[a : a + self.max_n]
                    rows.append(part + [0] * (self.max_n - len(part)))
                    counts.append(len(part))
            if len(rows) > self.batched.idx.shape[0]:
                raise InputError(f"{len(rows)} grouped launches exceed the {self.batched.idx.shape[0]} "
                                 "this layer stack was built for")
            self.batched.load(rows, counts)

    def rewind(self) -> None:
        """Back to the first loaded step (a device op on the current stream)."""
        if self.batched is not None:
            self.batched.counter.zero_()

    def experts(self, step: int) -> None:
        """Run step ``step``'s experts (steps run in the order they were loaded)."""
        if self.batched is not None:
            run = self.batched_graph.replay if self.cuda else self.batched.run
            for _ in range(self.launches[step]):
                run()
        elif self.expert_graphs:
            for slot in self.step_slots[step]:
                self.expert_graphs[slot].replay()
        else:
            for slot in self.step_slots[step]:
                self.kern.run(self.slots[slot])


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
            print(f"warning: issuing {n} calls took {issue * n / 1e3:.1f} ms, longer than the {lead_ms} ms "
                  "lead: the device time includes launch gaps", file=sys.stderr, flush=True)
        return gpu, issue

    def wall_us(self, fn: Callable[[], None]) -> float:
        """Wall-clock microseconds of fn including a device synchronisation."""
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6
