"""traces.provenance: the code a benchmark's figures name as the code they timed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from traces import provenance as P

ROOT = Path(__file__).resolve().parents[1]


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", message)
    return _git(root, "log", "-1", "--format=%h")


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for d in ("traces/capture", "traces/fixtures", "data"):
        (root / d).mkdir(parents=True)
    _git(root, "init", "-q")
    return root


def test_source_commit_names_the_last_commit_of_its_paths_and_marks_a_changed_working_copy(tmp_path):
    root = _repo(tmp_path)
    (root / "traces" / "a.py").write_text("x = 1\n")
    code_rev = _commit(root, "code")
    (root / "data" / "d.txt").write_text("d\n")
    data_rev = _commit(root, "data")
    assert P.source_commit(("traces",), root) == code_rev  # a later commit elsewhere does not count
    assert P.source_commit(("data",), root) == data_rev != code_rev
    (root / "traces" / "a.py").write_text("x = 2\n")
    assert P.source_commit(("traces",), root) == code_rev + "+"  # edited
    assert P.source_commit(("data",), root) == data_rev
    _git(root, "checkout", "-q", "--", "traces")
    (root / "traces" / "new.py").write_text("y = 1\n")
    assert P.source_commit(("traces",), root) == code_rev + "+"  # a new file not ignored
    (root / ".gitignore").write_text("traces/new.py\n")
    assert P.source_commit(("traces",), root) == code_rev  # ignored files are not the code
    (root / "traces" / "fixtures" / "f.py").write_text("fixture = 1\n")
    assert P.capture_commit(root) == code_rev  # fixtures are data, not the capture's code
    assert P.source_commit(("traces",), root) == code_rev + "+"
    outside = tmp_path / "plain"
    outside.mkdir()
    assert P.source_commit(("traces",), outside) == "?" == P.capture_commit(outside)  # no checkout
    assert P.source_commit(("traces",), tmp_path / "missing") == "?"


def test_the_sources_fingerprint_is_the_files_and_finds_their_commit(tmp_path, capsys):
    """The fingerprint of the files as they are equals that of the commit they match (from git's
    tree alone), ignores fixtures and non-Python files, and leads back to that commit even where
    the checkout's HEAD has moved on; an unknown one is None and one error line from the CLI."""
    data = b"print('a')\n"
    assert P.blob_id(data) == subprocess.run(["git", "hash-object", "--stdin"], input=data, capture_output=True,
                                             check=True).stdout.decode().strip()
    root = _repo(tmp_path)
    (root / "traces" / "a.py").write_text("x = 1\n")
    (root / "traces" / "capture" / "b.py").write_text("y = 1\n")
    first = _commit(root, "first")
    fp_first = P.sources_fingerprint(root)
    assert P.commit_fingerprint(first, root) == fp_first
    (root / "traces" / "capture" / "b.py").write_text("y = 2\n")
    assert P.sources_fingerprint(root) != fp_first  # a source edited
    second = _commit(root, "second")
    fp_second = P.sources_fingerprint(root)
    assert P.commit_fingerprint(second, root) == fp_second
    for path, text in [("traces/fixtures/f.py", "z = 1\n"), ("traces/notes.json", "{}\n"), ("data/d.py", "1\n")]:
        (root / path).write_text(text)
    later = _commit(root, "data only")
    assert P.sources_fingerprint(root) == fp_second == P.commit_fingerprint(later, root)
    assert P.find_commit(fp_second, root) == second  # the commit that made these sources, not a later one
    (root / "traces" / "capture" / "b.py").write_text("y = 1\n")  # the files of the first commit again
    assert P.find_commit(P.sources_fingerprint(root), root) == first
    (root / "traces" / "capture" / "c.py").write_text("new = 1\n")  # a file no commit has
    assert P.find_commit(P.sources_fingerprint(root), root) is None
    assert P.find_commit(fp_first, tmp_path) is None  # no checkout
    tool = subprocess.run([sys.executable, "-m", "traces.provenance", "0123456789ab"], cwd=ROOT,
                          capture_output=True, text=True)
    assert tool.returncode != 0 and tool.stdout == ""
    assert tool.stderr.strip().splitlines() == [
        "error: fingerprint=0123456789ab: no commit of this checkout's history has these capture sources; "
        "fetch the history the result was measured on, or check the value"]


def test_this_checkouts_capture_sources_lead_back_to_their_commit():
    if P.source_commit((".",), ROOT) == "?":
        pytest.skip("not a git checkout")
    rev = _git(ROOT, "log", "-1", "--format=%h", "--", *P.CAPTURE_SOURCES)
    assert P.capture_commit().rstrip("+") == rev
    assert P.find_commit(P.commit_fingerprint(rev)) == rev
    if not P.capture_commit().endswith("+"):
        assert P.sources_fingerprint() == P.commit_fingerprint("HEAD") == P.commit_fingerprint(rev)
