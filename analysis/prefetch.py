"""Prefetch against substitution: the table and plot of a sweep over strategies, prefetch
predictors, hosts and cache fractions (``make prefetch``; docs/PREFETCH.md).

Reads the sweep's ``report.parquet`` (written by ``moe-report``) and writes ``prefetch.md`` (one
table per host: time per token, substituted mass, hit rate and what prefetch moved) and
``prefetch.png`` (time per token and mass against the cache fraction, one panel pair per host,
prefetch runs dashed), each atomically::

    python -m analysis.prefetch runs/prefetch [--out DIR]
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import polars as pl
from matplotlib.figure import Figure

from traces.atomic import atomic_write_bytes, output_errors
from traces.errors import InputError

MIB = 2**20
COPY_ORDER = "hardware.pcie.copy_order"  # a host of the sweep may run with both (make prefetch)
NEEDED = ("policy.name", "prefetch.predictor", "hardware.name", "cache.fraction", "ms_per_token",
          "mean_mass", "hit_rate", "decode_tokens", "prefetches", "useful_prefetches",
          "late_prefetches", "prefetch_bytes", "wasted_prefetch_bytes")


def load(report: Path) -> pl.DataFrame:
    """The completed runs of a sweep's report, with a ``label`` per strategy and predictor."""
    if not report.is_file():
        raise InputError(f"{report}: no such report; run moe-report on the sweep first")
    df = pl.read_parquet(report)
    missing = [c for c in NEEDED if c not in df.columns]
    if missing:
        raise InputError(f"{report}: lacks {', '.join(missing)}; the sweep needs prefetch.predictor "
                         "among its settings (make prefetch runs one)")
    df = df.filter(pl.col("status") == "ok") if "status" in df.columns else df
    if df.is_empty():
        raise InputError(f"{report}: no completed run")
    label = pl.when(pl.col("prefetch.predictor") == "none").then(pl.col("policy.name")).otherwise(
        pl.col("policy.name") + " + prefetch (" + pl.col("prefetch.predictor") + ")")
    return df.with_columns(label=label, host=_host(df)).sort("host", "cache.fraction", "label")


def _host(df: pl.DataFrame) -> pl.Expr:
    """The profile's name, with its copy order where the sweep ran one profile with both."""
    if COPY_ORDER not in df.columns:
        return pl.col("hardware.name")
    order = pl.col(COPY_ORDER).fill_null("priority")
    both = order.n_unique().over("hardware.name") > 1
    return pl.when(both).then(pl.col("hardware.name") + ", copy order " + order).otherwise(
        pl.col("hardware.name"))


def table(df: pl.DataFrame) -> str:
    """One Markdown table per host."""
    out = []
    for (host,), rows in df.group_by("host", maintain_order=True):
        out += [f"### {host}", "",
                "| resident | strategy | ms/token | mean mass | hit rate | prefetches/token | useful | late "
                "| wasted MiB/token |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows.iter_rows(named=True):
            n = r["prefetches"]
            useful, late = (f"{100 * r[c] / n:.0f} %" if n else "" for c in ("useful_prefetches", "late_prefetches"))
            out.append(
                f"| {100 * r['cache.fraction']:.0f} % | {r['label']} | {r['ms_per_token']:.2f} "
                f"| {r['mean_mass']:.3f} | {100 * r['hit_rate']:.1f} % "
                f"| {n / r['decode_tokens']:.1f} | {useful} | {late} "
                f"| {r['wasted_prefetch_bytes'] / MIB / r['decode_tokens']:.2f} |")
        out.append("")
    return "\n".join(out)


def plot(df: pl.DataFrame) -> Figure:
    """Time per token and mean substituted mass against the cache fraction, a row per host."""
    hosts = df["host"].unique(maintain_order=True).to_list()
    policies = df["policy.name"].unique(maintain_order=True).to_list()
    fig = Figure(figsize=(11, 3.6 * len(hosts)), layout="constrained", dpi=110)
    axes = fig.subplots(len(hosts), 2, squeeze=False)
    for row, host in zip(axes, hosts, strict=True):
        mine = df.filter(pl.col("host") == host)
        for (label,), runs in mine.group_by("label", maintain_order=True):
            runs = runs.sort("cache.fraction")
            prefetch = runs["prefetch.predictor"][0] != "none"
            style = dict(color=f"C{policies.index(runs['policy.name'][0]) % 10}", marker="o",
                         linestyle="--" if prefetch else "-", label=label)
            x = 100 * runs["cache.fraction"].to_numpy()
            row[0].plot(x, runs["ms_per_token"].to_numpy(), **style)
            row[1].plot(x, runs["mean_mass"].to_numpy(), **style)
        row[0].set(xlabel="resident experts (%)", ylabel="ms per decode token", title=f"{host}: time")
        row[1].set(xlabel="resident experts (%)", ylabel="mean substituted gate mass",
                   title=f"{host}: quality cost")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig


def write(sweep: Path, out: Path | None = None) -> list[Path]:
    df = load(sweep / "report" / "report.parquet")
    out = out or sweep / "report"
    png = io.BytesIO()
    plot(df).savefig(png, format="png")
    files = {"prefetch.md": (table(df) + "\n").encode(), "prefetch.png": png.getvalue()}
    with output_errors(out):
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            atomic_write_bytes(out / name, data)
    return [out / name for name in files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.prefetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="the sweep directory (moe-report already run on it)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: SWEEP/report)")
    args = ap.parse_args(argv)
    try:
        for path in write(args.sweep, args.out):
            print(f"wrote {path}")
    except InputError as exc:
        print(f"analysis.prefetch: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
