"""Where an encoder's CPU goes: one unit of moe-capture's rows written as a part file (what each
encoder process does per unit) with the trace format's Parquet settings and with one of them
left out at a time, and what LZ4 saves on logits a real model produced.

The rows are ``traces.capture.writer_cost``'s: 3,206 tokens of the small Qwen3-Next shape at
batch 16 with top-64 logits and ids, synthetic (random bytes to LZ4). The settings are tried in
turn within each round; CPU time of this process, medians over the rounds. LZ4 on real logits:
the column sizes that the bundled capture ``traces/samples/fixture2.parquet`` (a trained 8 x 512
model, top-32 logits) records in its footer. From the repository root:

    PYTHONPATH=. python docs/capture/encode_options.py [--rounds 21]

Results: docs/CAPTURE.md (2026-12-07, the encoders' CPU).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from traces import format as trace_format
from traces.capture.writer import _write_part
from traces.capture.writer_cost import UNIT, _stored_rows

FIXTURE = Path(__file__).resolve().parents[2] / "traces" / "samples" / "fixture2.parquet"


def _without(**changes):
    """The format's Parquet settings with ``changes`` (a value, or a function of the old one)."""
    def options(schema):
        o = DEFAULT(schema)
        o.update({k: v(o[k]) if callable(v) else v for k, v in changes.items()})
        return o
    return options


DEFAULT = trace_format.parquet_options
SETTINGS = {
    "the format's settings": DEFAULT,
    "no page checksums": _without(write_page_checksum=False),
    "binary columns uncompressed": _without(
        compression=lambda c: {k: "none" if v == "lz4" else v for k, v in c.items()}),
    "nothing compressed, no checksums": _without(compression="none", write_page_checksum=False,
                                                  use_byte_stream_split=False, use_dictionary=False),
}


def lz4_on_real_logits(path: Path = FIXTURE) -> tuple[int, int]:
    """(compressed, uncompressed) bytes of the LZ4 logits column of a bundled capture."""
    meta = pq.ParquetFile(path).metadata
    columns = [meta.row_group(g).column(i) for g in range(meta.num_row_groups) for i in range(meta.num_columns)]
    logits = [c for c in columns if c.path_in_schema == "logits" and c.compression == "LZ4"]
    if not logits:
        raise SystemExit(f"{path}: no LZ4 logits column")
    return sum(c.total_compressed_size for c in logits), sum(c.total_uncompressed_size for c in logits)


def main() -> None:
    p = argparse.ArgumentParser(prog="docs/capture/encode_options.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=21)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    meta, rows = _stored_rows(UNIT)
    cpu: dict[str, list[float]] = {name: [] for name in SETTINGS}
    size: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for r in range(args.rounds + 1):  # the first round warms up, untimed
                for i, (name, options) in enumerate(SETTINGS.items()):
                    trace_format.parquet_options = options
                    part = Path(folder) / f"part{i}.parquet"
                    start = time.process_time()
                    _write_part(part, meta, UNIT, None, rows)
                    if r:
                        cpu[name].append(time.process_time() - start)
                    size[name] = part.stat().st_size
    finally:
        trace_format.parquet_options = DEFAULT
    raw = sum(v.nbytes for v in rows.values())
    print(f"one unit: {UNIT:,} tokens, {raw / 2**20:.1f} MiB of rows (small Qwen3-Next shape, top-64 logits, "
          f"synthetic); CPU ms, medians of {args.rounds} rounds")
    base = statistics.median(cpu["the format's settings"])
    for name, xs in cpu.items():
        m = statistics.median(xs)
        print(f"{name:34s} {m * 1e3:6.1f} ms ({m / base:.2f}x)  file {size[name] / 2**20:5.2f} MiB")
    packed, plain = lz4_on_real_logits()
    print(f"LZ4 on the logits of {FIXTURE.name}: {packed / 2**20:.2f} MiB of {plain / 2**20:.2f} MiB "
          f"({1 - packed / plain:.0%} saved)")


if __name__ == "__main__":
    main()
