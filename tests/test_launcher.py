"""The in-process launcher (simulator/launcher.py): the default for multiruns, results and run
directories as the basic launcher's file for file, one decode per trace, failures reported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml

from simulator.launcher import _PREPARED, PreparedJob, prepared_simulation
from traces.errors import InputError
from traces.format import write_trace
from traces.synth import synth_trace

REPO = Path(__file__).resolve().parent.parent
TIMING = {"sim_seconds"}
# What names the launcher or the sweep's own directory in Hydra's records of a job.
LAUNCHER_KEYS = (("launcher",), ("sweep", "dir"), ("runtime", "output_dir"),
                 ("runtime", "choices", "hydra/launcher"), ("overrides", "hydra"))


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "synth.parquet"
    meta, chunk = synth_trace(tokens=300, layers=3, experts=16, top_k=2, seed=5, logits="full",
                              prompt_share=0.0, seq_tokens=100)
    write_trace(path, meta, chunk)
    return path


def moe_sim(*args: str, cache: Path, cwd: Path = REPO, code: str | None = None):
    """``moe-sim ARGS`` in a fresh process (``code``: Python run before it, in that process)."""
    run = "import sys, simulator.run as r; sys.argv = ['moe-sim', *sys.argv[1:]]; r.main()"
    return subprocess.run([sys.executable, "-c", f"{code or ''}\n{run}", *args], cwd=cwd,
                          env=dict(os.environ, MOE_SIM_CACHE=str(cache), PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=900)


def job_files(sweep: Path) -> dict[str, Path]:
    return {str(p.relative_to(sweep)): p for p in sorted(sweep.rglob("*")) if p.is_file()}


def without_launcher(hydra_node: dict) -> dict:
    for *parents, key in LAUNCHER_KEYS:
        node = hydra_node
        for name in parents:
            node = node[name]
        del node[key]
    return hydra_node


def comparable(name: str, path: Path):
    """A file's content with what may differ between launchers taken out."""
    if name.endswith("summary.json"):
        return {k: v for k, v in json.loads(path.read_text()).items() if k not in TIMING}
    if name.endswith(("hydra.yaml", "multirun.yaml")):
        return without_launcher(yaml.safe_load(path.read_text())["hydra"])
    return path.read_bytes()


def test_default_launcher_matches_basic_file_for_file(trace, tmp_path):
    missing = tmp_path / "no-such-trace.parquet"
    sweep = [f"trace.path={trace},{missing}", "policy=fetch_all,quality_first",
             "cache.fraction=0.25,0.01"]  # 0.01 leaves no expert per layer: the job fails
    basic = moe_sim("-m", *sweep, f"hydra.sweep.dir={tmp_path / 'basic'}", "hydra/launcher=basic",
                    cache=tmp_path / "cache")
    default = moe_sim("-m", *sweep, f"hydra.sweep.dir={tmp_path / 'default'}",
                      "hydra.launcher.workers=2", cache=tmp_path / "cache")
    assert "Launching 8 jobs in this process, 2 simulations at once" in default.stdout
    assert default.returncode == basic.returncode != 0  # Hydra reports the failed jobs
    a, b = job_files(tmp_path / "basic"), job_files(tmp_path / "default")
    assert a.keys() == b.keys()
    for name in a:
        assert comparable(name, a[name]) == comparable(name, b[name]), name
    errors = sorted(n for n in a if n.endswith("error.txt"))
    summaries = sorted(n for n in a if n.endswith("summary.json"))
    assert len(errors) == 6 and len(summaries) == 2  # 4 jobs on the missing trace, 2 at 0.01
    assert "trace.path" in b["4/error.txt"].read_text()
    assert "cache.fraction=0.01" in b["1/error.txt"].read_text()
    launcher = yaml.safe_load(b["multirun.yaml"].read_text())["hydra"]["launcher"]
    assert launcher["_target_"].endswith(".InProcessLauncher")
    results = [line.split(" [")[0] for line in default.stdout.splitlines() if " ms/token" in line]
    assert results == [line.split(" [")[0] for line in basic.stdout.splitlines()
                       if " ms/token" in line]  # in job order
    assert not any(p.name.startswith(".trace_cache") for p in (tmp_path / "default").iterdir())
    assert not (tmp_path / "cache").exists()  # without trace.cache the user's cache is untouched


