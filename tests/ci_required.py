"""pytest plugin: in CI a skip that is not on the allow-list (CI_SKIPS below) is a failure, and tests
that need the real model or Ray are marked `slow`.

A test that README says runs in CI but skips there (a fixture found nothing in a fresh machine's cache,
a tool is missing) would let CI pass without it. With the environment variable CI set (GitHub
Actions, GitLab and most CI systems set CI=true), the skip of any test is reported as a failure with
the skip's reason, unless the test is listed in CI_SKIPS with why it cannot run on CI's machine (a
2-core CPU without a GPU). `ci_required` marks the tests whose fixtures must never skip there. Outside CI
a skip stays a skip; `-rs` (pyproject.toml) prints every skip's reason either way.

Tests that use the real model, the bootstrapped drafters, a Ray session or a redis-server of their own
(by their fixtures, SLOW_FIXTURES) are marked `slow`, so `pytest -m "not slow"` is the quick loop;
modules and tests that start subprocesses, Ray or a server themselves mark themselves. That is checked:
a test not marked `slow` that starts a process (subprocess.Popen, which Ray, redis-server and every
command run go through), in its setup or its body, fails with what it started.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

# The one list of tests allowed to skip in CI: test id (file::name, parameters ignored) -> why.
CI_SKIPS = {
    "tests/workers/engine/test_static_decode.py::test_cuda_graphs_match_eager":
        "CUDA graph capture needs a GPU; CI's machine has none (run on a lent GPU: scripts/gpu_bench.sh)",
    "tests/helm/test_pods.py::test_a_head_restart_fails_no_request":
        "the release's 9 pods share CI's 2 cores: the restarted head's raylet gives up on its dashboard "
        "agent at every start (Ray's fixed ~15 s port-file wait; issue 73, docs/reliability.md)",
}

# Short-lived processes that libraries start on their own (ctypes.util.find_library runs ldconfig,
# platform.processor() runs uname): not what a test starts.
LIBRARY_PROBES = frozenset({"ldconfig", "uname"})

# What a test starts, by its fixtures: the real model or a bootstrapped drafter, a Ray session, a
# redis-server of its own.
SLOW_FIXTURES = frozenset({"target_model_dir", "real_target_dir", "boot_drafter_dir",
                           "boot_hidden_drafter_dir", "ray_session", "ray_local", "ray_echo",
                           "ray_for_serving", "redis_server", "redis_with_password"})


# What a library does once per home, the first time it runs there, done at the session's start so that
# no test's phase starts it: matplotlib builds its font cache with `fc-list` under a new $HOME (a test
# that plots failed the guard below on a machine that had never run matplotlib, and passed on one that
# had). SKIP_FIRST_USES_ENV set: not done (tests/test_fresh_home.py's control).
SKIP_FIRST_USES_ENV = "SPECD_TEST_SKIP_FIRST_USES"


def pytest_sessionstart(session) -> None:
    if os.environ.get(SKIP_FIRST_USES_ENV):
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.font_manager  # noqa: F401 (its import builds or reads the font cache)
    except ImportError:
        return


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "ci_required: must run in CI; with CI set a skip is a failure")
    config.addinivalue_line("markers", "slow: loads the real model, starts Ray or subprocesses, or runs long")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if item.get_closest_marker("ci_required") is not None:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} is ci_required but was skipped in CI: {reason}"
    elif item.nodeid.split("[", 1)[0] not in CI_SKIPS:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} was skipped in CI ({reason}) and is not on the allow-list "
                           "(tests/ci_required.py: CI_SKIPS): install what it needs, or list it with why")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _no_process_unless_slow(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _no_process_unless_slow(item, "body"))


def _no_process_unless_slow(item, phase: str):
    """Run one phase of a test; a process started in it fails a test not marked slow."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    started: list[str] = []
    real_init = subprocess.Popen.__init__
    # Threads an earlier test left running (a managed redis-server's restarter, Ray's own) may start a
    # process now: not this test's. Its own thread and the threads it starts count.
    earlier = {t.ident for t in threading.enumerate()} - {threading.get_ident()}

    def watched(self, args, *rest, **kw):
        command = args if isinstance(args, str) else " ".join(map(str, args))
        ours = threading.get_ident() not in earlier
        if ours and os.path.basename(command.split(" ", 1)[0]) not in LIBRARY_PROBES:
            started.append(command)
        return real_init(self, args, *rest, **kw)

    subprocess.Popen.__init__ = watched
    try:
        result = yield
    finally:
        subprocess.Popen.__init__ = real_init
    if started:
        more = f" and {len(started) - 1} more" if len(started) > 1 else ""
        raise AssertionError(f"{item.nodeid} is not marked slow but its {phase} started a process "
                             f"({started[0][:200]!r}{more}): mark it `slow` (docs/testing.md)")
    return result
