"""``moe-report SWEEP_DIR [--out DIR]``: one table, plots and a write-up of a moe-sim sweep.

Writes into DIR (default ``SWEEP_DIR/report``): ``report.parquet`` and ``report.csv`` (one row
per job: meta, config, result and provenance columns as ``analysis.collect`` reads them, plus
``strategy`` and ``speedup_vs_fetch_all``), one PNG per plot, ``report.md`` and a
self-contained ``report.html`` (the PNGs embedded). Both documents open with the settings the
whole sweep shares (trace, model, hardware, cache, policy); their tables list only what varies.
Every file is written to a temporary name and renamed, and only once everything has been
computed, so an input error leaves no report file behind. docs/REPORTS.md describes a report.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import math
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from analysis import provenance
from analysis.collect import (
    BASELINE,
    BETA,
    FAILED,
    MISSING,
    OK,
    POLICY,
    PROTECT_RANKS,
    TAU,
    Sweep,
    View,
    format_value,
    is_unmodified_fetch_all,
    make_view,
    overridden,
    read_sweep,
    speedup_table,
)
from analysis.plots import Plot, all_plots, describe
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
    css: str = ""  # an HTML class for the table ("settings": a key-value list)


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
color:#222;line-height:1.4}h1{margin-bottom:.3em}h2{margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
table.settings{font-size:.9em;background:#f8f9fb}table.settings td:first-child{font-weight:600;
white-space:nowrap}img{max-width:100%}code{background:#eef0f3;padding:0 .2em}"""
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
            css = f" class='{block.css}'" if block.css else ""
            out.append(f"<table{css}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(f"<p><img alt='{html.escape(block.alt)}' "
                       f"src='data:image/png;base64,{data}'></p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --- report content ---------------------------------------------------------------------------


# Significant digits of a column's largest value; every row of the column gets its decimals.
SIGNIFICANT = {"number": 4, "percent": 3}
SPEEDUP_DECIMALS = 2


def _decimals(values: Sequence, significant: int) -> int:
    """Decimals giving the largest magnitude among ``values`` ``significant`` digits (0-6)."""
    sizes = [abs(v) for v in values if isinstance(v, int | float) and math.isfinite(v) and v]
    if not sizes:
        return significant - 1
    return min(6, max(0, significant - 1 - math.floor(math.log10(max(sizes)))))


def column_formatter(values: Sequence, kind: str):
    """One format for a whole column: ``number`` (SIGNIFICANT digits), ``percent`` (ratios
    shown in %), ``speedup`` (``1.25 ×``); other kinds show values as overrides are typed."""
    if kind == "speedup":
        return lambda v: "–" if v is None else f"{v:.{SPEEDUP_DECIMALS}f} ×"
    if kind in SIGNIFICANT:
        scale, suffix = (100.0, " %") if kind == "percent" else (1.0, "")
        places = _decimals([v * scale for v in values if v is not None], SIGNIFICANT[kind])
        return lambda v: "–" if v is None else f"{v * scale:.{places}f}{suffix}"
    return lambda v: "–" if v is None else format_value(v)


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
             "with its config columns, its summary.json results, provenance, status and error."),
        Heading("Fixed settings"),
        Table(["setting", "value"], _fixed_settings(sweep, view), css="settings"),
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


# --- the fixed-settings block ----------------------------------------------------------------

# Overrides that the fixed-settings rows already show (the command line shows them all).
SHOWN_OVERRIDES = ("trace.path", "model", "hardware", "policy", "cache", "cache.scope",
                   "cache.fraction", "cache.budget_bytes", "cache.eviction", BETA)


def _settings_rows(view: View) -> pl.DataFrame:
    """The runs whose settings the block describes: the successful ones, else all with a
    config."""
    return view.ok if view.ok.height else view.labelled.filter(pl.col("status") != MISSING)


def _varies(values: list, show=format_value, where: str = "see the table") -> str:
    return "varies: " + ", ".join(show(v) for v in values) + f" ({where})"


