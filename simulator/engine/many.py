"""Many configurations over one decoded trace, in parallel.

The Numba kernel releases the GIL (``nogil`` in simulator/jit.py) and keeps all of a run's state
in its own arrays, so independent runs proceed side by side on a thread pool while sharing the
trace's decoded arrays: an in-memory :class:`~traces.format.ArraySource`, or the memory-mapped
copy of simulator/trace_cache.py (a Parquet file is decoded into the cache once, not once per
configuration). Results are exactly those of separate :func:`simulator.engine.simulate` calls.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from simulator.engine import simulate
from simulator.engine.params import SimParams
from simulator.metrics import SimResult
from traces.sources import LimitedSource


def default_workers() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decoded(source):
    """``source`` itself if its chunks come from memory; a Parquet reader's trace cache copy
    (one decode, and no Parquet file shared between threads)."""
    if isinstance(source, LimitedSource):
        return LimitedSource(decoded(source.source), source.max_tokens)
    path = getattr(source, "path", None)
    if path is None:
        return source
    from simulator.trace_cache import cached_source

    cached = cached_source(path)
    cached.build()  # once, before the threads start: each would otherwise decode on its own
    return cached


def simulate_many(
    source,
    params_list: Sequence[SimParams],
    engine: str = "numba",
    workers: int | None = None,
    *,
    chunk_tokens: int | None = None,
) -> list[SimResult]:
    """Run every :class:`SimParams` of ``params_list`` over ``source``; results in list order.

    ``workers``: threads (default: the usable cores). The reference engine holds the GIL, so
    it gains nothing from more than one.
    """
    source = decoded(source)
    workers = default_workers() if workers is None else max(1, int(workers))
    workers = min(workers, len(params_list)) or 1
    if workers == 1:
        return [simulate(source, p, engine=engine, chunk_tokens=chunk_tokens) for p in params_list]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="simulate") as pool:
        futures = [pool.submit(simulate, source, p, engine, chunk_tokens=chunk_tokens)
                   for p in params_list]
        return [f.result() for f in futures]
