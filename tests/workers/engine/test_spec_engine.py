"""The in-process engine on tiny random models: lossless greedy, seeded sampling, slots, stop rules."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import FinishReason, NewRequest, SpecParams

GREEDY = SamplingParams()
PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256",
    ])


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


def _drafter(cfg, target, kind="model"):
    cfg.drafter.kind = kind
    return DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))


def _requests(spec: SpecParams, sampling=GREEDY, n=64, prompts=PROMPTS, prefix="r"):
    return [NewRequest(f"{prefix}{i}", p, sampling, n, spec) for i, p in enumerate(prompts)]


def _outputs(engine, reqs):
    return [s.output for s in engine.generate(reqs, ignore_eos=True)]


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("model", SpecParams(gamma=4)),
        ("model", SpecParams(gamma=1)),
        ("model", SpecParams(gamma=6, policy="egag")),
        ("model", SpecParams(gamma=6, policy="adaptive")),
        ("model", SpecParams(gamma=3, tree_width=3)),
        ("ngram", SpecParams(gamma=4)),
    ],
)
def test_greedy_output_equals_target_only(cfg, target, kind, spec):
    base = _outputs(SpecEngine(target), _requests(SpecParams(enabled=False)))
    engine = SpecEngine(target, _drafter(cfg, target, kind))
    seqs = engine.generate(_requests(spec), ignore_eos=True)
    assert [s.output for s in seqs] == base
    assert all(len(s.output) == 64 for s in seqs)
    total = sum(s.stats.drafted for s in seqs)
    assert total > 0, "the drafter must have proposed something"
    if spec.tree_width > 1:  # a real tree: more nodes than levels
        assert total > sum(sum(s.stats.gamma_history) for s in seqs)
    for s in seqs:
        st = s.stats
        assert st.accepted + st.recovered + st.bonus == st.emitted
        assert st.emitted == len(s.output) - 1  # the prefill's first token is no step
    assert target.free_slots() == cfg.target.max_slots


def test_mixed_batch_of_chains_trees_and_target_only_is_one_forward_per_step(cfg, target, monkeypatch):
    base = _outputs(SpecEngine(target), _requests(SpecParams(enabled=False)))
    specs = [SpecParams(gamma=3, tree_width=2), SpecParams(gamma=4), SpecParams(enabled=False),
             SpecParams(gamma=2, tree_width=3)]
    reqs = [NewRequest(f"m{i}", PROMPTS[i], GREEDY, 64, spec) for i, spec in enumerate(specs)]
    forwards, verifies = [], []

    def counted(fn, log):
        def wrapper(*args, **kwargs):
            log.append(1)
            return fn(*args, **kwargs)
        return wrapper

    engine = SpecEngine(target, _drafter(cfg, target))   # its start-up cost profile is not a step
    monkeypatch.setattr(target.runner, "extend", counted(target.runner.extend, forwards))
    monkeypatch.setattr(target.runner, "extend_trees", counted(target.runner.extend_trees, forwards))
    monkeypatch.setattr(target, "verify", counted(target.verify, verifies))
    seqs = engine.generate(reqs, ignore_eos=True)
    assert [s.output for s in seqs] == base
    assert seqs[0].stats.drafted > sum(seqs[0].stats.gamma_history) - 1 > 0   # trees really drafted
    assert seqs[2].stats.drafted == 0
    assert len(forwards) == len(verifies) > 0            # every verify is one target forward
    assert target.free_slots() == cfg.target.max_slots


def test_seeded_sampling_is_reproducible_across_batches(cfg, target):
    drafter = _drafter(cfg, target)
    engine = SpecEngine(target, drafter)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    alone = _outputs(engine, _requests(SpecParams(gamma=4), sampling, prompts=PROMPTS[:1]))
    mixed_reqs = _requests(SpecParams(gamma=4), sampling, prompts=PROMPTS)
    mixed_reqs[1] = NewRequest("other", PROMPTS[1], SamplingParams(temperature=1.0, seed=7), 64)
    mixed = _outputs(engine, mixed_reqs)
    assert mixed[0] == alone[0]
    again = _outputs(engine, _requests(SpecParams(gamma=4), sampling, prompts=PROMPTS[:1]))
    assert again == alone


def test_sampled_trees_run_and_free_slots(cfg, target):
    engine = SpecEngine(target, _drafter(cfg, target))
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=5)
    seqs = engine.generate(_requests(SpecParams(gamma=3, tree_width=3), sampling, n=40), ignore_eos=True)
    assert all(len(s.output) == 40 for s in seqs)
    assert all(0 <= t < 96 for s in seqs for t in s.output)
    assert target.free_slots() == cfg.target.max_slots


def test_more_requests_than_slots_and_stop_rules(cfg, target):
    engine = SpecEngine(target, _drafter(cfg, target))
    prompts = PROMPTS * 4  # 16 requests through 6 slots
    reqs = [NewRequest(f"s{i}", p, GREEDY, 5 + i, SpecParams(gamma=4)) for i, p in enumerate(prompts)]
    seqs = engine.generate(reqs, ignore_eos=True)
    assert [len(s.output) for s in seqs] == [5 + i for i in range(16)]
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
    # max_new_tokens is never overshot: γ is capped at remaining - 1
    assert all(max(s.stats.gamma_history, default=0) <= 5 + i - 1 for i, s in enumerate(seqs))
    # a stop token id ends the request like EOS and is the last token emitted
    base = seqs[0].output
    stop = base[2]
    req = NewRequest("stop", prompts[0], SamplingParams(), 5, SpecParams(gamma=4), stop_token_ids=(stop,))
    (seq,) = engine.generate([req], ignore_eos=True)
    assert seq.output == base[: base.index(stop) + 1]
    assert seq.finish_reason == FinishReason.EOS


def test_bad_requests_leave_workers_usable(cfg, target):
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        target.start([NewRequest("long", [1] * 250, SamplingParams(), 64)])
    with pytest.raises(ValueError, match="empty prompt"):
        target.start([NewRequest("empty", [], SamplingParams(), 4)])
    assert target.free_slots() == cfg.target.max_slots
    out = _outputs(SpecEngine(target), _requests(SpecParams(enabled=False), n=4, prompts=PROMPTS[:1]))
    assert len(out[0]) == 4


def test_drafter_hot_swap_keeps_output_exact(cfg, target, tiny_drafter_dir, tmp_path):
    drafter = _drafter(cfg, target)
    engine = SpecEngine(target, drafter)
    base = _outputs(SpecEngine(target), _requests(SpecParams(enabled=False), n=24))
    assert _outputs(engine, _requests(SpecParams(gamma=4), n=24)) == base
    # a new drafter version of the same shapes: the old weights, perturbed
    shutil.copytree(tiny_drafter_dir, tmp_path / "v2")
    tensors = load_file(str(tmp_path / "v2" / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
               for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "v2" / "model.safetensors"))
    (tmp_path / "v2" / "specd_drafter.json").write_text(json.dumps({"version": "tiny-2"}))
    # swap in the middle of running requests: start them, step a little, swap, finish
    reqs = _requests(SpecParams(gamma=4), n=24, prefix="hs")
    seen = []

    def on_step(seq, emitted):
        seen.append(len(emitted))
        if len(seen) == 6:
            assert drafter.load_drafter(str(tmp_path / "v2")) == "tiny-2"

    out = [s.output for s in engine.generate(reqs, on_step=on_step, ignore_eos=True)]
    assert out == base
    assert drafter.version() == "tiny-2"


def test_two_batches_advanced_in_turn_decode_as_each_would_alone(cfg, target):
    """Batch: what generate() loops over, one step per advance(). Two on one engine in turn (the engine
    benchmark's step-paired baseline: speculative beside target-only) give each its own outputs, greedy
    and seeded sampling alike, and each its own time."""
    engine = SpecEngine(target, _drafter(cfg, target))
    sampled = SamplingParams(temperature=0.8, seed=5)
    alone = {
        "spec": _outputs(engine, _requests(SpecParams(gamma=3), n=12, prompts=PROMPTS[:3], prefix="a")),
        "off": _outputs(engine, _requests(SpecParams(enabled=False), sampled, n=12, prompts=PROMPTS[:3],
                                          prefix="b")),
    }
    spec = engine.batch(_requests(SpecParams(gamma=3), n=12, prompts=PROMPTS[:3], prefix="c"), max_running=3,
                        ignore_eos=True)
    off = engine.batch(_requests(SpecParams(enabled=False), sampled, n=12, prompts=PROMPTS[:3], prefix="d"),
                       max_running=3, ignore_eos=True)
    steps = 0
    while not (spec.finished and off.finished):
        for batch in (spec, off):
            if not batch.finished:
                batch.advance()
        steps += 1
    assert [s.output for s in spec.sequences()] == alone["spec"]
    assert [s.output for s in off.sequences()] == alone["off"]
    assert [s.request_id for s in spec.sequences()] == ["c0", "c1", "c2"]
    assert steps == 11 and spec.seconds > 0 and off.seconds > 0   # the prefill's token, then 11 steps
    assert not target.running                                    # every slot given back
