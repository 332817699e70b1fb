"""Two checkouts of the simulator side by side: each policy's time over the minimal kernel's.

Processes alternate between the trees (before, after, before, ...). Each process runs the
minimal fetch_all + LRU kernel (simulator.yardstick.lru_hits) and the policies in rounds on one
synthetic trace from the trace cache, and reports each policy's median over the minimal kernel's
time in the same process, which takes out most of the shared machine's drift. Hits are checked
equal between the trees.

From the repository root, with a second checkout of the commit to compare against:
``git worktree add /tmp/before <commit>`` then
``python docs/bench/trees_side_by_side.py /tmp/before .`` (defaults: the Qwen3-Next shape, 4,096
tokens, 3 processes per tree of 7 rounds). Results: the "Unsigned indices" note of
docs/BENCHMARKS.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = "fetch_all+lru,rule015+lru,quality_first,fetch_all+lfu"


def worker(trace: str, cache: str, policies: list[str], rounds: int) -> dict:
    """Run in a process whose ``simulator`` is one tree's: medians over the minimal kernel."""
    import statistics

    import numpy as np

    from simulator.bench import POLICIES as ROWS
    from simulator.bench import _timed, sim_params
    from simulator.engine import read_options, simulate
    from simulator.trace_cache import cached_source
    from simulator.yardstick import lru_hits

    source = cached_source(trace, cache)
    meta = source.meta
    params = {n: sim_params(meta, ROWS[n] + ["model=qwen3_next_80b_a3b"]) for n in policies}
    first = params[policies[0]]
    capacity = int(first.pool_budget_bytes[0] // int(first.expert_bytes[0]))
    experts = np.concatenate([c.experts for c in source.iter_chunks(**read_options(first, source))])
    lru_hits(experts, meta.num_experts, capacity)  # compiled or loaded, not timed
    hits = {n: int(simulate(source, p).layer_hits.sum()) for n, p in params.items()}
    minimal, cpu = [], {n: [] for n in policies}
    for _ in range(rounds):
        minimal.append(_timed(lambda: lru_hits(experts, meta.num_experts, capacity))[1])
        for n, p in params.items():
            cpu[n].append(_timed(lambda p=p: simulate(source, p))[1])
    import simulator

    ratios = {n: statistics.median([b / a for a, b in zip(minimal, cpu[n], strict=True)]) for n in policies}
    return {"simulator": os.path.dirname(simulator.__file__), "hits": hits, "over_minimal": ratios}


def main() -> None:
    p = argparse.ArgumentParser(prog="docs/bench/trees_side_by_side.py", description=__doc__.split("\n\n")[0])
    p.add_argument("before", nargs="?", help="checkout of the tree to compare against")
    p.add_argument("after", nargs="?", help="checkout of the changed tree")
    p.add_argument("--processes", type=int, default=3, help="processes per tree")
    p.add_argument("--rounds", type=int, default=7, help="rounds per process")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the synthetic trace")
    p.add_argument("--policies", default=POLICIES, help="comma-separated rows of simulator.bench.POLICIES")
    p.add_argument("--worker", nargs=3, metavar=("TRACE", "CACHE", "POLICIES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        trace, cache, policies = args.worker
        print(json.dumps(worker(trace, cache, policies.split(","), args.rounds)))
        return
    for name in ("before", "after"):
        if getattr(args, name) is None or not (Path(getattr(args, name)) / "simulator" / "engine").is_dir():
            p.error(f"{name}={getattr(args, name)}: not a checkout of this project (no simulator/engine)")
    if min(args.processes, args.rounds, args.tokens) < 1:
        p.error("--processes, --rounds and --tokens must be at least 1")
    from simulator.bench import POLICIES as ROWS

    policies = args.policies.split(",")
    unknown = [n for n in policies if n not in ROWS]
    if unknown:
        p.error(f"--policies: {', '.join(unknown)} not known; choose from {', '.join(ROWS)}")
    from traces.synth import write_synth_trace

    results = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as work:
        trace = os.path.join(work, "trace.parquet")
        write_synth_trace(trace, args.tokens, 48, 512, 10, seed=0, logits="full", prompt_share=0.0)
        for i in range(args.processes):
            for name in ("before", "after"):
                tree = os.path.abspath(getattr(args, name))
                env = dict(os.environ, PYTHONPATH=tree)
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds", str(args.rounds),
                                      "--worker", trace, os.path.join(work, "cache"), ",".join(policies)],
                                     cwd=tree, env=env, capture_output=True, text=True)
                if run.returncode:
                    sys.exit(f"trees_side_by_side.py: the {name} tree failed: "
                             f"{(run.stderr.strip().splitlines() or ['no output'])[-1]}")
                result = json.loads(run.stdout.strip().splitlines()[-1])
                if os.path.realpath(result["simulator"]) != os.path.realpath(os.path.join(tree, "simulator")):
                    sys.exit(f"trees_side_by_side.py: the {name} process imported {result['simulator']}, "
                             f"not {tree}'s simulator")
                results[name].append(result)
                print(f"process {i + 1}/{args.processes}, {name}: done", file=sys.stderr)
    if any(r["hits"] != results["before"][0]["hits"] for rs in results.values() for r in rs):
        sys.exit("trees_side_by_side.py: the trees' hits differ; the comparison is void")
    print("| policy | before / minimal kernel | after / minimal kernel |")
    print("|---|---|---|")
    for n in policies:
        cells = []
        for name in ("before", "after"):
            values = sorted(r["over_minimal"][n] for r in results[name])
            cells.append(f"{values[0]:.2f}-{values[-1]:.2f}x")
        print(f"| {n} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
