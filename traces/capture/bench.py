"""Capture overhead: tokens/s of the same teacher-forced forwards with and without recording.

Three variants over the same windows and batches: ``forward`` (the model alone), ``hooks``
(router hooks, NLL, top-R selection and copies to the host; rows discarded) and ``capture``
(hooks plus the capture's trace writer, file closed). After one warm-up pass of each, they are
timed in ``repeats`` rounds (forward, hooks, capture; then capture, hooks, forward; and so on);
each one's median counts, and the median of the rounds' ratios beside it, each with a 95 %
bootstrap interval over the rounds (:func:`overhead_interval`): on a host whose speed moves from
pass to pass, a few rounds leave an overhead uncertain by several points. ``--ci-width W`` ends
the rounds early (from the fifth on, ``--repeats`` the most) once every capture's interval is at
most W points wide: ``--repeats 60 --ci-width 4`` measures until it can tell 10 % from 14 %.
On a host lent for a fixed time, ``--time-limit S`` starts no round that would end more than S
seconds after the bench started (each setting's first round always runs), and ``--out`` holds
every setting measured so far. Each round's end is reported on stderr.
The capture pass is also reported without its close (encoding the units still pending when the
last forward is done): that tail is fixed per capture, so a long capture's overhead tends to the
loop's, as long as the loop never waits for the writer. Each capture pass writes its file in the
system's temporary folder (TMPDIR sets it) and removes it after the close; the result records
that folder's file system, the ``vm.dirty_*`` settings and the pages dirty or under writeback at
each close (``page_cache``, ``dirty_at_close_mib``). The capture settings are moe-capture's defaults unless given
(``--logits``, ``--lookahead-depth``, ``--writers``). Prints a Markdown table:

    python -m traces.capture.bench --model traces/fixtures/model --input capture.jsonl --out bench.json
    python -m traces.capture.bench --model traces/fixtures/model --input docs/ --device cpu --tokens 2048

Torch is imported by the measuring functions only, so :func:`overhead_table` serves the model
cards on hosts without it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from traces.atomic import atomic_write_text
from traces.capture.config import (
    RECORDING_STREAMS,
    WRITERS,
    CaptureConfig,
    LookaheadConfig,
    ModelConfig,
)
from traces.capture.cores import descendants, processes


def meminfo_kb(fields: tuple[str, ...] = ("Dirty", "Writeback"), path: str = "/proc/meminfo") -> dict[str, int] | None:
    """``fields`` of /proc/meminfo in kB; None where it cannot be read (not Linux)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in fields:
            found[name] = int(value.split()[0])
    return found