def _fixed_settings(sweep: Sweep, view: View) -> list[list[str]]:
    """[setting, value] rows: trace, model, hardware, cache, policy, admission, the command."""
    rows = _settings_rows(view)
    trace = provenance.fixed_group(rows, "trace")
    if trace is None:
        paths = provenance.distinct(rows, provenance.column("trace", "path"))
        trace_value = _varies(paths, lambda p: f"`{p}`")
    else:
        trace_value = (f"`{provenance.trace_name(trace)}`: {provenance.trace_shape(trace)}; "
                       f"sha256 `{provenance.content_hash_prefix(trace)}`; recorded from "
                       f"{trace.get('model') or provenance.UNKNOWN} (source "
                       f"{trace.get('source') or provenance.UNKNOWN}); path `{trace['path']}`")
    model = provenance.fixed_group(rows, "model")
    if model is None:
        names = provenance.distinct(rows, provenance.column("model", "name"))
        model_value = _varies(names)
    else:
        model_value = (f"{provenance.model_text(model)}: "
                       f"{provenance.bytes_text(model['expert_bytes'])} per expert, "
                       f"{provenance.bytes_text(model['dense_bytes_per_layer'])} dense weights "
                       "per layer")
    hardware = provenance.fixed_group(rows, "hardware")
    if hardware is None:
        pairs = rows.select(provenance.column("hardware", "name"),
                            provenance.column("hardware", "source")).unique(maintain_order=True)
        hardware_value = _varies([provenance.hardware_text({"name": n, "source": src})
                                  for n, src in pairs.rows()], str)
    else:
        hardware_value = provenance.hardware_text(hardware)
    table = [["trace", trace_value], ["model", model_value], ["hardware", hardware_value],
             ["cache", _cache_value(rows, sweep)], ["policy", _policy_value(rows, sweep)],
             ["admission", _admission_value(rows, sweep)]]
    others = _other_overrides(sweep)
    if others:
        table.append(["also set", " ".join(f"`{o}`" for o in others)])
    if sweep.command is not None:
        table.append(["command", f"`moe-sim -m {' '.join(map(shlex.quote, sweep.command))}`"])
    return table


def _one_or_varies(rows: pl.DataFrame, column: str, sweep: Sweep) -> str:
    """A column's one value, or its values and who set them: the sweep or the presets."""
    values = provenance.distinct(rows, column)
    if len(values) == 1:
        return format_value(values[0])
    return _varies(values, where="see the table" if overridden(column, sweep)
                   else "as the policy presets set it")


def _cache_value(rows: pl.DataFrame, sweep: Sweep) -> str:
    size = provenance.cache_text(rows)
    if size is None:
        budgets = provenance.distinct(rows, "cache.budget_bytes")
        sized_by = "cache.fraction" if budgets in ([], [None]) else "cache.budget_bytes"
        size = (f"{_one_or_varies(rows, 'cache.scope', sweep)}, "
                f"{sized_by} {_one_or_varies(rows, sized_by, sweep)}")
    value = f"{size}; eviction {_one_or_varies(rows, 'cache.eviction', sweep)}"
    if provenance.distinct(rows, "cache.lfu_decay") not in ([], [None]):
        value += f", lfu_decay {_one_or_varies(rows, 'cache.lfu_decay', sweep)}"
    return value + f"; init {_one_or_varies(rows, 'cache.init', sweep)}"


def _policy_value(rows: pl.DataFrame, sweep: Sweep) -> str:
    names = provenance.distinct(rows, POLICY)
    if len(names) != 1:
        return "varies: " + ", ".join(map(format_value, names)) + " (one row per strategy)"
    fields = [c for c in rows.columns if c.startswith("policy.") and c != POLICY]
    return f"{format_value(names[0])}: " + ", ".join(
        f"{c.split('.', 1)[1]}={_one_or_varies(rows, c, sweep)}" for c in fields)


def _admission_value(rows: pl.DataFrame, sweep: Sweep) -> str:
    betas = provenance.distinct(rows, BETA)
    if betas == [None]:
        return f"off ({BETA}=null)"
    if len(betas) == 1:
        return f"background admission at {BETA}={format_value(betas[0])}"
    return f"{BETA} {_one_or_varies(rows, BETA, sweep)}"


def _other_overrides(sweep: Sweep) -> list[str]:
    """Command-line overrides of the sweep that no row of the block shows (``seed=3``)."""
    shown = {key.replace("/", ".") for key in SHOWN_OVERRIDES}
    return [o for o in sweep.command or ()
            if o.split("=", 1)[0].lstrip("+~").replace("/", ".") not in shown
            and not o.startswith("hydra")]


# --- the speedup table -----------------------------------------------------------------------


def _speedup_columns(sweep: Sweep, view: View) -> list[tuple[str, str, str]]:
    """(column, header, kind) of the speedup table."""
    return [
        *((c, c, "") for c in view.setting_columns),
        ("strategy", "strategy", ""),
        (sweep.result_column("ms_per_token"), "time/token (ms)", "number"),
        ("speedup", "speedup vs fetch_all", "speedup"),
        (sweep.result_column("substitution_rate"), "substituted calls", "percent"),
        (sweep.result_column("mean_mass"), "mean mass/token-layer", "number"),
        (sweep.result_column("hit_rate"), "hit rate", "percent"),
        ("jobs", "job", ""),
    ]


