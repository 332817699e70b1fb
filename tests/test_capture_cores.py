"""The model's thread on a CPU core of its own during a capture (traces.capture.cores; no torch)."""
from __future__ import annotations

import os
import threading

import pytest

from traces.capture import cores
from traces.capture import writer as W
from traces.capture.writer import ParallelTraceWriter

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs two CPUs and Linux affinity calls")


def fake_topology(tmp_path, siblings: dict[int, str]):
    for cpu, text in siblings.items():
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_core_siblings_read_lists_and_ranges(tmp_path):
    root = fake_topology(tmp_path, {0: "0,8", 1: "1-2", 3: "3"})
    assert cores.core_siblings(0, root) == {0, 8}
    assert cores.core_siblings(1, root) == {1, 2}
    assert cores.core_siblings(3, root) == {3}
    assert cores.core_siblings(5, root) == {5}  # no topology: the CPU alone


@needs_two_cpus
def test_the_model_thread_is_pinned_and_the_others_leave_its_core(tmp_path, monkeypatch):
    allowed = os.sched_getaffinity(0)
    first = max(allowed)
    monkeypatch.setattr(cores, "MIN_CPUS", 2)
    root = fake_topology(tmp_path, {first: str(first)})
    seen = {}

    def other():
        cores.leave_model_core()
        seen["other"] = os.sched_getaffinity(0)

    with cores.isolated(root=root) as cpu:
        assert cpu == first and os.sched_getaffinity(0) == {first}
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["other"] == allowed - {first}
    assert os.sched_getaffinity(0) == allowed  # restored after the block
    cores.leave_model_core()  # outside a block: nothing
    assert os.sched_getaffinity(0) == allowed


@needs_two_cpus
def test_nothing_is_pinned_when_disabled_with_too_few_cpus_or_no_other_core(tmp_path, monkeypatch):
    allowed = os.sched_getaffinity(0)
    with cores.isolated(enabled=False) as cpu:
        assert cpu is None and os.sched_getaffinity(0) == allowed
    monkeypatch.setattr(cores, "MIN_CPUS", len(allowed) + 1)
    with cores.isolated() as cpu:
        assert cpu is None and os.sched_getaffinity(0) == allowed
    monkeypatch.setattr(cores, "MIN_CPUS", 2)
    every = ",".join(str(c) for c in sorted(allowed))  # one core holds every allowed CPU
    with cores.isolated(root=fake_topology(tmp_path, {max(allowed): every})) as cpu:
        assert cpu is None and os.sched_getaffinity(0) == allowed


@needs_two_cpus
def test_the_writers_encoder_and_joiner_processes_run_off_the_models_core(tmp_path, monkeypatch):
    """Children started before the block (kept for the next writer) are moved too."""
    from test_capture_writer import trace_columns

    allowed = os.sched_getaffinity(0)
    first = max(allowed)
    meta, cols = trace_columns()
    with ParallelTraceWriter(tmp_path / "before.parquet", meta, unit_tokens=64, workers=2, processes=True) as w:
        w.write(**cols)  # leaves started encoders and a joiner in the pool
    monkeypatch.setattr(cores, "MIN_CPUS", 2)
    root = fake_topology(tmp_path / "sys", {first: str(first)})
    with cores.isolated(root=root):
        with ParallelTraceWriter(tmp_path / "t.parquet", meta, unit_tokens=64, workers=3, processes=True) as w:
            w.write(**cols)
        used = [c for kind in (W._Encoder, W._Joiner) for c in W._IDLE.get(kind, [])]  # not a dispatcher's
    assert len(used) >= 4  # three encoders (two of them from before) and the joiner, back in the pool
    assert all(os.sched_getaffinity(c.proc.pid) == allowed - {first} for c in used)


def test_descendants_follow_the_parent_links_to_every_depth(tmp_path):
    for pid, ppid in {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}.items():
        (tmp_path / str(pid)).mkdir()
        # a process name with spaces and a ")" must not shift the fields
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a) b) S {ppid} 0 0 0 0 0 0 0 0 0 {pid} 1 0 0\n")
    table = cores.processes(tmp_path)
    assert table[12] == (11, 13)  # parent, user + system ticks
    assert cores.descendants(10, table) == {11, 12, 13}
    assert cores.descendants(20, table) == {21}
    assert cores.descendants(12, table) == set()
    assert os.getpid() in cores.descendants(os.getppid())  # the real /proc


@needs_two_cpus
def test_a_dispatchers_encoders_started_before_the_block_leave_the_models_core(tmp_path, monkeypatch):
    """A dispatcher kept from an earlier writer is taken with the encoders and joiner it started
    then, which still have every CPU: they are moved with it."""
    from test_capture_writer import trace_columns

    from traces.capture.dispatch import DispatchedTraceWriter, _Dispatcher

    allowed = os.sched_getaffinity(0)
    first = max(allowed)
    meta, cols = trace_columns()
    W._close_children()  # a dispatcher of our own below
    with DispatchedTraceWriter(tmp_path / "before.parquet", meta, unit_tokens=64, workers=2) as w:
        w.write(**cols)
    (dispatcher,) = W._IDLE[_Dispatcher]
    below = cores.descendants(dispatcher.proc.pid)
    assert len(below) >= 3  # two encoders and the joiner
    monkeypatch.setattr(cores, "MIN_CPUS", 2)
    with cores.isolated(root=fake_topology(tmp_path / "sys", {first: str(first)})):
        with DispatchedTraceWriter(tmp_path / "t.parquet", meta, unit_tokens=64, workers=2) as w:
            w.write(**cols)
        for pid in {dispatcher.proc.pid} | below:
            assert os.sched_getaffinity(pid) == allowed - {first}, pid
