"""``hydra/launcher=inprocess``: every job of a moe-sim multirun in this process, one decode per trace.

The basic launcher runs jobs one after another and each job decodes its trace from Parquet
again; joblib and SLURM start a process per job, which pays the imports, the compose and the
kernel load each time. This launcher keeps Hydra's own path for every job (its config comes from
Hydra's config loader, :func:`hydra.core.utils.run_job` writes ``.hydra/``, runs the callbacks
and the task, and returns the :class:`~hydra.core.utils.JobReturn`), so run directories,
``multirun.yaml``, progress lines and failures are those of the basic launcher. What it changes
is where the simulation runs:

- each trace file of the sweep is decoded once, into the trace cache (simulator/trace_cache.py):
  the shared copy when the job sets ``trace.cache=true``, otherwise a private copy in the sweep
  directory, removed when the jobs are done; a thread of its own decodes it while this thread
  composes the sweep's configs, and the simulations over it wait for it; the jobs that walk the
  top-R order of unselected logit ids wait for one ranking pass on that thread, which keeps the
  order beside the copy (:meth:`SharedTraces.order`);
- each job's simulation starts on a thread pool as soon as its config is composed
  (``hydra.launcher.workers`` at once; the Numba kernel releases the GIL), while this thread
  composes further configs and lets ``run_job`` record finished jobs in job order. The job's
  task (``simulator.run._task``) takes the simulation it finds ready through
  :func:`prepared_simulation` when the config it resolves is the one simulated, and simulates
  itself otherwise;
- the configs the sweeper composes to validate a batch before launching it are kept and used,
  not composed a second time, and their simulations start during the validation.

Jobs that change the working directory (``hydra.job.chdir``) or the environment
(``hydra.job.env_set``) for their task run one after another inside their task, as with the
basic launcher: a simulation ahead of its task would see neither.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import shutil
import sys
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from traces.errors import EXIT_INPUT_ERROR, InputError

log = logging.getLogger(__name__)

# Simulated tokens whose results may wait to be recorded while the sweeper validates a batch
# (a result holds ~51 bytes per token: about 0.5 GB).
WAITING_TOKENS = 10_000_000


@dataclass
class PreparedJob:
    """A job's simulation started ahead of its task: the task config it runs and its future."""

    plain: dict
    future: Future
    tokens: int


_PREPARED: contextvars.ContextVar[PreparedJob | None] = contextvars.ContextVar(
    "moe_sim_prepared_job", default=None)


def prepared_simulation(plain: dict) -> tuple[dict, object] | None:
    """``(summary, SimResult)`` of the simulation the in-process launcher started for the job
    it is recording, if that simulation ran ``plain`` (the task's resolved config); else None.

    Waits for the simulation; re-raises what it raised (an InputError as the task would have).
    """
    job = _PREPARED.get()
    if job is None or job.plain != plain:
        return None
    return job.future.result()


def task_config(config: DictConfig) -> dict:
    """A job's config as its task resolves it: without the ``hydra`` node, interpolations
    resolved (``${hydra:...}`` against the sweep's config, unlike in the task: such a job then
    simulates in its task, see :func:`prepared_simulation`)."""
    return {key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            for key, value in config.items() if key != "hydra"}


class SharedTraces:
    """The decoded copy of each trace file a sweep reads, built on first use by a thread of its
    own, while this thread composes the sweep's further configs.

    ``private_root``: the trace cache for jobs without ``trace.cache`` (removed by
    :meth:`close`); jobs with ``trace.cache=true`` use the user's trace cache, as on their own.
    """

    def __init__(self, private_root: Path):
        self.private_root = private_root
        self._opened: dict[tuple[Path, bool], tuple[object, Future]] = {}
        self._orders: dict[tuple[int, int], Future] = {}
        self._orders_lock = threading.Lock()  # jobs ask for orders from the simulation threads
        self._builds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")

    def source(self, trace_cfg: dict) -> tuple[object, Future] | None:
        """The trace of ``trace_cfg`` (a CachedTrace) and the future of its decoding into the
        cache, or None where it cannot be opened (a missing or broken file: the job opens it
        itself and reports why)."""
        from simulator.run import resolve_path
        from simulator.trace_cache import cached_source

        path = resolve_path(str(trace_cfg["path"]))
        shared = bool(trace_cfg.get("cache"))
        key = (path.resolve(), shared)
        if key not in self._opened:
            try:
                source = cached_source(path, None if shared else self.private_root)
            except InputError:
                self._opened[key] = None
            else:
                self._opened[key] = (source, self._builds.submit(source.build))
        return self._opened[key]

    def order(self, source, order_r: int) -> Future:
        """The future of ranking ``source``'s logits into its kept top-``order_r`` order
        (:meth:`~simulator.trace_cache.CachedTrace.keep_order`), started by the first job that
        reads it: the jobs after it wait for that one pass instead of each ranking the logits
        again while it runs."""
        key = (id(source), order_r)
        with self._orders_lock:
            if key not in self._orders:
                self._orders[key] = self._builds.submit(source.keep_order, order_r)
            return self._orders[key]

    def close(self) -> None:
        """Forget the copies and remove the private ones (after a build under way)."""
        self._builds.shutdown(wait=True, cancel_futures=True)
        self._opened.clear()
        self._orders.clear()
        shutil.rmtree(self.private_root, ignore_errors=True)


