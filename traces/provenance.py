"""Which sources produced a measured figure.

Benchmarks store this beside their figures (``make bench``'s ``kernel_commit``, the capture
bench's ``capture_commit`` and ``capture_sources``), so that a saved result says what code it
timed without a note written by hand.

- :func:`source_commit`: the last commit of some paths, ending in ``+`` where the working copy
  of them differs from it; ``?`` without git or a checkout. It names the copy's own history: a
  copy of a working tree whose ``.git`` lags behind its files (as on a host the tree is copied
  to) gives an older commit and ``+``.
- :func:`sources_fingerprint`: a hash of the capture's source files as they are, wherever they
  are. Each file enters as its path and its git blob id, so the fingerprint of any commit comes
  from ``git ls-tree`` alone, and ``python -m traces.provenance FINGERPRINT`` finds the commit
  whose capture sources the measured files were (:func:`find_commit`).
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the capture's own sources: the package's Python files, not the fixtures and sample data under traces/
PACKAGE = "traces"
NOT_SOURCES = ("traces/fixtures/", "traces/samples/")
CAPTURE_SOURCES = (PACKAGE, *(f":(exclude){d.rstrip('/')}" for d in NOT_SOURCES))


def source_commit(paths: tuple[str, ...], cwd: str | Path) -> str:
    """The short hash of the last commit that touched ``paths`` (git pathspecs, relative to
    ``cwd``), ``+`` when the working copy of them differs from it (edited, staged or new files not
    ignored), or ``?``."""
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", *paths], cwd=cwd,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=cwd, capture_output=True,
                               text=True, check=True).stdout.strip() != ""
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return (rev or "?") + ("+" if rev and dirty else "")


def capture_commit(root: Path = ROOT) -> str:
    """:func:`source_commit` of the capture's sources (:data:`CAPTURE_SOURCES`)."""
    return source_commit(CAPTURE_SOURCES, root)


def _is_source(path: str) -> bool:
    return path.startswith(f"{PACKAGE}/") and path.endswith(".py") and not path.startswith(NOT_SOURCES)


def _fingerprint(entries: Iterable[tuple[str, str]]) -> str:
    """12 hex digits over the sorted (path, git blob id) pairs of the sources."""
    digest = hashlib.sha256()
    for path, blob in sorted(entries):
        digest.update(f"{path} {blob}\n".encode())
    return digest.hexdigest()[:12]


def blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def files_fingerprint(root: Path, files: Iterable[Path]) -> str:
    """12 hex digits over ``files`` as they are now, each by its path relative to ``root`` and its
    content (as its git blob id)."""
    return _fingerprint((p.relative_to(root).as_posix(), blob_id(p.read_bytes())) for p in files)


def sources_fingerprint(root: Path = ROOT) -> str:
    """The fingerprint of the capture's source files under ``root`` as they are now."""
    return files_fingerprint(root, (p for p in (root / PACKAGE).rglob("*.py")
                                    if _is_source(p.relative_to(root).as_posix())))


def commit_fingerprint(commit: str, root: Path = ROOT) -> str:
    """The fingerprint of the capture's sources at ``commit`` (from ``git ls-tree``)."""
    listing = subprocess.run(["git", "ls-tree", "-r", "--full-tree", commit, "--", PACKAGE], cwd=root,
                             capture_output=True, text=True, check=True).stdout
    entries = []
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        if _is_source(path):
            entries.append((path, meta.split()[2]))
    return _fingerprint(entries)


def find_commit(fingerprint: str, root: Path = ROOT) -> str | None:
    """The short hash of the commit that made capture sources with ``fingerprint`` (the newest
    such state, at the commit that brought it), or None (not in this checkout's history, or no
    git)."""
    try:
        commits = subprocess.run(["git", "log", "--format=%h", "--", *CAPTURE_SOURCES], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.split()
        found = None
        for c in commits:  # newest first: the match's older neighbours with the same sources
            if commit_fingerprint(c, root) == fingerprint:
                found = c
            elif found is not None:
                break
        return found
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Find the commit whose capture sources have a fingerprint "
                                "(a capture bench result's capture_sources).")
    p.add_argument("fingerprint", nargs="?", help="12 hex digits; without it, print this checkout's")
    args = p.parse_args(argv)
    if args.fingerprint is None:
        print(sources_fingerprint())
        return
    commit = find_commit(args.fingerprint)
    if commit is None:
        raise SystemExit(f"error: fingerprint={args.fingerprint}: no commit of this checkout's history has "
                         "these capture sources; fetch the history the result was measured on, or check the value")
    print(commit)


if __name__ == "__main__":
    main()
