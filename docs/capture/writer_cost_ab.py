"""The trace writer's CPU per unit in two trees, side by side: this checkout's
``traces/capture/writer_cost.py`` run in each tree's folder in turn (which goes first alternates
by round), each run a process of its own with its own writer processes, which import the tree's
code. Per round and tree the median over the run's passes of the writer's child processes' CPU
per unit; then the median of the rounds' ratios (B over A).

One measuring code for both trees: c1fba26's ``writer_cost`` left each pass's file until the run
ended, and on the development machine the writer's processes then took up to twice the CPU per
unit in a run's later passes (files on disk or in /dev/shm alike), where this one's, removing
each file after its pass, stayed level (docs/CAPTURE.md).

A tree is a folder holding ``traces/`` and ``simulator/`` (``git archive COMMIT traces
simulator | tar -x -C DIR``); the writer's processes start in it, so they run its code. From
the repository root:

    python docs/capture/writer_cost_ab.py OLD_TREE . --rounds 3 --workers 8 --passes 4 [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

WRITER_COST = Path(__file__).resolve().parents[2] / "traces" / "capture" / "writer_cost.py"
# runs a script as __main__ with the working folder first on the path: its imports are the tree's
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

UNIT_CPU = re.compile(r"child processes per [\d,]+-token unit ([\d.]+(?:, [\d.]+)*) \(median")


def unit_cpu(tree: Path, workers: int, passes: int, forwards: int) -> list[float]:
    """The writer's child processes' CPU ms per unit in each pass of one run in ``tree``."""
    command = [sys.executable, "-c", RUN_SCRIPT, str(WRITER_COST), "--writer", "dispatcher",
               "--workers", str(workers), "--passes", str(passes), "--forwards", str(forwards)]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    found = UNIT_CPU.search(done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"error: writer_cost in {tree} failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return [float(v) for v in found.group(1).split(", ")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="tree A (the baseline)")
    p.add_argument("b", type=Path, help="tree B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="encoder processes")
    p.add_argument("--passes", type=int, default=4, help="passes per run (the first warms the encoders)")
    p.add_argument("--forwards", type=int, default=24, help="blocks of 8,192 tokens per pass")
    p.add_argument("--out", type=Path, help="also write the result here as JSON")
    args = p.parse_args(argv)
    for tree in (args.a, args.b):
        if not (tree / "traces" / "capture" / "writer.py").is_file():
            p.error(f"{tree} holds no traces/capture/writer.py; give a folder with the tree's traces/ and simulator/")
    if min(args.rounds, args.workers, args.forwards) < 1 or args.passes < 2:
        p.error("--rounds, --workers and --forwards must be at least 1, --passes at least 2")
    if args.out is not None and not args.out.parent.is_dir():
        raise SystemExit(f"error: --out {args.out}: folder {args.out.parent} does not exist; create it first")
    runs: dict[str, list[list[float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
            runs[key].append(unit_cpu(getattr(args, key), args.workers, args.passes, args.forwards))
            print(f"round {r + 1} {key}: {runs[key][-1]} ms per unit", flush=True)
    # the first pass of a run warms the encoders the untimed write did not reach: left out
    medians = {k: [statistics.median(run[1:]) for run in v] for k, v in runs.items()}
    ratios = [b / a for a, b in zip(medians["a"], medians["b"], strict=True)]
    result = {"trees": [str(args.a), str(args.b)], "workers": args.workers, "passes": args.passes,
              "forwards": args.forwards, "ms_per_unit": runs, "medians": medians,
              "b_over_a": {"median": round(statistics.median(ratios), 3), "rounds": [round(x, 3) for x in ratios]}}
    print(json.dumps(result["medians"]), f"B / A: median {result['b_over_a']['median']}x, rounds {result['b_over_a']['rounds']}")
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