class Simulations:
    """The thread pool running jobs' simulations over their shared decoded traces."""

    def __init__(self, sweep_dir: Path, workers: int):
        from traces.atomic import remove_orphans, temp_path

        remove_orphans(sweep_dir, "trace_cache")  # the private copy of a sweep that was killed
        self.traces = SharedTraces(temp_path(sweep_dir / "trace_cache"))
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="simulate")
        self.waiting_tokens = 0  # of started simulations not yet recorded
        self._closed = weakref.finalize(self, _close, self.pool, self.traces)

    def start(self, config: DictConfig) -> PreparedJob | None:
        """Start the job's simulation (None where its task should simulate: its config does
        not resolve here, or its trace cannot be opened); it waits for the trace's decoding."""
        try:
            plain = task_config(config)
            shared = self.traces.source(plain["trace"])
        except Exception:  # the task meets the same problem and reports it
            return None
        if shared is None:
            return None
        opened, built = shared
        self.waiting_tokens += opened.num_tokens
        return PreparedJob(plain, self.pool.submit(_simulate_decoded, plain, opened, built, self.traces),
                           opened.num_tokens)

    def recorded(self, job: PreparedJob) -> None:
        """``job`` was recorded (or dropped): its result no longer waits."""
        self.waiting_tokens -= job.tokens
        job.future.cancel()  # its task did not ask for it (another config): do not run it

    def close(self) -> None:
        """Stop queued simulations, wait for running ones, remove the private trace copies."""
        self._closed()


def _simulate_decoded(plain: dict, opened, built: Future, traces: SharedTraces):
    """:func:`simulator.run.simulate_config` over the shared decoded trace once it is built (and
    its top-R order, where the job walks one: :meth:`SharedTraces.order`); where the decoding
    failed, over the trace file as the job's task would open it (and fail the same)."""
    from simulator.engine import read_options
    from simulator.run import prepare, run_prepared, simulate_config

    try:
        built.result()
    except Exception:  # noqa: BLE001 - the job meets the problem itself and reports it
        return simulate_config(plain)
    prepared = prepare(plain, opened)
    order_r = read_options(prepared.params, opened)["order_r"]
    if order_r and not opened.keeps_order(order_r):
        with contextlib.suppress(Exception):  # else the job's own pass ranks the logits (and
            traces.order(opened, order_r).result()  # meets what stopped this one)
    return run_prepared(prepared)


def _close(pool: ThreadPoolExecutor, traces: SharedTraces) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    traces.close()


