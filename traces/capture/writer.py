"""A trace writer that encodes on several threads: the capture's sink, off the model's critical path.

Parquet encoding runs inside pyarrow without the GIL, but one file is written by one thread.
:class:`ParallelTraceWriter` cuts the stream of recorded tokens into *units* of about one row
group; worker threads write each unit as a trace file of its own with
:class:`traces.format.TraceWriter` (so every unit is checked and encoded exactly as a single
writer would do it), and the unit files are appended to the output in order as soon as all
earlier ones are done, their bytes copied and their footers merged
(:class:`traces.capture.concat.ParquetJoin`: nothing is decoded or encoded twice; pages keep
their checksums). What is left for :meth:`ParallelTraceWriter.close` is the last units and the
footer.

The content hash (:class:`traces.format.ContentHash`) is one SHA-256 stream per column in trace
order, so it cannot be computed per unit and combined: the thread that appends a unit also feeds
the unit's stored columns to the file's hash, in unit order, and the units themselves are
written without one. The file records the hash a single writer of the same tokens records.

``processes=True`` (the capture's ``processes`` writer; its default, ``dispatcher``, runs this
writer with processes in a child process of its own: :mod:`traces.capture.dispatch`): each worker thread hands its unit to a process of a
shared pool and waits, so the encoding runs outside the capture's interpreter. Encoder threads
share the GIL with the thread that drives the model: every time the model's forward waits for
the device and wants the GIL back, it can wait up to a switch interval behind an encoder, which
cost captures of a 48-layer model 40 % of their speed on the GPU host. The appending and the
hash run outside it too, in a *joiner* process: an encoder leaves the unit's stored columns in
a block of shared memory of their own, and the thread that finds a unit next in order sends the
joiner its part file and block; the joiner reads the part's footer, copies the part into the
output while threads of its own hash the block's large columns, and removes both. What is left in the capturing process per unit is one
copy of the columns into shared memory and a few small messages (on the 30B shape, the append and the hash
had cost it ~30 us of CPU per token, about as much as the forward's own host side at batch 16).

Not even that copy where the producer asks for shared memory first (:meth:`ParallelTraceWriter.block`):
it fills a block of rows in a *slab* (the capture has the GPU copy the rows there, the slab
registered with CUDA), writes the block's views, and an encoder process is told where each piece
of its unit lies instead of getting a copy. A slab is lent again once all its tokens are in the
output; slabs are kept for the process's next writers. On the small Qwen3-Next shape at batch 16
the capture ran +6.2 % and +7.3 % over the forward alone against +33.6 % and +21.0 % with the
copy, side by side in two runs on the H200 (a third gave +21.2 %; docs/CAPTURE.md). The tokens
lent at a time are bounded (:class:`BoundedLending`), so a producer ahead of the encoders, or of
the joiner that hashes the rows in the slabs, waits in ``block`` instead of growing shared memory
without end.
"""
from __future__ import annotations

import atexit
import mmap
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from traces.atomic import pid_alive, temp_path
from traces.capture.concat import ParquetJoin, read_footer
from traces.capture.cores import leave_model_core
from traces.errors import InputError
from traces.format import ContentHash, TraceMeta, TraceWriter

MAX_AUTO_WORKERS = 8
# threads of the joiner that hash a unit's large columns while it copies the unit's part: per
# unit of the small Qwen3-Next shape (3,206 tokens, top-64 logits) the joiner then took 8.7 ms
# instead of 12.1 ms (2 cores, medians of 30: python -m traces.capture.writer_cost --join-units 60)
HASH_THREADS = 3
FINAL_UNIT_TOKENS = 256  # the units left at the close are split among the encoders down to this size


def default_workers() -> int:
    """Encoding threads when not set: half the CPU cores (the rest run the model's host side), 1 to 8."""
    return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 2) // 2))


