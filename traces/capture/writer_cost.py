"""CPU the trace writer costs: the thread that hands it the rows, and its child processes (no GPU, no torch).

Feeds moe-capture's trace writer (``--writer``: :class:`traces.capture.writer.ParallelTraceWriter`
with encoder processes, or the same in a dispatcher process, :mod:`traces.capture.dispatch`;
both side by side, pass by pass, by default) synthetic rows of the small Qwen3-Next
shape at batch 16 (8 MoE layers, 512 experts, top-10, top-64 logits; one block of 8,192 tokens
per forward, 3,206-token units, as moe-capture cuts them), each block in the writer's shared
memory as moe-capture's device puts it there (``shared_rows``; the copy in is not timed). Per
pass it reports the CPU of the calling thread inside ``write`` per forward, the CPU of the whole
capturing process per forward (the writer's threads too: they hold the interpreter lock that the
model's thread needs), and the CPU of the writer's processes per unit (from /proc; after an
untimed pass that starts them; ``--passes`` passes, medians):

    python -m traces.capture.writer_cost --forwards 24 --passes 3

``--join-units N`` also times the joiner's work per unit (:func:`join_ms`), with its threads
hashing the large columns and without, unit by unit alternately. ``--close-passes N`` times the
close of N passes of ``--forwards`` paced forwards (:func:`close_ms`), the writer told the
tokens to come (``expected_tokens``) and not, pass by pass alternately.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from traces.synth import synth_trace

LAYERS, EXPERTS, TOP_K, TOP_R, FORWARD, WINDOW, UNIT = 8, 512, 10, 64, 8192, 512, 3206


def _stored_rows(tokens: int) -> tuple:
    """(meta, columns) of ``tokens`` synthetic tokens of the shape, as moe-capture stores them."""
    meta, ch = synth_trace(tokens=tokens, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=0, logits="full",
                           seq_tokens=WINDOW, prompt_tokens=WINDOW, prompt_share=1.0)
    meta = replace(meta, logits_top_r=TOP_R)
    ids = np.argsort(-ch.logits, axis=-1, kind="stable")[..., :TOP_R]
    rows = dict(seq=ch.seq, pos=ch.pos, phase=ch.phase, experts=ch.experts.astype(np.int16), weights=ch.gates,
                logits=np.take_along_axis(ch.logits, ids, -1).astype(np.float16), logit_ids=ids.astype(np.int16),
                token_id=ch.token_id, nll=ch.nll)
    return meta, {k: v for k, v in rows.items() if v is not None}


def join_ms(units: int) -> dict[str, list[float]]:
    """Wall ms of the joiner's work on each of ``units`` units (its part copied into the output,
    its stored columns hashed where an encoder left them), in this process: the large columns
    hashed on the joiner's threads (``threads``, :meth:`traces.format.ContentHash.submit`) and
    every column in turn (``in turn``), unit by unit alternately."""
    from traces.capture.writer import _Join, _join_request, _stored_block, _write_part

    meta, rows = _stored_rows(UNIT)
    times: dict[str, list[float]] = {"threads": [], "in turn": []}
    state = _Join()
    pool = state.pool
    with tempfile.TemporaryDirectory() as folder:
        _join_request(state, ("open", str(Path(folder) / "joined.parquet"), meta))
        try:
            for i in range(units):
                part = Path(folder) / f"unit{i}.parquet"
                _write_part(part, meta, UNIT, None, rows)
                request = ("append", str(part), ("block", _stored_block(rows)))
                mode = "threads" if i % 2 else "in turn"
                state.pool = pool if mode == "threads" else None  # None: every column hashed in turn
                start = time.perf_counter()
                _join_request(state, request)
                times[mode].append(1e3 * (time.perf_counter() - start))
        finally:
            _join_request(state, ("end", False))
            pool.shutdown()
    return times


def _filled(writer, rows: dict[str, np.ndarray], forward: int) -> dict[str, np.ndarray]:
    """Forward ``forward``'s rows (``rows`` with its sequences' numbers) in the writer's shared
    memory, as moe-capture's device puts them there; plain arrays where /dev/shm has no room."""
    block = writer.block({name: (v.dtype, v.shape) for name, v in rows.items()})
    views = block.views if block else {name: np.empty_like(v) for name, v in rows.items()}
    for name, view in views.items():
        view[...] = rows[name]
    views["seq"] += forward * (FORWARD // WINDOW)
    return views


def close_ms(passes: int, forwards: int, workers: int, pace_s: float = 0.1) -> dict[str, list[float]]:
    """Wall ms of moe-capture's writer's close (the last write's return to the file closed), told
    the pass's tokens (``expected_tokens``: the last write cuts its units one per encoder) and not,
    pass by pass alternately. A forward's rows come every ``pace_s`` seconds, as a model's would,
    so that the encoders keep up and the close waits for the last write's units, not a backlog."""
    from traces.capture.capture import open_writer

    meta, rows = _stored_rows(FORWARD)
    times: dict[str, list[float]] = {"not told": [], "told": []}
    with tempfile.TemporaryDirectory() as folder:
        with open_writer(Path(folder) / "warm.parquet", meta, workers, "dispatcher", UNIT) as writer:
            writer.write(**rows)  # not timed: the processes start, load their kernels
        for n in range(passes):
            mode = "told" if n % 2 else "not told"
            path = Path(folder) / f"pass{n}.parquet"
            with open_writer(path, meta, workers, "dispatcher", UNIT,
                             expected_tokens=forwards * FORWARD if mode == "told" else None) as writer:
                for f in range(forwards):
                    time.sleep(pace_s)
                    writer.write(**_filled(writer, rows, f))
                end = time.perf_counter()
            times[mode].append(1e3 * (time.perf_counter() - end))
            path.unlink()
    return times


def writer_cpu(forwards: int, passes: int, workers: int, writers: tuple[str, ...] = ("processes",)) -> dict:
    """Per writer (``processes`` or ``dispatcher``; in turn, pass by pass) and pass: (CPU ms of the
    calling thread in ``write`` per forward, CPU ms of the whole capturing process per forward
    (every thread; the copy of the rows into the writer's memory left out), CPU ms of the
    writer's descendant processes per unit)."""
    from traces.capture.bench import _children_cpu
    from traces.capture.capture import open_writer

    meta, rows = _stored_rows(FORWARD)
    out: dict[str, list[tuple[float, float, float]]] = {w: [] for w in writers}
    with tempfile.TemporaryDirectory() as folder:
        for writer_kind in writers:  # not timed: the processes start, load their kernels
            with open_writer(Path(folder) / "warm.parquet", meta, workers, writer_kind, UNIT) as writer:
                writer.write(**rows)
        for n, writer_kind in itertools.product(range(passes), writers):
            spent, copying = 0.0, 0.0
            children, process = -_children_cpu(), -time.process_time()
            path = Path(folder) / f"pass{n}.parquet"
            with open_writer(path, meta, workers, writer_kind, UNIT) as writer:
                for f in range(forwards):
                    start = time.thread_time()
                    views = _filled(writer, rows, f)
                    middle = time.thread_time()
                    writer.write(**views)
                    spent += time.thread_time() - middle
                    copying += middle - start
            process += time.process_time() - copying
            children += _children_cpu()
            # removed at once (a pass of 24 forwards is 0.5 GB): where the passes' files were kept,
            # each pass's pages were memory the system had not used before, and on the development
            # machine (a virtual machine) a first touch of a page costs about 10 us, up to twice the
            # writer's CPU per unit in a run's later passes (docs/CAPTURE.md)
            path.unlink()
            out[writer_kind].append((1e3 * spent / forwards, 1e3 * process / forwards,
                                     1e3 * children / -(-forwards * FORWARD // UNIT)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m traces.capture.writer_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--forwards", type=int, default=24, help="blocks of 8,192 tokens per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="encoder processes")
    p.add_argument("--writer", default="processes,dispatcher",
                   help="processes and/or dispatcher (moe-capture's writer), comma-separated: side by side")
    p.add_argument("--close-passes", type=int, default=0,
                   help="also time the close of this many paced passes, told the tokens to come and not "
                        "(alternately); 0: not")
    p.add_argument("--join-units", type=int, default=0,
                   help="also time the joiner's work per unit over this many units, its threads hashing and not "
                        "(alternately); 0: not")
    args = p.parse_args(argv)
    if min(args.forwards, args.passes, args.workers) < 1 or min(args.join_units, args.close_passes) < 0:
        p.error("--forwards, --passes and --workers must be at least 1, --join-units and --close-passes at least 0")
    writers = tuple(args.writer.split(","))
    bad = [w for w in writers if w not in ("processes", "dispatcher")]
    if bad:
        p.error(f"--writer {bad[0]} is not valid; choose from: processes, dispatcher")
    for writer, cpu in writer_cpu(args.forwards, args.passes, args.workers, writers).items():
        thread, process, children = zip(*cpu, strict=True)
        print(f"{writer}: CPU per 8,192-token forward of the writing thread {_listed(thread)} ms, of the "
              f"capturing process {_listed(process)} ms; of the writer's child processes per {UNIT:,}-token "
              f"unit {_listed(children, 1)} ms")
    if args.close_passes:
        for mode, ms in close_ms(args.close_passes, args.forwards, args.workers).items():
            print(f"close, the writer {mode} the pass's tokens: wall ms, median of {len(ms)} "
                  f"{statistics.median(ms):.1f} (range {min(ms):.1f}-{max(ms):.1f})")
    if args.join_units:
        for mode, ms in join_ms(args.join_units).items():
            print(f"joiner, columns hashed {mode}: wall ms per {UNIT:,}-token unit, median of {len(ms)} "
                  f"{statistics.median(ms):.2f} (range {min(ms):.2f}-{max(ms):.2f})")


def _listed(values, digits: int = 2) -> str:
    return f"{', '.join(f'{x:.{digits}f}' for x in values)} (median {statistics.median(values):.{digits}f})"


if __name__ == "__main__":
    main()
