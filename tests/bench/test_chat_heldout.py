"""`specd bench chat` pieces that need no server: the prompt sets it draws, a phase's ratios from
hand-set times (a stand-in client), and the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specd.bench import chat_heldout


def test_the_held_out_halves_and_the_stream_never_share_a_prompt() -> None:
    fresh, after = chat_heldout.heldout_halves(16)
    stream = chat_heldout.stream_prompts(40)
    key = json.dumps
    assert len(fresh) == len(after) == 16 and len(stream) == 40
    assert not {key(m) for m in fresh} & {key(m) for m in after}
    assert not {key(m) for m in fresh + after} & {key(m) for m in stream}
    with pytest.raises(ValueError, match="two halves"):
        chat_heldout.heldout_halves(17)


class _Client:
    """Answers every prompt in 1 s with speculation on and 1.5 s or 2 s off, as a server would report."""

    def __init__(self, _address, timeout):
        self.calls = 0

    def generate(self, messages, max_new_tokens, ignore_eos, temperature, speculation):
        self.calls += 1
        self.clock.now += 1.0 if speculation else (1.5 if self.calls < 3 else 2.0)
        tokens = [1] * max_new_tokens if speculation or self.calls != 4 else [2] * max_new_tokens
        usage = {"drafted": 30, "accepted": 15, "steps": 10, "drafter_versions": ["v1"]}
        usage = usage if speculation else {}
        return SimpleNamespace(token_ids=tokens, usage=usage)

    def close(self):
        pass


def test_a_phase_is_target_only_time_over_speculative_time(monkeypatch) -> None:
    clock = SimpleNamespace(now=0.0)
    _Client.clock = clock
    monkeypatch.setattr("specd.cluster.client.SpecdClient", _Client)
    monkeypatch.setattr(chat_heldout.time, "perf_counter", lambda: clock.now)
    phase = chat_heldout.on_then_off("addr", [[{"role": "user", "content": "a"}]] * 2, 8, "test")
    assert phase["speedup"] == pytest.approx(3.5 / 2) and phase["speedup_median"] == pytest.approx(1.75)
    assert phase["drafted_per_step"] == 3.0 and phase["acceptance_rate"] == 0.5
    assert phase["greedy_mismatches"] == 1 and phase["drafter_versions"] == ["v1"]


def test_the_plot(tmp_path) -> None:
    per_prompt = [{"on_s": 1.0, "off_s": 1.2, "tokens": 96}] * 3
    result = {name: {"per_prompt": per_prompt, "speedup": 1.2} for name in ("fresh", "after")}
    chat_heldout.plot(result, tmp_path / "chat.png")
    assert (tmp_path / "chat.png").stat().st_size > 1000


def test_a_phase_reads_each_drafter_versions_drafts_from_the_servers_counters(monkeypatch) -> None:
    """The counters the router exports (cluster/metrics.py's names and label), read as Prometheus text."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    drafted = Counter("specd_drafted_tokens", "d", ["drafter_version"], registry=registry)
    accepted = Counter("specd_accepted_tokens", "a", ["drafter_version"], registry=registry)
    monkeypatch.setattr("urllib.request.urlopen",
                        lambda url, timeout: SimpleNamespace(read=lambda: generate_latest(registry)))
    drafted.labels("").inc(10)                      # a draft that carries no version
    accepted.labels("").inc(4)
    before = chat_heldout.by_version("http://x/metrics")
    assert before == {"none": {"drafted": 10.0, "accepted": 4.0}}
    drafted.labels("").inc(10)
    drafted.labels("suffix-24").inc(6)              # the suffix index's own version label
    drafted.labels("online-3").inc(20)
    accepted.labels("online-3").inc(5)
    now = chat_heldout.by_version("http://x/metrics")
    assert chat_heldout.phase_sources(before, now) == {
        "none": {"drafted": 10.0, "accepted": 0.0, "acceptance_rate": 0.0},
        "suffix-24": {"drafted": 6.0, "accepted": 0.0, "acceptance_rate": 0.0},
        "online-3": {"drafted": 20.0, "accepted": 5.0, "acceptance_rate": 0.25}}
    assert chat_heldout.by_version("") == {}


@pytest.mark.slow    # a child Python per layout
@pytest.mark.parametrize("layout", ["namespace", "top-level"])
def test_a_server_tree_serves_its_own_code_not_the_installed_checkouts(tmp_path, layout) -> None:
    """--server-tree runs another checkout's server (the bisect of issue 61): in the layout since 1add2c9
    (`specd.*` mapped onto top-level folders) and in the one before it (top-level packages)."""
    import subprocess
    import sys

    tree = tmp_path / "tree"
    (tree / "cluster").mkdir(parents=True)
    (tree / "cluster" / "__init__.py").write_text("")
    (tree / "cluster" / "serve.py").write_text("print(__file__)\n")
    setuptools = ('[tool.setuptools.package-dir]\n"specd.cluster" = "cluster"\n' if layout == "namespace"
                  else '[tool.setuptools.packages.find]\ninclude = ["cluster*"]\n')
    (tree / "pyproject.toml").write_text(setuptools)
    env, module = chat_heldout.server_tree(tree, tmp_path / "scratch")
    assert module == ("specd.cluster.serve" if layout == "namespace" else "cluster.serve")
    out = subprocess.run([sys.executable, "-m", module], env=env, cwd=tree, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert Path(out).resolve() == (tree / "cluster" / "serve.py").resolve()


def test_a_fresh_cache_shares_the_target_and_the_teacher_data_and_nothing_else(tmp_path, monkeypatch) -> None:
    shared = tmp_path / "shared"
    for folder in ("models/SmolLM2", "bootstrap_data", "drafters/online/versions"):
        (shared / folder).mkdir(parents=True)
    (shared / "models" / "SmolLM2" / "config.json").write_text("{}")
    (shared / "bootstrap_data" / "teacher-1.safetensors").write_text("cached")
    monkeypatch.setenv("SPECD_CACHE", str(shared))
    root = chat_heldout.fresh_cache(tmp_path / "run" / "cache")
    assert (root / "models").is_symlink() and (root / "models" / "SmolLM2" / "config.json").exists()
    copied = root / "bootstrap_data" / "teacher-1.safetensors"
    assert not (root / "bootstrap_data").is_symlink() and copied.read_text() == "cached"
    assert not (root / "drafters").exists()
    copied.write_text("written by the run")          # the run's teacher data never reaches the shared cache
    assert (shared / "bootstrap_data" / "teacher-1.safetensors").read_text() == "cached"


@pytest.mark.slow      # a child process that imports torch
def test_the_idle_load_runs_at_the_trainers_priority_and_stops_with_the_bench() -> None:
    import os
    import time

    from specd.bench.idle_load import check_fraction

    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="must lie in"):
            chat_heldout.start_idle_load(bad)
        parser = argparse.ArgumentParser()
        chat_heldout.add_arguments(parser)
        with pytest.raises(SystemExit):                  # refused before any server starts
            parser.parse_args(["--beside-load", str(bad)])
    assert chat_heldout.start_idle_load(None) is None and check_fraction(1.0) == 1.0
    load = chat_heldout.start_idle_load(0.5)
    try:
        deadline = time.monotonic() + 60
        # it lowers its own priority first thing; wait until it has
        while os.sched_getscheduler(load.pid) != os.SCHED_IDLE:
            assert load.poll() is None, "the idle load exited"
            assert time.monotonic() < deadline, "the idle load never went to SCHED_IDLE"
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, load.pid) >= 10
    finally:
        load.kill()
        load.wait()
    assert load.returncode is not None