def _reserve(fd: int, nbytes: int) -> None:
    """Size a new shared file, its pages reserved where the system can: a /dev/shm smaller than
    asked for (a container's default is 64 MiB) then fails here with ENOSPC instead of killing
    the process with SIGBUS at the first write past its end."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)
    else:
        os.ftruncate(fd, nbytes)


SHARED_PREFIXES = ("moe-trace-encoder-", "moe-trace-rows-")  # then the creating process's id, "-"
_SWEPT = [False]  # this process has removed the shared files of dead ones (:func:`remove_orphan_shared`)


SHARED_DIR_ENV = "MOE_TRACE_SHARED_DIR"  # where the shared-memory files go, if not /dev/shm


def shared_folder() -> str | None:
    """The folder of this process's shared-memory files: ``$MOE_TRACE_SHARED_DIR`` where it is
    set (an existing folder; child processes inherit it), else /dev/shm where there is one, else
    None (the system's temporary folder). The folder must be this host's own, not shared with
    other hosts or containers: :func:`remove_orphan_shared` takes a file whose process id runs
    nowhere here for the file of a dead process."""
    chosen = os.environ.get(SHARED_DIR_ENV)
    if chosen:
        if not os.path.isdir(chosen):
            raise InputError(f"{SHARED_DIR_ENV}={chosen} is not a folder; create it (a memory-backed "
                             "file system such as /dev/shm keeps the rows out of the disk) or unset it")
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def remove_orphan_shared(folder: str | None = None) -> list[Path]:
    """Remove the shared-memory files (:data:`SHARED_PREFIXES`) of processes that no longer run:
    a capture killed outright (SIGKILL, out of memory) runs no clean-up of its own. Returns the
    removed paths."""
    removed = []
    folder = folder or shared_folder() or tempfile.gettempdir()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in SHARED_PREFIXES if name.startswith(p)), None)
        pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(Path(folder, name))
            except OSError:
                pass
    return removed


class _Shared:
    """A file in shared memory (/dev/shm where there is one), mapped; both processes map it by path.
    Its name holds the id of the process that made it (:func:`remove_orphan_shared`)."""

    def __init__(self, nbytes: int, path: str | None = None, prefix: str = SHARED_PREFIXES[0]):
        if path is None:
            if not _SWEPT[0]:
                _SWEPT[0] = True
                remove_orphan_shared()
            fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=shared_folder())
            try:
                _reserve(fd, nbytes)
            except OSError:
                os.close(fd)
                Path(path).unlink(missing_ok=True)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        self.path, self.size = path, nbytes
        try:
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def close(self, unlink: bool = False) -> None:
        self.map.close()
        if unlink:
            Path(self.path).unlink(missing_ok=True)


def _layout(columns: dict[str, tuple[np.dtype, tuple]]) -> tuple[list[tuple[str, str, tuple, int]], int]:
    """Where each column (dtype, shape) goes in a shared block: (name, dtype, shape, offset) and
    the bytes in all."""
    layout, offset = [], 0
    for name, (dtype, shape) in columns.items():
        layout.append((name, dtype.str, shape, offset))
        offset += -(-dtype.itemsize * int(np.prod(shape)) // 64) * 64
    return layout, offset


def _views(block: mmap.mmap, layout) -> dict[str, np.ndarray]:
    return {name: np.ndarray(shape, np.dtype(dtype), buffer=block, offset=offset)
            for name, dtype, shape, offset in layout}


class Slab(_Shared):
    """Shared memory that one block of rows is written into by its producer and read in place by
    an encoder process (:meth:`ParallelTraceWriter.block`). Slabs are kept for the next blocks
    (and writers) of this process: a producer that registers one with its device (``pinned``,
    ``on_close``) does so once."""

    def __init__(self, nbytes: int, path: str | None = None):
        super().__init__(nbytes, path, prefix=SHARED_PREFIXES[1])  # with ``path``: another process's slab
        self._bytes = np.frombuffer(self.map, np.uint8)  # holds the mapping's address
        self.address = self._bytes.ctypes.data
        self.pinned: bool | None = None  # the producer's registration: None not tried, False failed
        self.on_close: list = []  # the producer's undo of its registration
        self.remaining = 0  # tokens of the block lent in it not encoded yet

    def close(self, unlink: bool = False) -> None:
        for undo in self.on_close:
            try:
                undo()
            except Exception:  # noqa: BLE001 - at exit the device may be gone already
                pass
        self.on_close.clear()
        self._bytes = None
        super().close(unlink)


SLAB_ROUND = 1 << 20  # slab sizes are rounded up to whole MiB, so one fits the next blocks of a run
_SLABS: list[Slab] = []  # every slab of this process
_FREE_SLABS: list[Slab] = []
_SLAB_LOCK = threading.Lock()
_SLAB_OF_MAP: dict[int, Slab] = {}  # id of a slab's map -> the slab (:func:`_slab_of`)


def _lend_slab(nbytes: int) -> Slab:
    """The smallest free slab of at least ``nbytes``, or a new one."""
    with _SLAB_LOCK:
        fits = [s for s in _FREE_SLABS if s.size >= nbytes]
        if fits:
            slab = min(fits, key=lambda s: s.size)
            _FREE_SLABS.remove(slab)
            return slab
    slab = Slab(-(-max(nbytes, 1) // SLAB_ROUND) * SLAB_ROUND)
    with _SLAB_LOCK:
        _SLABS.append(slab)
        _SLAB_OF_MAP[id(slab.map)] = slab
    return slab


def _return_slab(slab: Slab) -> None:
    with _SLAB_LOCK:
        slab.remaining = 0
        if slab not in _FREE_SLABS:
            _FREE_SLABS.append(slab)


def _slab_of(piece: dict[str, np.ndarray]) -> Slab | None:
    """The slab holding every column of ``piece`` (C-contiguous), or None.

    Found by the memory each view was made on (views of a slab's map, and their slices), not by
    comparing every column's address with every slab's: Python in the capturing process holds
    the interpreter lock the model's thread needs (docs/CAPTURE.md, the contention check)."""
    slab = None
    for a in piece.values():
        if not a.flags.c_contiguous:
            return None
        root = a.base
        while isinstance(root, np.ndarray):
            root = root.base
        found = _SLAB_OF_MAP.get(id(root))
        if found is None or found.map is not root or (slab is not None and found is not slab):
            return None
        slab = found
    return slab


# tokens lent at a time (:class:`BoundedLending`), in units: the units queue (2 per encoder), one
# unit in each encoder, one being cut and one pending
LENT_UNITS_PER_WORKER, LENT_UNITS_MORE = 3, 2


class BoundedLending:
    """The bound on the tokens of slabs lent at a time, a base of the writers that lend them
    (:meth:`ParallelTraceWriter.block`, :meth:`~traces.capture.dispatch.DispatchedTraceWriter.block`),
    initialised once their ``unit_tokens`` and ``workers`` are set: about
    :data:`LENT_UNITS_PER_WORKER` units per encoder. ``_lent_tokens`` counts the tokens of the
    slabs lent; ``_cond`` is notified when some are given back, or on an error (``_error``).
    ``lend_wait_s``: the seconds :meth:`_wait_to_lend` has waited so far (the producer held up by
    the bound)."""

    unit_tokens: int
    workers: int

    def __init__(self):
        self._max_lent = self.unit_tokens * (LENT_UNITS_PER_WORKER * self.workers + LENT_UNITS_MORE)
        self._lent_tokens = 0
        self._max_block = 0  # the most tokens of one block so far
        self._cond = threading.Condition(threading.RLock())
        self._error: BaseException | None = None
        self.lend_wait_s = 0.0

    def _wait_to_lend(self, tokens: int) -> None:
        """Wait while lending ``tokens`` more would pass the bound; re-raises the writer's error."""
        with self._cond:
            self._max_block = max(self._max_block, tokens)
            # the writer keeps the tokens after its last whole unit (< unit_tokens, in the last
            # blocks, at most unit_tokens + a block's) until more come: wait only while some slab
            # lies wholly before them, so that one is given back without more rows
            began = None
            while (self._lent_tokens + tokens > self._max_lent and self._error is None
                   and self._lent_tokens >= self.unit_tokens + self._max_block):
                began = began or time.perf_counter()
                self._cond.wait()
            if began:
                self.lend_wait_s += time.perf_counter() - began
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _in_slab(slab: Slab, piece: dict[str, np.ndarray]) -> tuple[str, int, list]:
    """Where ``piece`` lies in ``slab``, as an encoder maps it: (path, size, layout)."""
    return slab.path, slab.size, [(name, v.dtype.str, v.shape, v.ctypes.data - slab.address)
                                  for name, v in piece.items()]


class RowBlock:
    """Columns of one block of rows in a :class:`Slab` (``views``): fill them, then pass them to
    :meth:`ParallelTraceWriter.write`."""

    def __init__(self, views: dict[str, np.ndarray], slab: Slab):
        self.views, self.slab = views, slab


class _Child:
    """A child interpreter (``python -m traces.capture.writer ROLE``) that takes pickled requests
    on its stdin and answers each with one pickled ``(ok, value)`` on its stdout.

    Started as a plain subprocess, so nothing of the capturing program (its main module, CUDA, its
    threads) is imported or inherited.
    """

    role = ""
    module = "traces.capture.writer"
    session = False  # a session (and process group) of its own, which its children join

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the traces package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, self.role],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=self.session)
        leave_model_core(self.proc.pid)

    def send(self, request) -> None:
        try:
            pickle.dump(request, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self._exited()

    def reply(self):
        """The next answer's value; raises the child's error, or one naming its exit."""
        try:
            ok, value = pickle.load(self.proc.stdout)
        except (EOFError, ValueError, pickle.UnpicklingError):
            self._exited()
        if not ok:
            raise value
        return value

    def _exited(self):
        self.close()
        raise RuntimeError(f"a trace {self.role} process exited (code {self.proc.poll()}); "
                           "its error, if any, is printed above") from None

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self.proc.wait()


class _Encoder(_Child):
    """A child that writes units. A unit's columns go through shared memory (the slabs they were
    written in, or one copy into the encoder's block), the arguments and the reply through the
    pipes. The joiner hashes the unit's stored columns where they are: in the slabs, when they are
    the rows as given (no conversion), or else in a block of shared memory the child leaves them
    in, which the joiner removes (:func:`_stored_block`)."""

    role = "encoder"

    def __init__(self):
        super().__init__()
        self.block: _Shared | None = None

    def write_unit(self, part, meta, unit_tokens, after, pieces):
        """Where the joiner finds the unit's stored columns: ``("slabs", [(path, size, layout)])``,
        the pieces where they lie (their slabs stay lent until the joiner has hashed them), or
        ``("block", (path, size, layout))`` (:func:`_encode_request`). ``pieces``: the unit's
        columns in consecutive parts (:func:`_cut`). Pieces that lie in slabs (:meth:`ParallelTraceWriter.block`)
        are read there by the child; others are copied into this encoder's block one after the other."""
        slabs = [_slab_of(p) for p in pieces]
        if all(slabs):
            sources = [_in_slab(s, p) for s, p in zip(slabs, pieces, strict=True)]
            self.send((sources, part, meta, unit_tokens, after, True))
            block = self.reply()
            return ("slabs", sources) if block is None else ("block", block)
        n = sum(p["seq"].shape[0] for p in pieces)
        layout, nbytes = _layout({name: (v.dtype, (n, *v.shape[1:])) for name, v in pieces[0].items()})
        if self.block is None or self.block.size < nbytes:
            size = max(nbytes, 2 * self.block.size if self.block else 0, mmap.PAGESIZE)
            self._free_block()
            self.block = _Shared(size)
        for name, view in _views(self.block.map, layout).items():
            np.concatenate([p[name] for p in pieces], out=view)
        self.send(([(self.block.path, self.block.size, layout)], part, meta, unit_tokens, after, False))
        return ("block", self.reply())  # the encoder's block is filled again for the next unit

    def _free_block(self) -> None:
        if self.block is not None:
            self.block.close(unlink=True)
            self.block = None

    def close(self) -> None:
        super().close()
        self._free_block()


class _Joiner(_Child):
    """A child that builds the output from finished units in order (:func:`_join_request`)."""

    role = "joiner"


_IDLE: dict[type, list[_Child]] = {}  # started children, kept for the next writer (a bench opens one per pass)
_IDLE_LOCK = threading.Lock()


def _take(kind: type) -> _Child:
    with _IDLE_LOCK:
        child = _IDLE[kind].pop() if _IDLE.get(kind) else None
    if child is None:
        return kind()
    leave_model_core(child.proc.pid)  # started before the model's thread had a core of its own
    return child


def _give_back(child: _Child) -> None:
    if child.proc.poll() is None:
        with _IDLE_LOCK:
            _IDLE.setdefault(type(child), []).append(child)
    else:
        child.close()


@atexit.register
def _close_children() -> None:
    with _IDLE_LOCK:
        for child in (c for kind in _IDLE.values() for c in kind):
            child.close()
        _IDLE.clear()
    with _SLAB_LOCK:
        for slab in _SLABS:
            slab.close(unlink=True)
        _SLABS.clear()
        _FREE_SLABS.clear()
        _SLAB_OF_MAP.clear()


def _stored_block(stored: dict[str, np.ndarray]) -> tuple[str, int, list]:
    """The stored columns in a new block of shared memory: (path, size, layout)."""
    layout, nbytes = _layout({name: (v.dtype, v.shape) for name, v in stored.items()})
    block = _Shared(max(nbytes, 1))
    try:
        for name, view in _views(block.map, layout).items():
            view[...] = stored[name]
    except BaseException:
        block.close(unlink=True)
        raise
    block.close()
    return block.path, block.size, layout


class _Mapped:
    """The encoder's maps of the blocks and slabs it reads, the last :data:`KEEP` of them (a
    slab is lent again and again, so its map is made once); and the memory it joins the pieces of
    a unit that spans blocks in (:meth:`joined`), kept for the next such unit."""

    KEEP = 16

    def __init__(self):
        self.blocks: dict[tuple[str, int], _Shared] = {}
        self._join: dict[str, np.ndarray] = {}  # per column, bytes

    def joined(self, pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """:func:`_joined` in memory this encoder keeps: valid until its next call. A unit that
        spans two blocks (two in five of the small Qwen3-Next shape's 3,206-token units at batch
        16) had its columns joined in new memory each time: about 900 pages to fault in and clear
        per unit on average; the writer's processes now take 0.91x the CPU per unit on the 2-core
        development machine (``docs/capture/writer_cost_ab.py``, with ``TraceMeta.to_json``'s cut)."""
        if len(pieces) == 1:
            return pieces[0]
        out = {}
        for name, first in pieces[0].items():
            shape = (sum(p[name].shape[0] for p in pieces), *first.shape[1:])
            nbytes = first.dtype.itemsize * int(np.prod(shape))
            memory = self._join.get(name)
            if memory is None or memory.size < nbytes:
                memory = self._join[name] = np.empty(nbytes, np.uint8)
            out[name] = np.concatenate([p[name] for p in pieces], out=memory[:nbytes].view(first.dtype).reshape(shape))
        return out

    def get(self, path: str, size: int) -> _Shared:
        block = self.blocks.pop((path, size), None) or _Shared(size, path)
        self.blocks[(path, size)] = block  # the most recent last
        while len(self.blocks) > self.KEEP:
            self.blocks.pop(next(iter(self.blocks))).close()
        return block


def _encode_request(state: _Mapped, request):
    """Encoder: write a unit from its pieces in shared memory ((path, size, layout) each, in
    token order) as a part file. Returns None where the stored columns are the pieces' bytes
    and the pieces stay (``in_place``): the joiner hashes them there. Else the stored columns'
    block (path, size, layout): a block of 8 MB cost 9 ms of CPU to fill and 3 ms to remove (2
    cores), a sixth of a unit of the small Qwen3-Next shape. The joiner parses the part's footer
    itself, so the capturing process, which hands the unit on, does not unpickle and pickle it
    again (an entry for every offset the join rewrites)."""
    sources, part, meta, unit_tokens, after, in_place = request
    pieces = [_views(state.get(path, size).map, layout) for path, size, layout in sources]
    given = state.joined(pieces)  # the stored columns are either these (in place) or copied below
    stored = _write_part(part, meta, unit_tokens, after, given)
    if in_place and _same_arrays(stored, given):
        return None
    return _stored_block(stored)


def _same_arrays(stored: dict[str, np.ndarray], given: dict[str, np.ndarray]) -> bool:
    """The writer stored every column as given: the same memory, dtype and shape (no conversion,
    no column added), so hashing the given pieces in order hashes what it stored."""
    return stored.keys() == given.keys() and all(
        a.dtype == b.dtype and a.shape == b.shape and a.flags.c_contiguous and b.flags.c_contiguous
        and a.ctypes.data == b.ctypes.data for a, b in ((stored[k], given[k]) for k in stored))


class _Join:
    """The joiner's output: a ParquetJoin and the content hash, or None between files; its maps
    of the slabs it hashes rows in; the threads that hash a unit's large columns while it copies
    the unit's part (:data:`HASH_THREADS`)."""

    def __init__(self):
        self.file = self.join = self.content = None
        self.slabs = _Mapped()
        self.pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hash")


def _join_request(state: _Join, request):
    """Joiner: ``("open", path, meta)``; ``("append", part, where)``: the part's row groups, its
    stored columns hashed where :meth:`_Encoder.write_unit` says they are (the part and a block
    are removed whatever happens, slabs never); ``("end", keep)``: the footer and the
    content hash written (``keep``) or not, the file closed (then a next open)."""
    kind = request[0]
    if kind == "open":
        state.file = open(request[1], "wb")  # noqa: SIM115 - closed by "end"
        state.join, state.content = ParquetJoin(state.file), ContentHash(request[2])
        return None
    if kind == "append":
        _, part, (where, located) = request
        block = None
        try:
            if where == "slabs":  # the unit's pieces in order: one column's bytes after another's
                pieces = [_views(state.slabs.get(path, size).map, layout) for path, size, layout in located]
            else:
                path, size, layout = located
                block = _Shared(size, path)
                pieces = [_views(block.map, layout)]
            hashing = state.content.submit(pieces, state.pool)
            try:  # the part copied while its columns are hashed
                state.join.append(Path(part), *read_footer(Path(part)))
            finally:
                wait(hashing)  # none may still read the pieces when they are unmapped
            for f in hashing:
                f.result()  # a hash's error
        finally:
            if block is not None:
                block.close()
            _remove_unit_files(request)
        return None
    if kind == "end":
        file, state.file = state.file, None
        try:
            if request[1]:
                state.join.finish(state.content.hexdigest())
        finally:
            if file is not None:
                file.close()
        return None
    raise ValueError(f"unknown joiner request {kind!r}")


def _serve(role: str) -> None:
    """A child's loop (:class:`_Child`): one answer per request, errors included."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    handle, state = {"encoder": (_encode_request, _Mapped), "joiner": (_join_request, _Join)}[role]
    state = state()
    while True:
        try:
            request = pickle.load(stdin)
        except EOFError:
            return
        try:
            reply = (True, handle(state, request))
        except BaseException as e:  # noqa: BLE001 - every error goes back to the writer
            reply = (False, e)
        pickle.dump(reply, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()


def _write_part(part: Path, meta: TraceMeta, unit_tokens: int, after, cols: dict[str, np.ndarray]):
    """Write one unit as a trace file without a content hash; its stored columns."""
    with TraceWriter(part, meta, row_group_tokens=unit_tokens, record_content=False, after=after) as writer:
        return writer.write(**cols)


def _cut(blocks: list[dict[str, np.ndarray]], offset: int, n: int):
    """The next ``n`` tokens of ``blocks`` (from ``blocks[0][offset]``) as a unit's pieces (views
    of the blocks, one per block it spans), and the blocks and offset after it. Nothing is copied
    here: the encoder copies the pieces into its block (:meth:`_Encoder.write_unit`). Joining
    whole blocks first had cost the writing thread 4.2 ms per 8,192-token forward of the small
    Qwen3-Next shape with top-64 logits, now 0.3 ms (``python -m traces.capture.writer_cost``)."""
    pieces = []
    while n:
        block = blocks[0]
        size = block["seq"].shape[0]
        take = min(n, size - offset)
        pieces.append({name: v[offset:offset + take] for name, v in block.items()})
        n -= take
        offset += take
        if offset == size:
            blocks, offset = blocks[1:], 0
    return pieces, blocks, offset


def _joined(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A unit's pieces as one set of columns (a view where there is one piece)."""
    if len(pieces) == 1:
        return pieces[0]
    return {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}


def _remove_unit_files(request: tuple | None) -> None:
    """The part file and the stored block (not slabs) of a joiner's ``append`` request."""
    if request is not None and request[0] == "append":
        Path(request[1]).unlink(missing_ok=True)
        where, located = request[2]
        if where == "block":
            Path(located[0]).unlink(missing_ok=True)


def checked_settings(path, meta: TraceMeta, unit_tokens: int, workers: int | None,
                     expected_tokens: int | None = None) -> tuple[Path, TraceMeta, int, int]:
    """A parallel writer's (path, meta, unit tokens, workers), checked before anything starts
    (``expected_tokens`` too: None or at least 1)."""
    path = Path(path)
    meta.check(str(path))
    if not path.parent.is_dir():
        raise InputError(f"{path}: directory {path.parent} does not exist; create it first")
    if unit_tokens < 1:
        raise ValueError(f"unit_tokens must be >= 1, got {unit_tokens}")
    if expected_tokens is not None and expected_tokens < 1:
        raise ValueError(f"expected_tokens must be None or >= 1, got {expected_tokens}")
    return path, meta, unit_tokens, workers or default_workers()


class ParallelTraceWriter(BoundedLending):
    """Writes whole tokens to a trace file like :class:`TraceWriter`, encoding row groups in parallel.

    ``write`` takes what ``TraceWriter.write`` takes, from one thread, in trace order. Tokens are
    cut into units of ``unit_tokens`` (each becomes one row group) and queued to ``workers``
    threads; the queue is bounded, so a caller faster than the encoders waits in ``write`` (and
    in ``block``, where the tokens lent in slabs are bounded: :class:`BoundedLending`).
    Units and the growing output are hidden files beside ``path``, which the output replaces
    when ``close`` completes it. An exception inside the ``with`` block, or in a worker, leaves
    no file at ``path`` and no hidden files.

    ``expected_tokens`` (optional): the tokens the caller will write in all, where it knows them.
    The ``write`` that reaches them cuts everything pending into one unit per encoder at once, as
    ``close`` cuts what is left, so that the close waits for parts of units, not for the whole
    units that last write would queue. A wrong number costs nothing but that: with fewer tokens
    the close cuts as before, with more the writer goes on in whole units.
    """

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, unit_tokens: int, workers: int | None = None,
                 processes: bool = False, give_slab=None, expected_tokens: int | None = None):
        self.path, self.meta, self.unit_tokens, self.workers = checked_settings(path, meta, unit_tokens, workers,
                                                                                expected_tokens)
        super().__init__()
        self.expected_tokens = expected_tokens
        self._processes = processes
        self.num_tokens = 0
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_tokens = 0
        self._units: queue.Queue = queue.Queue(maxsize=2 * self.workers)
        self._tmp = temp_path(self.path)  # the output while it grows
        self._file = None
        self._join: ParquetJoin | None = None
        self._lock = threading.Lock()  # appends to the output and the content hash, in unit order
        self._content = ContentHash(meta)
        # unit index -> (file, footer, start, stored columns), until appended
        self._finished: dict[int, tuple] = {}
        self._appended = 0
        self._queued = 0
        self._last_queued: tuple[int, int] | None = None  # (seq, pos) of the last token queued
        self._cancelled = False  # workers skip what is still queued
        self._closed = False
        self._joiner: _Joiner | None = None  # with encoder processes: appends and hashes
        self._sent: queue.Queue = queue.Queue()  # the joiner's requests not answered yet, in order
        self._replies: threading.Thread | None = None
        if processes:
            self._joiner = _take(_Joiner)
            self._replies = threading.Thread(target=self._read_replies, args=(self._joiner,), name="trace-joiner",
                                             daemon=True)
            self._replies.start()
            self._to_joiner(("open", str(self._tmp), meta))
        self._lent: dict[Slab, int] = {}  # slabs of blocks written (or to be) not yet appended -> their tokens
        self._give_slab = give_slab or _return_slab  # a slab all of whose tokens are in the output
        self._threads = [threading.Thread(target=self._encode, name=f"trace-encoder-{i}", daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def block(self, columns: dict[str, tuple[np.dtype, tuple]]) -> RowBlock | None:
        """Shared memory for the next rows to write: ``columns`` name -> (dtype, shape), shape[0]
        the tokens. Fill the block's views, then pass them to :meth:`write`. Encoder processes
        read them where they are, so this process does not copy them again (with a device, the
        producer can have the device write them there: :class:`Slab`). The memory is lent until
        those tokens are in the output; waits while too many are lent (:class:`BoundedLending`).
        None where the system has no room for it (a small /dev/shm): write plain arrays then."""
        tokens = int(next(iter(columns.values()))[1][0])
        self._wait_to_lend(tokens)
        layout, nbytes = _layout({name: (np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in columns.items()})
        try:
            slab = _lend_slab(nbytes)
        except OSError:
            return None
        self.lend(slab, tokens)
        return RowBlock(_views(slab.map, layout), slab)

    def lend(self, slab: Slab, tokens: int) -> None:
        """``slab`` holds the next ``tokens`` rows to write, and is given back (``give_slab``) once
        they are all in the output: :meth:`block` of memory from elsewhere (:mod:`traces.capture.dispatch`).
        Never waits: the process that lent the slab bounds what it lends."""
        with self._cond:
            slab.remaining = tokens
            self._lent[slab] = tokens
            self._lent_tokens += tokens

    def _appended_pieces(self, pieces: list[dict[str, np.ndarray]]) -> None:
        """Give back the slabs all of whose tokens are in the output now (and hashed)."""
        for piece in pieces:
            slab = _slab_of(piece)
            with self._cond:
                if slab not in self._lent:
                    continue
                slab.remaining -= piece["seq"].shape[0]
                if slab.remaining > 0:
                    continue
                tokens = self._lent.pop(slab)
            self._give_slab(slab)
            with self._cond:  # only now: a block() woken finds the slab free
                self._lent_tokens -= tokens
                self._cond.notify_all()

    def _return_slabs(self) -> None:
        """Every slab still lent (the writer is done with them: workers stopped)."""
        with self._cond:
            lent, self._lent, self._lent_tokens = self._lent, {}, 0
        for slab in lent:
            self._give_slab(slab)

    def write(self, **columns) -> None:
        """Append tokens (the keyword arguments of ``TraceWriter.write``); re-raises a worker's error."""
        self._raise_error()
        cols = {name: np.asarray(v) for name, v in columns.items() if v is not None}
        n = cols["seq"].shape[0]
        if not n:
            return
        self.num_tokens += n
        self._pending.append(cols)
        self._pending_tokens += n
        if self.expected_tokens is not None and self.num_tokens - n < self.expected_tokens <= self.num_tokens:
            self._dispatch(final=True)  # the last write (as the caller expects): cut for the close
        elif self._pending_tokens >= self.unit_tokens:
            self._dispatch(final=False)

    def _dispatch(self, final: bool) -> None:
        """Queue the pending tokens as whole units (and, at the end, the rest as a last unit)."""
        if not self._pending:
            return
        n = self._pending_tokens
        whole = n if final else n - n % self.unit_tokens
        # the close waits for the last units: cut them smaller, one per encoder (down to FINAL_UNIT_TOKENS)
        size = min(self.unit_tokens, max(-(-n // self.workers), FINAL_UNIT_TOKENS)) if final else self.unit_tokens
        blocks, offset = self._pending, 0  # the next unit starts at blocks[0][offset]
        for start in range(0, whole, size):
            pieces, blocks, offset = _cut(blocks, offset, min(size, whole - start))
            self._units.put((self._queued, self._last_queued, pieces))  # each unit checks it follows the last
            self._last_queued = (int(pieces[-1]["seq"][-1]), int(pieces[-1]["pos"][-1]))
            self._queued += 1
        if blocks and offset:
            blocks[0] = {name: v[offset:] for name, v in blocks[0].items()}
        self._pending = blocks
        self._pending_tokens = n - whole

    def _encode(self) -> None:
        leave_model_core()
        encoder = None
        try:
            encoder = _take(_Encoder) if self._processes else None
        except OSError as e:
            self._fail(e)
        try:
            self._encode_units(encoder)
        finally:
            if encoder is not None:
                _give_back(encoder)

    def _encode_units(self, encoder: _Encoder | None) -> None:
        while (item := self._units.get()) is not None:
            index, after, pieces = item
            if self._error is not None or self._cancelled:
                continue  # drain the queue; close() reports the error
            part = temp_path(self.path.with_name(f"{self.path.name}.part{index:06d}"))
            try:
                # with an encoder process, this thread waits for it without the GIL
                stored = (encoder.write_unit(part, self.meta, self.unit_tokens, after, pieces) if encoder
                          else _write_part(part, self.meta, self.unit_tokens, after, _joined(pieces)))
                self._append_in_order(index, (part, stored, pieces))
            except InputError as e:  # bad rows: name the file the caller asked for
                self._fail(InputError(str(e).replace(str(part), str(self.path))))
            except BaseException as e:  # re-raised in the writing thread
                self._fail(e)

    def _append_in_order(self, index: int, unit: tuple) -> None:
        """Append every finished unit that comes next (the thread that finishes one does it, or
        hands it to the joiner process)."""
        with self._lock:
            self._finished[index] = unit
            while (unit := self._finished.get(self._appended)) is not None:
                part, stored, pieces = unit
                if self._joiner is not None:  # the joiner removes the part and the stored block
                    in_slabs = stored[0] == "slabs"  # then lent until the joiner has hashed them
                    self._to_joiner(("append", str(part), stored), pieces if in_slabs else None)
                    if in_slabs:
                        pieces = []
                else:
                    if self._join is None:
                        self._file = self._tmp.open("wb")
                        self._join = ParquetJoin(self._file)
                    self._join.append(part, *read_footer(part))
                    self._content.update(stored)  # may be views of the unit's slabs: hashed before they are lent again
                    part.unlink()
                del self._finished[self._appended]  # only now: a unit that failed is removed by close
                self._appended += 1
                self._appended_pieces(pieces)

    def _to_joiner(self, request: tuple, pieces: list | None = None) -> None:
        """Send ``request``; ``pieces``: the unit's rows in slabs, given back once answered."""
        self._sent.put((request, pieces))
        self._joiner.send(request)

    def _read_replies(self, joiner: _Joiner) -> None:
        """The joiner's answers, one per request, until the one to "end"; the first error is kept."""
        leave_model_core()
        while (item := self._sent.get()) is not None:
            request, pieces = item
            try:
                joiner.reply()
            except BaseException as e:  # noqa: BLE001 - re-raised in the writing thread
                self._fail(e)
                if joiner.proc.poll() is not None:  # exited: no more answers
                    _remove_unit_files(request)  # the rest: by _remove_files
                    return
            if pieces:
                self._appended_pieces(pieces)
            if request[0] == "end":
                return

    def _end_join(self, keep: bool) -> None:
        """The joiner writes the footer (``keep``) or not and closes the output; waits for it."""
        joiner, self._joiner = self._joiner, None
        if joiner is None:
            return
        try:
            end = ("end", keep)
            self._sent.put((end, None))
            joiner.send(end)
        except RuntimeError as e:
            self._fail(e)
            self._sent.put(None)
        self._replies.join()
        _give_back(joiner)

    def _stop_workers(self) -> None:
        for _ in self._threads:
            self._units.put(None)
        for t in self._threads:
            t.join()

    def _fail(self, error: BaseException) -> None:
        """Keep the first error for the writing thread; a :meth:`block` waiting for slabs raises it."""
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def close(self) -> None:
        """Encode what is pending, finish the output and move it to ``path``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._dispatch(final=True)
        finally:
            self._stop_workers()
        try:
            self._end_join(keep=self._error is None and self._queued > 0)
            self._raise_error()
            if not self._queued:
                TraceWriter(self.path, self.meta).close()  # no tokens: the single writer's error
            else:
                if self._join is not None:
                    self._join.finish(self._content.hexdigest())
                    self._file.close()
                os.replace(self._tmp, self.path)
        finally:
            self._remove_files()

    def abort(self) -> None:
        """Drop everything written; ``path`` is left as it was."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        self._cancelled = True
        try:
            self._stop_workers()
            self._end_join(keep=False)
        finally:
            self._remove_files()

    def _remove_files(self) -> None:
        """Remove the hidden files: units not appended, and the output unless it was moved to ``path``."""
        self._return_slabs()
        for part, stored, _ in self._finished.values():
            part.unlink(missing_ok=True)
            if isinstance(stored, tuple) and stored[0] == "block":  # an encoder process's, not handed on
                Path(stored[1][0]).unlink(missing_ok=True)
        self._finished.clear()
        while not self._sent.empty():  # handed to a joiner that exited before it answered
            item = self._sent.get()
            _remove_unit_files(item and item[0])
        if self._file is not None:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ParallelTraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        (self.close if exc_type is None else self.abort)()  # an error inside the block: no file


if __name__ == "__main__":
    _serve(sys.argv[1] if len(sys.argv) > 1 else "encoder")
