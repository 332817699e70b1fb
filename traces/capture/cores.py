"""A CPU core of its own for the thread that drives the model (``moe-capture pin_threads=true``).

A small model's forward on the GPU is bound by the one Python thread that launches its kernels.
Beside the trace writer (Parquet encoding in eight child processes, the units' copies into shared
memory, the joiner), that thread spent more CPU on the same work on the H200 host (16 CPUs, one
thread per core; small Qwen3-Next shape at batch 16, 524,288 tokens per pass: 1.95 s per pass
with recording alone, 2.24 s with the writer), though the loop never waited for the writer.
Pinned, it spent 2.12 s and the capture ran 28.9 % behind the forward instead of 34.4 %, side by
side in one run (`docs/capture/bench_1202l_next_b16.json`); at batch 1 12.9 -> 11.4 %, within
the noise. The rest of that cost is not the core: the host's caches and memory are shared.

:func:`isolated` pins the calling thread to one CPU for a block, and every thread and child
process of the capture that calls :func:`leave_model_core` (the drain, the writer's threads, its
encoder and joiner processes) to the other CPUs, that core's hardware siblings excluded. Only
where at least ``MIN_CPUS`` CPUs are allowed, on Linux; a no-op elsewhere. Off by default: a
model with layers offloaded to the CPU would run them on the one core.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

MIN_CPUS = 4  # fewer, and one core for the model's thread leaves too little for the writer
_others: frozenset[int] | None = None  # while isolated: the CPUs for everything but the model's thread


def core_siblings(cpu: int, root: Path = Path("/sys/devices/system/cpu")) -> set[int]:
    """The CPUs sharing ``cpu``'s core (hardware threads), ``cpu`` included; {cpu} if unknown."""
    try:
        text = (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    cpus = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus | {cpu}


@contextlib.contextmanager
def isolated(enabled: bool = True, root: Path = Path("/sys/devices/system/cpu")):
    """Within the block, the calling thread runs on one CPU and :func:`leave_model_core` sends
    the rest elsewhere; yields that CPU, or None where nothing was pinned (``enabled`` false,
    no affinity calls, fewer than ``MIN_CPUS`` CPUs allowed, or no CPU outside the core)."""
    global _others
    if not enabled or _others is not None or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)  # CPU 0 tends to take more of the host's interrupts
    others = frozenset(allowed - core_siblings(cpu, root))
    if len(allowed) < MIN_CPUS or not others:
        yield None
        return
    os.sched_setaffinity(0, {cpu})  # 0: the calling thread alone
    _others = others
    try:
        yield cpu
    finally:
        _others = None
        os.sched_setaffinity(0, allowed)


def processes(proc: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """Every running process's parent and CPU time so far in clock ticks (user + system), from
    /proc: ``{pid: (ppid, ticks)}``; empty where there is no /proc."""
    table = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        table[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def descendants(pid: int, table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """The running processes below ``pid`` (children, theirs, ...), from :func:`processes`."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def leave_model_core(pid: int = 0) -> None:
    """Move the calling thread (``pid`` 0), or every thread of the process ``pid`` and of its
    descendants (a dispatcher's encoders and joiner), off the model's core while
    :func:`isolated` is in force; otherwise nothing. A thread started by the pinned thread
    inherits its single CPU, so each capture thread calls this first."""
    if _others is None:
        return
    tasks = [0]
    if pid:
        tasks = []
        for process in (pid, *descendants(pid)):
            try:
                tasks += [int(t) for t in os.listdir(f"/proc/{process}/task")]
            except OSError:
                tasks.append(process)
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread or process that has exited meanwhile
            os.sched_setaffinity(task, _others)
