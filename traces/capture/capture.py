"""The capture loop: run a Hugging Face MoE model over text and record its routing as a trace.

Two modes. ``teacher_forced``: windows are batched (unequal lengths right-padded), one forward
per batch, every real token recorded (phase decode, or prefill for the first ``prefill_tokens``
of a window); the simulator replays it as generation. ``generate``: each window's first
``prompt_tokens`` are a prompt (one prefill forward, left-padded), then ``new_tokens`` decode
steps with the KV cache; every token fed to the model is recorded. Padding never enters the trace.

Device work is never waited on inside the loop. On the device, on a side stream of their own
(beside the next forward; ``recording_stream``), the recorded logits are cut to what the trace
stores (top R with ids, as ``traces.format`` would select them on the host), then copied into
the sink's shared memory (``shared_rows``, registered with CUDA), or else into pinned host memory; a drain thread hands each batch to the sink, by default a
:class:`~traces.capture.writer.ParallelTraceWriter` whose encoder processes read the rows where
the device wrote them and encode row groups in parallel. The GPU runs the next forwards meanwhile; only a sink slower than the model makes
the loop wait: on the drain's queue (``blocked_s`` in the summary), or for shared memory to lend
while the writer holds as many rows as it may (``lend_wait_s``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from traces.atomic import remove_orphans
from traces.capture import top_r
from traces.capture.config import RECORDING_STREAMS, WRITERS, CaptureConfig
from traces.capture.cores import isolated, leave_model_core
from traces.capture.dispatch import DispatchedTraceWriter
from traces.capture.hooks import (
    Lookahead,
    RawStep,
    RouterRecorder,
    StepRouting,
    check_lookahead_source,
    router_returns_probabilities,
)
from traces.capture.nll import token_nll
from traces.capture.routers import RouterSite, routing_metadata
from traces.capture.text import Window, make_windows, read_documents
from traces.capture.writer import ParallelTraceWriter, shared_folder
from traces.errors import InputError
from traces.format import (
    LOOKAHEAD_NO_LAYER,
    PHASE_DECODE,
    PHASE_PREFILL,
    TraceMeta,
    default_row_group_tokens,
    lookahead_missing,
)

MODES = ("teacher_forced", "generate")
# The writer's units (row groups) when not set: one forward's tokens, between 1/16 and 1/2 of the
# format's default row group (~1 to ~8 MiB of stored rows). Each unit costs the capturing process
# about a millisecond of Python beside the GPU's work (handing it to an encoder, appending it), so
# a fast model's units must be large: the fixture at batch 16 (0.5 M tokens/s) captured at +35 %
# over the forward with 1/16 of the default, +3 % with one forward of 8,192 tokens
# (docs/capture/bench_1202g_fix_b16.json). Larger units lengthen the close (the last units are
# encoded after the last forward; the writer splits them among its encoders).
UNIT_FRACTIONS = (16, 2)
# While capturing, the GIL changes hands at least this often: the encoder threads need it briefly
# between pyarrow calls, and a loop busy launching a small model's kernels would otherwise keep
# each of them waiting up to Python's default 5 ms (on 2 cores, a busy Python loop beside the
# encoders slowed them 2.7x at 5 ms, 1.8x at 0.5 ms).
CAPTURE_SWITCH_INTERVAL_S = 0.0005
# The most device memory of router outputs the recording holds for a block of forwards
# (CaptureConfig.record_block_tokens): 16 windows of 512 tokens of the small Qwen3-Next shape
# hold about 75 MB a forward, of a 48-layer, 512-expert model about 420 MB. While a block is
# stacked and put in stored form, its copies take a few times that for a moment, as they do for
# one forward of as many token slots (a forward larger than the bound goes alone).
RECORD_BLOCK_BYTES = 512 << 20
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped


@dataclass
class Rows:
    """Recorded rows of whole sequences in (seq, pos) order: T tokens, L layers, k ranks, E experts."""

    seq: np.ndarray  # int32[T]
    pos: np.ndarray  # int32[T]
    phase: np.ndarray  # int8[T]
    token_id: np.ndarray  # int32[T]
    domain: np.ndarray  # int16[T]
    nll: np.ndarray  # float32[T], teacher-forced NLL of the token in nats (NaN: no context)
    experts: np.ndarray  # int16[T, L, k], rank order
    weights: np.ndarray  # float32[T, L, k], gate weights as the model applied them
    logits: np.ndarray | None = None  # float16[T, L, E] router logits, or [T, L, R] the top R; or None
    logit_ids: np.ndarray | None = None  # int16[T, L, R] with top-R logits: their expert ids
    lookahead_logits: np.ndarray | None = None  # float16[T, L, D, R or E] (traces.format), or None
    lookahead_ids: np.ndarray | None = None  # int16[T, L, D, R] with top-R look-ahead, or None

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        """The arrays as keyword arguments of ``TraceWriter.write``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_logits_storage(value: str, field: str = "logits") -> tuple[str, int | None]:
    """``full`` | ``none`` | ``top:R`` -> (kind, R)."""
    if value in ("full", "none"):
        return value, None
    if value.startswith("top:"):
        try:
            r = int(value[4:])
        except ValueError:
            r = 0
        if r >= 1:
            return "top", r
    raise InputError(f"{field}={value} is not valid; choose full, none or top:R with R >= 1")


