"""Figures of a collected sweep (matplotlib, no pyplot state: each plot is its own Figure).

Each ``plot_*`` function returns a :class:`Plot`; when the sweep lacks what a figure needs,
``figure`` is None and ``note`` says why. Per-layer and per-token figures read
``per_layer.parquet`` / ``per_token.parquet`` from the run directories. Every title carries a
second line naming what its runs share (trace and shape, model, hardware, cache; see
``analysis.provenance.context_line``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from analysis import provenance
from analysis.collect import BETA, FRACTION, POLICY, Sweep, View, format_value, with_strategy

# Settings that change the platform: times do not compare across them, so they get own panels.
PLATFORM_PREFIXES = ("model.", "hardware.", "trace.")
PANEL_TITLES = ("model.name", "hardware.name", "trace.path")
MAX_PANELS = 6
MARKERS = "osD^vPX"
FRONT_STYLES = ("--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 1)), (0, (8, 3)))
MAX_SWITCH_LINES = 40  # more switches than this are drawn as ticks, not full-height lines
SEQUENCE_POLICIES = ("fetch_all", "rule015", "quality_first")
MAX_SEQUENCE_LINES = 6
MAX_PLOT_POINTS = 4000  # per line: more is invisible at figure resolution
MASS_LABEL = "mean substituted gate mass per token-layer"


@dataclass
class Plot:
    """One figure of the report, or the reason it was skipped."""

    name: str  # file stem: <name>.png
    title: str
    figure: Figure | None
    note: str = ""


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mask of the points no other point beats in both x and y (both minimised)."""
    mask = np.zeros(len(x), dtype=bool)
    best = math.inf
    for i in np.lexsort((y, x)):
        if y[i] < best:
            mask[i] = True
            best = y[i]
    return mask


def strategy_colors(labels: Sequence[str]) -> dict[str, Any]:
    """One fixed colour per strategy label, shared by all figures of a report."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def describe(setting: dict[str, Any]) -> str:
    """``cache.fraction=0.25, hardware.name=h200`` (empty for no setting)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in setting.items())


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained", dpi=110)


def _platform_columns(view: View) -> list[str]:
    return [c for c in view.setting_columns if c.startswith(PLATFORM_PREFIXES)]


def _panel_title(group: pl.DataFrame, view: View) -> str:
    """The platform of one panel (``hardware h200_measured (measured)``); empty when the
    platform is fixed."""
    columns = _platform_columns(view)
    titled = [c for c in columns if c in PANEL_TITLES] or columns
    words = []
    for column in titled:
        facts = provenance.fixed_group(group, column.split(".", 1)[0])
        if column == "hardware.name" and facts is not None:
            words.append(f"hardware {provenance.hardware_text(facts)}")
        elif column == "model.name" and facts is not None:
            words.append(f"model {provenance.model_text(facts)}")
        elif column == "trace.path" and facts is not None:
            words.append(f"trace {provenance.trace_name(facts)} "
                         f"({provenance.trace_shape(facts, short=True)})")
        else:
            words.append(f"{column}={format_value(group[column][0])}")
    return ", ".join(words)


def _panels(view: View, rows: pl.DataFrame) -> tuple[list[tuple[str, pl.DataFrame]], str]:
    """Split rows by platform (model, hardware, trace); titles name the platform."""
    columns = _platform_columns(view)
    if not columns:
        return [("", rows)], ""
    groups = [(_panel_title(group, view), group)
              for _, group in rows.group_by(columns, maintain_order=True)]
    if len(groups) <= MAX_PANELS:
        return groups, ""
    return groups[:MAX_PANELS], (f"The sweep has {len(groups)} model/hardware/trace "
                                 f"combinations; the first {MAX_PANELS} are shown.")


TITLE_POINTS = 10.5
CHAR_WIDTH = 0.55  # of the font size: an average character of the default sans-serif font


def _suptitle(fig: Figure, title: str, rows: pl.DataFrame) -> None:
    """The figure's title, and below it what its runs share, broken between its parts where
    one line would be wider than the figure."""
    width = int(fig.get_figwidth() * 72 / (TITLE_POINTS * CHAR_WIDTH))
    lines, context = [title], provenance.context_line(rows)
    for part in context.split(provenance.SEPARATOR) if context else []:
        if len(lines) > 1 and len(lines[-1]) + len(provenance.SEPARATOR) + len(part) <= width:
            lines[-1] += provenance.SEPARATOR + part
        else:
            lines.append(part)
    fig.suptitle("\n".join(lines), fontsize=TITLE_POINTS)


