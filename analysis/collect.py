"""Read a ``moe-sim`` sweep directory into one polars table, and the views a report needs.

A sweep is Hydra's multirun layout: ``SWEEP_DIR/<job>/`` with ``.hydra/config.yaml``,
``.hydra/overrides.yaml``, ``.hydra/hydra.yaml`` and, when the job succeeded, ``summary.json``
(when it failed, ``error.txt``); ``SWEEP_DIR/multirun.yaml`` holds the sweep's own overrides.
A single run directory reads as a sweep of one.

The table has one row per job, in job order:

- meta columns ``job_num``, ``job`` (the run directory relative to SWEEP_DIR), ``status``
  (``ok``, ``failed``, or ``missing`` for a job the sweep never started), ``error`` and
  ``overrides`` (the job's command-line overrides, space separated);
- config columns: every leaf of ``.hydra/config.yaml`` under its dotted name (``policy.tau``),
  interpolations resolved where they can be outside Hydra, lists as compact JSON strings;
- result columns: every scalar of ``summary.json`` under its own name (nested objects under
  dotted names, lists left out). A summary key that is also a config column (``engine``) is
  stored as ``result.<key>``; config and result keys that would shadow a meta column get
  ``config.`` / ``result.`` in front. Results are null for jobs that did not succeed.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from traces.errors import InputError

OK, FAILED, MISSING = "ok", "failed", "missing"
META_COLUMNS = ("job_num", "job", "status", "error", "overrides")
CONFIG_PREFIX, RESULT_PREFIX = "config.", "result."
MIN_PROGRESS_JOBS = 20  # fewer runs than this read too fast to need a progress bar

POLICY = "policy.name"
BASELINE = "fetch_all"
# Presets in the paper's order; other policy names follow alphabetically.
PAPER_ORDER = ("fetch_all", "rule015", "first_choice", "substitute_all", "quality_first",
               "speed_first", "cpu_offload")
STRATEGY_PREFIXES = ("policy.", "admission.")
FRACTION = "cache.fraction"
REFERENCE_FRACTION = 0.25  # the resident share the paper reports


@dataclass(frozen=True)
class Sweep:
    """A collected sweep: the table plus which of its columns came from where."""

    root: Path
    table: pl.DataFrame
    config_columns: tuple[str, ...]
    result_columns: tuple[str, ...]
    # Keys the jobs' overrides set ("policy", "cache.fraction"): what the user swept or fixed.
    override_keys: frozenset[str] = frozenset()

    def result_column(self, key: str) -> str:
        """The table column holding ``summary.json`` key ``key``."""
        return key if key in self.result_columns else RESULT_PREFIX + key


@dataclass
class _Run:
    job_num: int | None
    job: str
    status: str
    error: str | None
    overrides: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)


def collect_sweep(sweep_dir: str | os.PathLike, *, progress: bool = False) -> pl.DataFrame:
    """One row per job of the sweep at ``sweep_dir``: meta, config and result columns."""
    return read_sweep(sweep_dir, progress=progress).table


def read_sweep(sweep_dir: str | os.PathLike, *, progress: bool = False) -> Sweep:
    """Read every run below ``sweep_dir``; raises InputError when there is no run to read.

    ``progress`` shows a bar (jobs read / total) on an interactive stderr for large sweeps.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise InputError(f"{root}: no such sweep directory")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise InputError(f"{root}: no runs found (no <job>/.hydra/config.yaml below it); "
                         "pass the directory of a moe-sim run or multirun")
    bar = tqdm(run_dirs, desc="reading runs", unit="job", file=sys.stderr,
               disable=None if progress and len(run_dirs) >= MIN_PROGRESS_JOBS else True)
    runs = [read_run(root, run_dir) for run_dir in bar]
    runs += _missing_runs(root, {run.job_num for run in runs})
    runs.sort(key=lambda r: (r.job_num is None, r.job_num or 0, r.job))
    return _assemble(root, runs)


