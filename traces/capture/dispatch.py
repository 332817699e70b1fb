"""The capture's trace writer in a process of its own: one message per block of rows.

:class:`~traces.capture.writer.ParallelTraceWriter` keeps its encoder processes busy from threads
of the capturing process: per unit (about one row group) a thread pickles a request, waits, reads
the answer and hands the unit on to the joiner. That is 1-1.5 ms of Python per unit holding the
interpreter lock that the thread driving the model needs for every kernel launch; a launch-bound
forward pays about as much as that Python runs (docs/CAPTURE.md, the contention check).

:class:`DispatchedTraceWriter` runs the whole ParallelTraceWriter (its threads, encoders and
joiner) in a *dispatcher* child process. The capturing process lends the slabs of shared memory
(so it, which owns the device, registers them with CUDA), and for each block of rows sends the
dispatcher one small message saying where in which slab the rows lie; the dispatcher maps the
slab by its path and writes the rows as views of it, and says when a slab may be lent again.
Left in the capturing process per block: one pickled message out, one back (read by a thread
that waits on the pipe without the interpreter lock).

Rows that are not in a slab (no /dev/shm, or ``shared_rows`` off) travel through the pipe,
pickled: correct, but a copy; the ``processes`` writer suits them better.

The number of tokens lent at a time is bounded as in ParallelTraceWriter.block
(:class:`~traces.capture.writer.BoundedLending`: about :data:`~traces.capture.writer.LENT_UNITS_PER_WORKER` units per encoder), so a producer
faster than the encoders waits in :meth:`DispatchedTraceWriter.block` instead of growing shared memory without end. The
bound is kept here, where the slabs are lent: the dispatcher's writer takes each block as it comes
(:meth:`~traces.capture.writer.ParallelTraceWriter.lend`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time

import numpy as np

from traces.atomic import remove_orphans
from traces.capture.writer import (
    _SLAB_LOCK,
    _SLAB_OF_MAP,
    BoundedLending,
    ParallelTraceWriter,
    RowBlock,
    Slab,
    _Child,
    _give_back,
    _in_slab,
    _layout,
    _lend_slab,
    _return_slab,
    _slab_of,
    _take,
    _views,
    checked_settings,
)
from traces.format import TraceMeta


class _Dispatcher(_Child):
    """The child that hosts a ParallelTraceWriter (:func:`_serve`)."""

    role = "dispatcher"
    module = "traces.capture.dispatch"
    # its encoders and joiner in its process group: where it dies, they are stopped with it
    # (:meth:`DispatchedTraceWriter._end`); a Ctrl-C reaches the capture, which aborts the writer
    session = True

    def close(self) -> None:
        """Say goodbye first: an end of input without it means the capturing process died, and
        only then does the dispatcher remove the slabs it was lent (:func:`_serve`)."""
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            pickle.dump(("bye",), self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        super().close()


class DispatchedTraceWriter(BoundedLending):
    """:class:`~traces.capture.writer.ParallelTraceWriter` (encoders in processes) run by a
    dispatcher process; the same calls: :meth:`block`, :meth:`write`, :meth:`close`,
    :meth:`abort`, a context manager that leaves no file at ``path`` on an error."""

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, unit_tokens: int, workers: int | None = None,
                 expected_tokens: int | None = None):
        self.path, self.meta, self.unit_tokens, self.workers = checked_settings(path, meta, unit_tokens, workers,
                                                                                expected_tokens)
        super().__init__()
        self.num_tokens = 0
        self._lent: dict[str, tuple[Slab, int]] = {}  # slab path -> (slab, tokens) until the dispatcher frees it
        self._closed = False
        self._ended: BaseException | None = None  # the dispatcher's error at close
        self._died = False  # the dispatcher exited before it answered the close
        self._child = _take(_Dispatcher)
        try:
            self._child.send(("open", str(self.path), meta, unit_tokens, self.workers, expected_tokens))
            kind, value = self._receive()
        except BaseException:  # a Ctrl-C while it opens: it aborts what it opened and exits
            self._child.close()
            raise
        if kind != "opened":
            (self._child.close if kind == "exited" else lambda: _give_back(self._child))()
            raise value if isinstance(value, BaseException) else RuntimeError(f"dispatcher answered {kind!r}")
        self._reader = threading.Thread(target=self._read, name="trace-dispatcher", daemon=True)
        self._reader.start()

    def _receive(self) -> tuple[str, object]:
        try:
            return pickle.load(self._child.proc.stdout)
        except (EOFError, ValueError, OSError, pickle.UnpicklingError):
            return "exited", RuntimeError(f"the trace dispatcher process exited (code {self._child.proc.poll()}); "
                                          "its error, if any, is printed above")

    def _read(self) -> None:
        """The dispatcher's messages until the close's answer: slabs to lend again, its error."""
        while True:
            kind, value = self._receive()
            with self._cond:
                if kind == "free":
                    self._free(value)
                elif kind == "error":
                    self._error = self._error or value
                else:  # "closed" (value: its error or None), "exited"
                    self._ended = value
                    if kind == "exited":
                        self._died = True
                        self._error = self._error or value
                    self._cond.notify_all()
                    return
                self._cond.notify_all()

    def block(self, columns: dict[str, tuple[np.dtype, tuple]]) -> RowBlock | None:
        """As :meth:`ParallelTraceWriter.block`; waits while about :data:`~traces.capture.writer.LENT_UNITS_PER_WORKER`
        units' tokens per encoder are lent (the dispatcher's encoders behind)."""
        tokens = int(next(iter(columns.values()))[1][0])
        self._wait_to_lend(tokens)
        layout, nbytes = _layout({name: (np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in columns.items()})
        try:
            slab = _lend_slab(nbytes)
        except OSError:
            return None
        with self._cond:
            self._lent[slab.path] = (slab, tokens)
            self._lent_tokens += tokens
        return RowBlock(_views(slab.map, layout), slab)

    def write(self, **columns) -> None:
        """Append tokens (the keyword arguments of ``TraceWriter.write``); re-raises the dispatcher's error."""
        self._raise_error()
        cols = {name: np.asarray(v) for name, v in columns.items() if v is not None}
        n = cols["seq"].shape[0]
        slab = _slab_of(cols)
        lent = slab is not None and slab.path in self._lent
        if not n:
            if lent:
                self._free(slab.path)
            return
        self.num_tokens += n
        if lent:
            self._child.send(("rows", n, *_in_slab(slab, cols)))
        else:
            self._child.send(("arrays", cols))

    def _free(self, path: str) -> None:
        """The slab at ``path`` may be lent again (the caller holds ``_cond`` or not: it is reentrant)."""
        with self._cond:
            slab, tokens = self._lent.pop(path, (None, 0))
            self._lent_tokens -= tokens
        if slab is not None:
            _return_slab(slab)

    def _end(self, request: str) -> BaseException | None:
        """Send ``request`` ("close" or "abort"), wait for its answer; every slab lent again."""
        self._closed = True
        try:
            self._child.send((request,))
        except RuntimeError as e:  # exited: the reader ends on its own
            self._error = self._error or e
        self._reader.join()
        with self._cond:
            lent, self._lent, self._lent_tokens = self._lent, {}, 0
        for slab, _ in lent.values():
            _return_slab(slab)
        if self._died:  # its children too, then their files once they have exited
            with contextlib.suppress(OSError):
                os.killpg(self._child.proc.pid, signal.SIGKILL)
            self._child.close()
            _wait_gone(self._child.proc.pid)
            remove_orphans(self.path.parent)
        else:
            _give_back(self._child)
        return self._ended

    def close(self) -> None:
        """Encode what is pending, finish the output and move it to ``path``."""
        if self._closed:
            return
        ended = self._end("close")
        self._raise_error()
        if ended is not None:
            raise ended

    def abort(self) -> None:
        """Drop everything written; ``path`` is left as it was."""
        if not self._closed:
            self._end("abort")

    def __enter__(self) -> DispatchedTraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        (self.close if exc_type is None else self.abort)()


