"""A memory-mapped, decoded copy of a trace file, keyed by the file's content hash.

Decoding Parquet costs far more than simulating fetch-every-miss; a sweep of many Hydra jobs over
one trace decodes it once here and every later job maps the arrays straight from disk. The copy
lives under ``$MOE_SIM_CACHE`` (default ``$XDG_CACHE_HOME/moe-offload-sim``, i.e.
``~/.cache/moe-offload-sim``) in ``traces/<sha256 of the file>/``: one ``.npy`` file per
:class:`~traces.format.TraceChunk` array, in the chunk's dtypes, and ``meta.json``.

Concurrent jobs are safe: a copy is built in a private temporary directory beside its final
place and renamed into place in one step; a job that loses the race discards its own copy.
Chunks are zero-copy views; pages of a chunk are released once the next chunk is requested, so
resident memory follows the chunk size, not the trace size.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from traces.errors import InputError
from traces.format import ArraySource, TraceChunk, TraceMeta, default_max_tokens, open_trace

CACHE_ENV = "MOE_SIM_CACHE"
LAYOUT_VERSION = 1  # bump when the files below change meaning
STALE_BUILD_S = 24 * 3600  # a build directory this old belongs to a job that died
_ARRAYS = ("seq", "pos", "phase", "group", "domain", "token_id", "experts", "gates", "logits",
           "residency", "nll")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding decoded traces: ``cache_dir``, ``$MOE_SIM_CACHE`` or the user cache."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV)
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        cache_dir = Path(base) / "moe-offload-sim"
    return Path(cache_dir).expanduser() / "traces"


def content_hash(path: str | os.PathLike, root: Path | None = None) -> str:
    """SHA-256 of the file's bytes (hex).

    With ``root``, the digest is remembered under the file's identity (device, inode, size,
    modification time), so an unchanged file is hashed once, not once per job.
    """
    st = os.stat(path)
    memo = None
    if root is not None:
        ident = f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
        memo = root / "hashes" / hashlib.sha256(ident.encode()).hexdigest()
        try:
            return memo.read_text().strip()
        except OSError:
            pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(memo, digest)
    return digest


class CachedTrace:
    """A decoded trace mapped from the cache: the chunk-source protocol of traces/format.py.

    ``built`` is True when this call decoded the Parquet file, False when it re-used a copy.
    """

    def __init__(self, directory: Path, built: bool):
        self.directory = directory
        self.built = built
        info = json.loads((directory / "meta.json").read_text())
        self.meta = TraceMeta.from_json(info["meta"], str(directory / "meta.json"))
        self._maps: dict[str, mmap.mmap] = {}
        arrays = {name: self._map(name) for name in info["arrays"]}
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

    def _map(self, name: str) -> np.ndarray:
        path = self.directory / f"{name}.npy"
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
            if fortran:
                raise InputError(f"{path}: not a C-ordered array; delete {self.directory}")
            size = int(np.prod(shape)) * dtype.itemsize
            if size == 0:
                return np.zeros(shape, dtype)
            # a private mapping: the arrays are writable like freshly decoded ones (so kernels
            # compiled for those apply), while the file and other jobs never see a write
            self._maps[name] = mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)

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
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file; check the path")
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / content_hash(path, root)
    if (final / "meta.json").is_file() and _version(final) == LAYOUT_VERSION:
        return CachedTrace(final, built=False)
    _remove_stale_builds(root)
    build = Path(tempfile.mkdtemp(prefix=f".build-{final.name[:16]}-", dir=root))
    try:
        _decode_into(path, build, max_tokens)
        if (final / "meta.json").is_file() and _version(final) == LAYOUT_VERSION:
            return CachedTrace(final, built=False)  # a concurrent job finished first: use its copy
        if final.exists():  # an old layout
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(build, final)
        except OSError:  # another job renamed its copy into place first: use that one
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return CachedTrace(final, built=True)


def _version(directory: Path) -> int | None:
    try:
        return json.loads((directory / "meta.json").read_text()).get("layout_version")
    except (OSError, ValueError):
        return None


def _decode_into(path: Path, directory: Path, max_tokens: int | None) -> None:
    """Stream the Parquet file's chunks into one .npy file per array (then meta.json, last)."""
    with open_trace(path) as reader:
        meta, n = reader.meta, reader.num_tokens
        files: dict[str, object] = {}
        try:
            for c in reader.iter_chunks(max_tokens):
                if not files:
                    files = {name: _open_npy(directory, name, getattr(c, name), n)
                             for name in _ARRAYS if getattr(c, name) is not None}
                for name, f in files.items():
                    value = getattr(c, name)
                    if value.shape[0] == 0 and name in ("logits", "residency"):
                        continue
                    f.write(np.ascontiguousarray(value).data)
            if not files:
                raise InputError(f"{path}: the trace has no tokens; nothing to cache")
        finally:
            for f in files.values():
                f.close()
    info = {"layout_version": LAYOUT_VERSION, "meta": meta.to_json(), "num_tokens": n,
            "source_file": str(path.resolve()), "arrays": sorted(files)}
    _atomic_write_text(directory / "meta.json", json.dumps(info, indent=1))


def _open_npy(directory: Path, name: str, first: np.ndarray, num_tokens: int):
    """A .npy file for the whole trace's ``name`` array, header written, data to be appended."""
    tokens = num_tokens if first.shape[0] or name not in ("logits", "residency") else 0
    header = {"descr": np.lib.format.dtype_to_descr(first.dtype), "fortran_order": False,
              "shape": (tokens, *first.shape[1:])}
    f = open(directory / f"{name}.npy", "wb")  # closed by the caller
    np.lib.format.write_array_header_1_0(f, header)
    return f


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _remove_stale_builds(root: Path) -> None:
    """Remove build directories left by jobs that died (older than STALE_BUILD_S)."""
    now = time.time()
    for d in root.glob(".build-*"):
        try:
            if now - d.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass
