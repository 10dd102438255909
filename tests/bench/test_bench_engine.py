"""`specd bench engine`: planning, the `bench` CLI, the child protocol, and one real smoke run."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from specd.bench.child import Events, groups
from specd.bench.cli import add_cli as add_bench_cli
from specd.bench.engine import (
    FULL,
    QUICK,
    add_arguments,
    kv_cache_bytes,
    main,
    resolve_plan,
    run_bench,
)
from specd.bench.serve import run_bench as run_serve_bench
from specd.bench.systems import SYSTEMS, device_info, specd_overrides


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_full_plan_is_the_issue_matrix():
    plan = resolve_plan(parse([]))
    assert plan.systems == [n for n in SYSTEMS if n != "transformers-compiled"] and len(plan.systems) == 19
    goodput = {"specd-default", "specd-goodput", "specd-goodput-tree", "specd-suffix", "specd-suffix-only"}
    assert goodput <= set(plan.systems)
    assert {"specd-chain", "specd-chain-tokens"} <= set(plan.systems)
    assert {"vllm", "vllm-ngram", "vllm-specd-chain", "vllm-specd-ngram"} <= set(plan.systems)
    assert plan.workloads == ["gsm8k", "humaneval"]
    assert (plan.batch_sizes, plan.temperatures) == ([1, 8], [0.0, 0.7])
    assert plan.max_new_tokens == 128 and plan.reductions == []


def test_quick_plan_says_what_it_reduced_and_explicit_options_win():
    plan = resolve_plan(parse(["--quick", "--batch-sizes", "1", "--systems", "target-only,specd-ngram"]))
    assert plan.systems == ["target-only", "specd-ngram"]
    assert plan.batch_sizes == [1] and plan.workloads == QUICK.workloads
    said = " ".join(plan.reductions)
    assert "humaneval" in said and "0.7" in said and "batch sizes: left out 8" in said
    assert f"{QUICK.max_new_tokens} instead of {FULL.max_new_tokens}" in said


def test_unknown_system_is_refused():
    with pytest.raises(SystemExit, match="unknown system"):
        resolve_plan(parse(["--systems", "target-only,gpt5"]))


def test_bench_subcommands_are_siblings_under_one_bench_parser():
    parser = argparse.ArgumentParser(prog="specd")
    sub = parser.add_subparsers(dest="command")
    add_bench_cli(sub)
    args = parser.parse_args(["bench", "engine", "--quick", "--json", "x.json", "drafter.min_ngram=2"])
    assert args.quick and args.json == "x.json" and args.overrides == ["drafter.min_ngram=2"]
    assert args.func is run_bench
    serve = parser.parse_args(["bench", "serve", "--quick", "--clients", "2"])
    assert serve.func is run_serve_bench and serve.quick and serve.clients == 2
    assert list(sub.choices) == ["bench"]


def test_specd_overrides_fix_what_the_benchmark_needs():
    job = {"overrides": ["seed=3"], "model_dir": "/m", "threads": 2, "max_batch": 8, "max_seq_len": 512}
    out = specd_overrides(SYSTEMS["specd-ngram"], job)
    assert out[0] == "seed=3" and "drafter.kind=ngram" in out and "target.max_slots=8" in out
    assert "drafter.kind=model" in specd_overrides(SYSTEMS["specd-tree"], job)
    assert not any(o.startswith("drafter.kind") for o in specd_overrides(SYSTEMS["target-only"], job))
    assert not any(o.startswith("target.backend") for o in specd_overrides(SYSTEMS["specd-chain"], job))
    # the default model drafter reads target hidden states; specd-chain-tokens is the token-only one
    assert "drafter.target_hidden=true" in specd_overrides(SYSTEMS["specd-chain"], job)
    assert "drafter.target_hidden=false" in specd_overrides(SYSTEMS["specd-chain-tokens"], job)
    assert "drafter.kind=hybrid" in specd_overrides(SYSTEMS["specd-hybrid"], job)
    # --lockstep holds a group's target-only batch beside the speculative one: twice the target's slots
    for name in ("specd-default", "specd-ngram"):
        both = specd_overrides(SYSTEMS[name], {**job, "lockstep": True})
        assert "target.max_slots=16" in both and "drafter.max_slots=8" in both


def test_vllm_specd_systems_select_the_vllm_backend_with_an_engine_wide_gamma():
    job = {"model_dir": "/m", "max_batch": 1, "max_seq_len": 512}
    chain = specd_overrides(SYSTEMS["vllm-specd-chain"], job)
    assert {"target.backend=vllm", "drafter.kind=model", "spec.gamma=3", "spec.policy=fixed"} <= set(chain)
    assert "drafter.target_hidden=false" in chain  # vLLM does not hand its hidden states to a proposer
    assert "drafter.kind=ngram" in specd_overrides(SYSTEMS["vllm-specd-ngram"], job)
    assert SYSTEMS["vllm-specd-ngram"].speculative and SYSTEMS["vllm-specd-ngram"].backend == "vllm"


def test_kv_cache_bytes_matches_the_target_layout(tmp_path):
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # K and V, 30 layers, 3 KV heads of 64, float32, 256 positions, 8 slots
    assert kv_cache_bytes(tmp_path, 256, 8) == 2 * 30 * 3 * 64 * 4 * 256 * 8


def test_groups_are_consecutive_and_keep_seeds():
    got = list(groups([[1], [2], [3]], [10, 20, 30], 2))
    assert got == [([[1], [2]], [10, 20]), ([[3]], [30])]


def test_events_batch_token_counts_on_the_pipe():
    read_fd, write_fd = os.pipe()
    events = Events(write_fd, flush_every_s=3600.0)
    events.emit("phase", phase="warmup")
    events.tokens(3)
    events.tokens(4)        # held back: less than flush_every_s since the last write
    events.close()          # flushes the 7 pending tokens
    with os.fdopen(read_fd) as f:
        lines = [json.loads(line) for line in f]
    assert lines == [{"event": "phase", "phase": "warmup"}, {"event": "tokens", "n": 7}]


@pytest.mark.slow
def test_smoke_run_target_only_and_ngram(tmp_path):
    """Two prompts, 8 tokens, batch 1, greedy: real children, real model, counted tokens."""
    out = tmp_path / "bench.json"
    code = main(["--systems", "target-only,specd-ngram", "--workloads", "gsm8k", "--batch-sizes", "1",
                 "--temperatures", "0", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["meta"]["device"] == {"device": "cpu"}  # on CUDA it names the GPU
    assert [r["system"] for r in rows] == ["target-only", "specd-ngram"]
    for r in rows:
        assert r["generated_tokens"] == 16 and r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 100
    baseline, ngram = rows
    assert baseline["acceptance_rate"] is None and baseline["speedup_vs_target_only"] is None
    assert ngram["tokens_per_step"] >= 1.0
    assert ngram["speedup_vs_target_only"] == pytest.approx(ngram["tokens_per_s"] / baseline["tokens_per_s"])
    assert ngram["greedy_agreement_vs_target_only"] == 1.0     # lossless: same greedy tokens
    # eager decoding (the CPU's) has no static buckets: none was first used while timed
    assert all(r["first_use_buckets"] == 0 and r["first_use_s"] == 0.0 for r in rows)


@pytest.mark.slow
def test_continuous_lockstep_runs_one_queue_paired_by_windows(tmp_path):
    """--continuous --lockstep: four prompts as one queue of at most two running, each step beside its
    target-only twin; the windows' pairs add up to the steady span's figures, every request still
    finishes, and transformers (static groups only) is skipped."""
    out = tmp_path / "bench.json"
    code = main(["--systems", "target-only,specd-ngram,transformers", "--workloads", "gsm8k",
                 "--batch-sizes", "2", "--temperatures", "0", "--num-prompts", "4", "--max-new-tokens", "6",
                 "--continuous", "--lockstep", "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["meta"]["batching"] == "continuous" and result["meta"]["paired_by"] == "step"
    assert "static groups of one length only" in result["meta"]["skipped"]["transformers"]
    rows = {r["system"]: r for r in result["rows"]}
    ngram = rows["specd-ngram"]
    assert ngram["generated_tokens"] == 24 and ngram["greedy_agreement_vs_target_only"] == 1.0
    windows = ngram["paired_groups"]
    assert len(windows) >= 2     # the steady span: until a queue runs dry and a batch drops below two
    base_s, base_tokens, spec_s, spec_tokens = (sum(w[i] for w in windows) for i in range(4))
    # the span ends before the last requests' drain (each queue's last two requests run untimed)
    assert 12 <= spec_tokens == ngram["timed_tokens"] < 24 and 12 <= base_tokens < 24
    assert spec_s == pytest.approx(spec_tokens / ngram["tokens_per_s"])
    paired = (spec_tokens / spec_s) / (base_tokens / base_s)
    assert ngram["speedup_vs_target_only_paired"] == pytest.approx(paired)
    assert ngram["ms_per_token_p50"] > 0


@pytest.mark.slow
def test_mixed_lengths_give_each_request_its_own_length_in_every_system(tmp_path):
    """--lengths mixed: request i generates its seeded length, the same in target-only and specd."""
    from specd.bench.datasets import request_lengths

    out = tmp_path / "bench.json"
    code = main(["--systems", "target-only,specd-ngram", "--workloads", "gsm8k", "--batch-sizes", "2",
                 "--temperatures", "0", "--num-prompts", "4", "--max-new-tokens", "6", "--lengths", "mixed",
                 "--lockstep", "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    result = json.loads(out.read_text())
    lengths = request_lengths(4, 6, "mixed", seed=0)
    assert result["meta"]["lengths"] == "mixed" and len(set(lengths)) > 1
    for row in result["rows"]:
        assert row["requested_tokens"] == row["generated_tokens"] == sum(lengths)
    ngram = next(r for r in result["rows"] if r["system"] == "specd-ngram")
    assert ngram["greedy_agreement_vs_target_only"] == 1.0 and ngram["speedup_vs_target_only_paired"] > 0


def test_every_child_is_followed_by_a_checkpoint_of_what_was_measured(monkeypatch, tmp_path):
    """run_all hands over the results after each child, so `main` can write the rows measured so far: a
    run cut off by a time limit keeps its finished systems."""
    from rich.console import Console

    from specd.bench import engine

    monkeypatch.setattr(engine, "run_child", lambda job, folder, on_event: {"ok": True, "job": job["n"]})
    plan = resolve_plan(parse(["--systems", "target-only,specd-chain", "--workloads", "gsm8k",
                               "--batch-sizes", "1", "--temperatures", "0"]))
    jobs = {"target-only": {"n": 0}, "specd-chain": {"n": 1}}
    seen = []
    with open(os.devnull, "w") as quiet:
        engine.run_all(jobs, plan, tmp_path, Console(file=quiet), rounds=2,
                       after_each=lambda r: seen.append({k: [x["job"] for x in v] for k, v in r.items()}))
    assert seen == [{"target-only": [0], "specd-chain": []}, {"target-only": [0], "specd-chain": [1]},
                    {"target-only": [0, 0], "specd-chain": [1]},
                    {"target-only": [0, 0], "specd-chain": [1, 1]}]


def test_continuous_pairing_by_group_is_refused():
    with pytest.raises(SystemExit, match="--lockstep"):
        run_bench(parse(["--continuous", "--paired", "--systems", "target-only"]))


def test_gpu_baseline_and_device_info():
    compiled = SYSTEMS["transformers-compiled"]
    assert compiled.runner == "transformers" and compiled.compiled and not SYSTEMS["transformers"].compiled
    assert device_info("cpu") == {"device": "cpu"}  # no GPU name where there is no GPU


def test_goodput_and_suffix_systems_select_their_policy_and_drafter():
    job = {"model_dir": "/m", "max_batch": 1, "max_seq_len": 512}
    suffix = specd_overrides(SYSTEMS["specd-suffix"], job)
    assert {"drafter.kind=suffix", "spec.policy=goodput", "drafter.target_hidden=true"} <= set(suffix)
    alone = specd_overrides(SYSTEMS["specd-suffix-only"], job)
    assert "drafter.suffix_with_model=false" in alone and not SYSTEMS["specd-suffix-only"].needs_model_drafter
    assert SYSTEMS["specd-suffix"].needs_model_drafter and SYSTEMS["specd-goodput"].policy == "goodput"


def test_repetition_workload_follows_each_prompt_with_its_edited_copy(target_model_dir):
    from specd.bench.repetition import EDITED, repetition_prompts
    from specd.workers.models.loader import load_tokenizer

    rows = repetition_prompts(4, load_tokenizer(target_model_dir))
    assert [i >= EDITED for i, _ in rows] == [False, True, False, True]
    for (i, original), (j, edited) in zip(rows[::2], rows[1::2], strict=True):
        assert j == EDITED + i and original != edited
        head = next(k for k, (a, b) in enumerate(zip(original, edited, strict=False)) if a != b)
        tail = next(k for k, (a, b) in enumerate(zip(original[::-1], edited[::-1], strict=False)) if a != b)
        assert head + tail > 0.9 * len(original)   # a small edit: the rest of the prompt is unchanged
    assert resolve_plan(parse(["--workloads", "repeat"])).workloads == ["repeat"]


class _FakeBatch:
    """A queue of requests each needing `steps` advances, at most `size` running (Batch's surface)."""

    def __init__(self, n: int, size: int, steps: int) -> None:
        self.waiting = [f"r{i}" for i in range(n)]
        self.running: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.size, self.steps, self.seconds = size, steps, 0.0
        self.on_step = None

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def advance(self) -> None:
        while self.waiting and len(self.running) < self.size:
            self.running[self.waiting.pop(0)] = self.steps
        for rid in list(self.running):
            self.running[rid] -= 1
            self.on_step(rid, [0])
            if not self.running[rid]:
                self.done[rid] = self.running.pop(rid)
        self.seconds += 1.0


def test_steady_span_ends_when_a_queue_runs_dry_and_its_batch_drops():
    from specd.bench.steady import Span, drive

    span = Span(2)
    fast, slow = _FakeBatch(4, 2, 2), _FakeBatch(4, 2, 3)
    fast.on_step, slow.on_step = span.counter("fast"), span.counter("slow")
    span.watch("fast", fast)
    span.watch("slow", slow)
    admitted: dict[str, float] = {}
    while not (fast.finished and slow.finished):
        drive((fast, slow), admitted, once=True, span=span)
    # fast: two at a time, two steps each; after round 4 its queue is dry and both finish: the span ends
    # with the round before (slow then at three steps of two requests; round 4 admitted its last two)
    assert span.timed("fast") == (3.0, 6) and span.timed("slow") == (3.0, 6)
    assert (fast.seconds, slow.seconds) == (4.0, 6.0) and set(admitted) == {f"r{i}" for i in range(4)}


def test_cells_whose_timed_run_met_new_decode_buckets_are_reported():
    """A timed run that used static-decode buckets the warm-ups had not (a CUDA graph capture each on a
    GPU) says so when their first uses took a visible share of its wall time."""
    from specd.bench.report import first_use_warnings
    from specd.bench.runners import first_uses

    rows = [{"system": "specd-default", "workload": "gsm8k", "batch": 8, "wall_s": 0.5,
             "first_use_buckets": 8, "first_use_s": 0.2},
            {"system": "target-only", "workload": "gsm8k", "batch": 8, "wall_s": 0.5,
             "first_use_buckets": 1, "first_use_s": 0.001},
            {"system": "vllm", "workload": "gsm8k", "batch": 8, "wall_s": 0.5,
             "first_use_buckets": None, "first_use_s": None}]
    (warning,) = first_use_warnings(rows)
    assert warning.startswith("specd-default gsm8k batch 8: 8 decode buckets")
    assert "0.20 s of its 0.50 s" in warning

    class Worker:
        def __init__(self, uses):
            self.uses = uses

        def first_uses(self):
            return self.uses

    class Engine:
        target, drafter = Worker((3, 0.5)), Worker((2, 0.25))

    assert first_uses(Engine()) == (5, 0.75)
    Engine.drafter = None
    assert first_uses(Engine()) == (3, 0.5)
    assert first_uses(object()) is None        # not specd's engine (vLLM, transformers)