COUNT_READS = """
import atexit, pyarrow.parquet as pq
reads = []
read_row_group = pq.ParquetFile.read_row_group
def counted(self, i, columns=None, **kw):
    reads.append(i)
    return read_row_group(self, i, columns=columns, **kw)
pq.ParquetFile.read_row_group = counted
atexit.register(lambda: print(f"row groups read: {len(reads)}"))
"""


@pytest.mark.parametrize("launcher, reads", [("basic", 4), ("inprocess", 1)])
def test_each_trace_is_decoded_once_per_sweep(trace, tmp_path, launcher, reads):
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "cache.fraction=0.25,0.5",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra/launcher={launcher}",
                   cache=tmp_path / "cache", code=COUNT_READS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"row groups read: {reads}" in proc.stdout  # one row group, read by each decode
    assert len(list((tmp_path / "sweep").glob("*/summary.json"))) == 4


FAILING_DECODE = COUNT_READS + """
import threading, simulator.trace_cache as tc
from traces.errors import InputError
def build(self):
    print(f"decoding on {threading.current_thread().name}")
    raise InputError("cannot be written (No space left on device)")
tc.CachedTrace.build = build
"""


def test_jobs_read_the_trace_themselves_where_the_sweeps_decoding_fails(trace, tmp_path):
    """The shared copy is decoded on a thread of its own; where that fails, every job simulates
    from the trace file as its task would, with the same results."""
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "cache.fraction=0.25,0.5",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cache=tmp_path / "cache", code=FAILING_DECODE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("decoding on decode_0") == 1
    assert "row groups read: 4" in proc.stdout  # each job decoded the file itself
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    basic = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "cache.fraction=0.25,0.5",
                    f"hydra.sweep.dir={tmp_path / 'basic'}", "hydra/launcher=basic", cache=tmp_path / "cache")
    assert basic.returncode == 0, basic.stderr[-3000:]
    assert len(summaries) == 4 and all(
        comparable(p.name, p) == comparable(p.name, tmp_path / "basic" / p.parent.name / p.name) for p in summaries)


SLOW_RANKING = """
import atexit, threading, time, simulator.trace_cache as tc
ranked = []
rank = tc.stored_logit_order
def slow(*args, **kw):
    ranked.append(threading.current_thread().name)
    time.sleep(0.5)  # long enough for both simulation threads to ask for the order meanwhile
    return rank(*args, **kw)
tc.stored_logit_order = slow
atexit.register(lambda: print(f"ranked on: {sorted(ranked)}"))
"""