def _size_label(group: dict[str, Any]) -> str:
    """``cache 25 %`` for a cache fraction; other settings as overrides."""
    return ", ".join(f"cache {100 * v:.3g} %" if c == FRACTION and isinstance(v, float)
                     else f"{c}={format_value(v)}" for c, v in group.items())


def plot_time_vs_mass(sweep: Sweep, view: View) -> Plot:
    """Time per decode token against mean substituted mass, one point per run, and one Pareto
    front per cache size (per combination of the varied settings other than the platform)."""
    title = "Time per token vs substituted gate mass"
    ms, mass = sweep.result_column("ms_per_token"), sweep.result_column("mean_mass")
    has_columns = {ms, mass} <= set(view.ok.columns)
    rows = view.ok.drop_nulls([ms, mass]) if has_columns else view.ok.clear()
    if rows.height == 0:
        return Plot("time_vs_mass", title, None, "skipped: no successful run reports "
                    "ms_per_token and mean_mass.")
    panels, note = _panels(view, rows)
    colors = strategy_colors(view.strategies())
    front_cols = [c for c in view.setting_columns if c not in _platform_columns(view)]
    fronts = (rows.select(front_cols).unique().sort(front_cols, nulls_last=True).rows()
              if front_cols else [()])
    style = {front: (MARKERS[i % len(MARKERS)], FRONT_STYLES[i % len(FRONT_STYLES)],
                     str(round(0.15 + 0.45 * i / max(1, len(fronts) - 1), 2)))
             for i, front in enumerate(fronts)}
    fig = _figure(4.8 * len(panels) + 2.8, 4.8)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (panel, group) in zip(axes, panels, strict=True):
        for front in fronts:
            members = group
            for column, value in zip(front_cols, front, strict=True):
                members = members.filter(pl.col(column).is_null() if value is None
                                         else pl.col(column) == value)
            if members.height == 0:
                continue
            marker, line, shade = style[front]
            x, y = members[mass].to_numpy(), members[ms].to_numpy()
            ax.scatter(x, y, c=[colors[s] for s in members["strategy"]], marker=marker, s=46,
                       zorder=3, edgecolors="white", linewidths=0.6)
            on_front = pareto_front(x, y)
            order = np.argsort(x[on_front])
            ax.plot(x[on_front][order], y[on_front][order], color=shade, ls=line, lw=1.2,
                    zorder=2)
            ax.scatter(x[on_front], y[on_front], s=150, marker=marker, facecolors="none",
                       edgecolors="black", linewidths=1.1, zorder=4)
        x = group[mass].to_numpy()
        ax.set_xlabel(f"{MASS_LABEL}\n(sum of normalised gate weights, 0-1)")
        ax.set_ylabel("time per decode token (ms)")
        ax.set_title(f"{panel or 'all runs'} (lower left is better)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=min(0.0, float(x.min())) - 0.02 * max(float(x.max()), 1e-3))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color=colors[s], label=s) for s in colors]
    for front, (marker, line, shade) in style.items():
        label = _size_label(dict(zip(front_cols, front, strict=True)))
        handles.append(Line2D([], [], ls=line, marker=marker, markersize=9, color=shade,
                              markerfacecolor="none", markeredgecolor="black",
                              label=f"Pareto front, {label}" if label else "Pareto front"))
    fig.legend(handles=handles, loc="outside right center", fontsize=8, title="strategy",
               title_fontsize=9)
    _suptitle(fig, f"{title}, one point per run", rows)
    per = f" of its {' and '.join(front_cols)}" if front_cols else ""
    return Plot("time_vs_mass", title, fig, (note + f" Circled points form the Pareto front{per}: "
                "no other run there is both faster and substitutes less gate mass.").strip())


# The metrics drawn against a swept setting: (summary key, axis label, scale, panel title,
# whether the axis starts at 0; hit rates differ by a few percent and get a zoomed axis).
LINE_METRICS = (
    ("ms_per_token", "time per decode token (ms)", 1.0, "time per decode token", True),
    ("mean_mass", "mass per token-layer (0-1)", 1.0, "mean substituted gate mass", True),
    ("hit_rate", "hit rate (% of expert calls)", 100.0, "decode hit rate", False),
)


def _line_plot(sweep: Sweep, view: View, rows: pl.DataFrame, *, name: str, title: str,
               x_column: str, x_label: str, x_of: dict[Any, float],
               ticks: dict[float, str] | None, fixed: dict[str, Any]) -> Plot:
    """Each metric of LINE_METRICS against ``x_column``, one line per ``strategy`` of
    ``rows``, one row of panels per platform; ``x_of`` places each value on the x axis."""
    panels, note = _panels(view, rows)
    labels = rows.sort("_order")["strategy"].unique(maintain_order=True).to_list()
    colors = strategy_colors(view.strategies())  # the colours of the other figures
    if not set(labels) <= set(colors):
        colors = strategy_colors(labels)
    markers = {label: MARKERS[i % len(MARKERS)] for i, label in enumerate(labels)}
    fig = _figure(14, 3.9 * len(panels))
    axes = fig.subplots(len(panels), len(LINE_METRICS), squeeze=False)
    for panel_axes, (panel, group) in zip(axes, panels, strict=True):
        for (label,), lines in group.sort("_order").group_by("strategy", maintain_order=True):
            lines = lines.with_columns(_x=pl.col(x_column).replace_strict(
                x_of, default=None, return_dtype=pl.Float64)).sort("_x")
            # Strategies with equal values overlap: markers and some transparency tell them apart.
            style = {"color": colors[label], "marker": markers[label], "ms": 5, "alpha": 0.85,
                     "label": label}
            for ax, (key, _, scale, _, _) in zip(panel_axes, LINE_METRICS, strict=True):
                column = sweep.result_column(key)
                if column in lines.columns:
                    ax.plot(lines["_x"].to_numpy(), lines[column].to_numpy() * scale, **style)
        for ax, (_, y_label, _, sub, from_zero) in zip(panel_axes, LINE_METRICS, strict=True):
            ax.set_title(f"{sub}\n{panel}" if panel else sub, fontsize=10)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
            if ticks is not None:
                ax.set_xticks(list(ticks), list(ticks.values()))
            if from_zero:
                _zero_visible(ax)
            else:  # a share in percent: never above 100
                ax.set_ylim(top=min(100.0, ax.get_ylim()[1]))
    handles, legend_labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="outside right upper", fontsize=8, title="strategy",
               title_fontsize=9)
    _suptitle(fig, title, rows)
    fixed_note = f"Other settings fixed at {describe(fixed)}. " if fixed else ""
    return Plot(name, title, fig, (fixed_note + note).strip())