@dataclass(frozen=True)
class Storage:
    """What a capture keeps, resolved for the model: top R below E, else all E (the ids add nothing)."""

    logits: str  # "full", "top" or "none"
    logits_top_r: int  # R < E for "top", else 0
    lookahead: Lookahead | None  # None: no look-ahead
    lookahead_top_r: int  # R < E, or 0 for all E

    @classmethod
    def of(cls, cfg: CaptureConfig, num_experts: int, num_layers: int) -> Storage:
        """The storage ``cfg`` asks for, for a model of ``num_layers`` MoE layers of ``num_experts``."""
        kind, r = parse_logits_storage(cfg.logits)
        if kind == "top" and r >= num_experts:
            kind, r = "full", None
        la = cfg.lookahead
        la_r = 0
        if la.enabled:
            la_kind, la_r = parse_logits_storage(la.logits, "lookahead.logits")
            if la_kind == "none":
                raise InputError("lookahead.logits=none is not valid; choose full or top:R, or "
                                 "lookahead.enabled=false")
            la_r = 0 if la_kind == "full" or la_r >= num_experts else la_r
            check_lookahead_source(la.source)
            if not 1 <= la.depth < num_layers:
                raise InputError(f"lookahead.depth={la.depth} must be between 1 and the number of MoE "
                                 f"layers - 1 ({num_layers - 1})")
        return cls(logits=kind, logits_top_r=r or 0, lookahead=Lookahead(la.depth, la.source) if la.enabled else None,
                   lookahead_top_r=la_r)