def test_the_sweeps_jobs_share_one_ranking_of_the_logits(trace, tmp_path):
    """Jobs that walk the top-R order wait for one pass that keeps it, on the decoding thread,
    instead of each ranking the logits while that pass runs; results as the basic launcher's."""
    sweep = ["policy=rule015,quality_first", "cache.fraction=0.25,0.5"]
    proc = moe_sim("-m", f"trace.path={trace}", *sweep, "hydra.launcher.workers=2",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cache=tmp_path / "cache", code=SLOW_RANKING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ranked on: ['decode_0']" in proc.stdout  # the trace is one chunk: one ranking in all
    basic = moe_sim("-m", f"trace.path={trace}", *sweep, f"hydra.sweep.dir={tmp_path / 'basic'}",
                    "hydra/launcher=basic", cache=tmp_path / "cache")
    assert basic.returncode == 0, basic.stderr[-3000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 4 and all(
        comparable(p.name, p) == comparable(p.name, tmp_path / "basic" / p.parent.name / p.name) for p in summaries)


def test_shared_trace_cache_is_used_and_kept_with_trace_cache(trace, tmp_path):
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "trace.cache=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cache=tmp_path / "cache",
                   code=COUNT_READS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "row groups read: 1" in proc.stdout
    assert len(list((tmp_path / "cache" / "traces").glob("*/manifest.json"))) == 1


def test_jobs_that_change_directory_run_in_their_task(trace, tmp_path):
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015", "hydra.job.chdir=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Launching 2 jobs in this process one after another" in proc.stdout
    assert len(list((tmp_path / "sweep").glob("*/summary.json"))) == 2


@pytest.mark.parametrize("workers", ["0", "two", "true"])
def test_bad_worker_count_is_one_line_and_leaves_nothing(trace, tmp_path, workers):
    sweep = tmp_path / "sweep"
    proc = moe_sim("-m", f"trace.path={trace}", "policy=fetch_all,rule015",
                   f"hydra.launcher.workers={workers}", f"hydra.sweep.dir={sweep}",
                   cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"moe-sim: error: 'hydra.launcher.workers={workers if workers != 'true' else True}' must "
        "be a whole number >= 1 (or null for the usable cores)"]
    assert not sweep.exists()


def _done(value=None, error: Exception | None = None) -> Future:
    future = Future()
    future.set_exception(error) if error else future.set_result(value)
    return future


def test_prepared_simulation_only_for_the_config_it_ran():
    plain = {"policy": {"name": "fetch_all"}, "cache": {"fraction": 0.25}}
    assert prepared_simulation(plain) is None  # no launcher recording a job
    token = _PREPARED.set(PreparedJob(plain, _done(("summary", "result")), tokens=10))
    try:
        assert prepared_simulation(plain) == ("summary", "result")
        other = {**plain, "cache": {"fraction": 0.5}}
        assert prepared_simulation(other) is None  # the task resolved another config
    finally:
        _PREPARED.reset(token)
    token = _PREPARED.set(PreparedJob(plain, _done(error=InputError("bad trace")), tokens=10))
    try:
        with pytest.raises(InputError, match="bad trace"):
            prepared_simulation(plain)
    finally:
        _PREPARED.reset(token)


PLUGINS = ("from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
           "import hydra_plugins.moe_sim_launcher as m; print(m.__file__); "
           "print([f'{c.__module__}.{c.__name__}' for c in Plugins.instance().discover(Launcher)])")


def test_hydra_finds_the_launcher_outside_the_repository(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PLUGINS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "'hydra_plugins.moe_sim_launcher.InProcessLauncher'" in proc.stdout
    assert "JoblibLauncher" in proc.stdout and "SlurmLauncher" in proc.stdout  # others intact


@pytest.mark.slow
def test_a_regular_install_ships_the_plugin(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hydra_plugins/moe_sim_launcher/__init__.py" in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace: other plugins stay visible
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    # Without site: no editable finder; the installed copy first, Hydra from this environment.
    site = next(p for p in sys.path if p.endswith("site-packages"))
    proc = subprocess.run([sys.executable, "-S", "-c", PLUGINS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=f"{target}:{site}"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(str(target))
    assert "'hydra_plugins.moe_sim_launcher.InProcessLauncher'" in proc.stdout


COUNT_COMPOSES = """
import atexit
from hydra._internal.config_loader_impl import ConfigLoaderImpl
composed = []
load = ConfigLoaderImpl.load_sweep_config
def counted(self, master, overrides):
    composed.append(list(overrides))
    return load(self, master, overrides)
ConfigLoaderImpl.load_sweep_config = counted
atexit.register(lambda: print(f"composed: {len(composed)}"))
"""


def test_jobs_differing_in_values_only_are_composed_once(trace, tmp_path):
    """2 policies (a config group) x 3 fractions (a value): two compositions, the other four
    jobs copied from them (their files equal the basic launcher's: the test above)."""
    sweep = [f"trace.path={trace}", "policy=fetch_all,rule015", "cache.fraction=0.1,0.25,0.5"]
    proc = moe_sim("-m", *sweep, f"hydra.sweep.dir={tmp_path / 's'}", code=COUNT_COMPOSES,
                   cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "composed: 2" in proc.stdout
    fractions = [json.loads((tmp_path / "s" / str(n) / "summary.json").read_text())["provenance"]
                 ["config"]["cache"]["fraction"] for n in range(6)]
    assert fractions == [0.1, 0.25, 0.5] * 2