def plot_cache_fraction(sweep: Sweep, view: View) -> Plot:
    """Time per token, substituted mass and hit rate against cache fraction, one line per
    strategy."""
    title = "Time per token, substituted mass and hit rate vs cache size"
    if FRACTION not in view.setting_columns:
        return Plot("cache_fraction", title, None,
                    f"skipped: the sweep has one {FRACTION} value only; sweep "
                    f"{FRACTION}=0.1,0.25,0.5 to see this plot.")
    panel_cols = _platform_columns(view)
    rows = view.at_reference(exclude=[FRACTION, *panel_cols])
    fractions = [f for f in rows[FRACTION].unique().to_list() if f is not None]
    fixed = {c: v for c, v in view.reference.items() if c not in (FRACTION, *panel_cols)}
    return _line_plot(sweep, view, rows, name="cache_fraction", title=title, x_column=FRACTION,
                      x_label="cache size (% of expert weights resident)",
                      x_of={f: 100 * f for f in fractions}, ticks=None, fixed=fixed)


def plot_beta(sweep: Sweep, view: View) -> Plot:
    """Time per token, substituted mass and hit rate against admission.beta, one line per
    strategy apart from beta; admission off (beta null) sits right of the largest beta."""
    title = "Time per token, substituted mass and hit rate vs admission beta"
    swept = BETA in view.ok.columns and view.ok.height and view.ok.group_by(POLICY).agg(
        pl.col(BETA).n_unique().alias("n"))["n"].max() > 1
    if not swept:
        return Plot("beta", title, None,
                    f"skipped: no policy runs at more than one {BETA}; sweep e.g. "
                    f"policy=quality_first {BETA}=null,0.25,0.5,1.0 to see this plot.")
    panel_cols = _platform_columns(view)
    rows = view.at_reference(exclude=panel_cols).drop("strategy", "_order")
    rows = with_strategy(rows, [c for c in view.strategy_columns if c != BETA], view.inert)
    betas = sorted(b for b in rows[BETA].unique().to_list() if b is not None)
    x_of = {b: float(i) for i, b in enumerate(betas)}
    ticks = {x: format_value(b) for b, x in x_of.items()}
    if rows[BETA].null_count():
        x_of[None] = float(len(betas))
        ticks[float(len(betas))] = "off\n(null)"
    fixed = {c: v for c, v in view.reference.items() if c not in panel_cols}
    return _line_plot(sweep, view, rows, name="beta", title=title, x_column=BETA,
                      x_label=f"{BETA} (off: no background admission)",
                      x_of=x_of, ticks=ticks, fixed=fixed)