def speedup_display(speedups: pl.DataFrame) -> pl.DataFrame:
    """One row per setting and strategy (runs with identical results shown once): the row of
    job ``shown_as`` with ``jobs``, every job it stands for."""
    jobs = speedups.group_by("shown_as", maintain_order=True).agg(
        pl.col("job").str.join(", ").alias("jobs"))
    return speedups.filter(pl.col("job") == pl.col("shown_as")).join(
        jobs, on="shown_as", how="left", maintain_order="left")


def _speedup_table(sweep: Sweep, view: View, speedups: pl.DataFrame) -> Table:
    shown = speedup_display(speedups)
    columns = [c for c in _speedup_columns(sweep, view) if c[0] in shown.columns]
    formats = [column_formatter(shown[c].to_list(), kind) for c, _, kind in columns]
    rows = [[fmt(row[c]) for fmt, (c, _, _) in zip(formats, columns, strict=True)]
            for row in shown.rows(named=True)]
    return Table([header for _, header, _ in columns], rows)


def _speedup_blocks(sweep: Sweep, view: View, speedups: pl.DataFrame) -> list[Block]:
    blocks: list[Block] = [Heading("Speedup over fetch_all and substitution rate")]
    if speedups.height == 0:
        return blocks + [Para("No successful run: nothing to compare.")]
    blocks.append(Para(
        "Speedup = time per decode token of the unmodified fetch_all run (`policy.tau=0`, "
        "`policy.protect_ranks=0`, no admission: `admission.beta=null`) with the same trace, "
        "model, hardware and cache settings / that of the run. Substituted calls are a share "
        "of all decode expert calls."))
    blocks += [Para(note) for note in _baseline_notes(view, speedups)]
    return blocks + [_speedup_table(sweep, view, speedups)]


def _baseline_notes(view: View, speedups: pl.DataFrame) -> list[str]:
    """Which run each speedup is against, or why there is none; which rows stand for
    several runs."""
    notes = []
    has_fetch_all = POLICY in view.ok.columns and (view.ok[POLICY] == BASELINE).any()
    used = speedups["baseline_job"].drop_nulls().unique(maintain_order=True).to_list()
    if not has_fetch_all:
        notes.append("No fetch_all run in this sweep, so there is no baseline and no speedup; "
                     "add `policy=fetch_all` to the sweep.")
    elif not used:
        notes.append("No unmodified fetch_all run in this sweep, so the speedup column is "
                     "empty; add `policy=fetch_all` with its preset values to the sweep.")
    elif len(used) == 1:
        notes.append(f"Baseline: job {used[0]}.")
    shown = speedups.filter(pl.col("job") == pl.col("shown_as"))
    if len(used) > 1:
        per_setting = shown.filter(pl.col("job") == pl.col("baseline_job"))
        notes.append("Baselines: " + "; ".join(
            f"job {row['job']} at {describe({c: row[c] for c in view.setting_columns})}"
            for row in per_setting.rows(named=True)) + ".")
    if used and shown["speedup"].null_count():
        lacking = shown.filter(pl.col("baseline_job").is_null())
        settings = lacking.select(view.setting_columns).unique(maintain_order=True).rows()
        where = "; ".join(", ".join(f"{c}={format_value(v)}" for c, v in
                                    zip(view.setting_columns, row, strict=True))
                          for row in settings)
        notes.append("– : no unmodified fetch_all run has the same settings"
                     + (f" ({where})." if where else "."))
    shown_jobs = set(shown["job"])
    modified = [row for row in view.ok.rows(named=True)
                if row.get(POLICY) == BASELINE and not is_unmodified_fetch_all(row)
                and row["job"] in shown_jobs]
    for label in dict.fromkeys(row["strategy"] for row in modified):
        row = next(r for r in modified if r["strategy"] == label)
        changed = ", ".join(f"{c}={format_value(row[c])}" for c, default in
                            ((TAU, 0), (PROTECT_RANKS, 0), (BETA, None))
                            if c in row and row[c] != default)
        notes.append(f"{label} is not the unmodified fetch_all ({changed}), so it is not "
                     "used as a baseline.")
    for name, columns in view.inert.items():
        rows = view.ok.filter(pl.col(POLICY) == name)
        values = "; ".join(f"`{c}` = " + ", ".join(format_value(v) for v in
                                                  provenance.distinct(rows, c))
                           for c in columns)
        notes.append(f"{name} gave identical results at every {values}, so its runs are "
                     "shown as one row (the job column lists them): that setting does not "
                     "change what it does.")
    return notes


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
    """The ``moe-report`` command; returns the exit status (2 for bad input: a missing or
    empty sweep, a damaged summary.json)."""
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
        print(render_markdown([_speedup_table(sweep, view, speedup_table(sweep, view))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
