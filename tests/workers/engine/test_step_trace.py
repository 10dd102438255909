"""SPECD_STEP_TRACE (workers/engine/trace.py) on the in-process engine, and its summary script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.trace import TRACE_ENV
from specd.workers.engine.types import NewRequest, SpecParams

ROOT = Path(__file__).resolve().parents[3]


def _summary_module():
    spec = importlib.util.spec_from_file_location("step_trace", ROOT / "scripts" / "step_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    cfg = load_config([f"target.model_path={tiny_target_dir}", "target.max_seq_len=128"])
    return TargetWorker(cfg.target), cfg


def _generate(target, cfg, spec: SpecParams) -> list:
    cfg.drafter.kind = "ngram"
    engine = SpecEngine(target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir)))
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 7, 7, 7, 7, 7]]
    reqs = [NewRequest(f"t{i}", p, SamplingParams(), 12, spec) for i, p in enumerate(prompts)]
    return engine.generate(reqs, ignore_eos=True)


def test_no_trace_unless_the_environment_names_a_file(target, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _generate(*target, SpecParams(gamma=3, policy="fixed"))
    assert list(tmp_path.iterdir()) == []


def test_one_line_per_step_and_the_summary_counts_them_all(target, tmp_path, monkeypatch) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    seqs = _generate(*target, SpecParams(gamma=3, policy="fixed"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == max(s.stats.steps for s in seqs)        # one line per step of the batch
    assert sum(line["emitted"] for line in lines) == sum(len(s.output) - 1 for s in seqs)
    assert sum(sum(line["drafted"]) for line in lines) == sum(s.stats.drafted for s in seqs) > 0
    assert all(line["step_s"] >= line["verify_s"] > 0 for line in lines)
    rows = _summary_module().summarise(lines)
    assert sum(r["steps"] for r in rows) == len(lines)
    assert {r["batch"] for r in rows} <= {1, 2}
    drafted_rows = [r for r in rows if r["kind"] != "plain"]
    assert drafted_rows and all(r["emitted"] >= 1 for r in drafted_rows)


def test_alone_keeps_the_steps_nothing_overlapped() -> None:
    def step(pid: int, started: float, seconds: float) -> dict:
        return {"pid": pid, "started": started, "step_s": seconds}
    lines = [
        step(1, 0.0, 1.0),      # alone
        step(1, 2.0, 2.0),      # overlaps the next: pipelined
        step(1, 3.0, 0.5),      # inside the one before
        step(1, 4.5, 1.0),      # alone again (touching an end is not overlapping)
        step(2, 3.2, 0.1),      # another process's step overlaps nothing of process 1's
    ]
    kept = _summary_module().alone(lines)
    assert [(s["pid"], s["started"]) for s in kept] == [(1, 0.0), (1, 4.5), (2, 3.2)]