def _per_strategy_runs(view: View) -> pl.DataFrame:
    """The first reference-setting run of each strategy, in strategy order."""
    rows = view.at_reference().sort("_order", "job_num")
    return rows.unique("strategy", keep="first", maintain_order=True)


def _sequence_runs(view: View) -> tuple[pl.DataFrame, list[str]]:
    """Runs for the sequence plot: SEQUENCE_POLICIES (every policy when none of them but
    fetch_all ran), taking their variants in turn (the first variant of each policy, then the
    second, ...) up to MAX_SEQUENCE_LINES; and the labels left out."""
    runs = _per_strategy_runs(view)
    preferred = runs.filter(pl.col(POLICY).is_in(list(SEQUENCE_POLICIES)))
    if preferred.filter(pl.col(POLICY) != "fetch_all").height:
        runs = preferred
    turn = pl.int_range(pl.len()).over(POLICY)
    runs = runs.with_columns(_turn=turn).sort("_turn", "_order", maintain_order=True)
    kept = runs.head(MAX_SEQUENCE_LINES).sort("_order").drop("_turn")
    return kept, runs["strategy"][MAX_SEQUENCE_LINES:].to_list()


def _reference_note(view: View) -> str:
    return f"Runs at {describe(view.reference)}. " if view.reference else ""


