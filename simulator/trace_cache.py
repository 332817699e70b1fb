"""A memory-mapped, decoded copy of a trace file, keyed by the trace's content hash.

Decoding Parquet costs far more than simulating fetch-every-miss; a sweep of many Hydra jobs over
one trace decodes it once here and every later job maps the arrays straight from disk. The copy
lives under ``$MOE_SIM_CACHE`` (default ``$XDG_CACHE_HOME/moe-offload-sim``, i.e.
``~/.cache/moe-offload-sim``) in ``traces/<key>/``: one ``.npy`` file per array and
``manifest.json``. Logits stay float16 as stored (top-R ones with their ids), expert ids int16,
so the copy is about the size of the trace's float16 logits (plus 8 % at 48 x 512 x top-10, and
12.5 % for 64 ranked ids); chunks convert them with the float16 lookup table and decode only
what the caller asks for (``logits``, ``order_r``, as every chunk source). Look-ahead routing is
kept decoded, ids sorted by logit (int16) beside their float16 logits: the stored size for top-R
look-ahead, twice it for all E (whose order the reader would otherwise sort again per chunk).

Built while the first run streams: a source opened before a copy exists reads the Parquet file
for its first forward pass and writes the copy as it goes; the copy is put in place only when
the pass reaches the end and the content matches the trace's recorded hash. A pass that stops
early, raises or is killed leaves no usable copy (the next pass builds again). ``logit_order``
for an R not yet kept is computed the same way on a pass over the copy and kept beside it
(``candidate_order_<R>.npy``; any kept R' >= R serves R, as its first R ids).

The key is the content hash the trace records (its hex digest: a file rewritten with other
content gets another key, however its size and modification time look); a file written before
content hashes is keyed by the SHA-256 of its bytes (``file-<hex>``), remembered per file
identity including the inode's change time, which no rewrite can restore.

Integrity: the manifest records each array's size, CRC-32 and file identity (inode, size,
modification and change time). Opening a copy compares the identities (a few ``stat`` calls);
an array whose identity changed is checked against its CRC-32, and a copy that fails (edited,
truncated, an old layout, an unreadable manifest) is removed and rebuilt with one warning line
on stderr.

A copy, once built, is announced on stderr with its path and size and the cache's total (once
per process and copy): the cache can grow by gigabytes per trace. ``moe-trace cache list`` shows
the copies (:func:`cache_entries`), ``moe-trace cache clear`` removes them (:func:`clear_cache`).

Concurrent jobs are safe: a copy is built in a private temporary directory beside its final
place, named with the builder's process id, and renamed into place in one step; a job that loses
the race discards its own copy, and the next job removes the build directories of builders that
died. Within a process, one pass builds and passes that start meanwhile read the trace. A full
disk or an unwritable cache directory stops with one InputError naming it. Pages of a chunk
are released once the next chunk is requested, so resident memory follows the chunk size.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import mmap
import os
import shutil
import sys
import threading
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.atomic import atomic_write_text, output_errors, remove_orphans, temp_path
from traces.errors import InputError
from traces.format import (
    ContentHash,
    TraceChunk,
    TraceMeta,
    decode_stored,
    decoded_logits,
    default_max_tokens,
    float32_logits,
    group_plan,
    open_trace,
    order_width,
    recorded_content_hash,
    regular_file,
    stored_logit_order,
)

CACHE_ENV = "MOE_SIM_CACHE"
LAYOUT_VERSION = 5  # bump when the files below change meaning
# a kept logit_order for order_r = R: <ORDER_FILE><R>.npy, the ids of the R highest logits each
# token-layer did not select (layout 5; layout 4 kept them with the selected ids included)
ORDER_FILE = "candidate_order_"
MANIFEST = "manifest.json"
_PER_TOKEN = ("seq", "pos", "phase", "group", "domain", "token_id", "nll")  # from the decoded chunk
_STORED = ("experts", "residency", "logits", "logit_ids")  # as the trace stores them
# a pass drops the pages of the rows it has read from its mapping each time they add up to this
RELEASE_BYTES = 256 * 2**20
_LOOKAHEAD = {"lookahead_ids": np.int16, "lookahead_logits": np.float16}  # decoded, narrowed
_CRC_BLOCK = 16 * 2**20


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding decoded traces: ``cache_dir``, ``$MOE_SIM_CACHE`` or the user cache."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV)
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        cache_dir = Path(base) / "moe-offload-sim"
    return Path(cache_dir).expanduser() / "traces"


def trace_key(path: str | os.PathLike, root: Path | None = None) -> str:
    """The cache key of a trace file: its recorded content hash, else the SHA-256 of its bytes.

    With ``root``, a file's byte digest is remembered under the file's identity (device, inode,
    size, modification and change time), so an unchanged file is hashed once, not once per job.
    """
    recorded = recorded_content_hash(path)
    if recorded is not None:
        return recorded.removeprefix("sha256:")
    st = os.stat(path)
    memo = None
    if root is not None:
        ident = f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"
        memo = root / "hashes" / hashlib.sha256(ident.encode()).hexdigest()
        try:
            return memo.read_text().strip()
        except OSError:
            pass
    with open(path, "rb") as f:
        key = "file-" + hashlib.file_digest(f, "sha256").hexdigest()
    if memo is not None:
        with contextlib.suppress(OSError):  # a read-only cache only hashes again next time
            memo.parent.mkdir(exist_ok=True)
            atomic_write_text(memo, key)
    return key


class CachedTrace:
    """A trace served from its decoded copy: the chunk-source protocol of traces/format.py.

    ``built`` is True when this source builds the copy (on its first full forward pass, or
    :meth:`build`), False when it re-uses one. Construct through :func:`cached_source`.
    """

    keeps_logit_order = True  # an order_r asked for once is kept beside the copy (candidate_order_<R>)
    # every chunk was checked against the trace's metadata when decoded: the copy holds what the
    # validating reader returned (traces.format.find_problem), its integrity checked on opening,
    # and a first pass streams from that reader; so simulate() need not check the chunks again
    chunks_checked = True

    def __init__(self, path: Path, directory: Path, manifest: dict | None, max_tokens: int | None):
        self.path, self.directory = path, directory
        self.built = manifest is None
        self._build_tokens = max_tokens
        self._lock = threading.Lock()  # held by the one pass that writes to the cache
        self._maps: list[tuple[np.ndarray, mmap.mmap]] = []  # every mapped array and its mapping
        self._arrays: dict[str, np.ndarray] | None = None
        self._orders: dict[int, np.ndarray] = {}
        self._plans: dict[int, np.ndarray] = {}  # chunk plans of the copy by tokens per chunk
        if manifest is None:
            with open_trace(path) as reader:
                self.meta, self.num_tokens = reader.meta, reader.num_tokens
        else:
            self._mapped(manifest)

    def iter_chunks(self, max_tokens: int | None = None, *, logits: bool = True,
                    order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """Chunks of whole groups in trace order (default size: ~CHUNK_BYTES of what is decoded, so
        a run that reads no logits takes fewer, larger chunks: each costs the kernel a call);
        ``logits``, ``order_r`` and ``stored_ids`` as every source's (traces/format.py, *Options*)."""
        return self._chunks(max_tokens, False, logits, order_width(self.meta, order_r), stored_ids)

    def iter_chunks_reversed(self, max_tokens: int | None = None, *, logits: bool = True,
                             order_r: int = 0, stored_ids: bool = False) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first (a copy not yet built is built first)."""
        return self._chunks(max_tokens, True, logits, order_width(self.meta, order_r), stored_ids)

    def build(self) -> None:
        """Decode the trace into the cache now, if no copy is there yet."""
        for _ in self._chunks(self._build_tokens, False, False, 0, False, build_only=True):
            pass

    def keeps_order(self, order_r: int) -> bool:
        """Whether the top-``order_r`` order of unselected logit ids is kept beside the copy (a
        run asking for it reads it instead of ranking the logits)."""
        r = order_width(self.meta, order_r)
        return not r or any(kept >= r for kept in self._orders)

    def keep_order(self, order_r: int) -> None:
        """Rank the copy's logits into its kept top-``order_r`` order now, if it is not kept yet
        (a pass that reads nothing else; the copy is built first where it is not there)."""
        if not self.keeps_order(order_r):
            for _ in self.iter_chunks(logits=False, order_r=order_r):
                pass

    def _size(self, max_tokens: int | None, logits: bool = True) -> int:
        """Tokens per chunk: as given, else ~CHUNK_BYTES of what is decoded (``logits``: they are)."""
        return default_max_tokens(self.meta, logits) if max_tokens is None else int(max_tokens)

    def _chunks(self, max_tokens: int | None, descending: bool, logits: bool, order_r: int, stored_ids: bool,
                build_only: bool = False) -> Iterator[TraceChunk]:
        # decoding the Parquet file (and building the copy) reads every column, logits included;
        # the copy's chunks are views, sized by what the run decodes
        read = self._size(max_tokens)
        if self._arrays is None and self._lock.acquire(blocking=False):
            try:
                if self._arrays is None:
                    if not (descending or build_only):
                        yield from self._building(read, logits, order_r, stored_ids)
                        return
                    for _ in self._building(read, False, 0, False):  # not backwards: build, then serve
                        pass
            finally:
                self._lock.release()
        if build_only:
            return
        if self._arrays is None:  # another pass is building the copy: read the trace itself
            with open_trace(self.path) as reader:
                iterate = reader.iter_chunks_reversed if descending else reader.iter_chunks
                yield from iterate(read, logits=logits, order_r=order_r, stored_ids=stored_ids)
            return
        # dense float16 logits as stored are served as views; logit ids to walk are read from a
        # kept order, else computed from the chunk's logits
        as_views = logits == "float16" and not self.meta.logits_top_r
        kept = any(r >= order_r for r in self._orders)
        decodes = (bool(logits) and not as_views) or bool(order_r and not kept)
        yield from self._from_copy(self._size(max_tokens, decodes), descending, logits, order_r, stored_ids)

    def _building(self, max_tokens: int, logits: bool, order_r: int, stored_ids: bool) -> Iterator[TraceChunk]:
        """Stream the Parquet file, yielding its chunks and writing the copy; put it in place at
        the end (the content checked against the trace's recorded hash first)."""
        root = self.directory.parent
        remove_orphans(root)
        build = temp_path(root / f"build-{self.directory.name[:23]}")
        files: dict[str, _NpyWriter] = {}
        # a chunk's arrays are written by a thread of their own while the next chunk is decoded (the
        # copy into the page cache was half the build's CPU); one chunk's writes wait at a time
        writes, written = ThreadPoolExecutor(1, thread_name_prefix="trace-cache-write"), deque()
        with output_errors(self.directory), open_trace(self.path) as reader:
            try:
                build.mkdir()
                content = ContentHash(self.meta)
                for first_group, stored in reader.iter_stored(max_tokens):
                    content.update(stored)
                    chunk = decode_stored(self.meta, stored, first_group, logits=logits, order_r=order_r,
                                          stored_ids=stored_ids)
                    arrays = {**{n: getattr(chunk, n) for n in _PER_TOKEN if getattr(chunk, n) is not None},
                              "gates": chunk.gates, **{n: stored[n] for n in _STORED if n in stored},
                              **{n: getattr(chunk, n).astype(t) for n, t in _LOOKAHEAD.items()
                                 if getattr(chunk, n) is not None}}
                    if order_r:
                        arrays[f"{ORDER_FILE}{order_r}"] = chunk.logit_order
                    for name, value in arrays.items():
                        if name not in files:
                            files[name] = _NpyWriter(build / f"{name}.npy", value, self.num_tokens)
                    written.append(writes.submit(_append, [(files[n], v) for n, v in arrays.items()]))
                    while len(written) > 1:
                        written.popleft().result()
                    yield chunk
                while written:
                    written.popleft().result()
                for f in files.values():
                    f.close()
                recorded = reader.content_hash
                if recorded is not None and content.hexdigest() != recorded:
                    raise InputError(f"{self.path}: the decoded content does not match the hash the file "
                                     "records; the file was changed or damaged after it was written, "
                                     "re-create or restore it")
                orders = [n for n in files if n.startswith(ORDER_FILE)]
                manifest = {"layout_version": LAYOUT_VERSION, "meta": self.meta.to_json(),
                            "num_tokens": self.num_tokens, "source_file": str(self.path.resolve()),
                            "arrays": {n: f.record() for n, f in files.items() if n not in orders}}
                for name in orders:
                    atomic_write_text(build / f"{name}.json", json.dumps(files[name].record()))
                atomic_write_text(build / MANIFEST, json.dumps(manifest, indent=1))
                self._mapped(self._put_in_place(build))
                _announce(self.directory, self.path)
            finally:
                writes.shutdown(wait=True, cancel_futures=True)
                for f in files.values():
                    f.close()
                shutil.rmtree(build, ignore_errors=True)

    def _put_in_place(self, build: Path) -> dict:
        """Rename a complete build to the copy's place; the manifest of the copy now there."""
        try:
            os.rename(build, self.directory)
        except OSError:  # a concurrent job put its copy in place first: use that one
            pass
        manifest = _checked_manifest(self.directory)
        if manifest is None:
            raise InputError(f"{self.directory}: the trace cache copy could not be put in place; "
                             "check the cache directory")
        return manifest

    def _mapped(self, manifest: dict) -> None:
        self.meta = TraceMeta.from_json(manifest["meta"], str(self.directory / MANIFEST))
        self.num_tokens = int(manifest["num_tokens"])
        self._arrays = {name: self._map(name, info) for name, info in manifest["arrays"].items()}
        self._plans = {}
        self._orders = {int(p.stem.rsplit("_", 1)[1]): self._map(p.stem, info)
                        for p, info in _order_manifests(self.directory).items()}

    def _map(self, name: str, info: dict) -> np.ndarray:
        shape, dtype = tuple(info["shape"]), np.dtype(info["dtype"])
        count = int(np.prod(shape))
        if count == 0:
            return np.zeros(shape, dtype)
        with open(self.directory / f"{name}.npy", "rb") as f:
            # a private mapping: the arrays are writable like freshly decoded ones (so kernels
            # compiled for those apply), while the file and other jobs never see a write
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        array = np.frombuffer(mm, dtype=dtype, count=count, offset=info["offset"]).reshape(shape)
        self._maps.append((array, mm))
        return array

    def _from_copy(self, max_tokens: int, descending: bool, logits: bool,
                   order_r: int, stored_ids: bool) -> Iterator[TraceChunk]:
        a, meta = self._arrays, self.meta
        plan = self._plans.get(max_tokens)
        if plan is None:  # the copy does not change: each size planned once
            plan = self._plans[max_tokens] = group_plan(a["group"], max_tokens)
        kept = min((r for r in self._orders if r >= order_r), default=None) if order_r else None
        adding = None
        if order_r and kept is None and not descending and self._lock.acquire(blocking=False):
            adding = _OrderBuild(self.directory, order_r, self.num_tokens)
        pending = None  # rows read since the last release
        try:
            for start, stop, _ in (plan[::-1] if descending else plan):
                rows = slice(int(start), int(stop))
                ids = a["logit_ids"][rows] if "logit_ids" in a else None
                chunk = TraceChunk(
                    **{n: a[n][rows] for n in ("seq", "pos", "phase", "group", "domain", "token_id", "gates")},
                    experts=a["experts"][rows] if stored_ids else a["experts"][rows].astype(np.int32),
                    logits=(decoded_logits(meta, a["logits"][rows], ids, as_stored=logits == "float16")
                            if logits and "logits" in a
                            else np.zeros((0, meta.num_layers, meta.num_experts), np.float32)),
                    residency=a["residency"][rows] if "residency" in a
                    else np.zeros((0, meta.num_layers, meta.top_k), np.int8),
                    nll=a["nll"][rows] if "nll" in a else None,
                    lookahead_ids=(a["lookahead_ids"][rows].astype(np.int32) if "lookahead_ids" in a
                                   else None),
                    lookahead_logits=(float32_logits(a["lookahead_logits"][rows])
                                      if "lookahead_logits" in a else None))
                if kept is not None:
                    chunk.logit_order = np.ascontiguousarray(self._orders[kept][rows, :, :order_r])
                elif order_r:
                    chunk.logit_order = stored_logit_order(meta, a["logits"][rows], ids, order_r,
                                                           a["experts"][rows])
                    if adding:
                        adding.append(chunk.logit_order)
                yield chunk
                pending = rows if pending is None else slice(min(pending.start, rows.start),
                                                             max(pending.stop, rows.stop))
                if (pending.stop - pending.start) * self._token_bytes >= RELEASE_BYTES:
                    self._release(pending)
                    pending = None
            if adding:
                self._orders[order_r] = self._map(f"{ORDER_FILE}{order_r}", adding.commit())
        finally:
            if adding:
                adding.discard()
                self._lock.release()

    @property
    def _token_bytes(self) -> int:
        """Bytes one token's rows take in the mapped arrays."""
        return sum(array[:1].nbytes for array, _ in self._maps) or 1

    def _release(self, rows: slice) -> None:
        """Drop the pages of rows already served from this process (every ``RELEASE_BYTES`` of
        them, so a pass's memory stays bounded while repeated passes over a small copy find its
        pages still mapped).

        The pages stay in the page cache (shared by all jobs); a view still held elsewhere
        reads them back in on access, so this changes memory use, never values (unless a
        caller wrote into a chunk: such private changes are dropped with the pages).
        """
        for array, mm in self._maps:
            view = array[rows]
            if view.size == 0:
                continue
            start = view.ctypes.data - np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
            stop = start + view.nbytes
            start -= start % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, stop - start)


