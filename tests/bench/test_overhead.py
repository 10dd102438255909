"""`specd bench overhead`: free forwards keep the real workers' interfaces, and the bench reports cells."""

from __future__ import annotations

import json

import pytest

from specd.bench import overhead
from specd.bench.free_models import (
    TOKEN,
    FreeForward,
    FreeTargetWorker,
    UnpredictableTargetWorker,
    moving_token,
    write_stand_ins,
)


def test_free_forward_answers_with_the_real_shapes_and_refuses_writes(tmp_path):
    from specd.configs import load_config

    target_dir, drafter_dir = write_stand_ins(tmp_path, 512)
    cfg = load_config([f"target.model_path={target_dir}", "target.max_slots=2", "target.max_seq_len=512",
                       "target.decode=eager"])
    worker = FreeTargetWorker(cfg.target)
    forward = worker.runner._forward
    assert isinstance(forward, FreeForward)
    logits, hidden = worker.runner.extend([0], [[3, 4, 5]], return_hidden=True)
    assert logits.shape == (1, 3, 49152) and hidden.shape == (1, 3, 576)
    assert int(logits[0, -1].argmax()) == TOKEN
    assert int(worker.runner.cache.lengths[0]) == 3     # the KV bookkeeping ran around the free forward
    with pytest.raises(RuntimeError):
        logits.add_(1.0)        # a caller writing into the shared row would fail, not skew later steps
    assert forward.calls == 1


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_an_unpredictable_target_moves_its_peak_at_every_forward(tmp_path, decode):
    """No two forwards within a run peak at the same token, never at the drafter's TOKEN or EOS, and every
    position of one forward peaks at that forward's token."""
    import torch

    from specd.configs import load_config

    assert len({moving_token(i) for i in range(1, 40001)}) == 40000
    assert not {TOKEN, 1} & {moving_token(i) for i in range(1, 40001)}
    target_dir, _ = write_stand_ins(tmp_path, 512)
    cfg = load_config([f"target.model_path={target_dir}", "target.max_slots=2", "target.max_seq_len=512",
                       f"target.decode={decode}"])
    worker = UnpredictableTargetWorker(cfg.target)
    peaks = []
    slots = [worker.runner.allocate(), worker.runner.allocate()]
    with torch.inference_mode():
        for _ in range(4):
            logits = worker.runner.extend(slots, [[3, 4], [5, 6]])         # [2, 2, vocab]
            top = logits.argmax(dim=-1)
            assert torch.equal(top, torch.full_like(top, int(top[0, 0])))
            peaks.append(int(top[0, 0]))
    assert len(set(peaks)) == 4 and TOKEN not in peaks


def test_rejected_drafts_cells_draft_nothing_that_is_accepted(tmp_path):
    """--drafts rejected: a chain's drafts all fail, so each request emits one token a step (the recovered
    one), and the default's planner stops asking for drafts it will not get."""
    out = tmp_path / "rejected.json"
    rc = overhead.main(["--where", "in-process", "--systems", "chain,default", "--batch-sizes", "2",
                        "--steps", "20", "--warmup", "20", "--drafts", "rejected", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    by = {r["system"]: r for r in data["rows"]}
    assert data["meta"]["drafts"] == "rejected" and by["chain"]["drafts"] == "rejected"
    assert by["chain"]["tokens_per_step"] == 2 and by["default"]["tokens_per_step"] == 2
    assert by["chain"]["phases_ms"]["propose"] > 0


def test_in_process_cells_report_every_system(tmp_path):
    out = tmp_path / "overhead.json"
    rc = overhead.main(["--where", "in-process", "--batch-sizes", "1,2", "--steps", "3", "--warmup", "1",
                        "--json", str(out), "--plot", str(tmp_path / "overhead.png")])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["system"], r["batch"]) for r in rows} == {(s, b) for s in overhead.SYSTEMS for b in (1, 2)}
    for row in rows:
        assert row["where"] == "in-process" and row["host_ms_per_step"] > 0 and row["steps"] == 3
        assert set(row["phases_ms"]) == {"plan", "propose", "verify", "rest"}
    by = {(r["system"], r["batch"]): r for r in rows}
    # the stand-ins accept every greedy draft: a γ = 3 chain emits 4 tokens per request and step
    assert by[("chain", 2)]["tokens_per_step"] == 8
    assert by[("target-only", 1)]["phases_ms"]["propose"] == 0
    assert by[("chain", 1)]["phases_ms"]["plan"] > 0 and by[("target-only", 1)]["phases_ms"]["plan"] == 0
    assert len(data["meta"]["load_average_start"]) == 3
    assert data["meta"]["device"] == {"device": "cpu"}       # on CUDA the GPU's name too
    assert (tmp_path / "overhead.png").stat().st_size > 0
    # the GPU's busy time is profiled on CUDA with the real model only: no such keys here
    assert not any(key.startswith("gpu_") for row in rows for key in row)