def plot_layer_heatmaps(sweep: Sweep, view: View) -> Plot:
    """Layer x strategy heatmaps of decode hit rate and mean substituted mass."""
    title = "Hit rate and substituted mass per layer"
    runs = _per_strategy_runs(view)
    labels, tables, absent = [], [], []
    for row in runs.rows(named=True):
        path = sweep.root / row["job"] / "per_layer.parquet"
        if path.is_file():
            labels.append(row["strategy"])
            tables.append(pl.read_parquet(path, columns=["layer", "hit_rate", "mean_mass"]))
        else:
            absent.append(row["job"])
    if not labels:
        return Plot("layer_heatmap", title, None,
                    f"skipped: no per_layer.parquet in job(s) {', '.join(absent)}.")
    num_layers = 1 + max(int(t["layer"].max()) for t in tables)
    hit_rate, mass = (np.full((len(labels), num_layers), np.nan) for _ in range(2))
    for i, table in enumerate(tables):
        layer = table["layer"].to_numpy()
        hit_rate[i, layer] = table["hit_rate"].to_numpy() * 100
        mass[i, layer] = table["mean_mass"].to_numpy()
    annotate = num_layers <= 24 and len(labels) <= 12  # numbers fit in the cells
    fig = _figure(11, 2.2 + 0.72 * len(labels))
    axes = fig.subplots(2, 1)
    for ax, grid, cmap, vmin, fmt, bar_label, sub in (
            (axes[0], hit_rate, "viridis", None, "{:.0f}", "hit rate (%)", "decode hit rate"),
            (axes[1], mass, "magma_r", 0.0, "{:.3f}", "mass per\ntoken-layer (0-1)",
             "mean substituted gate mass per token-layer")):
        image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest", vmin=vmin)
        if annotate:
            for (i, layer), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    shade = image.norm(value)
                    dark = shade > 0.55 if cmap == "magma_r" else shade < 0.45
                    ax.text(layer, i, fmt.format(value), ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xticks(range(0, num_layers, max(1, num_layers // 16)))
        ax.set_xlabel("MoE layer")
        ax.set_title(sub, fontsize=10)
        fig.colorbar(image, ax=ax, label=bar_label, pad=0.01)
    _suptitle(fig, f"{title} (decode steps)", runs)
    absent_note = f"No per_layer.parquet in job(s) {', '.join(absent)}." if absent else ""
    return Plot("layer_heatmap", title, fig, (_reference_note(view) + absent_note).strip())


def _rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start; NaN ones skipped).

    Trailing, not centred, so that a change after a switch never shows before it.
    """
    finite = np.isfinite(values)
    sums = np.cumsum(np.concatenate([[0.0], np.where(finite, values, 0.0)]))
    counts = np.cumsum(np.concatenate([[0], finite]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    taken = counts[ends] - counts[starts]
    out = np.full(len(values), np.nan)
    np.divide(sums[ends] - sums[starts], taken, out=out, where=taken > 0)
    return out


def _switch_aligned(values: np.ndarray, switches: np.ndarray, before: int,
                    after: int, smooth: int) -> np.ndarray:
    """Mean of ``values`` at offsets -before..after-1 around each switch, within its segment.

    The mean is smoothed by a trailing mean over ``smooth`` offsets on each side of the switch
    separately, so nothing after a switch leaks before it.
    """
    edges = np.concatenate([[0], switches, [len(values)]])
    sums = np.zeros(before + after)
    counts = np.zeros(before + after)
    for i, switch in enumerate(switches):
        lo, hi = max(switch - before, edges[i]), min(switch + after, edges[i + 2])
        sums[lo - switch + before:hi - switch + before] += values[lo:hi]
        counts[lo - switch + before:hi - switch + before] += 1
    out = np.full(before + after, np.nan)
    np.divide(sums, counts, out=out, where=counts > 0)
    return np.concatenate([_rolling_mean(out[:before], smooth),
                           _rolling_mean(out[before:], smooth)])


def _zero_visible(ax) -> None:
    """Start the y axis just below 0, so a line at 0 (fetch_all's mass) is not hidden."""
    top = ax.get_ylim()[1]
    ax.set_ylim(-0.02 * top, top)


def _read_decode_tokens(path: Path) -> pl.DataFrame:
    tokens = pl.read_parquet(path, columns=["seq", "phase", "domain", "time_us", "mass"])
    return tokens.filter(pl.col("phase") == 1)


def _switches(tokens: pl.DataFrame) -> tuple[np.ndarray, str]:
    """Decode-token indices where a new domain (else a new sequence) starts, and which kind."""
    domain = tokens["domain"].to_numpy()
    if len(np.unique(domain[domain >= 0])) > 1:
        return np.flatnonzero(domain[1:] != domain[:-1]) + 1, "domain switch"
    seq = tokens["seq"].to_numpy()
    return np.flatnonzero(seq[1:] != seq[:-1]) + 1, "new sequence"


def plot_mass_over_tokens(sweep: Sweep, view: View) -> Plot:
    """Substituted mass along the trace with domain switches marked, and averaged after them."""
    title = "Substituted mass over the token sequence"
    runs, left_out = _sequence_runs(view)
    if runs.height == 0:
        return Plot("mass_over_tokens", title, None, "skipped: no successful run.")
    colors = strategy_colors(view.strategies())
    series, absent = [], []
    for row in runs.rows(named=True):
        path = sweep.root / row["job"] / "per_token.parquet"
        if path.is_file():
            series.append((row["strategy"], _read_decode_tokens(path)))
        else:
            absent.append(row["job"])
    absent_note = f"No per_token.parquet in job(s) {', '.join(absent)}. " if absent else ""
    series = [(label, tokens) for label, tokens in series if tokens.height > 0]
    if not series:
        return Plot("mass_over_tokens", title, None,
                    f"skipped: no per_token.parquet in job(s) {', '.join(absent)}." if absent
                    else "skipped: no decode tokens in per_token.parquet of job(s) "
                    f"{', '.join(runs['job'])}.")
    switches, kind = _switches(series[0][1])
    n = series[0][1].height
    window = min(n, int(np.clip(n // 100, 8, 512)))
    fig = _figure(11, 7.4 if len(switches) else 3.8)
    if len(switches):
        grid = fig.add_gridspec(2, 2)
        ax_seq = fig.add_subplot(grid[0, :])
        ax_mass, ax_ms = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    else:
        ax_seq = fig.add_subplot()
    stride = max(1, n // MAX_PLOT_POINTS)
    for label, tokens in series:
        mass = tokens["mass"].to_numpy()
        index = np.arange(len(mass))
        # from the first full window on: a mean over a few tokens at the start is noise
        ax_seq.plot(index[window - 1::stride], _rolling_mean(mass, window)[window - 1::stride],
                    lw=1.1, color=colors[label], label=label)
    _zero_visible(ax_seq)
    ax_seq.set_title(f"rolling mean; {_mark_switches(ax_seq, switches, kind)}" if len(switches)
                     else "rolling mean (the trace has no domain switch)", fontsize=10)
    ax_seq.set_xlabel("decode token (trace order)")
    ax_seq.set_ylabel(f"substituted mass per token\n(sum over layers, mean of last {window})")
    ax_seq.grid(alpha=0.3)
    ax_seq.legend(fontsize=8, loc="upper right")
    if len(switches):
        segment = int(np.median(np.diff(np.concatenate([[0], switches, [n]]))))
        after = int(np.clip(segment, 8, 256))
        before = max(2, after // 4)
        smooth = max(1, min(8, after // 32))
        offsets = np.arange(-before, after)
        for label, tokens in series:
            own, _ = _switches(tokens)
            for ax, values in ((ax_mass, tokens["mass"].to_numpy()),
                               (ax_ms, tokens["time_us"].to_numpy() / 1000)):
                ax.plot(offsets, _switch_aligned(values, own, before, after, smooth),
                        color=colors[label], lw=1.1, label=label)
        smoothed = f", mean of last {smooth}" if smooth > 1 else ""
        for ax, ylabel in ((ax_mass, f"substituted mass per token\n(sum over layers{smoothed})"),
                           (ax_ms, f"time per decode token (ms{smoothed})")):
            ax.axvline(0, color="0.3", ls="--", lw=1)
            ax.set_xlabel(f"decode tokens since {kind}")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        _zero_visible(ax_mass)
        ax_ms.set_ylim(bottom=0)
        ax_mass.set_title(f"mass around a {kind} (mean over {len(switches)})", fontsize=10)
        ax_ms.set_title(f"time around a {kind} (mean over {len(switches)})", fontsize=10)
    _suptitle(fig, f"{title}: what happens after a {kind}" if len(switches) else title, runs)
    left_out_note = f"Left out to keep the plot readable: {', '.join(left_out)}. " \
        if left_out else ""
    return Plot("mass_over_tokens", title, fig, (_reference_note(view) + absent_note
                                                 + left_out_note + _sequence_note(runs)).strip())


KIND_PLURAL = {"domain switch": "domain switches", "new sequence": "new sequences"}


def _mark_switches(ax, switches: np.ndarray, kind: str) -> str:
    """Mark switches on the sequence axis; returns how they are marked, for its title.

    A few get full-height dotted lines; more than MAX_SWITCH_LINES would hide the curves behind
    a grey wall (a 1M-token trace has thousands), so they become short ticks in a band below
    the zero line (where they hide no curve, not even fetch_all's mass of 0).
    """
    if len(switches) <= MAX_SWITCH_LINES:
        for switch in switches:
            ax.axvline(switch, color="0.5", ls=":", lw=0.8, alpha=0.7, zorder=0)
        return f"dotted lines: {kind}"
    top = ax.get_ylim()[1]
    ax.set_ylim(-0.1 * top, top)  # y = 0 at 1/11 of the height; the ticks take up 1/25
    ax.vlines(switches, 0, 0.04, transform=ax.get_xaxis_transform(), color="0.35", lw=0.6,
              alpha=0.5, zorder=1)
    return f"ticks along the bottom: {len(switches):,} {KIND_PLURAL.get(kind, kind)}"


def _sequence_note(runs: pl.DataFrame) -> str:
    """What to look for in the sequence plot, naming only the strategies it draws."""
    policies = runs[POLICY].to_list()
    notes = []
    if "fetch_all" in policies:
        notes.append("fetch_all never substitutes (mass 0); its time shows the cost of "
                     "fetching after a switch.")
    if "quality_first" in policies and "rule015" in policies:
        notes.append("Compare quality_first with rule015 (the same miss rule without "
                     "background admission) right after a switch: admission is meant to bring "
                     "the substituted mass down sooner.")
    elif BETA in runs.columns and runs.filter(pl.col(POLICY) == "quality_first")[BETA].n_unique() > 1:
        notes.append(f"Compare the quality_first lines right after a switch: a lower {BETA} "
                     "admits substituted experts sooner.")
    return " ".join(notes)


def all_plots(sweep: Sweep, view: View) -> list[Plot]:
    """Every figure of the report, in report order."""
    return [plot_time_vs_mass(sweep, view), plot_cache_fraction(sweep, view),
            plot_beta(sweep, view), plot_layer_heatmaps(sweep, view),
            plot_mass_over_tokens(sweep, view)]
