"""Layering: every module imports on its own in a fresh interpreter (no import cycles), and
nothing below the app imports the app (data flows one way: traces -> engine -> results)."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("traces", "simulator", "analysis")
NEEDS_TORCH = ("traces.capture", "traces.fixtures", "simulator.gpu.emulate")


def modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_module_imports_alone():
    have_torch = importlib.util.find_spec("torch") is not None
    names = [m for m in modules() if have_torch or not m.startswith(NEEDS_TORCH)]

    def load(name):
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        return name, proc.returncode, proc.stderr.strip().splitlines()[-1:] or [""]

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [(n, err[0]) for n, rc, err in pool.map(load, names) if rc != 0]
    assert not failed, failed


@pytest.mark.parametrize("package", ["simulator/engine", "simulator/policies", "traces"])
def test_lower_layers_do_not_import_the_app(package):
    """The engine, the policies and the trace side never import moe-sim's app or configs."""
    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in ("simulator.run", "simulator.config"), path
            elif isinstance(node, ast.Import):
                assert all(a.name not in ("simulator.run", "simulator.config") for a in node.names), path
