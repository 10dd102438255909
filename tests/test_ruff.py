"""ruff (the test extra's linter, configured in pyproject.toml) is clean on the whole tree: CI runs it
through the README's test command, like every other check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow          # a process: the quick loop leaves it to `ruff check .` by hand
def test_ruff_is_clean() -> None:
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ruff check . found problems:\n{out.stdout}{out.stderr}"
