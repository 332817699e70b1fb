"""How far the capture bench's overhead figures can be trusted: 95 % bootstrap intervals over the
rounds of saved results (``python -m traces.capture.bench --out``), as the bench now computes
them for each new run (``traces.capture.bench.overhead_interval``; results that hold them are
shown as stored, older ones recomputed from their rounds as saved, to the millisecond). One
Markdown row per run, named by its file and, where the result records it, the commit of the
capture code it timed (found by its sources' fingerprint where this checkout's history has it);
with ``--pooled``, a last row for all of them together
(``traces.capture.bench.pooled_overhead``: the mean of the runs' figures, its interval drawn over
runs and then rounds), where every run has the same setting.

From the repository root: ``PYTHONPATH=. python docs/capture/intervals.py docs/capture/bench_1205t_b16.json ...``
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from traces.capture.bench import _by_round, _span, overhead_interval, pooled_overhead
from traces.errors import InputError
from traces.provenance import find_commit


def _runs(path: Path, where: dict[str, str] | None = None) -> list[tuple[dict, dict]]:
    """(result, run) of each run of a saved result whose settings match ``where`` (:func:`parse_where`);
    a run's rounds, where it kept them, are one number per round for each pass."""
    try:
        bench = json.loads(path.read_text())
        runs = [(bench, r) for r in bench["runs"]]
        for _, r in runs:
            if {"forward", "hooks", "capture"} <= r.get("rounds_s", {}).keys():
                rounds = [[float(x) for x in r["rounds_s"][name]] for name in ("forward", "hooks", "capture")]
                if len({len(x) for x in rounds}) != 1 or not rounds[0]:
                    raise ValueError("rounds_s: forward, hooks and capture need one time each per round")
            r["capture_overhead_pct"], r["hooks_overhead_pct"], r["batch_size"]  # noqa: B018 - every row shows them
        return [(b, r) for b, r in runs
                if all(json.dumps(_setting_of(b, r, k)) == v for k, v in (where or {}).items())]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: not a capture bench result ({type(e).__name__}: {e}); give files written by "
                         "python -m traces.capture.bench --out") from None


def rows(path: Path, where: dict[str, str] | None = None) -> list[str]:
    return [row for bench, r in _runs(path, where) if (row := _row(path, bench, r))]


def _setting_of(bench: dict, r: dict, name: str):
    """A run's value of the setting ``name`` (:data:`SAME`), as results from before it was recorded
    ran; record_block_tokens as it acted: 0 where no block held two forwards."""
    if name == "record_block_tokens" and r.get("record_block_forwards") == 1:
        return 0
    return (bench if name == "model" else r).get(name, BEFORE.get(name))


