"""What one unit of the writer's work costs in its primitives on this host: the memory copy, the
SHA-256 of the content hash, the CRC-32 of Parquet's page checksums and LZ4, each on the bytes
of one unit of the small Qwen3-Next shape at batch 16 (3,206 tokens x 8 MoE layers of top-64
float16 logits and int16 ids, about 6.3 MiB of the unit's 8 MiB), one at a time, in this
process's one thread (CPU time, medians of ``--rounds``). Also what the host says of its CPU
(model, flags that these primitives use, the topology the guest sees).

The writer's processes spent 47-60 ms of CPU per unit on the GPU hosts against 22 ms on the
2-core development machine (docs/CAPTURE.md); run on both, this tells whether the primitives
themselves are slower there, or the same work runs slower beside the capture. From the
repository root:

    python docs/capture/host_primitives.py [--rounds 21] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

TOKENS, LAYERS, TOP_R = 3206, 8, 64
FLAGS = ("sha_ni", "avx2", "avx512f", "avx512bw", "pclmulqdq", "erms", "fsrm", "hypervisor")


def _cpu() -> dict:
    """Model name, MHz, the flags of :data:`FLAGS` present, CPUs and threads per core as the guest sees them."""
    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "openssl": __import__("ssl").OPENSSL_VERSION}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    info.update(model=fields.get("model name"), mhz=fields.get("cpu MHz"),
                cache=fields.get("cache size"), flags=[f for f in FLAGS if f in flags],
                siblings=fields.get("siblings"), cores=fields.get("cpu cores"))
    return info


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(1e3 * (time.process_time() - start))
    return round(statistics.median(times), 3)


def measure(rounds: int) -> dict:
    """ms of CPU per unit for each primitive (medians of ``rounds``), and the bytes it worked on."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((TOKENS, LAYERS, TOP_R)).astype(np.float16)
    ids = rng.integers(0, 512, (TOKENS, LAYERS, TOP_R)).astype(np.int16)
    data = np.concatenate([logits.view(np.uint8).ravel(), ids.view(np.uint8).ravel()])
    out = np.empty_like(data)
    raw = data.tobytes()
    buf = pa.py_buffer(raw)
    _median_ms(lambda: pa.compress(buf, codec="lz4_raw"), 3)  # codec loaded outside the timings
    ms = {
        "copy": _median_ms(lambda: np.copyto(out, data), rounds),
        "sha256": _median_ms(lambda: hashlib.sha256(raw).digest(), rounds),
        "crc32": _median_ms(lambda: zlib.crc32(raw), rounds),
        "lz4 compress": _median_ms(lambda: pa.compress(buf, codec="lz4_raw"), rounds),
    }
    packed = pa.compress(buf, codec="lz4_raw")
    ms["lz4 decompress"] = _median_ms(
        lambda: pa.decompress(packed, decompressed_size=len(raw), codec="lz4_raw"), rounds)
    return {"bytes": len(raw), "ms": ms,
            "GB/s": {k: round(len(raw) / v / 1e6, 2) if v else None for k, v in ms.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", type=Path, help="also write the result here as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds={args.rounds} must be at least 1")
    if args.out is not None and not args.out.parent.is_dir():
        raise SystemExit(f"error: --out {args.out}: folder {args.out.parent} does not exist; create it first")
    result = {"cpu": _cpu(), "rounds": args.rounds, **measure(args.rounds)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
