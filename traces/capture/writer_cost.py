"""CPU the trace writer costs: the thread that hands it the rows, and its child processes (no GPU, no torch).

Feeds :class:`traces.capture.writer.ParallelTraceWriter` synthetic rows of the small Qwen3-Next
shape at batch 16 (8 MoE layers, 512 experts, top-10, top-64 logits; one block of 8,192 tokens
per forward, 3,206-token units, as moe-capture cuts them), each block in the writer's shared
memory as moe-capture's device puts it there (``shared_rows``; the copy in is not timed). Per
pass it reports the CPU seconds of the calling thread inside ``write`` per forward, and the CPU
of the encoder and joiner processes per unit (from /proc; after an untimed pass that starts
them; ``--passes`` passes, medians):

    python -m traces.capture.writer_cost --forwards 24 --passes 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from traces.capture.writer import ParallelTraceWriter
from traces.synth import synth_trace

LAYERS, EXPERTS, TOP_K, TOP_R, FORWARD, WINDOW, UNIT = 8, 512, 10, 64, 8192, 512, 3206


def writer_cpu(forwards: int, passes: int, workers: int) -> list[tuple[float, float]]:
    """Per pass: (CPU ms of the calling thread in ``write`` per forward, CPU ms of the writer's
    child processes per unit)."""
    from traces.capture.bench import _children_cpu

    meta, ch = synth_trace(tokens=FORWARD, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=0, logits="full",
                           seq_tokens=WINDOW, prompt_tokens=WINDOW, prompt_share=1.0)
    meta = replace(meta, logits_top_r=TOP_R)
    ids = np.argsort(-ch.logits, axis=-1, kind="stable")[..., :TOP_R]
    rows = dict(seq=ch.seq, pos=ch.pos, phase=ch.phase, experts=ch.experts.astype(np.int16), weights=ch.gates,
                logits=np.take_along_axis(ch.logits, ids, -1).astype(np.float16), logit_ids=ids.astype(np.int16),
                token_id=ch.token_id, nll=ch.nll)
    rows = {k: v for k, v in rows.items() if v is not None}
    columns = {k: (v.dtype, v.shape) for k, v in rows.items()}
    out = []
    with tempfile.TemporaryDirectory() as folder:
        with ParallelTraceWriter(Path(folder) / "warm.parquet", meta, unit_tokens=UNIT, workers=workers,
                                 processes=True) as writer:  # not timed: the processes start, load their kernels
            writer.write(**rows)
        for n in range(passes):
            spent, children = 0.0, -_children_cpu()
            with ParallelTraceWriter(Path(folder) / f"pass{n}.parquet", meta, unit_tokens=UNIT, workers=workers,
                                     processes=True) as writer:
                for f in range(forwards):
                    block = writer.block(columns)  # None where /dev/shm has no room: plain arrays
                    views = block.views if block else {name: np.empty_like(v) for name, v in rows.items()}
                    for name, view in views.items():
                        view[...] = rows[name]
                    views["seq"] += f * (FORWARD // WINDOW)
                    start = time.thread_time()
                    writer.write(**views)
                    spent += time.thread_time() - start
            children += _children_cpu()
            out.append((1e3 * spent / forwards, 1e3 * children / -(-forwards * FORWARD // UNIT)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m traces.capture.writer_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--forwards", type=int, default=24, help="blocks of 8,192 tokens per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="encoder processes")
    args = p.parse_args(argv)
    if min(args.forwards, args.passes, args.workers) < 1:
        p.error("--forwards, --passes and --workers must be at least 1")
    cpu = writer_cpu(args.forwards, args.passes, args.workers)
    thread, children = [x for x, _ in cpu], [y for _, y in cpu]
    print(f"CPU of the writing thread per 8,192-token forward: {', '.join(f'{x:.2f}' for x in thread)} ms "
          f"(median {statistics.median(thread):.2f} ms)")
    print(f"CPU of the encoder and joiner processes per {UNIT:,}-token unit: "
          f"{', '.join(f'{y:.1f}' for y in children)} ms (median {statistics.median(children):.1f} ms)")


if __name__ == "__main__":
    main()
