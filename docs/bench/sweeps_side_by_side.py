"""Two checkouts of the simulator side by side: the 40-configuration sweep of ``make bench``.

The sweep of ``python -m simulator.bench_sweep`` (5 policies x 8 cache fractions over a
10,000-token full-logit trace of the Qwen3-Next shape, the default launcher, each sweep from an
empty trace cache) run by the two trees in alternation (before, after, before, ...), so both see
the same drift of a shared machine. On a VM the cost of memory the guest has not touched lately
moves a single sweep by a third; alternation with medians is what tells a change from that.
Each sweep's job summaries must be equal between the trees (timing and provenance aside).

From the repository root, with a second checkout of the commit to compare against:
``git worktree add /tmp/before <commit>`` then
``python docs/bench/sweeps_side_by_side.py /tmp/before .`` (default: 5 sweeps per tree).
"""
import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(prog="docs/bench/sweeps_side_by_side.py", description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="checkout of the tree to compare against")
    p.add_argument("after", help="checkout of the changed tree")
    p.add_argument("--sweeps", type=int, default=5, help="sweeps per tree")
    p.add_argument("--tokens", type=int, default=10_000, help="tokens of the swept trace")
    args = p.parse_args()
    trees = {}
    for name in ("before", "after"):
        tree = Path(getattr(args, name)).resolve()
        if not (tree / "simulator" / "launcher.py").is_file():
            p.error(f"{name}={tree}: not a checkout of this project with the in-process launcher")
        trees[name] = tree
    if args.sweeps < 1 or args.tokens < 1:
        p.error("--sweeps and --tokens must be at least 1")
    sys.path.insert(0, str(REPO))
    from simulator.bench_sweep import FRACTIONS, POLICIES, run_sweep, synth
    from simulator.engine.many import default_workers

    workers = default_workers()
    runs = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="sweeps-side-by-side-") as work:
        work = Path(work)
        trace, one = work / "trace.parquet", work / "one_token.parquet"
        synth(trace, args.tokens, 48, 512, 10)
        synth(one, 1, 48, 512, 10)
        for name, tree in trees.items():  # untimed: each tree compiles its kernels, or loads them
            os.chdir(tree)
            os.environ["PYTHONPATH"] = str(tree)
            run_sweep(one, work / f"{name}-warm", "default", workers, POLICIES, FRACTIONS)
        for i in range(args.sweeps):
            for name, tree in trees.items():
                os.chdir(tree)  # `python -m simulator.run` imports the tree it starts in
                os.environ["PYTHONPATH"] = str(tree)
                run = run_sweep(trace, work / f"{name}-{i}", "default", workers, POLICIES, FRACTIONS)
                runs[name].append(run)
                print(f"sweep {i + 1}/{args.sweeps}, {name}: {run['wall_s']:.1f} s wall, "
                      f"{run['cpu_s']:.1f} s CPU", file=sys.stderr)

    def comparable(run):
        return [{k: v for k, v in s.items() if k != "provenance"} for s in run["summaries"]]

    reference = comparable(runs["before"][0])
    if any(comparable(r) != reference for rs in runs.values() for r in rs):
        sys.exit("sweeps_side_by_side.py: the trees' job summaries differ; the comparison is void")
    jobs = runs["before"][0]["jobs"]
    print("| tree | sweeps | wall s (sorted) | median wall s | configs/min (median) | median CPU s |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        walls = sorted(r["wall_s"] for r in rs)
        median = statistics.median(walls)
        print(f"| {name} | {len(rs)} | {', '.join(f'{w:.1f}' for w in walls)} | {median:.1f} | "
              f"{jobs / median * 60:.1f} | {statistics.median(r['cpu_s'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
