"""The capture loop: run a Hugging Face MoE model over text and record its routing as a trace.

Two modes. ``teacher_forced``: windows are batched (unequal lengths right-padded), one forward
per batch, every real token recorded (phase decode, or prefill for the first ``prefill_tokens``
of a window); the simulator replays it as generation. ``generate``: each window's first
``prompt_tokens`` are a prompt (one prefill forward, left-padded), then ``new_tokens`` decode
steps with the KV cache; every token fed to the model is recorded. Padding never enters the trace.

Device work is never waited on inside the loop: the recorded tensors are copied to pinned host
memory asynchronously and a writer thread hands them to the trace writer, so the GPU runs the
next forward while the previous batch is compressed and written.
"""
from __future__ import annotations

import inspect
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from traces.capture.config import CaptureConfig
from traces.capture.hooks import RouterRecorder, router_returns_probabilities
from traces.capture.routers import RouterSite, routing_metadata
from traces.capture.text import Window, make_windows, read_documents
from traces.errors import InputError
from traces.format import (
    PHASE_DECODE,
    PHASE_PREFILL,
    TraceMeta,
    TraceWriter,
    default_row_group_tokens,
)

MODES = ("teacher_forced", "generate")
ROW_GROUP_FRACTION = 16  # capture row groups are 1/16 of the format's default (~4 MiB in memory)
NLL_CHUNK_ELEMENTS = 1 << 28  # bound the float32 copy of the LM logits used for the NLL


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
    logits: np.ndarray | None = None  # float16[T, L, E] router logits (the writer keeps top R), or None

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        """The arrays as keyword arguments of ``TraceWriter.write``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_logits_storage(value: str) -> tuple[str, int | None]:
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
    raise InputError(f"logits={value} is not valid; choose full, none or top:R with R >= 1")


class _Drain:
    """Moves recorded device tensors to the host and into the sink on a writer thread."""

    def __init__(self, write, device: torch.device, depth: int = 3):
        self._write = write
        self._cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
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
                self._write(Rows(**host, **{k: v.numpy() for k, v in copies.items()}))
            except BaseException as e:  # re-raised in the capture loop
                self._error = e

    def put(self, host: dict[str, np.ndarray], device: dict[str, torch.Tensor]) -> None:
        """Queue one block of rows: host arrays as they are, device tensors copied asynchronously."""
        if self._error is not None:
            raise self._error
        if self._cuda:
            copies = {}
            for k, t in device.items():
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                copies[k] = buf
            event = torch.cuda.Event()
            event.record()
        else:
            copies, event = {k: t.detach().cpu() for k, t in device.items()}, None
        self._queue.put((event, host, copies))

    def close(self) -> None:
        """Wait until everything queued is written; re-raise a writer error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def token_nll(lm_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced NLL (nats) of each token given the ones before it: float32[B, S], NaN at 0."""
    B, S, V = lm_logits.shape
    nll = torch.full((B, S), float("nan"), dtype=torch.float32, device=lm_logits.device)
    rows = max(1, NLL_CHUNK_ELEMENTS // max(1, S * V))
    for b in range(0, B, rows):
        lg = lm_logits[b : b + rows, :-1].float()
        nll[b : b + rows, 1:] = F.cross_entropy(
            lg.reshape(-1, V), input_ids[b : b + rows, 1:].reshape(-1), reduction="none"
        ).view(lg.shape[0], S - 1)
    return nll


def _routing_parts(routing, slots: torch.Tensor, logits_kind: str) -> dict[str, torch.Tensor]:
    parts = {
        "experts": routing.experts.index_select(0, slots).to(torch.int16),
        "weights": routing.weights.index_select(0, slots),
    }
    if logits_kind != "none":
        parts["logits"] = routing.logits.index_select(0, slots).to(torch.float16)
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


def teacher_forced(model, recorder: RouterRecorder, windows, batch_size, prefill_tokens, drain, logits_kind, on_tokens):
    """One forward per batch of windows; records every real token."""
    device = model.device
    for batch in batches(windows, batch_size):
        ids, lengths, input_ids, mask = right_padded(batch, device)
        B, S = ids.shape
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        routing = recorder.collect(B * S)
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        slots_np = np.concatenate([b * S + np.arange(n) for b, n in enumerate(lengths)])
        slots = torch.from_numpy(slots_np).to(device)
        dev = _routing_parts(routing, slots, logits_kind)
        dev["nll"] = token_nll(out.logits, input_ids).reshape(-1).index_select(0, slots)
        host = {
            "seq": np.repeat([w.seq for w in batch], lengths).astype(np.int32),
            "pos": pos,
            "phase": np.where(pos < prefill_tokens, PHASE_PREFILL, PHASE_DECODE).astype(np.int8),
            "token_id": ids.reshape(-1)[slots_np].astype(np.int32),
            "domain": np.repeat([w.domain for w in batch], lengths).astype(np.int16),
        }
        drain.put(host, dev)
        on_tokens(int(lengths.sum()))


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


def generate(model, recorder: RouterRecorder, windows, batch_size, gcfg, seed, drain, logits_kind, on_tokens):
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
        steps = [recorder.collect(B * P)]
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
            steps.append(recorder.collect(B))
            cache, next_logits = _returned_cache(out), out.logits[:, -1]
            on_tokens(B)
        # rows per sequence: its prompt slots, then its slot in every decode step
        slots_np = np.concatenate(
            [np.concatenate([b * P + np.arange(P - plen[b], P), B * P + np.arange(N) * B + b]) for b in range(B)]
        )
        slots = torch.from_numpy(slots_np).to(device)
        routing = type(steps[0])(
            experts=torch.cat([s.experts for s in steps]),
            weights=torch.cat([s.weights for s in steps]),
            logits=torch.cat([s.logits for s in steps]) if steps[0].logits is not None else None,
        )
        dev = _routing_parts(routing, slots, logits_kind)
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


def build_meta(model, sites: list[RouterSite], name: str, domains: list[str], logits: str, extra: dict,
               logits_are_probs: bool = False) -> TraceMeta:
    """TraceMeta of a capture from the model's routers and the capture settings."""
    r = routing_metadata(model, sites)
    kind, top_r = parse_logits_storage(logits)
    info = dict(r["extra"])
    info["logits_storage"] = logits
    info["logits_source"] = (
        "log of the router's returned softmax (logits up to a per-token shift)"
        if logits_are_probs else "router output"
    )
    info.update(extra)
    return TraceMeta(
        model=name,
        num_layers=len(sites),
        num_experts=r["num_experts"],
        top_k=r["top_k"],
        expert_bytes=r["expert_bytes"],
        dtype=r["dtype"],
        score_function=r["score_function"],
        renormalize=r["renormalize"],
        has_logits=kind != "none",
        logits_top_r=top_r or 0,
        layer_ids=r["layer_ids"],
        domains=list(domains),
        dense_bytes=r["dense_bytes"],
        source="capture",
        extra=info,
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


def open_writer(path: Path, meta: TraceMeta) -> TraceWriter:
    """The format's atomic writer with smaller row groups than its default.

    Small row groups are compressed and written on the writer thread while the GPU runs the next
    batches; with the default (one row group per ~64 MiB) most of a short capture's writing
    would happen at the end, after the last forward.
    """
    return TraceWriter(path, meta, row_group_tokens=max(256, default_row_group_tokens(meta) // ROW_GROUP_FRACTION))


def check_config(cfg: CaptureConfig) -> None:
    """Validate the fields that need no model, so a bad value fails before anything loads."""
    if cfg.mode not in MODES:
        raise InputError(f"mode={cfg.mode} is not valid; choose one of: {', '.join(MODES)}")
    parse_logits_storage(cfg.logits)
    if cfg.batch_size < 1:
        raise InputError(f"batch_size={cfg.batch_size} must be at least 1")
    if cfg.prefill_tokens < 0:
        raise InputError(f"prefill_tokens={cfg.prefill_tokens} must be >= 0")
    if cfg.mode == "generate" and (cfg.generate.prompt_tokens < 1 or cfg.generate.new_tokens < 0):
        raise InputError("generate.prompt_tokens must be >= 1 and generate.new_tokens >= 0")
    if not cfg.input.paths:
        raise InputError("input.paths is empty; give text files, folders or JSONL files")


def capture_windows(model, sites, windows, cfg: CaptureConfig, write, progress=None,
                    logits_are_probs: bool = False) -> dict:
    """Record ``windows`` through ``model`` and pass every block of rows to ``write(rows)``.

    Returns ``{"tokens", "seconds", "tokens_per_s"}`` (wall time including the writes).
    """
    kind, _ = parse_logits_storage(cfg.logits)
    drain = _Drain(write, model.device)
    counted = [0]

    def on_tokens(n: int) -> None:
        counted[0] += n
        if progress is not None:
            progress.update(n)

    start = time.perf_counter()
    try:
        with torch.inference_mode(), RouterRecorder(sites, kind != "none", logits_are_probs) as rec:
            if cfg.mode == "teacher_forced":
                teacher_forced(model, rec, windows, cfg.batch_size, cfg.prefill_tokens, drain, kind, on_tokens)
            else:
                generate(model, rec, windows, cfg.batch_size, cfg.generate, cfg.model.seed, drain, kind, on_tokens)
    finally:
        drain.close()
    seconds = time.perf_counter() - start
    return {"tokens": counted[0], "seconds": seconds, "tokens_per_s": counted[0] / max(seconds, 1e-9)}


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
            "generate": asdict(cfg.generate) if cfg.mode == "generate" else None,
            "inputs": [str(p) for p in cfg.input.paths],
            "seed": cfg.model.seed,
            "model_source": cfg.model.path or cfg.model.config,
            **_versions(model.device),
        }
    }
    probs = router_returns_probabilities(model, sites)
    meta = build_meta(model, sites, name, domains, cfg.logits, extra, probs)
    total = sum(len(w.tokens) for w in windows)
    if cfg.mode == "generate":
        total = sum(min(len(w.tokens), cfg.generate.prompt_tokens) + cfg.generate.new_tokens for w in windows)
    if not out.parent.is_dir():
        out.parent.mkdir(parents=True)
    with open_writer(out, meta) as writer, _progress(cfg.progress, total) as bar:
        stats = capture_windows(model, sites, windows, cfg, lambda rows: writer.write(**rows.columns()), bar,
                                probs)
    stats.update(
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
