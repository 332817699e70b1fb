"""The trace writer's CPU per unit in two trees, side by side: ``python -m traces.capture.writer_cost``
run in each tree's folder in turn (which goes first alternates by round), each run a process of
its own with its own writer processes. Per round and tree the median over the run's passes of
the writer's child processes' CPU per unit; then the median of the rounds' ratios (B over A).

The runs write their files in ``--tmp-dir`` (TMPDIR; default: a new folder in /dev/shm where it
has room for a run's files, else the system's temporary folder). A tree's ``writer_cost`` may leave each pass's file until the run ends (c1fba26's does),
and files on a disk then start the system's writeback within a run, which on the development
machine raised every writer process's CPU per unit 1.7x: in memory neither tree's runs pay it.

A tree is a folder holding ``traces/`` and ``simulator/`` (``git archive COMMIT traces
simulator | tar -x -C DIR``); the writer's processes start in it, so they run its code. From
the repository root:

    python docs/capture/writer_cost_ab.py OLD_TREE . --rounds 3 --workers 8 --passes 4 [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

UNIT_CPU = re.compile(r"child processes per [\d,]+-token unit ([\d.]+(?:, [\d.]+)*) \(median")


def unit_cpu(tree: Path, workers: int, passes: int, forwards: int, tmp_dir: Path | None = None) -> list[float]:
    """The writer's child processes' CPU ms per unit in each pass of one run in ``tree``, its
    files in ``tmp_dir`` (None: the system's temporary folder)."""
    command = [sys.executable, "-m", "traces.capture.writer_cost", "--writer", "dispatcher",
               "--workers", str(workers), "--passes", str(passes), "--forwards", str(forwards)]
    env = dict(os.environ, TMPDIR=str(tmp_dir)) if tmp_dir is not None else None
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False, env=env)
    found = UNIT_CPU.search(done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"error: writer_cost in {tree} failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return [float(v) for v in found.group(1).split(", ")]


FORWARD_FILE_BYTES = 21 << 20  # a pass's file per forward of writer_cost's rows (8,192 tokens: 19.8 MiB)


def run_bytes(passes: int, forwards: int) -> int:
    """The most one run's files may take: every pass's kept until the run ends, its warm-up's too."""
    return (passes + 1) * forwards * FORWARD_FILE_BYTES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="tree A (the baseline)")
    p.add_argument("b", type=Path, help="tree B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="encoder processes")
    p.add_argument("--passes", type=int, default=4, help="passes per run (the first warms the encoders)")
    p.add_argument("--forwards", type=int, default=24, help="blocks of 8,192 tokens per pass")
    p.add_argument("--out", type=Path, help="also write the result here as JSON")
    p.add_argument("--tmp-dir", type=Path, default=None,
                   help="folder for the runs' files (default: a new one in /dev/shm where there is one)")
    args = p.parse_args(argv)
    for tree in (args.a, args.b):
        if not (tree / "traces" / "capture" / "writer_cost.py").is_file():
            p.error(f"{tree} holds no traces/capture/writer_cost.py; give a folder with the tree's traces/ and simulator/")
    if min(args.rounds, args.workers, args.forwards) < 1 or args.passes < 2:
        p.error("--rounds, --workers and --forwards must be at least 1, --passes at least 2")
    if args.out is not None and not args.out.parent.is_dir():
        raise SystemExit(f"error: --out {args.out}: folder {args.out.parent} does not exist; create it first")
    if args.tmp_dir is not None and not args.tmp_dir.is_dir():
        raise SystemExit(f"error: --tmp-dir {args.tmp_dir}: not a folder; create it first")
    made = None
    if args.tmp_dir is None and Path("/dev/shm").is_dir():
        if shutil.disk_usage("/dev/shm").free >= run_bytes(args.passes, args.forwards):
            made = args.tmp_dir = Path(tempfile.mkdtemp(prefix="writer-cost-ab-", dir="/dev/shm"))
        else:
            print(f"/dev/shm has no room for a run's files: they go to {tempfile.gettempdir()}", flush=True)
    try:
        result = _rounds(args)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    print(json.dumps(result["medians"]), f"B / A: median {result['b_over_a']['median']}x, rounds {result['b_over_a']['rounds']}")
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out)


def _rounds(args) -> dict:
    """Every round's runs of both trees, and the ratios."""
    runs: dict[str, list[list[float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
            runs[key].append(unit_cpu(getattr(args, key), args.workers, args.passes, args.forwards, args.tmp_dir))
            print(f"round {r + 1} {key}: {runs[key][-1]} ms per unit", flush=True)
    # the first pass of a run warms the encoders the untimed write did not reach: left out
    medians = {k: [statistics.median(run[1:]) for run in v] for k, v in runs.items()}
    ratios = [b / a for a, b in zip(medians["a"], medians["b"], strict=True)]
    return {"trees": [str(args.a), str(args.b)], "workers": args.workers, "passes": args.passes,
            "forwards": args.forwards, "tmp_dir": str(args.tmp_dir) if args.tmp_dir else tempfile.gettempdir(),
            "ms_per_unit": runs, "medians": medians,
            "b_over_a": {"median": round(statistics.median(ratios), 3), "rounds": [round(x, 3) for x in ratios]}}


if __name__ == "__main__":
    main()
