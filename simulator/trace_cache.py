"""A memory-mapped, decoded copy of a trace file, keyed by the trace's content hash.

Decoding Parquet costs far more than simulating fetch-every-miss; a sweep of many Hydra jobs over
one trace decodes it once here and every later job maps the arrays straight from disk. The copy
lives under ``$MOE_SIM_CACHE`` (default ``$XDG_CACHE_HOME/moe-offload-sim``, i.e.
``~/.cache/moe-offload-sim``) in ``traces/<key>/``: one ``.npy`` file per
:class:`~traces.format.TraceChunk` array, in the chunk's dtypes, and ``manifest.json``.

The key is the content hash the trace records (its hex digest: a file rewritten with other
content gets another key, however its size and modification time look); a file written before
content hashes is keyed by the SHA-256 of its bytes (``file-<hex>``), remembered per file
identity including the inode's change time, which no rewrite can restore.

Integrity: a copy is built only from a trace whose decoded content matches its recorded hash.
The manifest records each array's size, CRC-32 and file identity (inode, size, modification and
change time). Opening a copy compares the identities (a few ``stat`` calls); an array whose
identity changed is checked against its CRC-32, and a copy that fails (edited, truncated, an
old layout, an unreadable manifest) is removed and rebuilt with one warning line on stderr.

Concurrent jobs are safe: a copy is built in a private temporary directory beside its final
place, named with the builder's process id, and renamed into place in one step; a job that loses
the race discards its own copy, and the next job removes the build directories of builders that
died. A full disk or an unwritable cache directory stops with one InputError naming it.
Chunks are zero-copy views; pages of a chunk are released once the next chunk is requested, so
resident memory follows the chunk size, not the trace size.
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
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from traces.atomic import atomic_write_text, output_errors, remove_orphans, temp_path
from traces.errors import InputError
from traces.format import (
    ArraySource,
    ContentHash,
    TraceChunk,
    TraceMeta,
    decode_stored,
    default_max_tokens,
    open_trace,
    recorded_content_hash,
    regular_file,
)

CACHE_ENV = "MOE_SIM_CACHE"
LAYOUT_VERSION = 2  # bump when the files below change meaning
MANIFEST = "manifest.json"
_ARRAYS = ("seq", "pos", "phase", "group", "domain", "token_id", "experts", "gates", "logits",
           "residency", "nll")
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
        memo.parent.mkdir(exist_ok=True)
        atomic_write_text(memo, key)
    return key


class CachedTrace:
    """A decoded trace mapped from the cache: the chunk-source protocol of traces/format.py.

    ``built`` is True when this call decoded the Parquet file, False when it re-used a copy.
    Construct through :func:`cached_source`; the manifest is trusted here, checked there.
    """

    def __init__(self, directory: Path, built: bool, manifest: dict):
        self.directory = directory
        self.built = built
        self.meta = TraceMeta.from_json(manifest["meta"], str(directory / MANIFEST))
        self._maps: dict[str, mmap.mmap] = {}
        arrays = {name: self._map(name, info) for name, info in manifest["arrays"].items()}
        arrays.setdefault("nll", None)
        self._source = ArraySource(self.meta, TraceChunk(**arrays))

    @property
    def num_tokens(self) -> int:
        return self._source.num_tokens

    def iter_chunks(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """Chunks of whole groups in trace order (default size as the Parquet reader's)."""
        return self._release_after(self._source.iter_chunks(self._size(max_tokens)))

    def iter_chunks_reversed(self, max_tokens: int | None = None) -> Iterator[TraceChunk]:
        """The chunks of :meth:`iter_chunks`, last to first."""
        return self._release_after(self._source.iter_chunks_reversed(self._size(max_tokens)))

    def _size(self, max_tokens: int | None) -> int:
        return default_max_tokens(self.meta) if max_tokens is None else int(max_tokens)

    def _map(self, name: str, info: dict) -> np.ndarray:
        path = self.directory / f"{name}.npy"
        shape, dtype = tuple(info["shape"]), np.dtype(info["dtype"])
        count = int(np.prod(shape))
        if count == 0:
            return np.zeros(shape, dtype)
        with open(path, "rb") as f:
            # a private mapping: the arrays are writable like freshly decoded ones (so kernels
            # compiled for those apply), while the file and other jobs never see a write
            self._maps[name] = mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return np.frombuffer(mm, dtype=dtype, count=count, offset=info["offset"]).reshape(shape)

    def _release_after(self, chunks: Iterator[TraceChunk]) -> Iterator[TraceChunk]:
        """Yield chunks; when the next is asked for, drop the last one's pages from this process.

        The pages stay in the page cache (shared by all jobs); a view still held elsewhere
        reads them back in on access, so this changes memory use, never values (unless a
        caller wrote into a chunk: such private changes are dropped with the pages).
        """
        for c in chunks:
            yield c
            for name, mm in self._maps.items():
                view = getattr(c, name)
                if view is None or view.size == 0:
                    continue
                start = view.ctypes.data - _address(mm)
                stop = start + view.nbytes
                start -= start % mmap.PAGESIZE
                mm.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _address(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data


def cached_source(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  max_tokens: int | None = None) -> CachedTrace:
    """Open a trace file through the cache, decoding it into the cache the first time.

    The app's one call: ``source = cached_source(path)`` in place of ``open_trace(path)``.
    ``max_tokens``: tokens decoded per chunk while building (default: the reader's).
    """
    path = regular_file(path)
    root = cache_root(cache_dir)
    with output_errors(root):
        root.mkdir(parents=True, exist_ok=True)
    remove_orphans(root)
    remove_orphans(root / "hashes")
    final = root / trace_key(path, root)
    manifest = _checked_manifest(final)
    if manifest is not None:
        return CachedTrace(final, built=False, manifest=manifest)
    build = temp_path(root / f"build-{final.name[:23]}")
    try:
        with output_errors(final):
            build.mkdir()
            _decode_into(path, build, max_tokens)
            manifest = _checked_manifest(final, quiet=True)
            if manifest is not None:  # a concurrent job finished first: use its copy
                return CachedTrace(final, built=False, manifest=manifest)
            try:
                os.rename(build, final)
            except OSError:  # another job renamed its copy into place first: use that one
                manifest = _checked_manifest(final, quiet=True)
                if manifest is None:
                    raise
                return CachedTrace(final, built=False, manifest=manifest)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return CachedTrace(final, built=True, manifest=_read_manifest(final))


def _read_manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def _checked_manifest(directory: Path, quiet: bool = False) -> dict | None:
    """The manifest of a complete, intact copy at ``directory``, or None (nothing there, or a
    copy that failed its checks: removed, with one warning line unless ``quiet``)."""
    if not directory.exists():
        return None
    try:
        manifest = _read_manifest(directory)
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise _Stale(f"layout {manifest.get('layout_version')!r}, this version writes {LAYOUT_VERSION}")
        changed = {}
        for name, info in manifest["arrays"].items():
            identity = _identity(directory / f"{name}.npy")
            if identity[1] != info["bytes"]:
                raise _Stale(f"array '{name}' has {identity[1]:,} bytes, the manifest {info['bytes']:,}")
            if identity != info["identity"]:
                if _crc32(directory / f"{name}.npy") != info["crc32"]:
                    raise _Stale(f"array '{name}' fails its CRC-32 check")
                changed[name] = identity  # copied or touched, yet intact: cheap again next time
    except (_Stale, OSError, ValueError, KeyError, TypeError) as exc:
        if not quiet:
            print(f"warning: trace cache {directory} is stale or damaged ({exc}); rebuilding it",
                  file=sys.stderr)
        _remove(directory)
        return None
    if changed:
        for name, identity in changed.items():
            manifest["arrays"][name]["identity"] = identity
        with contextlib.suppress(OSError):  # a read-only cache stays correct, only slower
            atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


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


def _decode_into(path: Path, directory: Path, max_tokens: int | None) -> None:
    """Stream the Parquet file's chunks into one .npy file per array, then the manifest (last).

    The content is checked against the trace's recorded hash before the manifest is written.
    """
    with open_trace(path) as reader:
        meta, n = reader.meta, reader.num_tokens
        recorded = reader.content_hash
        content = ContentHash(meta)
        files: dict[str, _NpyWriter] = {}
        try:
            for first_group, stored in reader.iter_stored(max_tokens):
                content.update(stored)
                c = decode_stored(meta, stored, first_group)
                if not files:
                    files = {name: _NpyWriter(directory / f"{name}.npy", getattr(c, name), n)
                             for name in _ARRAYS if getattr(c, name) is not None}
                for name, f in files.items():
                    f.append(getattr(c, name))
        finally:
            for f in files.values():
                f.close()
    if recorded is not None and content.hexdigest() != recorded:
        raise InputError(f"{path}: the decoded content does not match the hash the file records; "
                         "the file was changed or damaged after it was written, re-create or restore it")
    manifest = {"layout_version": LAYOUT_VERSION, "meta": meta.to_json(), "num_tokens": n,
                "source_file": str(path.resolve()),
                "arrays": {name: f.record() for name, f in files.items()}}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))


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
