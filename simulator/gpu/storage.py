"""Expert weights on disk, read the way an offloading engine reads them: ``O_DIRECT`` (the page
cache bypassed), into page-aligned host buffers that are pinned on a GPU host, so that the copy
to the GPU can start from the buffer the read filled.

``moe-calibrate`` times reads of this file and ``moe-replay`` executes a plan's SSD reads from
it: both read the same file with the same code. Block ``b`` of an expert file holds
``block_bytes`` bytes at offset ``b * block_bytes``; a trace's expert x is read from block
``x mod blocks`` (the file holds fewer blocks than a model has experts; the disk does not care
which expert a block stands for).
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

from traces.errors import InputError

DIRECT_ALIGN = 4096  # O_DIRECT offset, length and buffer alignment
WRITE_CHUNK_BYTES = 64 << 20


def round_up(n: int, align: int = DIRECT_ALIGN) -> int:
    """n rounded up to a multiple of ``align``."""
    return -(-int(n) // align) * align


def direct_flag() -> int:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise InputError("this platform has no O_DIRECT; SSD reads can't bypass the page cache")
    return flag


class HostBuffers:
    """``n`` host buffers of ``round_up(nbytes)`` bytes each (uint8 rows) that start on page
    boundaries, so O_DIRECT reads can fill them; page-locked (pinned) when ``pinned``, so copies
    to a GPU run asynchronously from them. Allocated in chunks of at most ``CHUNK_BYTES``: the
    pinned allocator rounds every allocation up to a power of two."""

    CHUNK_BYTES = 1 << 30

    def __init__(self, n: int, nbytes: int, pinned: bool):
        from simulator.gpu.kernels import import_torch

        torch = import_torch()
        self.row_bytes = round_up(nbytes)
        per_chunk = max(1, (self.CHUNK_BYTES - DIRECT_ALIGN) // self.row_bytes)
        self.rows = []
        for start in range(0, n, per_chunk):
            m = min(per_chunk, n - start)
            flat = torch.empty(m * self.row_bytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pinned)
            skip = -flat.data_ptr() % DIRECT_ALIGN
            self.rows.extend(flat[skip : skip + m * self.row_bytes].view(m, self.row_bytes).unbind(0))
        self.arrays = [row.numpy() for row in self.rows]  # the same memory, as buffers for os.preadv

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


def write_expert_file(path: Path, size_bytes: int) -> Path:
    """``path`` as it is if it exists, else created with ``size_bytes`` random bytes; on disk
    and out of the page cache either way; InputError where O_DIRECT reads fail there."""
    path = Path(path)
    size_bytes = round_up(size_bytes)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        block = os.urandom(WRITE_CHUNK_BYTES)  # random: a disk or a host layer could compress zeros
        with open(path, "wb") as f:
            left = size_bytes
            while left > 0:
                f.write(block[: min(WRITE_CHUNK_BYTES, left)])
                left -= WRITE_CHUNK_BYTES
            f.flush()
            os.fsync(f.fileno())
    try:
        with DirectFile(path, DIRECT_ALIGN) as f:
            f.read(0, mmap.mmap(-1, DIRECT_ALIGN))  # anonymous mappings are page-aligned
    except OSError as e:
        raise InputError(f"O_DIRECT reads fail in {path.parent} ({e.strerror}); give a file on a real disk "
                         "(--ssd-dir or --ssd-file)") from e
    if hasattr(os, "posix_fadvise"):  # what the write left in the page cache would serve reads
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return path


def temporary_expert_file(directory: str, size_bytes: int) -> Path:
    """A new expert file of ``size_bytes`` in ``directory`` (the caller removes it)."""
    fd, name = tempfile.mkstemp(prefix="moe-calibrate-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        return write_expert_file(Path(name), size_bytes)
    except BaseException:
        os.unlink(name)
        raise


class DirectFile:
    """An expert file opened for O_DIRECT reads of ``block_bytes`` (a multiple of the page)."""

    def __init__(self, path: Path, block_bytes: int):
        if block_bytes % DIRECT_ALIGN:
            raise InputError(f"O_DIRECT blocks must be multiples of {DIRECT_ALIGN} bytes, got {block_bytes}")
        self.path, self.block_bytes = Path(path), int(block_bytes)
        self.blocks = os.path.getsize(path) // self.block_bytes
        if self.blocks < 1:
            raise InputError(f"{path} holds no block of {block_bytes} bytes; make it larger")
        self.fd = os.open(path, os.O_RDONLY | direct_flag())

    def read(self, block: int, buf) -> int:
        """Read block ``block mod blocks`` into ``buf`` (a page-aligned writable buffer of
        block_bytes); returns the bytes read."""
        return os.preadv(self.fd, [buf], (int(block) % self.blocks) * self.block_bytes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