def cached_source(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  max_tokens: int | None = None) -> CachedTrace:
    """Open a trace file through the cache; without a copy yet, the first full pass builds it.

    The app's one call: ``source = cached_source(path)`` in place of ``open_trace(path)``.
    ``max_tokens``: tokens decoded per chunk by :meth:`CachedTrace.build`.
    """
    path = regular_file(path)
    root = cache_root(cache_dir)
    with output_errors(root):
        root.mkdir(parents=True, exist_ok=True)
    remove_orphans(root)
    remove_orphans(root / "hashes")
    directory = root / trace_key(path, root)
    return CachedTrace(path, directory, _checked_manifest(directory, warn=True), max_tokens)


_announced: set[Path] = set()  # copies this process has announced


def _announce(directory: Path, trace: Path) -> None:
    """One stderr line for a copy built: its path, its size and the cache's total."""
    if directory in _announced:
        return
    _announced.add(directory)
    entries = cache_entries(directory.parent.parent)
    size = next((e.bytes for e in entries if e.path == directory), _dir_bytes(directory))
    print(f"trace cache: decoded {trace} into {directory} ({_gib(size)}); the cache holds "
          f"{len(entries)} {'copy' if len(entries) == 1 else 'copies'}, "
          f"{_gib(sum(e.bytes for e in entries))} (moe-trace cache list | clear)", file=sys.stderr)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def _dir_bytes(directory: Path) -> int:
    total = 0
    for p in directory.rglob("*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total


@dataclass(frozen=True)
class CacheEntry:
    """One decoded copy in the cache."""

    key: str
    path: Path
    source_file: str | None  # the trace it was decoded from (as it was then)
    num_tokens: int | None
    bytes: int
    modified: float  # POSIX time the copy was last written


def cache_entries(cache_dir: str | os.PathLike | None = None) -> list[CacheEntry]:
    """The decoded copies under the cache (``cache_dir``, else ``$MOE_SIM_CACHE`` or the user
    cache), largest first; a copy with an unreadable manifest is listed without its trace."""
    root = cache_root(cache_dir)
    entries = []
    for directory in sorted(root.iterdir()) if root.is_dir() else ():
        if directory.name == "hashes" or directory.name.startswith(".") or not directory.is_dir():
            continue
        try:
            manifest = _read_manifest(directory)
            source, tokens = manifest.get("source_file"), manifest.get("num_tokens")
        except (OSError, ValueError):
            source, tokens = None, None
        with contextlib.suppress(OSError):
            entries.append(CacheEntry(directory.name, directory, source, tokens,
                                      _dir_bytes(directory), directory.stat().st_mtime))
    return sorted(entries, key=lambda e: -e.bytes)


def clear_cache(cache_dir: str | os.PathLike | None = None,
                keys: list[str] | None = None) -> list[CacheEntry]:
    """Remove the copies whose key starts with one of ``keys`` (all of them, and the remembered
    file digests, without ``keys``); return the removed entries. A run that has a copy open keeps
    reading it (its pages stay until it ends)."""
    root = cache_root(cache_dir)
    chosen = [e for e in cache_entries(cache_dir)
              if not keys or any(e.key.startswith(k) for k in keys)]
    if keys:
        unknown = [k for k in keys if not any(e.key.startswith(k) for e in chosen)]
        if unknown:
            raise InputError(f"trace cache {root}: no copy has a key starting with "
                             f"'{unknown[0]}'; moe-trace cache list shows the keys")
    for entry in chosen:
        _remove(entry.path)
    if not keys:
        shutil.rmtree(root / "hashes", ignore_errors=True)
        remove_orphans(root)
    return chosen


def _read_manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def _order_manifests(directory: Path) -> dict[Path, dict]:
    """The kept ``logit_order`` arrays that pass their checks (a failing one is removed)."""
    kept = {}
    for manifest in directory.glob(f"{ORDER_FILE}*.json"):
        npy = manifest.with_suffix(".npy")
        try:
            info = json.loads(manifest.read_text())
            _check_array(npy, info)
            kept[npy] = info
        except (_Stale, OSError, ValueError, KeyError, TypeError) as exc:
            print(f"warning: trace cache {npy} is stale or damaged ({exc}); it is computed again",
                  file=sys.stderr)
            for p in (manifest, npy):
                p.unlink(missing_ok=True)
    return kept


def _checked_manifest(directory: Path, warn: bool = False) -> dict | None:
    """The manifest of a complete, intact copy at ``directory``, or None (nothing there, or a
    copy that failed its checks: removed, with one warning line if ``warn``)."""
    if not directory.exists():
        return None
    try:
        manifest = _read_manifest(directory)
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise _Stale(f"layout {manifest.get('layout_version')!r}, this version writes {LAYOUT_VERSION}")
        changed = {name: identity for name, info in manifest["arrays"].items()
                   if (identity := _check_array(directory / f"{name}.npy", info)) != info["identity"]}
    except (_Stale, OSError, ValueError, KeyError, TypeError) as exc:
        if warn:
            print(f"warning: trace cache {directory} is stale or damaged ({exc}); rebuilding it",
                  file=sys.stderr)
        _remove(directory)
        return None
    if changed:  # copied or touched, yet intact: cheap again next time
        for name, identity in changed.items():
            manifest["arrays"][name]["identity"] = identity
        with contextlib.suppress(OSError):  # a read-only cache stays correct, only slower
            atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _check_array(path: Path, info: dict) -> list[int]:
    """The array file's identity; raises _Stale unless its size (and, for a changed identity,
    its CRC-32) is what the manifest records."""
    identity = _identity(path)
    if identity[1] != info["bytes"]:
        raise _Stale(f"array '{path.stem}' has {identity[1]:,} bytes, the manifest {info['bytes']:,}")
    if identity != info["identity"] and _crc32(path) != info["crc32"]:
        raise _Stale(f"array '{path.stem}' fails its CRC-32 check")
    return identity


class _Stale(Exception):
    """A cached copy that must not be used."""


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _remove(directory: Path) -> None:
    """Take a copy out of use at once (one rename), then delete it."""
    doomed = temp_path(directory)
    try:
        os.rename(directory, doomed)
    except OSError:
        return  # gone already, or another job is replacing it
    shutil.rmtree(doomed, ignore_errors=True)


class _NpyWriter:
    """A .npy file for a whole trace's array, header first, data appended chunk by chunk."""

    def __init__(self, path: Path, first: np.ndarray, num_tokens: int):
        self.path = path
        tokens = num_tokens if first.shape[0] else 0  # absent logits or residency stay (0, ...)
        self.shape, self.dtype = (tokens, *first.shape[1:]), first.dtype
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {
            "descr": np.lib.format.dtype_to_descr(first.dtype), "fortran_order": False,
            "shape": self.shape})
        self.offset = len(header.getvalue())
        self._crc = zlib.crc32(header.getvalue())
        self._file = open(path, "wb")  # closed by close()
        self._file.write(header.getvalue())

    def append(self, value: np.ndarray) -> None:
        data = np.ascontiguousarray(value).data
        self._file.write(data)
        self._crc = zlib.crc32(data, self._crc)

    def close(self) -> None:
        self._file.close()

    def record(self) -> dict:
        """The manifest entry: shape, dtype, data offset, size, CRC-32 and file identity."""
        identity = _identity(self.path)
        return {"shape": list(self.shape), "dtype": self.dtype.str, "offset": self.offset,
                "bytes": identity[1], "crc32": self._crc, "identity": identity}


def _append(pairs: list[tuple[_NpyWriter, np.ndarray]]) -> None:
    """One chunk's arrays appended to their files (the build's writing thread)."""
    for writer, value in pairs:
        writer.append(value)


class _OrderBuild:
    """``candidate_order_<R>`` of a copy, written beside it during one forward pass over it."""

    def __init__(self, directory: Path, r: int, num_tokens: int):
        self.final = directory / f"{ORDER_FILE}{r}.npy"
        self.num_tokens = num_tokens
        self._tmp = temp_path(self.final)
        self._writer: _NpyWriter | None = None

    def append(self, order: np.ndarray) -> None:
        with output_errors(self.final):
            if self._writer is None:
                self._writer = _NpyWriter(self._tmp, order, self.num_tokens)
            self._writer.append(order)

    def commit(self) -> dict:
        """Put the array in place with its manifest entry; return the entry."""
        with output_errors(self.final):
            self._writer.close()
            os.replace(self._tmp, self.final)
            self._writer.path = self.final
            info = self._writer.record()
            atomic_write_text(self.final.with_suffix(".json"), json.dumps(info))
        self._writer = None
        return info

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._tmp.unlink(missing_ok=True)
