"""How fast a moe-sim multirun goes through its jobs, per Hydra launcher, side by side.

``python -m simulator.bench_sweep`` writes a synthetic full-logit trace (``moe-trace synth ...
--logits full``; default 10,000 tokens of the Qwen3-Next shape, 48 layers x 512 experts x
top-10) and a 1-token trace of the same shape, then runs the same sweep (5 policies x 8 cache
fractions = 40 configurations) through ``moe-sim -m`` with each launcher: the basic launcher,
joblib (one process per core) and the default (the in-process launcher, simulator/launcher.py).
Every sweep starts from an empty trace cache, so each reads its trace from Parquet.

It prints two Markdown tables:

- configurations per minute of wall time, the sweep's CPU time (its processes and their
  children) and whether every job's summary equals the basic launcher's (timing fields aside);
- the fixed cost of a sweep and of each job: the sweep over the 1-token trace with all 40
  configurations and with one, ``per job = (wall_40 - wall_1) / 39`` and ``per sweep = wall_1 -
  per job`` (start-up, imports, compose, kernel load, exit).

Runs take minutes: the basic launcher decodes the trace once per job.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from simulator.bench import _table
from simulator.engine.many import default_workers
from traces.atomic import atomic_write_text

POLICIES = ("fetch_all", "rule015", "first_choice", "quality_first", "speed_first")
FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
LAUNCHERS = ("basic", "joblib", "default")
TARGET_CONFIGS_PER_MIN = 150  # the 40-configuration sweep, default launcher, 2 cores
TIMING_FIELDS = ("sim_seconds",)  # summary fields that differ between runs of one config


def launcher_overrides(launcher: str, workers: int) -> list[str]:
    """moe-sim overrides selecting ``launcher`` ('default': none, the in-process launcher)."""
    if launcher == "default":
        return []
    if launcher == "joblib":
        return ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={workers}"]
    return [f"hydra/launcher={launcher}"]


def synth(path: Path, tokens: int, layers: int, experts: int, top_k: int) -> None:
    """A synthetic full-logit trace through the moe-trace command."""
    cmd = [sys.executable, "-m", "traces.cli", "synth", str(path), "--tokens", str(tokens),
           "--layers", str(layers), "--experts", str(experts), "--top-k", str(top_k),
           "--seed", "1", "--logits", "full", "--prompt-share", "0"]  # decode only: a 1-token trace too
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def run_sweep(trace: Path, sweep_dir: Path, launcher: str, workers: int,
              policies: tuple[str, ...], fractions: tuple[float, ...]) -> dict:
    """One ``moe-sim -m`` sweep from an empty trace cache: wall and CPU seconds, summaries."""
    env = dict(os.environ, MOE_SIM_CACHE=str(sweep_dir.with_name(sweep_dir.name + "-cache")))
    cmd = [sys.executable, "-m", "simulator.run", "-m", f"trace.path={trace}",
           f"policy={','.join(policies)}", f"cache.fraction={','.join(map(str, fractions))}",
           f"hydra.sweep.dir={sweep_dir}", "progress=false",
           *launcher_overrides(launcher, workers)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    jobs = len(policies) * len(fractions)
    summaries = [sweep_dir / str(n) / "summary.json" for n in range(jobs)]
    if proc.returncode != 0 or not all(p.exists() for p in summaries):
        raise RuntimeError(f"the {launcher} sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.rmtree(env["MOE_SIM_CACHE"], ignore_errors=True)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    target = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.launcher._target_
    results = [{k: v for k, v in json.loads(p.read_text()).items() if k not in TIMING_FIELDS}
               for p in summaries]
    return {"jobs": jobs, "wall_s": wall, "cpu_s": cpu, "summaries": results,
            "launcher_class": target.rsplit(".", 1)[-1]}


def measure(work_dir: Path, tokens: int, layers: int, experts: int, top_k: int,
            launchers: tuple[str, ...], repeats: int) -> dict:
    """Every sweep of the report (medians of ``repeats``); returns the figures."""
    workers = default_workers()
    trace, one = work_dir / "trace.parquet", work_dir / "one_token.parquet"
    _say(f"writing a {tokens}-token trace ({layers} x {experts} x top-{top_k}, full logits)")
    synth(trace, tokens, layers, experts, top_k)
    synth(one, 1, layers, experts, top_k)
    figures = {"tokens": tokens, "shape": [layers, experts, top_k], "workers": workers,
               "repeats": repeats, "launchers": {}}
    for launcher in launchers:
        runs = {"sweep": [], "one_token": [], "one_job": []}
        for rep in range(repeats):
            _say(f"{launcher}: 40-configuration sweep, run {rep + 1} of {repeats}")
            runs["sweep"].append(run_sweep(trace, work_dir / f"{launcher}-{rep}", launcher,
                                           workers, POLICIES, FRACTIONS))
            _say(f"{launcher}: fixed costs (1-token trace)")
            runs["one_token"].append(run_sweep(one, work_dir / f"{launcher}-one-{rep}", launcher,
                                               workers, POLICIES, FRACTIONS))
            runs["one_job"].append(run_sweep(one, work_dir / f"{launcher}-job-{rep}", launcher,
                                             workers, POLICIES[:1], FRACTIONS[:1]))
        figures["launchers"][launcher] = {
            "wall_s": _median(runs["sweep"], "wall_s"),
            "cpu_s": _median(runs["sweep"], "cpu_s"),
            "jobs": runs["sweep"][0]["jobs"],
            "launcher_class": runs["sweep"][0]["launcher_class"],
            "summaries": runs["sweep"][0]["summaries"],
            "one_token_wall_s": _median(runs["one_token"], "wall_s"),
            "one_token_cpu_s": _median(runs["one_token"], "cpu_s"),
            "one_job_wall_s": _median(runs["one_job"], "wall_s"),
            "one_job_cpu_s": _median(runs["one_job"], "cpu_s"),
        }
    return figures


def _median(runs: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def render(figures: dict) -> str:
    """The two Markdown tables of the module docstring."""
    layers, experts, top_k = figures["shape"]
    launchers = figures["launchers"]
    reference = launchers.get("basic", next(iter(launchers.values())))["summaries"]
    rows, fixed = [], []
    for name, f in launchers.items():
        label = f"{name} ({f['launcher_class']})"
        jobs = f["jobs"]
        equal = ("yes" if f["summaries"] == reference else "NO") if "basic" in launchers else "basic not run"
        rows.append([label, f"{jobs / f['wall_s'] * 60:.1f}", f"{f['wall_s']:.1f}",
                     f"{f['cpu_s']:.1f}", f"{f['cpu_s'] / jobs:.2f}", equal])
        per_job = (f["one_token_wall_s"] - f["one_job_wall_s"]) / (jobs - 1)
        per_job_cpu = (f["one_token_cpu_s"] - f["one_job_cpu_s"]) / (jobs - 1)
        fixed.append([label, f"{f['one_job_wall_s'] - per_job:.2f}", f"{per_job:.3f}",
                      f"{per_job_cpu:.3f}"])
    return "\n".join([
        f"Sweep of {len(POLICIES)} policies x {len(FRACTIONS)} cache fractions over a "
        f"{figures['tokens']:,}-token full-logit trace ({layers} x {experts} x top-{top_k}), "
        f"{figures['workers']} usable cores, each sweep from Parquet (empty trace cache):",
        "",
        _table(["launcher", "configs/min", "wall s", "CPU s", "CPU s/config",
                "results equal basic's"], rows),
        "",
        "Fixed cost (the same sweep over a 1-token trace, and a sweep of one job):",
        "",
        _table(["launcher", "per sweep, wall s", "per job, wall s", "per job, CPU s"], fixed),
    ])


def _say(msg: str) -> None:
    print(f"[bench_sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m simulator.bench_sweep",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000, help="tokens of the swept trace")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma-separated, of {', '.join(LAUNCHERS)} (default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per figure (medians)")
    ap.add_argument("--work-dir", help="scratch directory, kept (default: a temporary one, removed)")
    ap.add_argument("--json", help="also write the figures as JSON here")
    ap.add_argument("--out", help="also write the tables as a Markdown page here (docs/SWEEPS.md)")
    args = ap.parse_args(argv)
    launchers = tuple(args.launchers.split(","))
    unknown = sorted(set(launchers) - set(LAUNCHERS))
    if unknown or args.repeats < 1 or args.tokens < 1:
        ap.error(f"--launchers takes {', '.join(LAUNCHERS)}; --repeats and --tokens >= 1")
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="moe-bench-sweep-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures = measure(work_dir, args.tokens, args.layers, args.experts, args.top_k,
                          launchers, args.repeats)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(figures, indent=1))
    tables = render(figures)
    if args.out:
        atomic_write_text(args.out, page(figures, tables, argv if argv is not None else sys.argv[1:]))
    print(tables)


def page(figures: dict, tables: str, argv: list[str]) -> str:
    """docs/SWEEPS.md: how it was made, the target and whether the default launcher meets it."""
    from simulator.bench import _kernel_commit

    default = figures["launchers"].get("default")
    verdict = ""
    if default:
        rate = default["jobs"] / default["wall_s"] * 60
        verdict = (f" The default launcher: {rate:.1f} configurations per minute, "
                   f"{rate / TARGET_CONFIGS_PER_MIN:.2f}x the target ({'met' if rate >= TARGET_CONFIGS_PER_MIN else 'not met'}).")
    return "\n".join([
        "# Sweep throughput", "",
        f"Generated by `python -m simulator.bench_sweep {' '.join(argv)}` (part of `make bench`) at "
        f"commit {_kernel_commit(('..',))}, {time.strftime('%Y-%m-%d %H:%M')}; do not edit by hand. "
        f"Medians of {figures['repeats']} sweeps. Target: {TARGET_CONFIGS_PER_MIN} configurations per "
        f"minute with the default launcher on 2 cores.{verdict}", "",
        tables, ""])


if __name__ == "__main__":
    main()
