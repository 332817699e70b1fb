"""``moe-report SWEEP_DIR [--out DIR]``: one table, plots and a write-up of a moe-sim sweep.

Writes into DIR (default ``SWEEP_DIR/report``): ``report.parquet`` and ``report.csv`` (one row
per job: meta, config and result columns as ``analysis.collect`` reads them, plus ``strategy``
and ``speedup_vs_fetch_all``), one PNG per plot, ``report.md`` and a self-contained
``report.html`` (the PNGs embedded). Every file is written to a temporary name and renamed, and
only once everything has been computed.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from analysis.collect import (
    BASELINE,
    FAILED,
    MISSING,
    OK,
    POLICY,
    STRATEGY_PREFIXES,
    Sweep,
    View,
    format_value,
    make_view,
    read_sweep,
    speedup_table,
)
from analysis.plots import Plot, all_plots
from traces.atomic import atomic_write_bytes
from traces.errors import EXIT_INPUT_ERROR, InputError

# --- a tiny document model, rendered to Markdown and to HTML -------------------------------


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str  # `backticks` mark code


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    file: str
    alt: str
    png: bytes


Block = Heading | Para | Table | Image


def render_markdown(blocks: Sequence[Block]) -> str:
    """Markdown with images linked by file name (they lie next to report.md)."""
    out = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Para):
            out.append(block.text)
        elif isinstance(block, Table):
            cells = [[c.replace("|", "\\|") for c in row] for row in [block.header, *block.rows]]
            out.append("\n".join(["| " + " | ".join(cells[0]) + " |",
                                  "|" + "---|" * len(block.header),
                                  *("| " + " | ".join(row) + " |" for row in cells[1:])]))
        else:
            out.append(f"![{block.alt}]({block.file})")
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;font-size:.85em;margin:1em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}
code{background:#f3f3f3;padding:0 .2em}"""
_NUMBER = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?\s*(%|×)?$")


