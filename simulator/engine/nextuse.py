"""Belady pre-pass: for every selection, the group ordinal of the same expert's next selection.

One reverse pass over the trace writes int32 next-use rows (``NEVER_GROUP`` = never again) to a
temporary memory-mapped file, so a long trace is never held in memory; the simulation pass then
reads them back chunk by chunk in trace order. The file is deleted when the pass closes. Rows of
up to ``IN_MEMORY_BYTES`` stay in memory instead (a short run would spend more on the file's
creation, mapping and removal than on its kernel).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from simulator.engine.state import kernel_array
from simulator.jit import jit
from traces.format import TraceChunk, slice_chunk

NEVER_GROUP = 2**31 - 1  # in next-use rows (int32 group ordinals): never selected again
IN_MEMORY_BYTES = 64 << 20  # next-use rows kept in memory up to this size, then in a file


@jit(allocates=False)
def next_use_backward(experts, group, last_seen, out):
    """Fill ``out`` int32[T, L, k] for one chunk, walking its groups backwards.

    ``last_seen`` int32[L*E]: group ordinal of each expert's earliest selection after this
    chunk, updated in place to the earliest selection in or after it. Every selection of a group
    gets the next selection in a *later* group (a prefill group's repeats share one value).
    """
    T, L, K = experts.shape
    E = last_seen.shape[0] // L
    b = T
    while b > 0:
        g = group[b - 1]
        a = b - 1
        while a > 0 and group[a - 1] == g:
            a -= 1
        for layer in range(L):
            base = layer * E
            for t in range(a, b):
                for i in range(K):
                    out[t, layer, i] = last_seen[base + experts[t, layer, i]]
            for t in range(a, b):
                for i in range(K):
                    last_seen[base + experts[t, layer, i]] = g
        b = a


def after_group(chunk: TraceChunk, last_group: int) -> TraceChunk:
    """The tokens of ``chunk`` whose group ordinal is above ``last_group`` (groups ascend)."""
    start = int(np.searchsorted(chunk.group, last_group, side="right"))
    return chunk if start == 0 else slice_chunk(chunk, start, chunk.num_tokens)


def _chunks_backwards(source, chunk_tokens):
    if hasattr(source, "iter_chunks_reversed"):  # next uses read expert ids only
        yield from source.iter_chunks_reversed(chunk_tokens, logits=False)
    else:  # an in-memory source: its chunks are views, so holding them all is cheap
        yield from reversed(list(source.iter_chunks(chunk_tokens, logits=False)))


class NextUseFile:
    """Next-use rows of every token after ``last_warmup_group``, on disk; use as a context manager.

    ``source.iter_chunks_reversed(max_tokens)``, where present, must yield chunks of whole
    groups, the last chunk first, each chunk's tokens in trace order.
    """

    def __init__(self, source, last_warmup_group: int = -1, chunk_tokens: int | None = None):
        meta = source.meta
        L, E, K = meta.num_layers, meta.num_experts, meta.top_k
        self._dir = None  # the file's folder, once the rows outgrow IN_MEMORY_BYTES
        last_seen = np.full(L * E, NEVER_GROUP, np.int32)
        held: list[np.ndarray] = []  # rows last token first, while in memory
        f = None
        n = 0
        try:
            for chunk in _chunks_backwards(source, chunk_tokens):
                chunk = after_group(chunk, last_warmup_group)
                if chunk.num_tokens == 0:
                    continue
                out = np.empty((chunk.num_tokens, L, K), np.int32)
                next_use_backward(
                    kernel_array(chunk.experts, np.int32),
                    kernel_array(chunk.group, np.int64),
                    last_seen,
                    out,
                )
                held.append(out[::-1])
                n += chunk.num_tokens
                if f is None and n * L * K * 4 > IN_MEMORY_BYTES:
                    self._dir = tempfile.TemporaryDirectory(prefix="moe-next-use-")
                    f = open(os.path.join(self._dir.name, "next_use.int32"), "wb")  # noqa: SIM115
                if f is not None:
                    for rows in held:
                        f.write(rows.tobytes())
                    held.clear()
        finally:
            if f is not None:
                f.close()
        self.first_use = last_seen  # int32[L*E]: each expert's first selection
        self.num_tokens = n
        if f is not None:
            self._rows = np.memmap(f.name, np.int32, "r", shape=(n, L, K))
        else:
            self._rows = np.concatenate(held) if held else None

    def rows(self, start: int, stop: int) -> np.ndarray:
        """int32[stop - start, L, k] rows of simulated tokens [start, stop), in trace order."""
        n = self.num_tokens
        return np.array(self._rows[n - stop : n - start][::-1])  # a copy, in trace order

    def close(self) -> None:
        self._rows = None  # release the mapping before the file goes
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> NextUseFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