def find_run_dirs(root: Path) -> list[Path]:
    """Directories below ``root`` (itself included) that hold ``.hydra/config.yaml``."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        if ".hydra" in dirnames and os.path.isfile(os.path.join(dirpath, ".hydra", "config.yaml")):
            found.append(Path(dirpath))
            dirnames.clear()  # a run directory holds outputs, not further runs
        else:
            dirnames.sort()
    return found


def read_run(root: Path, run_dir: Path) -> _Run:
    """One job's config, results and status; a broken job becomes a failed row, never an error."""
    hydra_dir = run_dir / ".hydra"
    job = run_dir.relative_to(root).as_posix()
    overrides = _read_overrides(hydra_dir / "overrides.yaml")
    run = _Run(_job_num(hydra_dir / "hydra.yaml", run_dir.name), job, FAILED, None, overrides)
    try:
        run.config = flatten_config(hydra_dir / "config.yaml")
    except Exception as exc:  # any unreadable config fails this job only, not the report
        run.error = f"unreadable .hydra/config.yaml: {_one_line(str(exc))}"
        return run
    summary, error_txt = run_dir / "summary.json", run_dir / "error.txt"
    if summary.is_file():
        try:
            loaded = json.loads(summary.read_text())
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            run.error = f"unreadable summary.json: {_one_line(str(exc))}"
            return run
        run.results = _flatten(loaded, keep_lists=False)
        run.status = OK
    elif error_txt.is_file():
        run.error = _one_line(error_txt.read_text(errors="replace")) or "error.txt is empty"
    else:
        run.error = "no summary.json or error.txt: the job was interrupted or is still running"
    return run


def flatten_config(path: Path) -> dict[str, Any]:
    """Leaves of a saved Hydra config as {dotted key: scalar}; lists as JSON strings."""
    cfg = OmegaConf.load(path)
    flat = _flatten(OmegaConf.to_container(cfg, resolve=False), keep_lists=True)
    for key, value in flat.items():
        if isinstance(value, str) and "${" in value:
            flat[key] = _resolve(cfg, key, value)
    return flat


def _resolve(cfg: DictConfig, key: str, raw: str) -> Any:
    # Resolvers such as ${hydra:...} exist only inside a Hydra app: keep the raw text then.
    try:
        value = OmegaConf.select(cfg, key)
    except Exception:
        return raw
    return raw if isinstance(value, DictConfig | ListConfig) else value


def _flatten(obj: dict, *, keep_lists: bool, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, keep_lists=keep_lists, prefix=name + "."))
        elif isinstance(value, list):
            if keep_lists:
                flat[name] = json.dumps(value, separators=(",", ":"))
        else:
            flat[name] = value
    return flat


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)  # noqa: S506 (a safe loader)


def _read_overrides(path: Path) -> list[str]:
    try:
        loaded = _load_yaml(path)
    except (OSError, yaml.YAMLError):
        return []
    return [str(item) for item in loaded] if isinstance(loaded, list) else []