class _KeepComposed:
    """A config loader passing every job config it composes for the launcher's sweep to
    ``composed(overrides, config)``; otherwise the loader it wraps.

    A job whose overrides differ from an earlier job's of the sweep only in the values of plain
    ``key=value`` overrides (no config group, no hydra key, no add or delete, each key once)
    starts from a copy of that job's config: Hydra's own override step
    (``_apply_overrides_to_config``) sets the differing values, and the job's records of its
    overrides (``hydra.overrides.task``, ``hydra.job.override_dirname``) are rewritten as
    Hydra writes them. That is what composing it again gives (tests/test_launcher.py compares
    every job file with the basic launcher's), without reading and merging the config tree
    again, most of a small job's fixed cost.
    """

    def __init__(self, loader, master: DictConfig, composed):
        self._loader, self._master, self._composed = loader, master, composed
        self._bases: dict[tuple, tuple[list, DictConfig]] = {}

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        if master_config is not self._master:
            return self._loader.load_sweep_config(master_config, sweep_overrides)
        parsed = self._plain(sweep_overrides)
        signature = None if parsed is None else tuple(
            (o.key_or_group, None if value else o.input_line) for o, value in parsed)
        if signature in self._bases:
            config = self._from_base(master_config, parsed, *self._bases[signature])
        else:
            config = self._loader.load_sweep_config(master_config, sweep_overrides)
            if signature is not None:
                self._bases[signature] = ([o for o, _ in parsed], copy.deepcopy(config))
        self._composed(tuple(sweep_overrides), config)
        return config

    def _plain(self, overrides: list[str]):
        """``[(Override, is a plain value override)]``, or None where the sweep's overrides are
        not all single values with distinct keys (then every job is composed)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.override_parser.types import OverrideType

        try:
            parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
        except Exception:  # Hydra reports it when it composes the job
            return None
        keys = [o.key_or_group for o in parsed]
        if len(set(keys)) != len(keys) or any(o.is_sweep_override() for o in parsed):
            return None
        repository = getattr(self._loader, "repository", None)
        if repository is None:
            return None
        out = []
        for o in parsed:
            group = o.package is not None or repository.group_exists(o.key_or_group.replace(".", "/"))
            plain = (not group and not o.is_hydra_override() and o.type == OverrideType.CHANGE)
            out.append((o, plain))
        return out

    @staticmethod
    def _from_base(master: DictConfig, parsed, base_overrides: list, base: DictConfig) -> DictConfig:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname

        changed = [o for (o, plain), b in zip(parsed, base_overrides, strict=True)
                   if plain and o.input_line != b.input_line]
        config = copy.deepcopy(base)
        ConfigLoaderImpl._apply_overrides_to_config(changed, config)
        task = [o for o, _ in parsed if not o.is_hydra_override()]
        with open_dict(config.hydra):
            config.hydra.overrides.task = [o.input_line for o in task]
            conf = config.hydra.job.config.override_dirname
            config.hydra.job.override_dirname = get_overrides_dirname(
                overrides=task, exclude_keys=list(conf.exclude_keys), item_sep=conf.item_sep,
                kv_sep=conf.kv_sep)
        OmegaConf.copy_cache(from_config=master, to_config=config)
        return config


class InProcessLauncher(Launcher):
    """Hydra launcher running every job in this process (module docstring)."""

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                    or workers < 1):
            # Hydra instantiates the launcher before the sweep directory exists: stop here.
            print(f"moe-sim: error: 'hydra.launcher.workers={workers}' must be a whole number "
                  ">= 1 (or null for the usable cores)", file=sys.stderr)
            sys.exit(EXIT_INPUT_ERROR)
        self.workers = workers
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        self._loader = None
        self._kept: dict[tuple[str, ...], tuple[DictConfig, PreparedJob | None]] = {}
        self._sims: Simulations | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context
        # The sweeper composes every job of a batch to validate it, through this same context,
        # right before launching the batch: keep those configs instead of composing them twice.
        self._loader = hydra_context.config_loader
        hydra_context.config_loader = _KeepComposed(self._loader, config, self._validated)

    def _ahead(self) -> bool:
        """Whether simulations may run ahead of their tasks (module docstring)."""
        job = self.config.hydra.job
        return not job.chdir and not job.env_set

    def _simulations(self) -> Simulations:
        if self._sims is None:
            from simulator.engine.many import default_workers

            self._sims = Simulations(Path(str(self.config.hydra.sweep.dir)),
                                     self.workers or default_workers())
        return self._sims

    def _validated(self, overrides: tuple[str, ...], config: DictConfig) -> None:
        prepared = None
        if self._ahead() and self._simulations().waiting_tokens < WAITING_TOKENS:
            prepared = self._sims.start(config)
        self._kept[overrides] = (config, prepared)

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        """Run the jobs, ``workers`` simulations at once; JobReturns in job order."""
        setup_globals()
        hc = self.config.hydra
        configure_log(hc.hydra_logging, hc.verbose)
        Path(str(hc.sweep.dir)).mkdir(parents=True, exist_ok=True)
        sims = self._simulations()
        workers = sims.workers
        log.info(f"Launching {len(job_overrides)} jobs in this process"
                 + (f", {workers} simulations at once" if self._ahead() else " one after another"))
        pending: deque[tuple[DictConfig, PreparedJob | None]] = deque()
        runs: list[JobReturn] = []
        try:
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                config, prepared = self._kept.pop(tuple(overrides), (None, None))
                if config is None:
                    config = self._loader.load_sweep_config(self.config, list(overrides))
                with open_dict(config):
                    config.hydra.job.id = idx
                    config.hydra.job.num = idx
                if prepared is None and self._ahead():
                    prepared = sims.start(config)
                pending.append((config, prepared))
                if len(pending) > workers:  # keep `workers` simulations going while recording
                    runs.append(self._record(*pending.popleft()))
            while pending:
                runs.append(self._record(*pending.popleft()))
        finally:
            for _, prepared in self._kept.values():
                if prepared is not None:
                    sims.recorded(prepared)
            self._kept.clear()
            sims.close()
            self._sims = None
        return runs

    def _record(self, config: DictConfig, prepared: PreparedJob | None) -> JobReturn:
        """Hydra's run_job for the job; its task finds ``prepared``."""
        token = _PREPARED.set(prepared)
        try:
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                          config=config, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir")
        finally:
            _PREPARED.reset(token)
            if prepared is not None:
                self._sims.recorded(prepared)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret
