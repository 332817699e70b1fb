"""How fast a trace decodes, side by side in one run: ``python -m traces.bench_decode``.

Writes a synthetic trace of the Qwen3-Next shape (48 MoE layers x 512 experts, top-10, full
router logits; ``--tokens`` 5,000 by default) with ``moe-trace synth`` into a temporary
directory, a copy with compact logits (``fixed_size_list<float16>``, byte-stream-split and zstd:
the encoding every earlier version wrote), and the trace cache's copy; then prints, per way of
reading, the median over ``--repeats`` passes of CPU and wall milliseconds per 1,000 tokens for
one full pass of ``iter_chunks`` (page checksums verified).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from traces.format import TraceChunk, open_trace, read_trace, repack_trace

SHAPE = ["--layers", "48", "--experts", "512", "--top-k", "10", "--seed", "1", "--logits", "full"]


def _timed(make: Callable[[], Iterator[TraceChunk]], tokens: int, repeats: int) -> tuple[float, float]:
    """Median CPU and wall ms per 1k tokens of draining ``make()``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        seen = sum(chunk.num_tokens for chunk in make())
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        assert seen == tokens
    return (statistics.median(cpu) * 1e6 / tokens, statistics.median(wall) * 1e6 / tokens)


def main(argv: list[str] | None = None) -> int:
    """Print the side-by-side table; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m traces.bench_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=5000, help="tokens of the synthetic trace")
    parser.add_argument("--repeats", type=int, default=5, help="passes per row (the median is shown)")
    args = parser.parse_args(argv)
    from simulator.trace_cache import cached_source
    from traces.cli import main as moe_trace

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        new, old = Path(tmp) / "new.parquet", Path(tmp) / "old.parquet"
        if moe_trace(["synth", str(new), "--tokens", str(args.tokens), *SHAPE]):
            return 2
        repack_trace(new, old, compact_logits=True)
        cache = cached_source(new, Path(tmp) / "cache")
        cache.build()
        for _ in cache.iter_chunks(logits=False, order_r=64):  # keeps logit_order for R = 64
            pass
        n, reader, legacy = cache.num_tokens, open_trace(new), open_trace(old)
        logits_bytes = n * 48 * 512 * 2
        cache_bytes = sum(p.stat().st_size for p in cache.directory.glob("*.npy"))
        rows = [
            ("Parquet, compact logits (list<float16>, BSS + zstd)", lambda: legacy.iter_chunks()),
            ("Parquet, fixed_size_binary + lz4 (the default)", lambda: reader.iter_chunks()),
            ("Parquet, compact encoding, logits=False", lambda: legacy.iter_chunks(logits=False)),
            ("Parquet, logits=False", lambda: reader.iter_chunks(logits=False)),
            ("trace cache, float16 + lookup table", lambda: cache.iter_chunks()),
            ("trace cache, logits=False", lambda: cache.iter_chunks(logits=False)),
            ("trace cache, logits=False, order_r=64 (kept)", lambda: cache.iter_chunks(logits=False, order_r=64)),
        ]
        assert read_trace(old)[1].logits.tobytes() == read_trace(new)[1].logits.tobytes()
        print(f"{n:,} tokens, 48 layers x 512 experts, top-10, full logits; medians of {args.repeats} passes")
        print(f"files: compact logits {old.stat().st_size / 2**20:.1f} MiB, default "
              f"{new.stat().st_size / 2**20:.1f} MiB; trace cache {cache_bytes / 2**20:.1f} MiB "
              f"({cache_bytes / logits_bytes:.1%} of the float16 logits, with order_r=64 kept)")
        print(f"| {'decode':<52} | CPU ms / 1k tokens | wall ms / 1k tokens |")
        print(f"|{'-' * 54}|--------------------|---------------------|")
        for name, make in rows:
            cpu, wall = _timed(make, n, args.repeats)
            print(f"| {name:<52} | {cpu:18.1f} | {wall:19.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
