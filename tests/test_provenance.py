"""traces.provenance: the commit a benchmark's figures name as the code they timed."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from traces.provenance import CAPTURE_SOURCES, capture_commit, source_commit


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_source_commit_names_the_last_commit_of_its_paths_and_marks_a_changed_working_copy(tmp_path):
    root = tmp_path / "repo"
    (root / "code").mkdir(parents=True)
    (root / "data").mkdir()
    _git(root, "init", "-q")
    (root / "code" / "a.py").write_text("x = 1\n")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "code")
    code_rev = _git(root, "log", "-1", "--format=%h")
    (root / "data" / "d.txt").write_text("d\n")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "data")
    assert source_commit(("code",), root) == code_rev  # a later commit elsewhere does not count
    assert source_commit(("code", ":(exclude)code/gen"), root) == code_rev
    assert source_commit(("data",), root) == _git(root, "log", "-1", "--format=%h") != code_rev
    (root / "code" / "a.py").write_text("x = 2\n")
    assert source_commit(("code",), root) == code_rev + "+"  # edited
    assert source_commit(("data",), root) == _git(root, "log", "-1", "--format=%h")
    _git(root, "checkout", "-q", "--", "code")
    (root / "code" / "new.py").write_text("y = 1\n")
    assert source_commit(("code",), root) == code_rev + "+"  # a new file not ignored
    (root / ".gitignore").write_text("code/new.py\n")
    assert source_commit(("code",), root) == code_rev  # ignored files are not the code
    outside = tmp_path / "plain"
    outside.mkdir()
    assert source_commit(("code",), outside) == "?"  # no checkout
    assert source_commit(("code",), tmp_path / "missing") == "?"


def test_capture_commit_is_the_capture_sources_commit_in_this_checkout():
    root = Path(__file__).resolve().parents[1]
    if source_commit((".",), root) == "?":
        pytest.skip("not a git checkout")
    rev = _git(root, "log", "-1", "--format=%h", "--", *CAPTURE_SOURCES)
    assert capture_commit().rstrip("+") == rev
    # the fixtures are data, not the capture's code: a commit touching only them is not named
    fixtures_rev = _git(root, "log", "-1", "--format=%h", "--", "traces/fixtures")
    touched = _git(root, "show", "--name-only", "--format=", fixtures_rev).split()
    if all(p.startswith(("traces/fixtures/", "traces/samples/")) or not p.startswith("traces/") for p in touched):
        assert rev != fixtures_rev