def _wait_gone(group: int, timeout_s: float = 10.0) -> None:
    """Wait until no process of the process group ``group`` runs (killed ones are reaped by the
    system), at most ``timeout_s``: a file a killed process wrote is an orphan only after that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except OSError:  # none left
            return
        time.sleep(0.01)


_MAPPED: dict[str, Slab] = {}  # the dispatcher's maps of the capturing process's slabs, by path


def _mapped(path: str, size: int) -> Slab:
    """The capturing process's slab at ``path``, mapped here once and known to :func:`_slab_of`."""
    slab = _MAPPED.get(path)
    if slab is None or slab.size != size:
        slab = _MAPPED[path] = Slab(size, path)
        with _SLAB_LOCK:
            _SLAB_OF_MAP[id(slab.map)] = slab
    return slab


def _serve() -> None:
    """The dispatcher's loop: ``("open", path, meta, unit_tokens, workers, expected_tokens)`` -> "opened";
    ``("rows", tokens, path, size, layout)`` and ``("arrays", columns)`` written, no answer (the
    first error is sent as "error"); ``("close",)``/``("abort",)`` -> ("closed", error or None).
    A slab all of whose rows are in the output is sent back as ("free", path).

    At the end of its input (the capturing process closed it, or was killed) a writer still open
    is aborted, its hidden files removed; where the capturing process is gone, nothing is told
    any more, and the slabs it lent, which it can no longer remove, are removed here. Gone means
    the input ended without ``("bye",)`` (:meth:`_Dispatcher.close`): a killed process's pipes
    close before it is reaped, so its children may see the end while it is still their parent."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    lock = threading.Lock()
    gone = [False]

    def tell(kind: str, value=None) -> None:
        with lock:
            if gone[0]:
                return
            try:
                pickle.dump((kind, value), stdout, protocol=pickle.HIGHEST_PROTOCOL)
                stdout.flush()
            except (BrokenPipeError, ValueError):  # the capturing process is gone: no one to tell
                gone[0] = True

    writer: ParallelTraceWriter | None = None
    failed = bye = False
    while True:
        try:
            request = pickle.load(stdin)
        except (EOFError, pickle.UnpicklingError):  # the end, or a message cut off by a death
            try:
                if writer is not None:
                    writer.abort()
            finally:
                if not bye:  # the capturing process died (or exited without closing us)
                    for path in _MAPPED:  # removed by name; the maps go with this process
                        with contextlib.suppress(OSError):
                            os.unlink(path)
            return
        kind = request[0]
        if kind == "bye":
            bye = True
            continue
        try:
            if kind == "open":
                _, path, meta, unit_tokens, workers, expected_tokens = request
                writer = ParallelTraceWriter(path, meta, unit_tokens, workers, processes=True,
                                             give_slab=lambda slab: tell("free", slab.path),
                                             expected_tokens=expected_tokens)
                failed = False
                tell("opened")
            elif kind in ("close", "abort"):
                done, writer = writer, None
                error = None
                try:
                    (done.close if kind == "close" else done.abort)()
                except BaseException as e:  # noqa: BLE001 - sent to the capturing process
                    error = e
                tell("closed", error)
            elif failed:  # rows after an error: give their slab back at once
                if kind == "rows":
                    tell("free", request[2])
            elif kind == "rows":
                _, tokens, path, size, layout = request
                slab = _mapped(path, size)
                writer.lend(slab, tokens)
                writer.write(**_views(slab.map, layout))
            elif kind == "arrays":
                writer.write(**request[1])
            else:
                raise ValueError(f"unknown dispatcher request {kind!r}")
        except BaseException as e:  # noqa: BLE001 - sent to the capturing process
            if kind == "open":
                tell("error", e)
            elif not failed:
                failed = True
                tell("error", e)


if __name__ == "__main__":
    _serve()