def _job_num(hydra_yaml: Path, dir_name: str) -> int | None:
    try:
        num = _load_yaml(hydra_yaml)["hydra"]["job"]["num"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        num = dir_name
    try:
        return int(num)
    except (TypeError, ValueError):
        return None


def expected_overrides(root: Path) -> list[list[str]] | None:
    """Each job's overrides in job order, from ``multirun.yaml``; None when unknown.

    Only the basic sweeper's jobs can be listed (it expands a cartesian product); this repeats
    its expansion so that job numbers line up.
    """
    path = root / "multirun.yaml"
    if not path.is_file():
        return None
    try:
        hydra_cfg = _load_yaml(path)["hydra"]
        sweeper = hydra_cfg.get("sweeper") or {}
        if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return None
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        args += [str(a) for a in hydra_cfg["overrides"]["task"]]
        parsed = OverridesParser.create().parse_overrides(args)
        return BasicSweeper.split_arguments(parsed, None)[0]
    except Exception:  # an unexpected multirun.yaml only costs the list of jobs never started
        return None


def _missing_runs(root: Path, present: set[int | None]) -> list[_Run]:
    expected = expected_overrides(root) or []
    return [_Run(num, str(num), MISSING, "no run directory: the sweep stopped before this job",
                 list(overrides))
            for num, overrides in enumerate(expected) if num not in present]


def _assemble(root: Path, runs: list[_Run]) -> Sweep:
    config_keys = _ordered_union(run.config for run in runs)
    result_keys = _ordered_union(run.results for run in runs)
    config_names = {k: CONFIG_PREFIX + k if k in META_COLUMNS else k for k in config_keys}
    taken = set(META_COLUMNS) | set(config_names.values())
    result_names = {k: RESULT_PREFIX + k if k in taken else k for k in result_keys}
    series = [
        pl.Series("job_num", [r.job_num for r in runs], dtype=pl.Int64),
        pl.Series("job", [r.job for r in runs], dtype=pl.String),
        pl.Series("status", [r.status for r in runs], dtype=pl.String),
        pl.Series("error", [r.error for r in runs], dtype=pl.String),
        pl.Series("overrides", [" ".join(r.overrides) for r in runs], dtype=pl.String),
    ]
    series += [_series(name, [r.config.get(k) for r in runs]) for k, name in config_names.items()]
    series += [_series(name, [r.results.get(k) for r in runs]) for k, name in result_names.items()]
    override_keys = frozenset(_override_key(o) for r in runs for o in r.overrides)
    return Sweep(root, pl.DataFrame(series), tuple(config_names.values()),
                 tuple(result_names.values()), override_keys)


def _ordered_union(dicts: Iterable[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for d in dicts:
        seen.update(dict.fromkeys(d))
    return list(seen)


def _series(name: str, values: list[Any]) -> pl.Series:
    """One column with a single dtype even when jobs disagree (int vs float, number vs text)."""
    present = [v for v in values if v is not None]
    if not present:
        return pl.Series(name, values, dtype=pl.Null)
    if all(isinstance(v, bool) for v in present):
        return pl.Series(name, values, dtype=pl.Boolean)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pl.Series(name, values, dtype=pl.Int64)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return pl.Series(name, [None if v is None else float(v) for v in values], dtype=pl.Float64)
    return pl.Series(name, [v if v is None or isinstance(v, str) else json.dumps(v)
                            for v in values], dtype=pl.String)


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# --- views of a collected sweep -------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """The successful runs of a sweep, labelled by strategy, with what else the sweep varies.

    - ``strategy_columns``: config columns that make up a strategy: ``policy.*``, ``admission.*``
      and any column a policy preset sets by itself (one value per policy, never overridden,
      e.g. ``cache.eviction`` when quality_first brings its own eviction).
    - ``setting_columns``: the other config columns whose value varies between runs.
    - ``reference``: the setting shown where a plot needs one run per strategy: the setting
      of actual runs with the cache fraction nearest the paper's 25 %, then with most runs.
    """

    labelled: pl.DataFrame  # the sweep's table plus "strategy" and a sort key "_order"
    ok: pl.DataFrame  # the successful rows of ``labelled``, in job order
    strategy_columns: tuple[str, ...]
    setting_columns: tuple[str, ...]
    reference: dict[str, Any]

    def strategies(self) -> list[str]:
        """Strategy labels present, in the paper's order."""
        return self.ok.sort("_order")["strategy"].unique(maintain_order=True).to_list()

    def at_reference(self, exclude: Iterable[str] = ()) -> pl.DataFrame:
        """Runs at the reference setting, except for the columns in ``exclude``."""
        rows = self.ok
        for column, value in self.reference.items():
            if column not in exclude:
                rows = rows.filter(_equals(column, value))
        return rows


def make_view(sweep: Sweep) -> View:
    """Label successful runs by strategy and find the settings the sweep varies."""
    ok = sweep.table.filter(pl.col("status") == OK)
    strategy_cols = strategy_columns(sweep, ok)
    setting_cols = _named_settings(ok, [c for c in sweep.config_columns
                                        if c not in strategy_cols and ok[c].n_unique() > 1])
    labelled = with_strategy(sweep.table, strategy_cols)
    ok = labelled.filter(pl.col("status") == OK)
    return View(labelled, ok, strategy_cols, setting_cols, _reference(ok, setting_cols))


def _named_settings(ok: pl.DataFrame, columns: list[str]) -> tuple[str, ...]:
    """Varying settings, with a group's fields folded into its name: when ``hardware.name``
    varies, ``hardware.pcie.bandwidth_gbps`` (one value per name) is not a setting of its own."""
    kept = []
    for column in columns:
        name = column.split(".", 1)[0] + ".name"
        if name != column and name in columns:
            per_name = ok.group_by(name).agg(pl.col(column).n_unique().alias("n"))
            if per_name["n"].max() == 1:
                continue
        kept.append(column)
    return tuple(kept)


def strategy_columns(sweep: Sweep, ok: pl.DataFrame) -> tuple[str, ...]:
    """``policy.*``, ``admission.*`` and columns set by policy presets (see View)."""
    columns = [c for c in sweep.config_columns if c.startswith(STRATEGY_PREFIXES)]
    if POLICY not in ok.columns or ok.height == 0:
        return tuple(columns)
    for column in sweep.config_columns:
        if column in columns or ok[column].n_unique() < 2 or _overridden(column, sweep):
            continue
        per_policy = ok.group_by(POLICY).agg(pl.col(column).n_unique().alias("n"))
        if per_policy["n"].max() == 1:
            columns.append(column)
    return tuple(columns)


def _overridden(column: str, sweep: Sweep) -> bool:
    parts = column.split(".")
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    # A group override ("hardware=rtx3090") is written with "/" for nested groups.
    return any(key.replace("/", ".") in prefixes for key in sweep.override_keys)


def with_strategy(table: pl.DataFrame, strategy_cols: Iterable[str]) -> pl.DataFrame:
    """Add ``strategy`` (e.g. ``quality_first (beta=0.25)``) and a hidden sort key ``_order``.

    A label names the policy plus the strategy columns that vary among runs of that policy.
    """
    if POLICY not in table.columns:
        return table.with_columns(strategy=pl.lit(None, pl.String), _order=pl.lit(0))
    extra_cols = [c for c in strategy_cols if c != POLICY]
    varying: dict[Any, list[str]] = {}
    for (name,), group in table.group_by(POLICY, maintain_order=True):
        varying[name] = [c for c in extra_cols if group[c].n_unique() > 1]
    labels, orders = [], []
    rows = table.select(POLICY, *extra_cols).rows(named=True)
    for row in rows:
        name = row[POLICY]
        shown = varying.get(name, [])
        extras = ", ".join(f"{c.rsplit('.', 1)[-1]}={format_value(row[c])}" for c in shown)
        labels.append(None if name is None else f"{name} ({extras})" if extras else str(name))
        orders.append((policy_rank(name), str(name), tuple(_sortable(row[c]) for c in shown)))
    rank = {key: i for i, key in enumerate(sorted(set(orders)))}
    return table.with_columns(pl.Series("strategy", labels, dtype=pl.String),
                              pl.Series("_order", [rank[o] for o in orders], dtype=pl.Int64))


def policy_rank(name: Any) -> int:
    """Position of a policy name in the paper's order (unknown names last)."""
    return PAPER_ORDER.index(name) if name in PAPER_ORDER else len(PAPER_ORDER)


def format_value(value: Any) -> str:
    """A config value as a user would type it in an override."""
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _sortable(value: Any) -> tuple:
    if value is None:
        return (2, 0.0, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _equals(column: str, value: Any) -> pl.Expr:
    return pl.col(column).is_null() if value is None else pl.col(column) == value


def _reference(ok: pl.DataFrame, setting_cols: Sequence[str]) -> dict[str, Any]:
    """The setting of actual runs: cache fraction nearest the paper's, then most strategies."""
    if not setting_cols:
        return {}
    combos = ok.group_by(list(setting_cols), maintain_order=True).agg(pl.len().alias("_runs"))

    def preference(combo: dict) -> tuple:
        fraction = combo.get(FRACTION)
        distance = abs(fraction - REFERENCE_FRACTION) if isinstance(fraction, float) else 0.0
        return distance, -combo["_runs"]

    best = min(combos.rows(named=True), key=preference)  # ties: the earliest job's setting
    return {c: best[c] for c in setting_cols}


def speedup_table(sweep: Sweep, view: View | None = None) -> pl.DataFrame:
    """Each successful run against the fetch_all run with the same non-strategy config.

    Columns: ``job``, the setting columns, ``strategy``, ``ms_per_token``,
    ``speedup`` (baseline ms_per_token / ms_per_token; null without a baseline),
    ``substitution_rate``, ``first_choice_substitutions``, ``mean_mass``, ``hit_rate``,
    ``baseline_job``. Rows by setting, then strategy in the paper's order.
    """
    view = view or make_view(sweep)
    match_cols = [c for c in sweep.config_columns if c not in view.strategy_columns]
    ms = sweep.result_column("ms_per_token")
    baselines: dict[tuple, list[dict]] = {}
    if POLICY in view.ok.columns:
        for row in view.ok.filter(pl.col(POLICY) == BASELINE).rows(named=True):
            baselines.setdefault(tuple(row[c] for c in match_cols), []).append(row)

    def agreement(row: dict, base: dict) -> int:
        return sum(row[c] == base[c] for c in view.strategy_columns)

    speedups, baseline_jobs = [], []
    for row in view.ok.rows(named=True):
        # Several fetch_all runs may match (a sweep over beta runs fetch_all at each beta):
        # take the one sharing most strategy values, the earliest among equals.
        candidates = baselines.get(tuple(row[c] for c in match_cols), [])
        base = max(candidates, key=lambda b: agreement(row, b)) if candidates else None
        ok_times = base is not None and base.get(ms) is not None and row.get(ms)
        speedups.append(base[ms] / row[ms] if ok_times else None)
        baseline_jobs.append(base["job"] if base is not None else None)
    results = [sweep.result_column(k) for k in ("ms_per_token", "substitution_rate",
                                                 "first_choice_substitutions", "mean_mass",
                                                 "hit_rate")]
    table = view.ok.with_columns(pl.Series("speedup", speedups, dtype=pl.Float64),
                                 pl.Series("baseline_job", baseline_jobs, dtype=pl.String))
    keep = ["job", *view.setting_columns, "strategy",
            *(c for c in results if c in table.columns), "speedup", "baseline_job"]
    sort_cols = [*view.setting_columns, "_order", "job_num"]
    return table.sort(sort_cols, nulls_last=True).select(keep)
