"""A tour of the Python API on the bundled trace: one run, a sweep, and a moe-sim sweep read back.

    .venv/bin/python examples/api_tour.py [OUT_DIR]

Prints what each step returns; ``main()`` also returns it (tests/test_api.py runs the tour and
checks the numbers). The first 4,000 tokens of the trace keep it to well under a minute.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl

from simulator import read_sweep, simulate, sweep

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "traces" / "samples" / "fixture.parquet"
TOKENS = {"trace.max_tokens": 4000}
POLICIES = ["fetch_all", "rule015", "quality_first"]
FRACTIONS = [0.1, 0.25, 0.5]


def main(out_dir: Path) -> dict:
    """Run the tour, writing the moe-sim sweep under ``out_dir``; return its results."""
    # 1. One run: the summary (summary.json's fields), per-token and per-layer tables, the config.
    one = simulate(TRACE, policy="quality_first", **{"cache.fraction": 0.25}, **TOKENS)
    s = one.summary
    print(f"quality_first: {s['ms_per_token']:.3f} ms/token, hit rate {s['hit_rate']:.3f}, "
          f"mean mass {s['mean_mass']:.4f} on {s['provenance']['trace']['num_layers']} layers x "
          f"{s['provenance']['trace']['num_experts']} experts")
    by_domain = (one.per_token.filter(pl.col("phase") == 1)
                 .group_by("domain_name", maintain_order=True)
                 .agg(tokens=pl.len(), mass_per_token=pl.col("mass").mean()))
    print(by_domain)

    # 2. A sweep: one row per configuration, the trace decoded once for all of them.
    table = sweep(TRACE, {"policy": POLICIES, "cache.fraction": FRACTIONS}, **TOKENS)
    baseline = (table.filter(pl.col("policy") == "fetch_all")
                .select("cache.fraction", pl.col("ms_per_token").alias("fetch_all_ms")))
    speedups = (table.join(baseline, on="cache.fraction")
                .with_columns(speedup=pl.col("fetch_all_ms") / pl.col("ms_per_token"))
                .select("policy", "cache.fraction", "ms_per_token", "speedup", "hit_rate",
                        "mean_mass"))
    print(speedups)

    # 3. A moe-sim sweep on the command line, read back as one table.
    sweep_dir = out_dir / "sweep"
    subprocess.run([sys.executable, "-m", "simulator.run", "-m", f"trace.path={TRACE}",
                    "policy=fetch_all,quality_first", "cache.fraction=0.25",
                    f"trace.max_tokens={TOKENS['trace.max_tokens']}", f"hydra.sweep.dir={sweep_dir}"],
                   check=True, cwd=REPO)
    runs = read_sweep(sweep_dir)
    print(runs.select("job", "status", "policy.name", "ms_per_token", "hit_rate"))
    return {"one": one, "by_domain": by_domain, "table": table, "speedups": speedups, "runs": runs}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
