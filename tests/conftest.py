"""Shared fixtures: paths to the samples and to the real inputs beside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REAL = SHARED / "real"
SAMPLES = ROOT / "samples" / "plans"


def require_tool(name: str) -> str:
    """Path of an external tool; fails (not skips) when it is missing and CI is set."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (.ci/run installs it) but was not found")
        pytest.skip(f"{name} not installed (CI installs it)")
    return path


def run_cli(*args: str, cwd: Path | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``wiretrace`` as a user would (a subprocess of this interpreter)."""
    proc = subprocess.run([sys.executable, "-m", "wiretrace.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"wiretrace {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not REAL.is_dir():
        pytest.fail(f"{REAL} is missing: the shared real inputs must sit beside the checkout")
    return REAL


@pytest.fixture(scope="session")
def demo_plan() -> Path:
    return SAMPLES / "gpt2-small-2x4.json"