def test_the_static_decode_path_runs_on_free_forwards(tmp_path):
    """decode=static (the GPU path's logic, uncaptured): the static decoder's padded forward is free too,
    and a chain still emits every drafted token and a bonus."""
    out = tmp_path / "static.json"
    # drafter.path names the real cells' drafter (one whose reduced head lacks the stand-ins' token):
    # the free cells keep their stand-in
    rc = overhead.main(["--where", "in-process", "--systems", "target-only,chain", "--batch-sizes", "2",
                        "--steps", "3", "--warmup", "1", "--json", str(out),
                        "target.decode=static", "drafter.decode=static", f"drafter.path={tmp_path / 'none'}"])
    assert rc == 0
    by = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert by["chain"]["tokens_per_step"] == 8 and by["target-only"]["tokens_per_step"] == 2


def test_free_cells_run_a_captured_decode_mode_uncaptured():
    """`target.decode=compiled` asked for the real cells (the GPU default) must not fail the free ones:
    they run the static path, which free forwards can stand in for."""
    from specd.configs import load_config

    cfg = load_config(["target.decode=compiled", "drafter.decode=graph"])
    overhead.uncaptured(cfg)
    assert (cfg.target.decode, cfg.drafter.decode) == ("static", "static")
    cfg = load_config(["target.decode=eager"])
    overhead.uncaptured(cfg)
    assert (cfg.target.decode, cfg.drafter.decode) == ("eager", "auto")


def test_gpu_busy_profiles_only_real_forwards_on_cuda():
    class Run:
        done = False

        def advance(self):
            raise AssertionError("no step is profiled off CUDA")

    class Target:
        device = "cpu"

    assert overhead.gpu_busy(Run(), "real", Target()) == {}
    Target.device = "cuda"
    assert overhead.gpu_busy(Run(), "free", Target()) == {}


def test_top_kernels_rank_kernels_by_time_per_step():
    """Per step over the profiled steps, the costliest first, at most `top` of them."""
    from types import SimpleNamespace as K

    kernels = ([K(name="gemv", device_time_total=3.0)] * 4 + [K(name="sdpa", device_time_total=10.0)] * 2
               + [K(name="fused_rms", device_time_total=1.0)] * 2)
    assert overhead.top_kernels(kernels, steps=2, top=2) == [
        {"name": "sdpa", "launches_per_step": 1.0, "us_per_step": 10.0},
        {"name": "gemv", "launches_per_step": 2.0, "us_per_step": 6.0}]


@pytest.mark.slow     # starts Ray actors
def test_router_cells_run_through_ray_actors(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "router.json"
    rc = overhead.main(["--where", "router", "--systems", "target-only,chain", "--batch-sizes", "1",
                        "--steps", "3", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["where"]) for r in rows] == [("target-only", "router"), ("chain", "router")]
    assert not any(r["compiled_calls"] for r in rows)            # plain actor calls unless asked
    assert rows[1]["tokens_per_step"] == 4 and rows[1]["phases_ms"]["propose"] > 0
    busy = [r["actor_busy_ms"] for r in rows]
    assert busy[0]["drafter"] == 0 and busy[0]["target"] > 0     # target-only never calls the drafter
    assert busy[1]["drafter"] > 0 and busy[1]["target"] > 0


@pytest.mark.slow     # starts Ray actors and a compiled graph
def test_router_cells_time_the_compiled_graph_with_compiled_calls(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "router-compiled.json"
    rc = overhead.main(["--where", "router", "--systems", "chain", "--batch-sizes", "1", "--steps", "3",
                        "--warmup", "1", "--json", str(out), "ray.compiled_calls=true"])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["compiled_calls"] is True and row["tokens_per_step"] == 4
    assert row["actor_busy_ms"]["drafter"] > 0 and row["actor_busy_ms"]["target"] > 0


def test_unknown_system_is_refused():
    with pytest.raises(SystemExit, match="unknown system"):
        overhead.main(["--systems", "nope"])



def test_rows_measured_before_a_failing_cell_are_written(tmp_path, monkeypatch):
    import specd.bench.overhead_router

    def no_ray(*_args, **_kwargs):
        raise RuntimeError("The current node timed out during startup")

    monkeypatch.setattr(specd.bench.overhead_router, "run_router_cells", no_ray)
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError, match="timed out"):
        overhead.main(["--systems", "target-only", "--batch-sizes", "1", "--steps", "2", "--warmup", "1",
                       "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["where"]) for r in rows] == [("target-only", "in-process")]