def page_cache_facts(folder: str | None = None, proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> dict:
    """Where the capture passes write their files and what the system does with pages written: the
    folder (``tempfile.gettempdir()``, which TMPDIR sets), its file system (from the mounts), the
    ``vm.dirty_*`` settings, the memory available and this process's memory cgroup limit: a pass
    of 2,097,152 tokens of the small Qwen3-Next shape writes 3.6 GB, and past the background
    threshold the system writes dirty pages back while a pass runs. None for what cannot be read."""
    folder = folder or tempfile.gettempdir()

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    mount = None
    for line in (read(f"{proc}/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 3 and (folder == parts[1] or folder.startswith(parts[1].rstrip("/") + "/")) and \
                (mount is None or len(parts[1]) > len(mount[0])):
            mount = (parts[1], parts[2])
    vm = {name: read(f"{proc}/sys/vm/{name}") for name in
          ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes", "dirty_expire_centisecs")}
    available = meminfo_kb(("MemTotal", "MemAvailable"), f"{proc}/meminfo")
    return {"folder": folder, "mount": mount[0] if mount else None, "filesystem": mount[1] if mount else None,
            "vm": {k: int(v) if v is not None and v.isdigit() else v for k, v in vm.items()},
            "memory_kb": available,  # the memory cgroup's limit: v2's file, else v1's
            "cgroup_memory_max": read(f"{cgroup}/memory.max") or read(f"{cgroup}/memory/memory.limit_in_bytes")}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_only(model, windows, batch_size: int) -> None:
    import torch

    from traces.capture.capture import batches, right_padded

    with torch.inference_mode():
        for batch in batches(windows, batch_size):
            _, _, input_ids, mask = right_padded(batch, model.device)
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    _sync(model.device)


class Timed(NamedTuple):
    """A result that says how long its own measured part took (what came after it is not timed)."""

    seconds: float
    result: object


def _timed_rounds(fns: dict, repeats: int, alternate: bool = False, enough=None, deadline: float | None = None,
                  ) -> tuple[dict[str, float], dict, dict[str, list[float]], dict]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds (one call of each per round, in
    turn), after a warm-up call of each; and each function's last result. A function that returns
    :class:`Timed` is timed by it. Rounds, not one function's repeats back to back: a host whose
    speed drifts over the minutes of a run then moves every variant alike instead of showing up
    as one variant's overhead. ``alternate``: every other round runs them in the reverse order
    (forward, hooks, capture; then capture, hooks, forward), so that neither a drift within a
    round nor what the call before leaves behind favours one of them. Third: each function's
    timed rounds in seconds (the drift). Fourth: each function's median CPU seconds per call, of
    the calling thread (``main_thread``) and of the process's other threads (``other_threads``).
    ``enough(times)``: called after each round with the rounds so far; True ends the rounds
    before ``repeats`` (which is then the most). ``deadline`` (a ``time.perf_counter()`` value):
    no round starts that would end after it, as long as the longest round so far (the first
    round always runs). Each round's end is reported on stderr."""
    def call(fn) -> tuple[float, object]:
        start = time.perf_counter()
        out = fn()
        return (out.seconds, out.result) if isinstance(out, Timed) else (time.perf_counter() - start, out)

    results = {name: call(fn)[1] for name, fn in fns.items()}  # warm-up: kernels, allocator, first writer
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[tuple[float, float, float]]] = {name: [] for name in fns}
    longest = 0.0
    for r in range(repeats):
        if r and deadline is not None and time.perf_counter() + longest > deadline:
            print(f"[bench] {r} of {repeats} rounds: the next would end past --time-limit", file=sys.stderr,
                  flush=True)
            break
        began = time.perf_counter()
        for name, fn in (reversed(fns.items()) if alternate and r % 2 else fns.items()):
            process, thread, children = time.process_time(), time.thread_time(), _children_cpu()
            seconds, results[name] = call(fn)
            times[name].append(seconds)
            cpu[name].append((time.process_time() - process, time.thread_time() - thread,
                              _children_cpu() - children))
        took = time.perf_counter() - began
        longest = max(longest, took)
        print(f"[bench] round {r + 1} of {repeats}: {took:.1f} s", file=sys.stderr, flush=True)
        if enough is not None and enough(times):
            break
    cpu_s = {name: {"main_thread": round(statistics.median(c[1] for c in runs), 3),
                    "other_threads": round(statistics.median(c[0] - c[1] for c in runs), 3),
                    "child_processes": round(statistics.median(c[2] for c in runs), 3)}
             for name, runs in cpu.items()}
    return {name: statistics.median(t) for name, t in times.items()}, results, times, cpu_s


def _children_cpu() -> float:
    """CPU seconds so far of this process's running descendants (the writer's encoders and joiner,
    kept between writers, and a dispatcher's), from /proc; 0 where there is none."""
    table = processes()
    total = sum(table[pid][1] for pid in descendants(os.getpid(), table))
    return total / os.sysconf("SC_CLK_TCK") if total else 0.0


def measure_overhead(model, sites, windows, name: str, domains: list[str], cfg: CaptureConfig,
                     repeats: int = 3, writers: tuple[str, ...] = (), streams: tuple[str, ...] = (),
                     kernels: tuple[bool, ...] = (), ci_width: float = 0.0,
                     blocks: tuple[int, ...] = (), deadline: float | None = None,
                     rows_kernels: tuple[bool, ...] = ()) -> list[dict]:
    """Tokens/s of forward, hooks and capture at ``cfg`` (batch size, storage, writers); overheads
    in %. ``writers``: the capture with each of these writers (default: ``cfg.writer``),
    ``streams``: with each of these recording streams (default: ``cfg.recording_stream``),
    ``kernels``: with the top-R kernel on and off (default: ``cfg.top_r_kernel``), and ``blocks``:
    with each of these ``record_block_tokens`` (default: ``cfg.record_block_tokens``), and
    ``rows_kernels``: with the stored-rows kernel on and off (default: ``cfg.rows_kernel``), all in
    the same rounds, side by side; one result per writer and recording (stream, kernel, block and
    rows-kernel setting), the forward shared, the hooks shared by the writers of a recording.
    ``deadline``: as in :func:`_timed_rounds`."""
    from traces.capture.capture import (
        batch_tokens,
        build_meta,
        capture_windows,
        open_writer,
        pins_threads,
    )
    from traces.capture.cores import isolated
    from traces.capture.hooks import router_returns_probabilities

    tokens = sum(len(w.tokens) for w in windows)
    probs = router_returns_probabilities(model, sites)
    writers = tuple(writers) or (cfg.writer,)
    recordings = [(s, k, b, f) for s in tuple(streams) or (cfg.recording_stream,)
                  for k in tuple(kernels) or (cfg.top_r_kernel,)
                  for b in tuple(blocks) or (cfg.record_block_tokens,)
                  for f in tuple(rows_kernels) or (cfg.rows_kernel,)]
    variants = [(w, *rec) for w in writers for rec in recordings]

    def recording(stream: str, kernel: bool, block: int, rows: bool) -> CaptureConfig:
        return replace(cfg, recording_stream=stream, top_r_kernel=kernel, record_block_tokens=block, rows_kernel=rows)

    def hooks(*rec) -> dict:
        return capture_windows(model, sites, windows, recording(*rec), lambda rows: None, logits_are_probs=probs)

    # per variant and capture pass: the loop's end to the file closed, the start to the writer open
    # (its fixed cost), the writer's tokens per row group, the seconds the loop waited for shared
    # memory to lend (the writer's bound on the rows it holds)
    closes: dict[tuple, list[float]] = {v: [] for v in variants}
    lending: dict[tuple, list[float]] = {v: [] for v in variants}
    opens: dict[tuple, list[float]] = {v: [] for v in variants}
    units: dict[tuple, list[int]] = {v: [] for v in variants}
    # the system's dirty pages and pages under writeback when the file is closed (kB), or None
    dirty: dict[tuple, list] = {v: [] for v in variants}

    def capture(writer: str, *rec) -> Timed:
        """Timed from the start to the file closed: removing the file after it (a 131,072-token
        trace of the 30B shape is 1.4 GB of page cache) is no part of a capture."""
        start = time.perf_counter()
        meta = build_meta(model, sites, name, domains, cfg, {}, probs)
        with tempfile.TemporaryDirectory() as tmp:
            with open_writer(Path(tmp) / "bench.parquet", meta, cfg.writers, writer, cfg.unit_tokens,
                             batch_tokens(cfg), tokens) as w:
                opens[writer, *rec].append(time.perf_counter() - start)
                units[writer, *rec].append(w.unit_tokens)
                stats = capture_windows(model, sites, windows, recording(*rec),
                                        lambda rows: w.write(**rows.columns()), logits_are_probs=probs,
                                        block=w.block if cfg.shared_rows else None)
                end = time.perf_counter()
                lending[writer, *rec].append(w.lend_wait_s)
            closed = time.perf_counter()
            closes[writer, *rec].append(closed - end)
            dirty[writer, *rec].append(meminfo_kb())
        return Timed(closed - start, stats)

    modes = {"forward": lambda: _forward_only(model, windows, cfg.batch_size)}
    modes.update({_hooks_mode(*rec): (lambda rec=rec: hooks(*rec)) for rec in recordings})
    modes.update({_mode(*v): (lambda v=v: capture(*v)) for v in variants})
    with isolated(pins_threads(cfg, model.device)) as cpu_of_model:  # all passes alike
        t, last, rounds, cpu = _timed_rounds(modes, repeats, alternate=True,
                                             enough=_narrow_enough(ci_width, [_mode(*v) for v in variants]),
                                             deadline=deadline)
    return [_overhead(cfg, v, tokens, t, rounds, cpu, last[_mode(*v)], units[v], closes[v], opens[v], lending[v],
                      cpu_of_model, dirty[v]) for v in variants]


MIN_ROUNDS = 5  # rounds before an interval may end the measurement (fewer resample too coarsely)


def _narrow_enough(width: float, captures: list[str]):
    """``enough`` for :func:`_timed_rounds`: every capture pass's overhead over the forward has a 95 %
    interval (the ratio of the medians, :func:`overhead_interval`) at most ``width`` points wide,
    from :data:`MIN_ROUNDS` rounds on; None where ``width`` is 0 (every round runs)."""
    if width <= 0:
        return None

    def enough(times: dict[str, list[float]]) -> bool:
        if len(times["forward"]) < MIN_ROUNDS:
            return False
        spans = [overhead_interval(times[c], times["forward"]) for c in captures]
        return all(high - low <= width for low, high in spans)
    return enough


def _recording(stream: str, kernel: bool, block: int | None = None, per_block: int | None = None,
               rows: bool = False) -> str:
    """A recording's label; ``per_block``: the most forwards a block held, where a result says;
    ``rows``: the stored-rows kernel asked for (``rows_kernel``)."""
    if block is None:
        held = ""
    elif block == 0:
        held = ", forwards handed on alone"
    elif per_block == 1:
        held = f", forwards handed on alone (record_block_tokens {block:,} holds no two of them)"
    else:
        held = f", forwards held in blocks of {block:,} tokens" + (f" (up to {per_block})" if per_block else "")
    return (f"recording on the {stream} stream" + ("" if kernel else ", top-R by sorts")
            + (", stored columns in one launch" if rows and kernel else "") + held)


def _mode(writer: str, stream: str, kernel: bool, block: int, rows: bool) -> str:
    return f"capture ({writer}, {_recording(stream, kernel, block, rows=rows)})"


def _hooks_mode(stream: str, kernel: bool, block: int, rows: bool) -> str:
    return f"hooks ({_recording(stream, kernel, block, rows=rows)})"


def _overhead(cfg: CaptureConfig, variant: tuple[str, str, bool, int, bool], tokens: int, t: dict, rounds: dict,
              cpu: dict, stats: dict, units: list[int], closes: list[float], opens: list[float], lending: list[float],
              cpu_of_model, dirty: list | None = None) -> dict:
    """One variant's result of :func:`measure_overhead` (writer, recording stream, top-R kernel,
    record_block_tokens, rows kernel), its modes named ``hooks`` and ``capture``; ``dirty``:
    :func:`meminfo_kb` at each capture pass's close."""
    writer, stream, kernel, block, rows = variant
    mode, hooks = _mode(*variant), _hooks_mode(stream, kernel, block, rows)
    t_fwd, t_hooks, t_cap = t["forward"], t[hooks], t[mode]
    close = statistics.median(closes[1:])  # the timed rounds' (the first pass is the warm-up)
    opened = statistics.median(opens[1:])
    rounds = {"forward": rounds["forward"], "hooks": rounds[hooks], "capture": rounds[mode]}
    cpu = {"forward": cpu["forward"], "hooks": cpu[hooks], "capture": cpu[mode]}
    return {
        "logits": cfg.logits,
        "lookahead": _lookahead_label(cfg.lookahead),
        "batch_size": cfg.batch_size,
        "writers": _workers(cfg),
        "writer": writer,
        "recording_stream": stream,
        "top_r_kernel": kernel,  # asked for: it runs on a GPU with Triton and top-R logits
        "record_block_tokens": block,
        "rows_kernel": rows,  # asked for: it runs with the top-R kernel, top-R logits and no look-ahead
        "record_block_forwards": stats.get("forwards_per_block"),  # the most one block held: 1, every forward alone
        "unit_tokens": units[-1],
        "model_cpu": cpu_of_model,
        "shared_rows": cfg.shared_rows,  # the CPU the model's thread was pinned to (pin_threads), or None
        "tokens": tokens,
        "rounds": len(rounds["forward"]),  # fewer than asked where --ci-width ended them early
        "forward_tokens_per_s": round(tokens / t_fwd),
        "hooks_tokens_per_s": round(tokens / t_hooks),
        "capture_tokens_per_s": round(tokens / t_cap),
        "hooks_overhead_pct": round(100 * (t_hooks / t_fwd - 1), 1),
        "capture_overhead_pct": round(100 * (t_cap / t_fwd - 1), 1),
        # the median over the rounds of each round's capture / forward: on a host whose speed moves
        # from pass to pass, the ratio of the medians and this can differ by several points
        "capture_overhead_by_round_pct": _by_round(rounds["capture"], rounds["forward"]),
        "hooks_overhead_by_round_pct": _by_round(rounds["hooks"], rounds["forward"]),
        # how far each figure can move with the rounds drawn: 95 % bootstrap intervals over the
        # rounds (each round's passes kept together), [low, high] in %
        "capture_overhead_ci95_pct": overhead_interval(rounds["capture"], rounds["forward"]),
        "capture_overhead_by_round_ci95_pct": overhead_interval(rounds["capture"], rounds["forward"], by_round=True),
        "hooks_overhead_ci95_pct": overhead_interval(rounds["hooks"], rounds["forward"]),
        "hooks_overhead_by_round_ci95_pct": overhead_interval(rounds["hooks"], rounds["forward"], by_round=True),
        # the capture without its close: what a capture converges to as it grows, while the loop
        # never waits for the writer (the close encodes the units still pending, a fixed tail)
        "capture_loop_overhead_pct": round(100 * ((t_cap - close) / t_fwd - 1), 1),
        "close_s": round(close, 3),
        "open_s": round(opened, 3),  # the start to the writer open (metadata, threads, encoders)
        "writer_wait_pct": round(100 * stats["blocked_s"] / t_cap, 1),  # of the last capture pass
        # the loop waiting to lend shared memory for rows (the writer's bound), median of the passes
        "lend_wait_pct": round(100 * statistics.median(lending[1:]) / t_cap, 1),
        "rounds_s": {name: [round(x, 3) for x in times] for name, times in rounds.items()},
        # CPU seconds of the measuring process per pass (medians): its main thread, which drives
        # the model, its other threads (the drain, the writer's) and its descendant processes
        # (the encoders, the joiner, a dispatcher; 0 without /proc)
        "cpu_s": cpu,
        # MiB of the system's pages dirty or under writeback at each timed capture pass's close:
        # where they pass vm.dirty_background_* (page_cache_facts), the pass ran beside a writeback
        "dirty_at_close_mib": _dirty_mib(dirty),
    }


def _dirty_mib(dirty: list | None) -> dict | None:
    """{"dirty": [...], "writeback": [...]} in MiB over the timed passes (the first is the warm-up),
    or None where /proc/meminfo was not read."""
    timed = [d for d in (dirty or [])[1:] if d]
    if not timed:
        return None
    return {key: [round(d.get(field, 0) / 1024) for d in timed] for key, field in
            (("dirty", "Dirty"), ("writeback", "Writeback"))}


def _by_round(times: list[float], forward: list[float]) -> float:
    """Overhead in % of the median round: the median over the rounds of ``times`` / ``forward``."""
    return round(100 * (statistics.median(t / f for t, f in zip(times, forward, strict=True)) - 1), 1)


def overhead_interval(times: list[float], forward: list[float], by_round: bool = False, level: float = 0.95,
                      draws: int = 4000, seed: int = 0) -> list[float]:
    """A percentile bootstrap interval, in %, of the overhead of ``times`` over ``forward`` (one of
    each per round): the ratio of the medians, or (``by_round``) the median of the rounds' ratios.
    Rounds are drawn with replacement, each round's two passes together (a round's passes share
    the host's speed of the moment). Of the host's noise, not of the model: with few rounds on a
    host whose speed moves from pass to pass, the interval is wide, and a target a few points
    away is neither met nor missed. [low, high], rounded to 0.1; one round gives its own ratio."""
    import numpy as np

    t, f = np.asarray(times, np.float64), np.asarray(forward, np.float64)
    if t.shape != f.shape or t.ndim != 1 or not t.size:
        raise ValueError("one time and one forward time per round, at least one round")
    picks = np.random.default_rng(seed).integers(0, t.size, size=(draws, t.size))
    if by_round:
        stat = np.median((t / f)[picks], axis=1)
    else:
        stat = np.median(t[picks], axis=1) / np.median(f[picks], axis=1)
    low, high = np.quantile(100 * (stat - 1), [(1 - level) / 2, (1 + level) / 2])
    return [round(float(low), 1), round(float(high), 1)]


def pooled_overhead(runs: list[tuple[list[float], list[float]]], by_round: bool = False, level: float = 0.95,
                    draws: int = 4000, seed: int = 0) -> tuple[float, list[float]]:
    """The overhead of several runs of one setting (each ``(times, forward)``, one of each per
    round, as :func:`overhead_interval` takes): the mean of the runs' figures (ratio of the
    medians, or ``by_round`` the median round), in %, and its percentile bootstrap interval drawn
    in two stages, runs with replacement and then each drawn run's rounds, so that both the
    spread between hosts and the noise within each run widen it. (point, [low, high]), rounded
    to 0.1. The runs' order does not change it: they are drawn in an order of their own."""
    import numpy as np

    if not runs:
        raise ValueError("at least one run")
    rng = np.random.default_rng(seed)
    pairs = []
    for times, forward in runs:
        t, f = np.asarray(times, np.float64), np.asarray(forward, np.float64)
        if t.shape != f.shape or t.ndim != 1 or not t.size:
            raise ValueError("one time and one forward time per round, at least one round in each run")
        pairs.append((t, f))
    pairs.sort(key=lambda pair: (pair[0].tolist(), pair[1].tolist()))  # the same draws, whatever the order given

    def figure(t, f):  # [..., rounds] -> [...]
        return np.median(t / f, axis=-1) if by_round else np.median(t, axis=-1) / np.median(f, axis=-1)

    point = float(np.mean([figure(t, f) for t, f in pairs]))
    chosen = rng.integers(0, len(pairs), size=(draws, len(pairs)))
    stat = np.zeros(draws)
    for i, (t, f) in enumerate(pairs):  # each run's resampled figure, wherever the first stage drew it
        n = (chosen == i).sum(axis=1)
        picks = rng.integers(0, t.size, size=(int(n.sum()), t.size))
        np.add.at(stat, np.repeat(np.arange(draws), n), figure(t[picks], f[picks]))
    low, high = np.quantile(100 * (stat / len(pairs) - 1), [(1 - level) / 2, (1 + level) / 2])
    return round(100 * (point - 1), 1), [round(float(low), 1), round(float(high), 1)]


def _workers(cfg: CaptureConfig) -> int:
    """The number of encoding threads a capture with ``cfg`` uses."""
    from traces.capture.writer import default_workers

    return cfg.writers or default_workers()


def _span(interval: list[float]) -> str:
    return f"{interval[0]:+.1f} to {interval[1]:+.1f} %"


def _lookahead_label(la: LookaheadConfig) -> str:
    return f"{la.depth} x {la.logits} ({la.source})" if la.enabled else "none"


def overhead_table(bench: dict) -> list[str]:
    """The Markdown table of one bench result (``--out`` JSON), a line per run."""
    lines = [
        "| logits | look-ahead | encoders | batch (windows) | forward only, tok/s | + recording, tok/s | "
        "+ trace writer, tok/s | recording overhead | recording + writer overhead | "
        "the same without the file's close (close, s) | loop waiting for the writer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["runs"]:
        wait = f"{r['writer_wait_pct']:.1f} %" if "writer_wait_pct" in r else "n/a"
        if "lend_wait_pct" in r:
            wait += f" (+ {r['lend_wait_pct']:.1f} % to lend)"
        loop = (f"{r['capture_loop_overhead_pct']:+.1f} % ({r['close_s']:.2f})"
                if "capture_loop_overhead_pct" in r else "n/a")
        encoders = f"{r['writers']} {r.get('writer', 'threads')}" if "writers" in r else "1 thread"
        if "unit_tokens" in r:
            encoders += f", {r['unit_tokens']:,}-token units"
        if r.get("model_cpu") is not None:
            encoders += f", model's thread on CPU {r['model_cpu']}"
        if "shared_rows" in r:
            encoders += ", rows shared in place" if r["shared_rows"] else ", rows copied"
        if "recording_stream" in r:
            label = _recording(r["recording_stream"], r.get("top_r_kernel", True), r.get("record_block_tokens"),
                               r.get("record_block_forwards"), r.get("rows_kernel", False))
            encoders += f", {label}"
        lines.append(
            f"| {r.get('logits', bench.get('logits'))} | {r.get('lookahead', 'none')} | {encoders} | {r['batch_size']} | "
            f"{r['forward_tokens_per_s']:,} | {r['hooks_tokens_per_s']:,} | {r['capture_tokens_per_s']:,} | "
            f"{r['hooks_overhead_pct']:+.1f} % | {r['capture_overhead_pct']:+.1f} % | {loop} | {wait} |"
        )
    return lines


def _counts(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated list of whole numbers >= 0, or the parser's error naming ``flag``."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = [-1]
    if min(counts) < 0:
        p.error(f"{flag} {text}: give whole numbers >= 0, comma-separated")
    return counts


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()  # --time-limit counts from here, the model's load included
    defaults = CaptureConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--config", help="config.json of a randomly initialised model")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--input", nargs="+", required=True, help="text files, folders or JSONL")
    p.add_argument("--tokens", type=int, default=20480, help="input tokens per measured pass")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--logits", default=defaults.logits,
                   help=f"logits storages to measure, comma-separated (default: moe-capture's, {defaults.logits})")
    p.add_argument("--lookahead-depth", type=int, default=0,
                   help="also record look-ahead routing this many layers ahead (moe-capture's other defaults)")
    p.add_argument("--writers", default=str(defaults.writers),
                   help="encoders, comma-separated to compare; 0: moe-capture's default")
    p.add_argument("--writer", default=defaults.writer,
                   help=f"the writer: {', '.join(WRITERS)}; comma-separated to compare them in the same rounds "
                        f"(default: {defaults.writer})")
    p.add_argument("--unit-tokens", default="0",
                   help="tokens per row group the writer encodes at a time, comma-separated; 0: moe-capture's auto")
    p.add_argument("--pin-threads", default="1" if defaults.pin_threads else "0",
                   help="1: the model's thread on a CPU core of its own (moe-capture's pin_threads), 0: not; "
                        "comma-separated to compare")
    p.add_argument("--shared-rows", default="1" if defaults.shared_rows else "0",
                   help="1: the device writes the rows into the encoders' shared memory (moe-capture's "
                        "shared_rows), 0: through pinned buffers, copied; comma-separated to compare")
    p.add_argument("--recording-stream", default=defaults.recording_stream,
                   help=f"where the recording's device work runs: {', '.join(RECORDING_STREAMS)}; comma-separated "
                        f"to compare them in the same rounds (default: {defaults.recording_stream})")
    p.add_argument("--top-r-kernel", default="1" if defaults.top_r_kernel else "0",
                   help="1: the top-R logits selected by the Triton kernel where it runs (moe-capture's "
                        "top_r_kernel), 0: by two sorts; comma-separated to compare them in the same rounds")
    p.add_argument("--rows-kernel", default="1" if defaults.rows_kernel else "0",
                   help="1: each block's stored routing columns written by one Triton kernel where it runs "
                        "(moe-capture's rows_kernel), 0: step by step and copied; comma-separated to compare "
                        "them in the same rounds")
    p.add_argument("--record-block-tokens", default=str(defaults.record_block_tokens),
                   help="tokens of routing the recording holds before handing rows on (moe-capture's "
                        "record_block_tokens; 0: every forward alone); comma-separated to compare them in "
                        "the same rounds")
    p.add_argument("--repeats", type=int, default=3, help="rounds (the most, with --ci-width)")
    p.add_argument("--ci-width", type=float, default=0.0,
                   help="end the rounds early, from the 5th on, once every capture's overhead has a 95 %% "
                        "interval at most this many points wide (0: run every round)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds from the start (the model's load included) by which the rounds should end: "
                        "no round starts that would end later, as long as the longest so far (each setting's "
                        "first round always runs); results so far are written to --out after each setting. "
                        "For a host lent for a fixed time (0: no limit)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", help="auto (cuda when available) | cuda | cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    bad = [w for w in args.writer.split(",") if w not in WRITERS]
    if bad:
        p.error(f"--writer {bad[0]} is not valid; choose from: {', '.join(WRITERS)}")
    bad = [s for s in args.recording_stream.split(",") if s not in RECORDING_STREAMS]
    if bad:
        p.error(f"--recording-stream {bad[0]} is not valid; choose from: {', '.join(RECORDING_STREAMS)}")
    units, encoders = _counts(p, "--unit-tokens", args.unit_tokens), _counts(p, "--writers", args.writers)
    held = tuple(_counts(p, "--record-block-tokens", args.record_block_tokens))
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: rounds must be at least 1")
    if not args.ci_width >= 0:
        p.error(f"--ci-width {args.ci_width}: give a width in points >= 0 (0: run every round)")
    if not args.time_limit >= 0:
        p.error(f"--time-limit {args.time_limit}: give seconds >= 0 (0: no limit)")
    deadline = started + args.time_limit if args.time_limit else None
    pins, shares, kernels = args.pin_threads.split(","), args.shared_rows.split(","), args.top_r_kernel.split(",")
    fused = args.rows_kernel.split(",")
    for flag, values in (("--pin-threads", pins), ("--shared-rows", shares), ("--top-r-kernel", kernels),
                         ("--rows-kernel", fused)):
        if any(x not in ("0", "1") for x in values):
            p.error(f"{flag} {','.join(values)}: give 1 or 0, comma-separated")

    import torch

    from traces.capture.model import load_model
    from traces.capture.text import make_windows, read_documents
    from traces.provenance import capture_commit, sources_fingerprint

    mcfg = ModelConfig(path=args.model, config=args.config, tokenizer=args.tokenizer, dtype=args.dtype,
                       device=args.device)
    model, tokenizer, sites, name = load_model(mcfg)
    docs = read_documents(args.input)
    windows, domains = make_windows(docs, tokenizer, args.window, max_tokens=args.tokens)
    results = {"model": name, "device": str(model.device),
               "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
               "layers": len(sites), "experts": sites[0].num_experts, "top_k": sites[0].top_k,
               "parameters": sum(p.numel() for p in model.parameters()),
               # the capture code timed (traces.provenance): the checkout's last commit of it, and
               # the files' own fingerprint, which names them also where the copy's .git lags
               "capture_commit": capture_commit(), "capture_sources": sources_fingerprint(),
               "time_limit_s": args.time_limit or None, "page_cache": page_cache_facts(), "runs": []}
    lookahead = replace(defaults.lookahead, enabled=args.lookahead_depth > 0, depth=max(1, args.lookahead_depth))
    writers = tuple(args.writer.split(","))  # side by side in the same rounds
    for logits, workers, bs, unit, pin, share in itertools.product(
            args.logits.split(","), encoders, (int(x) for x in args.batch_sizes.split(",")), units, pins, shares):
        cfg = replace(defaults, logits=logits, batch_size=bs, writers=workers, writer=writers[0],
                      lookahead=lookahead, unit_tokens=unit, input=replace(defaults.input, window_tokens=args.window),
                      pin_threads=pin == "1", shared_rows=share == "1")
        for r in measure_overhead(model, sites, windows, name, domains, cfg, args.repeats, writers,
                                  tuple(args.recording_stream.split(",")), tuple(k == "1" for k in kernels),
                                  args.ci_width, held, deadline, tuple(f == "1" for f in fused)):
            results["runs"].append(r)
            print(f"{name} logits={logits} writer={r['writer']} recording stream {r['recording_stream']} "
                  f"top-R kernel {int(r['top_r_kernel'])} rows kernel {int(r['rows_kernel'])} block {r['record_block_tokens']} unit {r['unit_tokens']} batch {bs} shared rows {share} "
                  f"model's CPU "
                  f"{r['model_cpu']}: forward {r['forward_tokens_per_s']} tok/s, "
                  f"hooks {r['hooks_tokens_per_s']} ({r['hooks_overhead_pct']:+.1f} %, 95 % interval "
                  f"{_span(r['hooks_overhead_ci95_pct'])}), "
                  f"capture {r['capture_tokens_per_s']} ({r['capture_overhead_pct']:+.1f} % in {r['rounds']} rounds, "
                  f"{r['capture_overhead_by_round_pct']:+.1f} % in the median round; 95 % intervals "
                  f"{_span(r['capture_overhead_ci95_pct'])} and {_span(r['capture_overhead_by_round_ci95_pct'])}; "
                  f"{r['capture_loop_overhead_pct']:+.1f} % without the close of {r['close_s']:.2f} s; "
                  f"writer open {r['open_s']:.3f} s, waited to lend {r['lend_wait_pct']:.1f} %); "
                  "CPU s per pass, main thread / other threads / child processes: "
                  + ", ".join(f"{k} {v['main_thread']:.2f} / {v['other_threads']:.2f} / {v['child_processes']:.2f}"
                              for k, v in r["cpu_s"].items()),
                  flush=True)
        if args.out:  # after each setting: a process stopped later keeps the settings measured
            atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    print(f"\n{name} on {results['gpu'] or results['device']} ({results['layers']} MoE layers, "
          f"{results['experts']} experts, top-{results['top_k']}), {results['runs'][0]['tokens']:,} "
          f"tokens per pass, capture code of {results['capture_commit']} (sources {results['capture_sources']}):\n")
    print("\n".join(overhead_table(results)))


if __name__ == "__main__":
    main()
