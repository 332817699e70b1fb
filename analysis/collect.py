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
- provenance columns ``provenance.trace.*``, ``provenance.model.*``,
  ``provenance.hardware.*``: what produced the run (``analysis.provenance``), for every job
  with a readable config.

A summary.json that is not a JSON object, or holds text where a number belongs, is an input
error (moe-sim writes it atomically, so it was damaged afterwards); an unreadable
``.hydra/config.yaml`` only fails its job (Hydra writes it as the job starts, and a killed job
may leave it half written).
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

from analysis import provenance
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
TAU, PROTECT_RANKS, BETA = "policy.tau", "policy.protect_ranks", "admission.beta"
# Summary keys read as numbers, and config keys the report computes with.
NUMERIC_RESULTS = ("tokens", "decode_tokens", "expert_calls", "hits", "hit_rate", "fetches",
                   "substitutions", "substitution_rate", "first_choice_substitutions",
                   "mean_mass", "ms_per_token")
NUMERIC_CONFIG = (FRACTION, TAU, PROTECT_RANKS, BETA)
WALL_CLOCK_RESULTS = ("sim_seconds",)  # differ between runs of identical configurations
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
    provenance_columns: tuple[str, ...] = ()
    # The sweep's command-line overrides (multirun.yaml; a single run's own); None if unknown.
    command: tuple[str, ...] | None = None

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
    facts: dict[str, Any] = field(default_factory=dict)  # provenance columns


def collect_sweep(sweep_dir: str | os.PathLike, *, progress: bool = False) -> pl.DataFrame:
    """One row per job of the sweep at ``sweep_dir``: meta, config and result columns."""
    return read_sweep(sweep_dir, progress=progress).table


