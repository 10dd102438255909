"""The README's test command on a machine whose $HOME has never run the suite's libraries: the quick
loop's process guard (tests/ci_required.py) must not fail a test for what a library does on its first use
under a new home (matplotlib's font cache, built with `fc-list`). The plotting tests of the quick loop run
in a child pytest under a fresh HOME; a control without the session-start warm-up shows the guard catching
it there, so this test can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_required import SKIP_FIRST_USES_ENV

pytestmark = pytest.mark.slow     # a child pytest

REPO = Path(__file__).resolve().parents[1]
# the quick loop's tests that draw a PNG (matplotlib's first use)
PLOTTING = ["tests/bench/test_bench_report.py"]


def _quick_loop(home: Path, *, skip_first_uses: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", SKIP_FIRST_USES_ENV)}
    env.update(HOME=str(home), CI="true")
    if skip_first_uses:
        env[SKIP_FIRST_USES_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           *PLOTTING], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_quick_loop_passes_under_a_fresh_home(tmp_path) -> None:
    run = _quick_loop(tmp_path / "home", skip_first_uses=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert (tmp_path / "home" / ".cache" / "matplotlib").is_dir()     # it was a first use


def test_control_the_guard_sees_a_first_use_under_a_fresh_home(tmp_path) -> None:
    run = _quick_loop(tmp_path / "home", skip_first_uses=True)
    assert run.returncode != 0 and "is not marked slow but its" in run.stdout and "fc-list" in run.stdout, (
        run.stdout[-3000:])