def parse_where(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items (``--where``) -> {key: value as JSON text}; KEY one of :data:`SAME`."""
    where = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in SAME:
            raise InputError(f"--where {item}: give KEY=VALUE with KEY one of {', '.join(SAME)}")
        try:
            where[key] = json.dumps(json.loads(value))
        except ValueError:
            where[key] = json.dumps(value)  # a bare word: a string setting
    return where


SAME = ("model", "batch_size", "tokens", "logits", "lookahead", "writer", "writers", "recording_stream", "shared_rows",
        "top_r_kernel", "top_r_programs", "model_cpu", "record_block_tokens", "recording_thread",
        "rows_kernel")  # what runs pooled must share
# what results saved before a setting existed (or after it was removed: recording_thread and top_r_programs, 2026-12-07,
# docs/CAPTURE.md) ran with
BEFORE = {"record_block_tokens": 0, "recording_thread": False, "top_r_programs": 0, "rows_kernel": False}


def pooled_row(paths: list[Path], where: dict[str, str] | None = None) -> str:
    """One Markdown row for the runs of ``paths`` (those matching ``where``) together; they must
    share one setting."""
    runs = [(bench, r) for path in paths for bench, r in _runs(path, where) if {"forward", "hooks", "capture"} <= r.get(
        "rounds_s", {}).keys()]
    if not runs:
        raise InputError("--pooled: no run holds its rounds; give results written since the bench kept them")
    for name in SAME:
        values = {json.dumps(_setting_of(bench, r, name)) for bench, r in runs}
        if len(values) > 1:
            raise InputError(f"--pooled: the runs differ in {name} ({', '.join(sorted(values))}); pool runs of one "
                             "setting only")
    rounds = [r["rounds_s"] for _, r in runs]
    cap = [(x["capture"], x["forward"]) for x in rounds]
    point, interval = pooled_overhead(cap)
    by_round, by_round_interval = pooled_overhead(cap, by_round=True)
    hooks, hooks_interval = pooled_overhead([(x["hooks"], x["forward"]) for x in rounds])
    gpus = sorted({bench.get("gpu") or bench.get("device") for bench, _ in runs})
    commits = sorted({code for bench, _ in runs if (code := _code(bench))})
    code = f" ({', '.join(commits)})" if commits else ""
    bench, r = runs[0]
    return (f"| pooled: {len(runs)} runs{code} | {', '.join(gpus)} | {bench.get('model')} | {r['batch_size']} | "
            f"{r.get('writers', '')} {r.get('writer', '')}{_setting(r)} | {sum(len(x['forward']) for x in rounds)} | "
            f"{point:+.1f} % ({_span(interval)}) | {by_round:+.1f} % ({_span(by_round_interval)}) | "
            f"{hooks:+.1f} % ({_span(hooks_interval)}) |")


def _row(path: Path, bench: dict, r: dict) -> str | None:
    """One run's Markdown row; None for a run saved before the bench kept its rounds."""
    rounds = r.get("rounds_s", {})
    if not {"forward", "hooks", "capture"} <= rounds.keys():
        return None
    fwd, cap, hooks = rounds["forward"], rounds["capture"], rounds["hooks"]
    by_round = r.get("capture_overhead_by_round_pct")  # from the unrounded times
    if by_round is None:
        by_round = _by_round(cap, fwd)
    return (f"| {_name(path, bench)} | {bench.get('gpu') or bench.get('device')} | {bench.get('model')} | {r['batch_size']} | "
            f"{r.get('writers', '')} {r.get('writer', '')}{_setting(r)} | {len(fwd)} | {r['capture_overhead_pct']:+.1f} % "
            f"({_span(r.get('capture_overhead_ci95_pct') or overhead_interval(cap, fwd))}) | {by_round:+.1f} % "
            f"({_span(r.get('capture_overhead_by_round_ci95_pct') or overhead_interval(cap, fwd, True))}) | "
            f"{r['hooks_overhead_pct']:+.1f} % ({_span(r.get('hooks_overhead_ci95_pct') or overhead_interval(hooks, fwd))}) |")


def _code(bench: dict) -> str | None:
    """The capture code a result timed: the commit whose sources have its ``capture_sources``
    fingerprint in this checkout's history, else the commit it recorded (``+``: with changes), or
    None where it records neither."""
    found = _find_commit(bench["capture_sources"]) if bench.get("capture_sources") else None
    return found or bench.get("capture_commit")


_find_commit = functools.cache(find_commit)  # once per fingerprint


def _name(path: Path, bench: dict) -> str:
    """The result's file name, and the capture code it timed where it says (:func:`_code`)."""
    code = _code(bench)
    return f"{path.stem} ({code})" if code else path.stem


def _setting(r: dict) -> str:
    """What sets a run apart from the capture's defaults, where a result holds several."""
    parts = []
    if r.get("model_cpu") is not None:
        parts.append("model's thread pinned")
    if r.get("recording_stream") == "main":
        parts.append("recording on the model's stream")
    if r.get("top_r_kernel") is False:
        parts.append("top-R by two sorts")
    elif r.get("top_r_programs"):
        parts.append(f"top-R kernel in at most {r['top_r_programs']:,} programs")
    if r.get("shared_rows") is False:
        parts.append("rows copied")
    if r.get("recording_thread"):
        parts.append("recording on a thread of its own")
    if r.get("record_block_tokens") and r.get("record_block_forwards") != 1:
        parts.append(f"forwards held in blocks of {r['record_block_tokens']:,} tokens")
    return "".join(f", {p}" for p in parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="bench results (JSON)")
    p.add_argument("--pooled", action="store_true",
                   help="a last row for all the runs together (the mean of their figures; one setting only)")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="only the runs with this setting, e.g. record_block_tokens=0 (repeatable; results "
                        "from before a setting was recorded count as what they ran)")
    args = p.parse_args(argv)
    where = parse_where(args.where)
    table = [row for path in args.files for row in rows(path, where)]
    if args.pooled:
        table.append(pooled_row(args.files, where))
    print("| result | GPU | model | batch | encoders | rounds | capture overhead (95 % interval) | "
          "median round (95 % interval) | recording alone (95 % interval) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    try:
        main()
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