def _inline_html(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def render_html(blocks: Sequence[Block], title: str) -> str:
    """One self-contained page: the PNGs are embedded as base64 data URIs."""
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{_CSS}</style></head><body>"]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_inline_html(block.text)}</h{block.level}>")
        elif isinstance(block, Para):
            out.append(f"<p>{_inline_html(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline_html(c)}</th>" for c in block.header)
            body = "".join(
                "<tr>" + "".join(f"<td class='num'>{_inline_html(c)}</td>" if _NUMBER.match(c)
                                 else f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>"
                for row in block.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(f"<p><img alt='{html.escape(block.alt)}' "
                       f"src='data:image/png;base64,{data}'></p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --- report content ---------------------------------------------------------------------------


def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "–"
    if kind == "percent":
        return f"{100 * value:.1f} %"
    if kind == "speedup":
        return f"{value:.2f} ×"
    if kind == "mass":
        return f"{value:.4f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return format_value(value)


def report_table(view: View, speedups: pl.DataFrame) -> pl.DataFrame:
    """The collected table plus ``strategy`` and ``speedup_vs_fetch_all`` per job."""
    speedup = speedups.select("job", pl.col("speedup").alias("speedup_vs_fetch_all"))
    return view.labelled.drop("_order").join(speedup, on="job", how="left",
                                             maintain_order="left")


def _summary_blocks(sweep: Sweep, view: View) -> list[Block]:
    status = sweep.table["status"]
    counts = {s: int((status == s).sum()) for s in (OK, FAILED, MISSING)}
    line = (f"Sweep `{sweep.root}`: {sweep.table.height} job(s), {counts[OK]} ok, "
            f"{counts[FAILED]} failed")
    line += f", {counts[MISSING]} never started." if counts[MISSING] else "."
    blocks: list[Block] = [
        Heading(f"Sweep report: {sweep.root.resolve().name}", 1),
        Para(line + " The full table is in `report.parquet` and `report.csv`: one row per job "
             "with its config columns, its summary.json results, status and error."),
    ]
    if view.setting_columns:
        blocks.append(Para("Settings varied besides the strategy: "
                           + ", ".join(f"`{c}`" for c in view.setting_columns) + "."))
    bad = sweep.table.filter(pl.col("status") != OK)
    if bad.height:
        blocks += [Heading("Failed jobs"),
                   Table(["job", "status", "overrides", "error"],
                         [[r["job"], r["status"], r["overrides"] or "–", r["error"] or "–"]
                          for r in bad.rows(named=True)])]
    return blocks


def _speedup_blocks(sweep: Sweep, view: View, speedups: pl.DataFrame) -> list[Block]:
    blocks: list[Block] = [Heading("Speedup over fetch_all and substitution rate")]
    if speedups.height == 0:
        return blocks + [Para("No successful run: nothing to compare.")]
    has_baseline = POLICY in view.ok.columns and (view.ok[POLICY] == BASELINE).any()
    if not has_baseline:
        blocks.append(Para("No fetch_all run in this sweep, so there is no baseline and no "
                           "speedup; add `policy=fetch_all` to the sweep."))
    else:
        preset_set = [c for c in view.strategy_columns if not c.startswith(STRATEGY_PREFIXES)]
        strategy = "`policy.*`, `admission.*`" + "".join(f", `{c}`" for c in preset_set)
        blocks.append(Para(
            "Speedup = time per decode token of fetch_all / that of the run, where fetch_all "
            "is the run with the same value in every config column outside the strategy "
            f"({strategy}"
            + (", which the policy presets set" if preset_set else "")
            + "). Substituted calls are a share of all decode expert calls."
            + (" – means no fetch_all run has the same settings."
               if speedups["speedup"].null_count() else "")))
    columns = [
        *((c, c, "") for c in view.setting_columns),
        ("strategy", "strategy", ""),
        (sweep.result_column("ms_per_token"), "time/token (ms)", ""),
        ("speedup", "speedup vs fetch_all", "speedup"),
        (sweep.result_column("substitution_rate"), "substituted calls", "percent"),
        (sweep.result_column("mean_mass"), "mean mass/token-layer", "mass"),
        (sweep.result_column("hit_rate"), "hit rate", "percent"),
        ("job", "job", ""),
    ]
    columns = [c for c in columns if c[0] in speedups.columns]
    rows = [[_fmt(row[c], kind) for c, _, kind in columns]
            for row in speedups.rows(named=True)]
    return blocks + [Table([header for _, header, _ in columns], rows)]


def _plot_blocks(plot: Plot, png: bytes | None) -> list[Block]:
    blocks: list[Block] = [Heading(plot.title)]
    if png is not None:
        blocks.append(Image(f"{plot.name}.png", plot.title, png))
    if plot.note:
        blocks.append(Para(plot.note[0].upper() + plot.note[1:]))
    return blocks


def _png(plot: Plot) -> bytes | None:
    if plot.figure is None:
        return None
    return _encoded(lambda buffer: plot.figure.savefig(buffer, format="png"))


# --- files -----------------------------------------------------------------------------------


def write_report(sweep: Sweep, out_dir: Path) -> list[Path]:
    """Write every output of the report into ``out_dir``; returns the paths written."""
    view = make_view(sweep)
    speedups = speedup_table(sweep, view)
    table = report_table(view, speedups)
    plots = all_plots(sweep, view)
    pngs = [_png(plot) for plot in plots]
    blocks = _summary_blocks(sweep, view) + _speedup_blocks(sweep, view, speedups)
    for plot, png in zip(plots, pngs, strict=True):
        blocks += _plot_blocks(plot, png)
    title = f"moe-sim sweep report: {sweep.root.resolve().name}"
    files = {"report.parquet": _encoded(table.write_parquet),
             "report.csv": _encoded(table.write_csv)}
    files.update((f"{plot.name}.png", png) for plot, png in zip(plots, pngs, strict=True)
                 if png is not None)
    files["report.md"] = render_markdown(blocks).encode()
    files["report.html"] = render_html(blocks, title).encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write_bytes(out_dir / name, data)
    return [out_dir / name for name in files]


def _encoded(write: Callable[[io.BytesIO], object]) -> bytes:
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``moe-report`` command; returns the exit status (2 for a missing or empty sweep)."""
    parser = argparse.ArgumentParser(
        prog="moe-report",
        description="Collect a moe-sim sweep (Hydra multirun directory) into report.parquet, "
                    "report.csv, PNG plots, report.md and a self-contained report.html.")
    parser.add_argument("sweep_dir", type=Path, help="the multirun directory (or one run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: SWEEP_DIR/report)")
    parser.add_argument("--table", action="store_true",
                        help="also print the speedup table (Markdown) on stdout")
    args = parser.parse_args(argv)
    try:
        sweep = read_sweep(args.sweep_dir, progress=True)
    except InputError as exc:
        print(f"moe-report: error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    out_dir = args.out if args.out is not None else args.sweep_dir / "report"
    try:
        write_report(sweep, out_dir)
    except OSError as exc:
        print(f"moe-report: error: cannot write the report to {out_dir}: {exc}", file=sys.stderr)
        return 1
    status = sweep.table["status"]
    print(f"moe-report: {sweep.table.height} job(s): {int((status == OK).sum())} ok, "
          f"{int((status == FAILED).sum())} failed, {int((status == MISSING).sum())} never "
          f"started; wrote {out_dir / 'report.md'} and {out_dir / 'report.html'}")
    if args.table:
        view = make_view(sweep)
        print(render_markdown(_speedup_blocks(sweep, view, speedup_table(sweep, view))[-1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
