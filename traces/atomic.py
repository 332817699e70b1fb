"""Atomic file output, the one helper every writer uses.

A file is written under a hidden temporary name beside its target (same file system, so the
final rename is atomic) and renamed into place only when it is complete: readers see the old
file, nothing, or the whole new one. Temporary names carry the writer's process id
(``.{name}.{pid}.{random}.tmp``), so a later run can tell the leftovers of a killed writer from
a file another live process is still writing (:func:`remove_orphans`); a directory built in
place of a file (the trace cache's) carries the same kind of name. A full disk or a permission
error while writing becomes one :class:`~traces.errors.InputError` naming the path
(:func:`output_errors`).
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from traces.errors import InputError

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh hidden temporary name beside ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def file_mode() -> int:
    """The mode a plainly created file gets (``mkstemp`` would leave 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed."""
    tmp = temp_path(path)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode())


def pid_alive(pid: int) -> bool:
    """True if a process with this id runs on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def remove_orphans(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove temporary files and directories in ``directory`` left by writers that no longer run.

    ``name``: only the temporaries of that target name. Returns the removed paths.
    """
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP.match(p.name)
        if not m or (name is not None and m["name"] != name):
            continue
        if int(m["pid"]) != os.getpid() and not pid_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
    return removed


@contextlib.contextmanager
def output_errors(path: str | os.PathLike) -> Iterator[None]:
    """Turn an OSError raised while writing ``path`` (disk full, permissions) into one InputError.

    The message names ``path`` (the target, not its hidden temporary) and the cause.
    """
    try:
        yield
    except OSError as exc:
        cause = " ".join((exc.strerror or str(exc)).split())
        raise InputError(f"{path}: cannot be written ({cause}); free disk space, or choose a "
                         "writable location") from None
