"""The suite's CI rule (tests/ci_required.py), run through a real pytest: with CI set, a skipped
`ci_required` test fails the run, and so does any other skip not on the allow-list (CI_SKIPS); a listed
one stays a skip; without CI every skip is a skip; tests that use the real model are marked slow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # each test runs pytest in a subprocess

REPO = Path(__file__).resolve().parents[1]
SAMPLE = '''
import pytest

@pytest.mark.ci_required
def test_needs_a_fixture_that_is_missing():
    pytest.skip("no drafter in the cache")

def test_optional():
    pytest.skip("optional tool missing")

@pytest.fixture
def target_model_dir():
    return "x"

def test_real_model(target_model_dir):
    pass
'''


# a test at the id CI_SKIPS lists (the rootdir is tmp_path, so ids are relative to it)
LISTED = '''
import pytest

def test_cuda_graphs_match_eager():
    pytest.skip("CUDA graph capture needs a GPU")
'''


def _pytest(tmp_path: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    listed = tmp_path / "tests" / "workers" / "engine"
    listed.mkdir(parents=True, exist_ok=True)
    (listed / "test_static_decode.py").write_text(LISTED)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_required", "-q", "-rfs",
                           "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_skips_fail_in_ci_unless_listed(tmp_path) -> None:
    ci = _pytest(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout
    assert "2 failed, 1 passed, 1 skipped" in ci.stdout
    assert "is ci_required but was skipped in CI" in ci.stdout and "no drafter in the cache" in ci.stdout
    assert "test_optional was skipped in CI (Skipped: optional tool missing) and is not on the allow-list" \
        in ci.stdout
    assert "SKIPPED [1] tests/workers/engine/test_static_decode.py" in ci.stdout    # listed: a skip
    local = _pytest(tmp_path, None)
    assert local.returncode == 0 and "1 passed, 3 skipped" in local.stdout, local.stdout
    assert _pytest(tmp_path, "false").returncode == 0


def test_tests_of_the_real_model_are_marked_slow(tmp_path) -> None:
    quick = _pytest(tmp_path, None, "-m", "not slow")
    assert "3 skipped, 1 deselected" in quick.stdout, quick.stdout


STARTS = '''
import subprocess, sys, threading
import pytest

go, done = threading.Event(), threading.Event()

def _left_running():       # a thread an earlier test (here: the module) left running
    go.wait()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    done.set()

threading.Thread(target=_left_running, daemon=True).start()

def test_a_process_from_an_earlier_thread_is_not_this_tests():
    go.set()
    assert done.wait(60)

@pytest.fixture
def started_in_setup():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_one_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_setup_starts_one_unmarked(started_in_setup):
    pass

@pytest.mark.slow
def test_starts_one_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_none():
    pass

def test_a_library_probe_is_not_a_start():
    import ctypes.util
    ctypes.util.find_library("m")      # runs ldconfig -p
'''


def test_a_test_that_starts_a_process_must_be_marked_slow(tmp_path) -> None:
    (tmp_path / "test_starts.py").write_text(STARTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_required", "-q", "-p",
                          "no:cacheprovider", str(tmp_path / "test_starts.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "1 failed, 4 passed, 1 error" in out, out       # the setup one is an error in setup
    assert "test_starts_one_unmarked is not marked slow but its body started a process" in out
    assert "test_setup_starts_one_unmarked is not marked slow but its setup started a process" in out
