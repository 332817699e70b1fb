"""The paper's comparison in the paper's setting, row by row against its figures (``make paper``).

Reads a sweep's ``report.parquet`` (``moe-report``; one hardware profile, one cache fraction)
and writes ``paper.md``: per strategy the simulated time per token split into the compute floor
(time not spent waiting for transfers) and the stall, the transfers behind the stall, the
substituted share and mass, the speedup over fetch_all and where it lands against the paper's
figure (Quality-First and Speed-First: 2.5-3.0x over fetch-every-miss), with the reason read
off those numbers::

    python -m analysis.paper runs/paper/setting [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl

from traces.atomic import atomic_write_text, output_errors
from traces.errors import InputError

PAPER = {"quality_first": (2.5, 3.0), "speed_first": (2.5, 3.0)}  # speedup over fetch_all
NEEDED = ("policy.name", "hardware.name", "cache.fraction", "ms_per_token", "stall_ms_per_token",
          "decode_tokens", "fetches", "ssd_reads", "background_admissions", "substitution_rate",
          "mean_mass")


def load(report: Path) -> pl.DataFrame:
    if not report.is_file():
        raise InputError(f"{report}: no such report; run moe-report on the sweep first")
    df = pl.read_parquet(report)
    missing = [c for c in NEEDED if c not in df.columns]
    if missing:
        raise InputError(f"{report}: lacks {', '.join(missing)}; run moe-report on a moe-sim sweep")
    df = df.filter(pl.col("status") == "ok") if "status" in df.columns else df
    for column in ("hardware.name", "cache.fraction"):
        if df[column].n_unique() != 1:
            raise InputError(f"{report}: {column} varies; the comparison needs one host and one "
                             "cache fraction (make paper runs one)")
    if "fetch_all" not in df["policy.name"].to_list():
        raise InputError(f"{report}: no fetch_all run, the paper's baseline; add policy=fetch_all")
    return df


def rows(df: pl.DataFrame) -> list[dict]:
    base = df.filter(pl.col("policy.name") == "fetch_all").row(0, named=True)
    out = []
    for r in df.iter_rows(named=True):
        n = r["decode_tokens"]
        stall, total = r["stall_ms_per_token"], r["ms_per_token"]
        out.append(dict(strategy=r["policy.name"], ms=total, stall=stall, floor=total - stall,
                        fetches=r["fetches"] / n, ssd=r["ssd_reads"] / n,
                        admissions=r["background_admissions"] / n,
                        substituted=r["substitution_rate"], mass=r["mean_mass"],
                        speedup=base["ms_per_token"] / total, base=base))
    return sorted(out, key=lambda x: -x["ms"])


def verdict(row: dict) -> tuple[str, str]:
    """Where a row lands against the paper and why, from its own numbers."""
    figure = PAPER.get(row["strategy"])
    base = row["base"]
    bound = base["ms_per_token"] / row["floor"]  # no stall at all: the most this floor allows
    if figure is None:
        return "", ""
    low, high = figure
    where = ("within" if low <= row["speedup"] <= high else "below" if row["speedup"] < low
             else "above")
    share = row["stall"] / row["ms"]
    if where == "below":
        why = (f"{share:.0%} of its time is still stall: its rule still fetches "
               f"{row['fetches']:.1f} experts per token and {row['ssd']:.1f} SSD reads per token "
               f"feed them and its admissions; with no stall its compute floor of "
               f"{row['floor']:.2f} ms would give {bound:.2f}x")
    elif where == "above":
        why = (f"fetch_all's stall ({base['stall_ms_per_token']:.2f} of {base['ms_per_token']:.2f} ms) "
               "is a larger share than on the paper's host")
    else:
        why = f"stall {share:.0%} of its time; the compute floor allows {bound:.2f}x"
    return f"{where} {low:g}-{high:g}x", why


def table(df: pl.DataFrame) -> str:
    first = df.row(0, named=True)
    lines = [f"Host `{first['hardware.name']}`, {100 * first['cache.fraction']:.0f} % of experts "
             "resident; speedup = fetch_all's time per token / the strategy's.", "",
             "| strategy | ms/token | stall ms | compute floor ms | fetches/token | SSD reads/token "
             "| substituted | mean mass | speedup | paper | why |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows(df):
        where, why = verdict(r)
        lines.append(f"| {r['strategy']} | {r['ms']:.2f} | {r['stall']:.2f} | {r['floor']:.2f} "
                     f"| {r['fetches']:.1f} | {r['ssd']:.2f} | {100 * r['substituted']:.1f} % "
                     f"| {r['mass']:.3f} | {r['speedup']:.2f}x | {where} | {why} |")
    return "\n".join(lines) + "\n"


def write(sweep: Path, out: Path | None = None) -> Path:
    text = table(load(sweep / "report" / "report.parquet"))
    path = (out or sweep / "report") / "paper.md"
    with output_errors(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.paper", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="the sweep directory (moe-report already run on it)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: SWEEP/report)")
    args = ap.parse_args(argv)
    try:
        path = write(args.sweep, args.out)
    except InputError as exc:
        print(f"analysis.paper: error: {exc}", file=sys.stderr)
        return 2
    print(path.read_text(), end="")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
