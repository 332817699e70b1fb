"""Which sources produced a measured figure: the last commit of the paths that hold them.

Benchmarks store this beside their figures (``make bench``'s ``kernel_commit``, the capture
bench's ``capture_commit``), so that a saved result says what code it timed without a note
written by hand. A commit ends in ``+`` when the working copy of those paths differs from it;
``?`` means no git or no checkout (an installed package, a copied tree without ``.git``).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

# the capture's own sources: the package, not the fixtures and sample data under traces/
CAPTURE_SOURCES = ("traces", ":(exclude)traces/fixtures", ":(exclude)traces/samples")


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


def capture_commit() -> str:
    """:func:`source_commit` of the capture's sources (:data:`CAPTURE_SOURCES`)."""
    return source_commit(CAPTURE_SOURCES, Path(__file__).resolve().parent.parent)