def read_sweep(sweep_dir: str | os.PathLike, *, progress: bool = False) -> Sweep:
    """Read every run below ``sweep_dir``; raises InputError when there is no run to read or a
    summary.json is damaged (see the module docstring).

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
    _check_result_types(root, runs)
    command = _sweep_arguments(root)
    if command is None and len(run_dirs) == 1:
        command = runs[0].overrides if runs[0].status != MISSING else None
    return _assemble(root, runs, command)


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
    """One job's config, results, provenance and status; a failed or unfinished job becomes a
    failed row. Raises InputError for a damaged summary.json or a config value the report
    cannot compute with."""
    hydra_dir = run_dir / ".hydra"
    job = run_dir.relative_to(root).as_posix()
    overrides = _read_overrides(hydra_dir / "overrides.yaml")
    job_num, cwd = _job_facts(hydra_dir / "hydra.yaml", run_dir.name)
    run = _Run(job_num, job, FAILED, None, overrides)
    try:
        run.config = flatten_config(hydra_dir / "config.yaml")
    except Exception as exc:  # any unreadable config fails this job only, not the report
        run.error = f"unreadable .hydra/config.yaml: {_one_line(str(exc))}"
        return run
    _check_numbers(run.config, NUMERIC_CONFIG, hydra_dir / "config.yaml", job)
    summary, error_txt = run_dir / "summary.json", run_dir / "error.txt"
    loaded = _read_summary(summary, job) if summary.is_file() else None
    recorded = loaded.pop("provenance", None) if loaded is not None else None
    facts = provenance.run_provenance(run.config, recorded, cwd)
    run.facts = {provenance.column(g, n): v for g, names in facts.items()
                 for n, v in names.items()}
    if loaded is not None:
        run.results = _flatten(loaded, keep_lists=False)
        run.status = OK
    elif error_txt.is_file():
        run.error = _one_line(error_txt.read_text(errors="replace")) or "error.txt is empty"
    else:
        run.error = "no summary.json or error.txt: the job was interrupted or is still running"
    return run


def _read_summary(path: Path, job: str) -> dict:
    fix = f"re-run job {job} (moe-sim writes summary.json) or remove its directory"
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not readable as JSON ({_one_line(str(exc))}); {fix}") from None
    if not isinstance(loaded, dict):
        raise InputError(f"{path}: holds a JSON {type(loaded).__name__}, not an object; {fix}")
    _check_numbers(loaded, NUMERIC_RESULTS, path, job)
    return loaded


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = _one_line(repr(value))
    return text if len(text) <= 40 else text[:37] + "..."


def _check_numbers(values: dict[str, Any], keys: Sequence[str], path: Path, job: str) -> None:
    for key in keys:
        value = values.get(key)
        if value is not None and not _is_number(value):
            raise InputError(f"{path}: '{key}' is {_short(value)}, expected a number or null; "
                             f"fix the file or re-run job {job}")


def _check_result_types(root: Path, runs: list[_Run]) -> None:
    """A summary key that is a number in some jobs must not be text in others."""
    numeric = {k for run in runs for k, v in run.results.items() if _is_number(v)}
    for run in runs:
        for key in sorted(numeric):
            value = run.results.get(key)
            if value is not None and not _is_number(value):
                path = root / run.job / "summary.json"
                raise InputError(f"{path}: '{key}' is {_short(value)}, but a number in other "
                                 f"jobs; fix the file or re-run job {run.job}")


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


def _job_facts(hydra_yaml: Path, dir_name: str) -> tuple[int | None, str | None]:
    """(job number, the directory moe-sim ran in) from ``.hydra/hydra.yaml``."""
    try:
        hydra_cfg = _load_yaml(hydra_yaml)["hydra"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        hydra_cfg = {}
    num = _get(hydra_cfg, "job", "num")
    cwd = _get(hydra_cfg, "runtime", "cwd")
    try:
        num = int(dir_name if num is None else num)
    except (TypeError, ValueError):
        num = None
    return num, cwd if isinstance(cwd, str) else None


def _get(tree: Any, *keys: str) -> Any:
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _sweep_arguments(root: Path) -> list[str] | None:
    """The sweep's overrides from ``multirun.yaml`` (sweeper params first); None when unknown."""
    try:
        hydra_cfg = _load_yaml(root / "multirun.yaml")["hydra"]
        params = (hydra_cfg.get("sweeper") or {}).get("params") or {}
        return [f"{k}={v}" for k, v in params.items()] + [
            str(a) for a in hydra_cfg["overrides"]["task"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None


def expected_overrides(root: Path) -> list[list[str]] | None:
    """Each job's overrides in job order, from ``multirun.yaml``; None when unknown.

    Only the basic sweeper's jobs can be listed (it expands a cartesian product); this repeats
    its expansion so that job numbers line up.
    """
    args = _sweep_arguments(root)
    if args is None:
        return None
    try:
        sweeper = _load_yaml(root / "multirun.yaml")["hydra"].get("sweeper") or {}
        if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return None
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(args)
        return BasicSweeper.split_arguments(parsed, None)[0]
    except Exception:  # an unexpected multirun.yaml only costs the list of jobs never started
        return None


def _missing_runs(root: Path, present: set[int | None]) -> list[_Run]:
    expected = expected_overrides(root) or []
    return [_Run(num, str(num), MISSING, "no run directory: the sweep stopped before this job",
                 list(overrides))
            for num, overrides in enumerate(expected) if num not in present]


def _assemble(root: Path, runs: list[_Run], command: list[str] | None) -> Sweep:
    config_keys = _ordered_union(run.config for run in runs)
    result_keys = _ordered_union(run.results for run in runs)
    config_names = {k: CONFIG_PREFIX + k if k in META_COLUMNS else k for k in config_keys}
    taken = set(META_COLUMNS) | set(config_names.values()) | set(provenance.columns())
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
    facts = provenance.columns()
    series += [_series(name, [r.facts.get(name) for r in runs]) for name in facts]
    override_keys = frozenset(_override_key(o) for r in runs for o in r.overrides)
    return Sweep(root, pl.DataFrame(series), tuple(config_names.values()),
                 tuple(result_names.values()), override_keys, facts,
                 None if command is None else tuple(command))


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
    - ``inert``: per policy, the strategy columns it was swept over that did not change a
      single result (admission.beta for fetch_all, which never substitutes); labels leave
      them out, so those runs read as one strategy.
    """

    labelled: pl.DataFrame  # the sweep's table plus "strategy" and a sort key "_order"
    ok: pl.DataFrame  # the successful rows of ``labelled``, in job order
    strategy_columns: tuple[str, ...]
    setting_columns: tuple[str, ...]
    reference: dict[str, Any]
    inert: dict[str, tuple[str, ...]] = field(default_factory=dict)

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
    inert = inert_columns(sweep, ok, strategy_cols)
    labelled = with_strategy(sweep.table, strategy_cols, inert)
    ok = labelled.filter(pl.col("status") == OK)
    return View(labelled, ok, strategy_cols, setting_cols, _reference(ok, setting_cols), inert)


def inert_columns(sweep: Sweep, ok: pl.DataFrame,
                  strategy_cols: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Per policy, the strategy columns it varies over whose value changes none of its
    results (wall-clock ones aside), judged among runs that agree on every other setting."""
    if POLICY not in ok.columns or ok.height == 0:
        return {}
    compared = [c for c in sweep.result_columns if c not in WALL_CLOCK_RESULTS]
    if not compared:
        return {}
    inert: dict[str, tuple[str, ...]] = {}
    for (name,), rows in ok.group_by(POLICY, maintain_order=True):
        found: list[str] = []
        for column in strategy_cols:
            if column == POLICY or rows[column].n_unique() < 2:
                continue
            keys = [c for c in sweep.config_columns if c != column and c not in found]
            groups = rows.group_by(keys).agg(pl.len().alias("runs"),
                                             pl.struct(compared).n_unique().alias("results"))
            if groups["results"].max() == 1 and groups["runs"].max() > 1:
                found.append(column)
        if found:
            inert[name] = tuple(found)
    return inert


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
        if column in columns or ok[column].n_unique() < 2 or overridden(column, sweep):
            continue
        per_policy = ok.group_by(POLICY).agg(pl.col(column).n_unique().alias("n"))
        if per_policy["n"].max() == 1:
            columns.append(column)
    return tuple(columns)


def overridden(column: str, sweep: Sweep) -> bool:
    """Whether the sweep's overrides set ``column`` or a group above it (``cache=global``)."""
    parts = column.split(".")
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    # A group override ("hardware=rtx3090") is written with "/" for nested groups.
    return any(key.replace("/", ".") in prefixes for key in sweep.override_keys)


def with_strategy(table: pl.DataFrame, strategy_cols: Iterable[str],
                  inert: dict[str, tuple[str, ...]] | None = None) -> pl.DataFrame:
    """Add ``strategy`` (e.g. ``quality_first (beta=0.25)``) and a hidden sort key ``_order``.

    A label names the policy plus the strategy columns that vary among runs of that policy,
    except those ``inert`` lists for it.
    """
    if POLICY not in table.columns:
        return table.with_columns(strategy=pl.lit(None, pl.String), _order=pl.lit(0))
    extra_cols = [c for c in strategy_cols if c != POLICY]
    inert = inert or {}
    varying: dict[Any, list[str]] = {}
    for (name,), group in table.group_by(POLICY, maintain_order=True):
        varying[name] = [c for c in extra_cols
                         if group[c].n_unique() > 1 and c not in inert.get(name, ())]
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


def is_unmodified_fetch_all(row: dict[str, Any]) -> bool:
    """Whether a run is fetch_all as its preset defines it: every miss fetched (policy.tau 0,
    policy.protect_ranks 0) and no background admission (admission.beta null)."""
    return (row.get(POLICY) == BASELINE and row.get(TAU, 0.0) == 0
            and row.get(PROTECT_RANKS, 0) == 0 and row.get(BETA) is None)


def speedup_table(sweep: Sweep, view: View | None = None) -> pl.DataFrame:
    """Each successful run against the unmodified fetch_all run with the same settings.

    The baseline is a run for which :func:`is_unmodified_fetch_all` holds and which has the
    same value in every config column outside the strategy (trace, model, hardware, cache,
    ...); the earliest such job when there are several, none when there is none.

    Columns: ``job``, the setting columns, ``strategy``, ``ms_per_token``,
    ``speedup`` (baseline ms_per_token / ms_per_token; null without a baseline),
    ``substitution_rate``, ``first_choice_substitutions``, ``mean_mass``, ``hit_rate``,
    ``baseline_job``, ``shown_as`` (the job standing for all runs with the same setting and
    strategy label, which have identical results: the baseline among them, else the earliest).
    Rows by setting, then strategy in the paper's order.
    """
    view = view or make_view(sweep)
    match_cols = [c for c in sweep.config_columns if c not in view.strategy_columns]
    ms = sweep.result_column("ms_per_token")
    baselines: dict[tuple, dict] = {}
    for row in view.ok.rows(named=True):
        if is_unmodified_fetch_all(row):
            baselines.setdefault(tuple(row[c] for c in match_cols), row)
    speedups, baseline_jobs, shown_as = [], [], {}
    for row in view.ok.rows(named=True):
        base = baselines.get(tuple(row[c] for c in match_cols))
        ok_times = base is not None and base.get(ms) is not None and row.get(ms)
        speedups.append(base[ms] / row[ms] if ok_times else None)
        baseline_jobs.append(base["job"] if base is not None else None)
        key = (*(row[c] for c in view.setting_columns), row["strategy"])
        if key not in shown_as or (base is not None and base["job"] == row["job"]):
            shown_as[key] = row["job"]
    results = [sweep.result_column(k) for k in ("ms_per_token", "substitution_rate",
                                                 "first_choice_substitutions", "mean_mass",
                                                 "hit_rate")]
    table = view.ok.with_columns(
        pl.Series("speedup", speedups, dtype=pl.Float64),
        pl.Series("baseline_job", baseline_jobs, dtype=pl.String),
        pl.Series("shown_as", [shown_as[(*(r[c] for c in view.setting_columns), r["strategy"])]
                               for r in view.ok.rows(named=True)], dtype=pl.String))
    keep = ["job", *view.setting_columns, "strategy",
            *(c for c in results if c in table.columns), "speedup", "baseline_job", "shown_as"]
    sort_cols = [*view.setting_columns, "_order", "job_num"]
    return table.sort(sort_cols, nulls_last=True).select(keep)