class _Drain:
    """Moves recorded device tensors to the host and into the sink on a thread of its own.

    With ``block`` (the sink's :meth:`~traces.capture.writer.ParallelTraceWriter.block`), each
    block of rows goes straight into the sink's shared memory: on a GPU, that memory is registered
    with the device (once per slab) and the device copies the rows there itself, or its kernels
    write them there (:meth:`put_filled`); the encoder processes read them in place. Without it
    (or where the registration fails), the rows go through pinned buffers of torch's own and the
    sink copies them.

    With ``side`` (the default), the recording's own device work (:meth:`beside`) runs on the
    drain's stream too.

    ``blocked_s`` counts the seconds the capture loop waited because the sink fell behind.
    """

    def __init__(self, write, device: torch.device, depth: int = 3, block=None, side: bool = True):
        self._write = write
        self._block = block
        self._cuda = device.type == "cuda"
        self._side = side
        # copies on a stream of their own overlap the next forward instead of queueing behind it
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self.blocked_s = 0.0
        self._thread = threading.Thread(target=self._run, name="trace-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        leave_model_core()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            event, host, copies = item
            try:
                if event is not None:
                    event.synchronize()
                self._write(Rows(**host, **{k: v.numpy() if isinstance(v, torch.Tensor) else v
                                           for k, v in copies.items()}))
            except BaseException as e:  # re-raised in the capture loop
                self._error = e

    @contextlib.contextmanager
    def beside(self, *inputs: torch.Tensor | None):
        """Run the device work issued inside on the drain's stream, after what the model's stream
        has queued so far: a block's top-R selection and NLL (in generate mode also the stacking
        of its steps) then run beside the next forward instead of ahead of it (that work is
        milliseconds per forward of a small model at batch 16; a forward whose inputs are copied
        from pageable memory waits for its stream).

        ``inputs``: the model's tensors that work reads (router outputs, LM logits, input ids),
        kept from the allocator until the drain's stream is past them. Without ``side`` or a GPU,
        the work stays where it is.
        """
        if not (self._cuda and self._side):
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        for t in inputs:
            if t is not None:
                t.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            yield

    def put(self, host: dict[str, np.ndarray], device: dict[str, torch.Tensor]) -> None:
        """Queue one block of rows: host arrays as they are, device tensors copied asynchronously."""
        if self._error is not None:
            raise self._error
        views = self._lend(host, {k: (t.dtype, tuple(t.shape)) for k, t in device.items()})
        if views is not None:  # every column in the sink's shared memory
            host, copies = {}, views
            event = self._copy(device, {k: torch.from_numpy(views[k]) for k in device})
        elif self._cuda:
            copies = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in device.items()}  # cached by torch
            event = self._copy(device, copies)
        else:
            copies, event = {k: t.detach().cpu() for k, t in device.items()}, None
        self._enqueue(event, host, copies)

    def put_filled(self, host: dict[str, np.ndarray], columns: dict[str, tuple[torch.dtype, tuple]], fill,
                   inputs: list[torch.Tensor | None]) -> None:
        """Queue one block of rows whose device columns (``columns``: name -> (dtype, shape)) the
        device writes into host memory itself: ``fill(targets)`` issues that work, on the drain's
        stream (:meth:`beside`, reading ``inputs``), into ``targets``, the sink's shared memory
        registered with the device or else pinned buffers (plain ones without a GPU). No copy is
        queued: one launch can write a block's columns where the encoders read them."""
        if self._error is not None:
            raise self._error
        views = self._lend(host, columns)
        if views is not None:
            host, rows = {}, views
            targets = {k: torch.from_numpy(views[k]) for k in columns}
        else:
            targets = rows = {k: torch.empty(shape, dtype=dtype, pin_memory=self._cuda)  # cached by torch
                              for k, (dtype, shape) in columns.items()}
        with self.beside(*inputs):
            fill(targets)
            event = None
            if self._cuda:
                event = torch.cuda.Event()
                event.record()  # on the stream the work went to
        self._enqueue(event, host, rows)

    def _enqueue(self, event, host: dict[str, np.ndarray], rows: dict) -> None:
        start = time.perf_counter()
        self._queue.put((event, host, rows))
        self.blocked_s += time.perf_counter() - start

    def _lend(self, host: dict[str, np.ndarray], device: dict[str, tuple[torch.dtype, tuple]]) -> dict[str, np.ndarray] | None:
        """Views of shared memory from the sink for one block of rows (``device``: the columns the
        device writes, name -> (dtype, shape)), the host columns copied in; None where there is no
        such memory or the device cannot write there (then, and from now on, the rows take the
        pinned buffers' way; a block lent goes back at the writer's close)."""
        if self._block is None:
            return None
        columns = {k: (v.dtype, v.shape) for k, v in host.items()}
        columns.update({k: (_numpy_dtype(dtype), shape) for k, (dtype, shape) in device.items()})
        block = self._block(columns)
        if block is None or (self._cuda and not _registered(block.slab)):
            self._block = None
            return None
        for k, v in host.items():
            block.views[k][...] = v
        return block.views

    def _copy(self, device: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]):
        """Copy each device tensor into its host target: on a GPU asynchronously, on the drain's
        stream (returns the event that marks the end), else at once (returns None)."""
        if not self._cuda:
            for k, t in device.items():
                targets[k].copy_(t)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            for k, t in device.items():
                targets[k].copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # not reused by the next forward before the copy
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def close(self) -> None:
        """Wait until everything queued is written; re-raise a writer error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def _registered(slab) -> bool:
    """Register a :class:`~traces.capture.writer.Slab` with CUDA (once), so the device copies
    rows into it asynchronously; False where the driver refused (the rows then take the pinned
    buffers' way)."""
    if slab.pinned is None:
        cudart = torch.cuda.cudart()
        # mapped: the device's kernels may write there too (_Drain.put_filled), not only its copies
        slab.pinned = int(cudart.cudaHostRegister(slab.address, slab.size, CUDA_HOST_REGISTER_MAPPED)) == 0
        if slab.pinned:
            slab.on_close.append(lambda: cudart.cudaHostUnregister(slab.address))
    return slab.pinned


def _sort_descending(values: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last axis descending, ties in index order (numpy's stable argsort of -x).

    Adding 0 makes -0.0 equal to 0.0 for sorts that compare bit patterns, as numpy compares values.
    """
    return torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices


def top_r_logits(logits: torch.Tensor, experts: torch.Tensor, r: int,
                 score_dtype: torch.dtype = torch.float16, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-R logits a trace stores, selected on the device exactly as ``traces.format`` does.

    ``logits`` float16[n, L, E], ``experts`` int64[n, L, k] -> (float16[n, L, R] descending,
    int16[n, L, R] their ids): the R highest, the selected experts always among them.

    With ``kernel`` (the capture's ``top_r_kernel``), on a GPU with Triton, one kernel does it
    (:mod:`traces.capture.top_r`); elsewhere two stable sorts. Their scores stay float16
    (``score_dtype``; float32 holds the same values in the same order): the sort over all E takes
    about 30 % less device time on 16-bit keys (docs/CAPTURE.md).
    """
    if kernel and score_dtype == torch.float16 and top_r.uses_kernel(logits):
        out = top_r.top_r(logits, experts, r)
        if out is not None:
            return out
    score = logits.to(score_dtype, copy=True)
    score.scatter_(-1, experts, float("inf"))
    ids = _sort_descending(score)[..., :r]
    values = logits.gather(-1, ids)
    order = _sort_descending(values)
    return values.gather(-1, order), ids.gather(-1, order).to(torch.int16)


def top_r_lookahead(lookahead: torch.Tensor, r: int, missing: torch.Tensor,
                    kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-R look-ahead as stored: float16[n, L, D, E] -> (float16 [n, L, D, R] descending, int16 ids):
    :func:`top_r_logits` with no expert selected (the kernel where ``kernel`` and it runs).

    ``missing`` bool[L, D]: layer l + d does not exist; its ids become the format's sentinel.
    """
    none = torch.empty((*lookahead.shape[:-1], 0), dtype=torch.int64, device=lookahead.device)
    values, ids = top_r_logits(lookahead, none, r, kernel=kernel)
    ids[:, missing] = LOOKAHEAD_NO_LAYER
    return values, ids


def _real(values: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``values`` at the real token slots (``None``: all of them)."""
    return values if slots is None else values.index_select(0, slots)


def _routing_parts(routing: StepRouting, slots: torch.Tensor | None, storage: Storage,
                   missing: torch.Tensor | None, kernel: bool = True) -> dict[str, torch.Tensor]:
    """The recorded tensors of the real token slots (``slots``; None: every slot), in the form the
    trace stores (on the device).

    ``missing`` bool[L, D] (with look-ahead): layer l + d does not exist. ``kernel``: the top-R
    selections' kernel where it runs (:func:`top_r_logits`, :func:`top_r_lookahead`).
    """
    experts = _real(routing.experts, slots)
    parts = {"experts": experts.to(torch.int16), "weights": _real(routing.weights, slots)}
    if storage.logits != "none":
        logits = _real(routing.logits, slots).to(torch.float16)
        if storage.logits_top_r:
            parts["logits"], parts["logit_ids"] = top_r_logits(logits, experts, storage.logits_top_r,
                                                                   kernel=kernel)
        else:
            parts["logits"] = logits
    if storage.lookahead:
        ahead = _real(routing.lookahead, slots).to(torch.float16)
        if storage.lookahead_top_r:
            parts["lookahead_logits"], parts["lookahead_ids"] = top_r_lookahead(
                ahead, storage.lookahead_top_r, missing, kernel)
        else:
            parts["lookahead_logits"] = ahead
    return parts


def batches(windows: list[Window], size: int) -> Iterator[list[Window]]:
    for i in range(0, len(windows), size):
        yield windows[i : i + size]


def right_padded(batch: list[Window], device: torch.device):
    """(ids int64[B, S] on the host, lengths, input ids on device, attention mask or None).

    The mask is None when all windows have the same length (no padding to hide).
    """
    lengths = np.array([len(w.tokens) for w in batch])
    B, S = len(batch), int(lengths.max())
    ids = np.zeros((B, S), dtype=np.int64)
    for b, w in enumerate(batch):
        ids[b, : lengths[b]] = w.tokens
    mask = None
    if (lengths != S).any():
        mask = torch.from_numpy((np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)).to(device)
    return ids, lengths, torch.from_numpy(ids).to(device), mask


@dataclass
class _Forward:
    """One teacher-forced forward the recording holds: its windows, their lengths, the padded
    length S, what the hooks kept and the tokens' NLL (float32[B * S], on the device)."""

    windows: list[Window]
    lengths: np.ndarray
    S: int
    raw: RawStep
    nll: torch.Tensor

    @property
    def padded(self) -> bool:
        return bool((self.lengths != self.S).any())


def _real_slots(held: list[_Forward]) -> np.ndarray | None:
    """The slots of the real tokens of the forwards ``held``, one after the other; None where no
    window is padded (every slot is a token)."""
    if not any(f.padded for f in held):
        return None
    parts, offset = [], 0
    for f in held:
        parts.append(offset + np.concatenate([b * f.S + np.arange(n) for b, n in enumerate(f.lengths)]))
        offset += len(f.lengths) * f.S
    return np.concatenate(parts)


def _host_columns(windows: list[Window], lengths: np.ndarray, prefill_tokens: int) -> dict[str, np.ndarray]:
    """The host columns of the rows of ``windows`` (``lengths``: their tokens)."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = (np.arange(int(lengths.sum())) - starts).astype(np.int32)
    return {
        "seq": np.repeat([w.seq for w in windows], lengths).astype(np.int32),
        "pos": pos,
        "phase": np.where(pos < prefill_tokens, PHASE_PREFILL, PHASE_DECODE).astype(np.int8),
        "token_id": np.concatenate([w.tokens for w in windows]).astype(np.int32),
        "domain": np.repeat([w.domain for w in windows], lengths).astype(np.int16),
    }


def teacher_forced(model, recorder: RouterRecorder, windows, batch_size, prefill_tokens, drain, stored, on_tokens,
                   block_tokens: int = 0, block_bytes: int = 0, rows_r: int = 0):
    """One forward per batch of windows; records every real token.

    The routing of consecutive forwards is held (up to ``block_tokens`` token slots and
    ``block_bytes`` of router outputs, or one forward where it alone is larger; 0: none held) and
    handed on in one block: stacked, put in stored form by ``stored(routing, slots)`` (the device
    tensors to keep, :func:`_routing_parts`) and queued to the drain. Towards the end the blocks shrink: a block holds no more slots than
    the forwards after it, so the writer (faster than the model) has encoded it before the last
    forward ends, and the last forward goes alone: the close waits for one forward's rows only.
    The same rows either way. ``rows_r``: as in :func:`_hand_on`. Returns the most forwards one
    block held (1: every forward alone).
    """
    device = model.device
    todo = list(batches(windows, batch_size))
    slots_of = [len(b) * max(len(w.tokens) for w in b) for b in todo] + [0]
    after = np.cumsum(slots_of[::-1])[::-1].tolist()[1:] + [0]  # slots of the forwards after each
    held: list[_Forward] = []
    slots_held = bytes_held = most = 0
    for i, batch in enumerate(todo):
        ids, lengths, input_ids, mask = right_padded(batch, device)
        B, S = ids.shape
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        raw = recorder.take(B * S)
        with drain.beside(out.logits, input_ids):
            nll = token_nll(out.logits, input_ids).reshape(-1)
        held.append(_Forward(batch, lengths, S, raw, nll))
        on_tokens(int(lengths.sum()))
        nbytes = raw.nbytes()
        slots_held, bytes_held = slots_held + B * S, bytes_held + nbytes
        # hand on unless the next forward fits: in the slots, in the slots of the forwards after
        # it, and in the bytes (a slot's router outputs are the same size in every forward)
        more = slots_held + slots_of[i + 1]
        if i + 1 == len(todo) or more > min(block_tokens, after[i + 1]) or \
                bytes_held + nbytes // (B * S) * slots_of[i + 1] > block_bytes:
            _hand_on(held, prefill_tokens, drain, stored, device, rows_r)
            most = max(most, len(held))
            held, slots_held, bytes_held = [], 0, 0
    return most


def _hand_on(held: list[_Forward], prefill_tokens: int, drain, stored, device, rows_r: int = 0) -> None:
    """Stack the routing of the forwards ``held`` on the model's stream, put it in stored form on
    the drain's stream (:meth:`_Drain.beside`), then queue it with the host columns to the drain.

    The stack stays on the model's stream: there the layers' router outputs go back to that
    stream's memory pool once stacked, ready for the next forward. Stacked on the drain's stream
    (69c763c), each one is held from the allocator until that stream is past it; two runs at
    batch 16 then gave +11.8 % and +18.0 %, twenty with the stack here +11.8 % pooled
    (docs/CAPTURE.md, runs 1207a-l).

    ``rows_r`` (top-R logits without look-ahead, ``rows_kernel``): R, and the stored routing
    columns are written by one launch where the drain puts them (:func:`_put_rows`), where the
    kernel runs; 0: step by step (``stored``), then copied."""
    routing = StepRouting.stacked([f.raw for f in held], float_weights=not rows_r)
    slots_np = _real_slots(held)
    slots = None if slots_np is None else torch.from_numpy(slots_np).to(device)
    nlls = [f.nll for f in held]
    windows = [w for f in held for w in f.windows]
    lengths = np.concatenate([f.lengths for f in held])
    if rows_r and top_r.uses_rows_kernel(routing.logits):  # the rows' memory lent first: the launch writes there
        _put_rows(_host_columns(windows, lengths, prefill_tokens), routing, slots, nlls, rows_r, drain, stored)
        return
    routing = routing.with_float_weights()
    with drain.beside(*routing.tensors(), slots):
        dev = stored(routing, slots)
        dev["nll"] = _real(torch.cat(nlls) if len(nlls) > 1 else nlls[0], slots)
    drain.put(_host_columns(windows, lengths, prefill_tokens), dev)


def _put_rows(host: dict[str, np.ndarray], routing: StepRouting, slots: torch.Tensor | None,
              nlls: list[torch.Tensor], r: int, drain: _Drain, stored) -> None:
    """Hand on a block whose stored routing columns one launch writes where the drain puts them
    (:func:`traces.capture.top_r.stored_rows`, :meth:`_Drain.put_filled`: on a GPU, the writer's
    shared memory), with the NLL copied beside them: top-R logits without look-ahead. Where the
    kernel fails, ``stored`` makes the columns and they are copied there (the same rows)."""
    T, (_, L, _), k = host["seq"].shape[0], routing.logits.shape, routing.experts.shape[-1]
    columns = {"experts": (torch.int16, (T, L, k)), "weights": (torch.float32, (T, L, k)),
               "logits": (torch.float16, (T, L, r)), "logit_ids": (torch.int16, (T, L, r)),
               "nll": (torch.float32, (T,))}

    def fill(targets: dict[str, torch.Tensor]) -> None:
        if not top_r.stored_rows(routing.logits, routing.experts, routing.weights, slots, targets):
            for name, t in stored(routing.with_float_weights(), slots).items():
                targets[name].copy_(t, non_blocking=True)
        targets["nll"].copy_(_real(torch.cat(nlls) if len(nlls) > 1 else nlls[0], slots), non_blocking=True)

    drain.put_filled(host, columns, fill, [*routing.tensors(), slots, *nlls])


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _cache_argument(model) -> str:
    """Name of the KV-cache argument: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def generate(model, recorder: RouterRecorder, windows, batch_size, gcfg, seed, drain, stored, on_tokens):
    """Prefill each prompt, then decode ``new_tokens`` steps with the KV cache, recording each fed token."""
    device = model.device
    cache_arg = _cache_argument(model)
    gen = None
    if gcfg.temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    for batch in batches(windows, batch_size):
        plen = np.array([min(len(w.tokens), gcfg.prompt_tokens) for w in batch])
        B, P, N = len(batch), int(plen.max()), gcfg.new_tokens
        ids = np.zeros((B, P), dtype=np.int64)
        mask_np = np.zeros((B, P), dtype=np.int64)
        for b, w in enumerate(batch):
            ids[b, P - plen[b] :] = w.tokens[: plen[b]]
            mask_np[b, P - plen[b] :] = 1
        input_ids = torch.from_numpy(ids).to(device)
        mask = torch.from_numpy(mask_np).to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        steps = [recorder.take(B * P)]
        nll_prefill = token_nll(out.logits, input_ids)
        nll_prefill[:, 1:][mask[:, :-1] == 0] = float("nan")
        nlls, toks = [nll_prefill.reshape(-1)], [input_ids.reshape(-1)]
        cache, next_logits = _returned_cache(out), out.logits[:, -1]
        on_tokens(int(plen.sum()))
        next_pos = torch.from_numpy(plen).to(device)
        for t in range(N):
            tok = _next_token(next_logits, gcfg.temperature, gen)
            nlls.append(F.cross_entropy(next_logits.float(), tok, reduction="none"))
            toks.append(tok)
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            out = model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=(next_pos + t)[:, None],
                use_cache=True,
                **{cache_arg: cache},
            )
            steps.append(recorder.take(B))
            cache, next_logits = _returned_cache(out), out.logits[:, -1]
            on_tokens(B)
        # rows per sequence: its prompt slots, then its slot in every decode step
        slots_np = np.concatenate(
            [np.concatenate([b * P + np.arange(P - plen[b], P), B * P + np.arange(N) * B + b]) for b in range(B)]
        )
        slots = torch.from_numpy(slots_np).to(device)
        with drain.beside(*(t for step in steps for t in step.tensors()), *nlls, *toks, slots):
            dev = stored(StepRouting.stacked(steps), slots)
            dev["nll"] = torch.cat(nlls).index_select(0, slots)
            dev["token_id"] = torch.cat(toks).index_select(0, slots).to(torch.int32)
        counts = plen + N
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in counts])
        host = {
            "seq": np.repeat([w.seq for w in batch], counts).astype(np.int32),
            "pos": pos,
            "phase": np.concatenate(
                [np.r_[np.full(p, PHASE_PREFILL), np.full(N, PHASE_DECODE)] for p in plen]
            ).astype(np.int8),
            "domain": np.repeat([w.domain for w in batch], counts).astype(np.int16),
        }
        drain.put(host, dev)


def build_meta(model, sites: list[RouterSite], name: str, domains: list[str], cfg: CaptureConfig,
               extra: dict, logits_are_probs: bool = False) -> TraceMeta:
    """TraceMeta of a capture from the model's routers and the capture settings."""
    r = routing_metadata(model, sites)
    storage = Storage.of(cfg, r["num_experts"], len(sites))
    info = dict(r["extra"])
    info["logits_storage"] = cfg.logits
    info["logits_source"] = (
        "log of the router's returned softmax (logits up to a per-token shift)"
        if logits_are_probs else "router output"
    )
    if storage.lookahead:
        info["lookahead_storage"] = cfg.lookahead.logits
    info.update(extra)
    ahead = storage.lookahead
    return TraceMeta(
        model=name,
        num_layers=len(sites),
        num_experts=r["num_experts"],
        top_k=r["top_k"],
        expert_bytes=r["expert_bytes"],
        dtype=r["dtype"],
        score_function=r["score_function"],
        renormalize=r["renormalize"],
        has_logits=storage.logits != "none",
        logits_top_r=storage.logits_top_r,
        layer_ids=r["layer_ids"],
        domains=list(domains),
        dense_bytes=r["dense_bytes"],
        source="capture",
        extra=info,
        lookahead_depth=ahead.depth if ahead else 0,
        lookahead_top_r=storage.lookahead_top_r,
        lookahead_source=ahead.source if ahead else "",
    )


def _versions(device: torch.device) -> dict:
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        v["gpu"] = torch.cuda.get_device_name(device)
    return v


def _progress(enabled: bool | None, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, disable=None if enabled is None else not enabled,
                desc="capture", smoothing=0.1)


def open_writer(path: Path, meta: TraceMeta, workers: int | None = None, writer: str = "dispatcher",
                unit_tokens: int = 0, batch_tokens: int = 0,
                expected_tokens: int | None = None) -> ParallelTraceWriter | DispatchedTraceWriter:
    """The capture's trace writer: row groups smaller than the format's default, encoded in parallel.

    Row groups are encoded by the writer's encoders while the GPU runs the next batches; with
    the default (one row group per ~16 MiB) much of a short capture's writing would happen at the
    end, after the last forward, and with very small ones a fast model pays each unit's handling
    hundreds of times a second (:data:`UNIT_FRACTIONS`). ``workers`` None or 0: :func:`~traces.capture.writer.default_workers`;
    ``writer``: encoders in child ``processes`` or in ``threads`` of this process, or the whole
    writer in a ``dispatcher`` process (:mod:`traces.capture.dispatch`); ``unit_tokens``:
    tokens per row group, 0: :func:`auto_unit_tokens` of ``batch_tokens`` (one forward's);
    ``expected_tokens``: the tokens the capture will write, where known (the last write then cuts
    its units small for the close: :class:`~traces.capture.writer.ParallelTraceWriter`).
    """
    unit = unit_tokens or auto_unit_tokens(meta, batch_tokens)
    if writer == "dispatcher":
        return DispatchedTraceWriter(path, meta, unit_tokens=unit, workers=workers or None,
                                     expected_tokens=expected_tokens)
    return ParallelTraceWriter(path, meta, unit_tokens=unit, workers=workers or None, processes=writer == "processes",
                               expected_tokens=expected_tokens)


def pins_threads(cfg: CaptureConfig, device: torch.device) -> bool:
    """Whether a capture gives the thread that drives the model a CPU core of its own
    (``pin_threads``; on a GPU only: on the CPU the model's own threads need the cores)."""
    return cfg.pin_threads and device.type == "cuda"


def auto_unit_tokens(meta: TraceMeta, batch_tokens: int = 0) -> int:
    """The writer's tokens per row group when not set: ``batch_tokens`` (one forward's tokens)
    within :data:`UNIT_FRACTIONS` of the format's default row group, at least 256."""
    rows = default_row_group_tokens(meta)
    low = max(256, rows // UNIT_FRACTIONS[0])
    return min(max(low, rows // UNIT_FRACTIONS[1]), max(low, batch_tokens))


def batch_tokens(cfg: CaptureConfig) -> int:
    """The tokens one forward of ``cfg`` records at most (a batch of windows or of sequences)."""
    if cfg.mode == "generate":
        return cfg.batch_size * (cfg.generate.prompt_tokens + cfg.generate.new_tokens)
    return cfg.batch_size * cfg.input.window_tokens


def check_config(cfg: CaptureConfig) -> None:
    """Validate the fields that need no model, so a bad value fails before anything loads."""
    if cfg.mode not in MODES:
        raise InputError(f"mode={cfg.mode} is not valid; choose one of: {', '.join(MODES)}")
    Storage.of(cfg, num_experts=2**15, num_layers=2**15)  # the strings; sizes once the model is known
    if cfg.batch_size < 1:
        raise InputError(f"batch_size={cfg.batch_size} must be at least 1")
    if cfg.writers < 0:
        raise InputError(f"writers={cfg.writers} must be >= 0 (0: half the CPU cores)")
    if cfg.unit_tokens < 0:
        raise InputError(f"unit_tokens={cfg.unit_tokens} must be >= 0 (0: one forward's tokens, within 1 to 8 MiB of rows)")
    if cfg.writer not in WRITERS:
        raise InputError(f"writer={cfg.writer} is not valid; choose one of: {', '.join(WRITERS)}")
    if cfg.recording_stream not in RECORDING_STREAMS:
        raise InputError(f"recording_stream={cfg.recording_stream} is not valid; choose one of: "
                         f"{', '.join(RECORDING_STREAMS)}")
    if cfg.record_block_tokens < 0:
        raise InputError(f"record_block_tokens={cfg.record_block_tokens} must be >= 0 (0: every forward's "
                         "rows handed on alone)")
    if cfg.prefill_tokens < 0:
        raise InputError(f"prefill_tokens={cfg.prefill_tokens} must be >= 0")
    if cfg.mode == "generate" and (cfg.generate.prompt_tokens < 1 or cfg.generate.new_tokens < 0):
        raise InputError("generate.prompt_tokens must be >= 1 and generate.new_tokens >= 0")
    if not cfg.input.paths:
        raise InputError("input.paths is empty; give text files, folders or JSONL files")
    shared_folder()  # $MOE_TRACE_SHARED_DIR, where set, names a folder


def capture_windows(model, sites, windows, cfg: CaptureConfig, write, progress=None,
                    logits_are_probs: bool = False, block=None) -> dict:
    """Record ``windows`` through ``model`` and pass every block of rows to ``write(rows)``.

    ``write`` runs on the drain thread; the rows are in stored form (:class:`Rows`). ``block``
    (optional, the writer's :meth:`~traces.capture.writer.ParallelTraceWriter.block`) lends shared
    memory for each block's rows, which the device writes straight into (:class:`_Drain`); the
    rows ``write`` gets are then views of that memory, lent again once the writer has them in the
    file: copy what is to be kept beyond that. Returns
    ``{"tokens", "seconds", "tokens_per_s", "blocked_s", "forwards_per_block"}`` (wall time
    including the writes; ``blocked_s`` of it the loop waited for ``write``; the most forwards one
    block of :func:`teacher_forced` held, None in generate mode).
    """
    storage = Storage.of(cfg, sites[0].num_experts, len(sites))
    missing = None
    if storage.lookahead:
        missing = torch.from_numpy(lookahead_missing(len(sites), storage.lookahead.depth)).to(model.device)
    drain = _Drain(write, model.device, block=block, side=cfg.recording_stream == "side")
    counted = [0]
    # the stored routing columns in one launch (top-R logits, no look-ahead): R, else 0
    fused = cfg.rows_kernel and cfg.top_r_kernel and storage.logits == "top" and not storage.lookahead
    rows_r = storage.logits_top_r if fused else 0

    def stored(routing: StepRouting, slots: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return _routing_parts(routing, slots, storage, missing, cfg.top_r_kernel)

    def on_tokens(n: int) -> None:
        counted[0] += n
        if progress is not None:
            progress.update(n)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, CAPTURE_SWITCH_INTERVAL_S))
    start = time.perf_counter()
    try:
        with torch.inference_mode(), RouterRecorder(sites, storage.logits != "none", logits_are_probs,
                                                    storage.lookahead) as rec:
            if cfg.mode == "teacher_forced":
                per_block = teacher_forced(model, rec, windows, cfg.batch_size, cfg.prefill_tokens, drain, stored,
                                           on_tokens, cfg.record_block_tokens, RECORD_BLOCK_BYTES, rows_r)
            else:
                generate(model, rec, windows, cfg.batch_size, cfg.generate, cfg.model.seed, drain, stored,
                         on_tokens)
                per_block = None
    finally:
        drain.close()
        sys.setswitchinterval(interval)
    seconds = time.perf_counter() - start
    return {"tokens": counted[0], "seconds": seconds, "tokens_per_s": counted[0] / max(seconds, 1e-9),
            "blocked_s": drain.blocked_s, "forwards_per_block": per_block}


def run_capture(cfg: CaptureConfig, out: Path | None = None) -> dict:
    """Load the model and text named by ``cfg``, capture, write the trace; returns a summary dict."""
    from traces.capture.model import load_model

    check_config(cfg)
    out = Path(out or cfg.out)
    if out.exists() and not cfg.force:
        raise InputError(f"'{out}' exists; pass force=true to overwrite it")
    docs = read_documents(cfg.input.paths, cfg.input.text_field, cfg.input.domain_field, cfg.input.domain)
    model, tokenizer, sites, name = load_model(cfg.model)
    windows, domains = make_windows(
        docs, tokenizer, cfg.input.window_tokens, cfg.input.min_window_tokens, cfg.input.max_tokens,
        cfg.input.add_bos,
    )
    extra = {
        "capture": {
            "mode": cfg.mode,
            "window_tokens": cfg.input.window_tokens,
            "min_window_tokens": cfg.input.min_window_tokens,
            "add_bos": cfg.input.add_bos,
            "batch_size": cfg.batch_size,
            "prefill_tokens": cfg.prefill_tokens,
            "lookahead": asdict(cfg.lookahead) if cfg.lookahead.enabled else None,
            "generate": asdict(cfg.generate) if cfg.mode == "generate" else None,
            "inputs": [str(p) for p in cfg.input.paths],
            "seed": cfg.model.seed,
            "model_source": cfg.model.path or cfg.model.config,
            **_versions(model.device),
        }
    }
    probs = router_returns_probabilities(model, sites)
    meta = build_meta(model, sites, name, domains, cfg, extra, probs)
    total = sum(len(w.tokens) for w in windows)
    if cfg.mode == "generate":
        total = sum(min(len(w.tokens), cfg.generate.prompt_tokens) + cfg.generate.new_tokens for w in windows)
    if not out.parent.is_dir():
        out.parent.mkdir(parents=True)
    remove_orphans(out.parent)  # unit files of a capture that was killed
    start = time.perf_counter()
    with isolated(pins_threads(cfg, model.device)), \
            open_writer(out, meta, cfg.writers, cfg.writer, cfg.unit_tokens, batch_tokens(cfg), total or None) as writer, \
            _progress(cfg.progress, total) as bar:
        stats = capture_windows(model, sites, windows, cfg, lambda rows: writer.write(**rows.columns()), bar,
                                probs, block=writer.block if cfg.shared_rows else None)
    seconds = time.perf_counter() - start  # end to end: the last units encoded and joined too
    stats.update(
        seconds=seconds,
        tokens_per_s=stats["tokens"] / max(seconds, 1e-9),
        writers=writer.workers,
        lend_wait_s=writer.lend_wait_s,  # 0 where the rows are not lent in shared memory
        path=str(out),
        bytes=out.stat().st_size,
        sequences=len(windows),
        layers=len(sites),
        experts=meta.num_experts,
        top_k=meta.top_k,
        domains=domains,
    )
    if not math.isfinite(stats["tokens_per_s"]):
        stats["tokens_per_s"] = 0.0
    return stats
