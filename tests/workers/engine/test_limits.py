"""Requests at the edges of the context: long targets, last tokens, neighbours that draft, trees at the end.

Each case was a failure before (a CacheFullError in the target or the drafter that failed the whole group).
"""

from __future__ import annotations

import pytest
import torch

from specd.configs import load_config
from specd.workers.core.kv_cache import CacheFullError
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.runner import ModelRunner

GREEDY = SamplingParams()


def _config(tiny_target_dir, tiny_drafter_dir, *extra):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.pack=none",
        "target.max_slots=4", "drafter.max_slots=4", *extra,
    ])


def test_drafter_context_follows_a_target_longer_than_2048(tiny_target_dir, tiny_drafter_dir):
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "target.max_seq_len=2304")
    assert cfg.drafter.max_seq_len == 2304
    target = TargetWorker(cfg.target)
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    prompt = [(7 * i) % 90 + 2 for i in range(2200)]
    reqs = [NewRequest("long", prompt, GREEDY, 16, SpecParams(gamma=3))]
    [seq] = SpecEngine(target, drafter).generate(reqs, ignore_eos=True)
    [base] = SpecEngine(target).generate(
        [NewRequest("base", prompt, GREEDY, 16, SpecParams(enabled=False))], ignore_eos=True
    )
    assert seq.output == base.output and len(seq.output) == 16
    assert seq.stats.drafted > 0


def test_an_explicit_drafter_context_is_kept(tiny_target_dir, tiny_drafter_dir):
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "target.max_seq_len=512", "drafter.max_seq_len=1024")
    assert (cfg.target.max_seq_len, cfg.drafter.max_seq_len) == (512, 1024)
    with pytest.raises(ValueError, match="drafter.max_seq_len"):
        _config(tiny_target_dir, tiny_drafter_dir, "drafter.max_seq_len=256")


def _target_only(target, prompt, n):
    [seq] = SpecEngine(target).generate(
        [NewRequest("base", prompt, GREEDY, n, SpecParams(enabled=False))], ignore_eos=True
    )
    return seq.output


@pytest.fixture(scope="module")
def short_cfg(tiny_target_dir, tiny_drafter_dir):
    return _config(tiny_target_dir, tiny_drafter_dir, "target.max_seq_len=64")


@pytest.fixture(scope="module")
def short_target(short_cfg):
    return TargetWorker(short_cfg.target)


LONG = [(5 * i) % 90 + 2 for i in range(50)]   # 50 + 14 new tokens = max_seq_len 64 exactly
SHORT = [5, 9, 13, 2]


@pytest.mark.parametrize("neighbour", [SpecParams(gamma=3), SpecParams(gamma=3, tree_width=3)])
@pytest.mark.parametrize("last", [SpecParams(gamma=3), SpecParams(enabled=False)])
def test_last_tokens_beside_a_drafting_neighbour(short_cfg, short_target, neighbour, last):
    drafter = DraftWorker(short_cfg.drafter, short_cfg.spec, str(short_target.model_dir))
    reqs = [NewRequest("last", LONG, GREEDY, 14, last), NewRequest("next", SHORT, GREEDY, 60, neighbour)]
    seqs = SpecEngine(short_target, drafter).generate(reqs, ignore_eos=True)
    assert seqs[0].output == _target_only(short_target, LONG, 14)
    assert seqs[1].output == _target_only(short_target, SHORT, 60)
    assert short_target.free_slots() == short_cfg.target.max_slots


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, seed=3)])
def test_a_tree_alone_at_the_end_of_the_context(short_cfg, short_target, sampling):
    drafter = DraftWorker(short_cfg.drafter, short_cfg.spec, str(short_target.model_dir))
    req = NewRequest("tree", LONG, sampling, 14, SpecParams(gamma=4, tree_width=3))
    [seq] = SpecEngine(short_target, drafter).generate([req], ignore_eos=True)
    assert len(seq.output) == 14 and seq.stats.drafted > 0
    if sampling.is_greedy:
        assert seq.output == _target_only(short_target, LONG, 14)


def test_a_longer_drafter_context_is_trimmed_to_the_target(tiny_target_dir, tiny_drafter_dir, short_target):
    # The drafter plans trees for 128 positions; the target keeps the nodes its 64 can hold.
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "target.max_seq_len=64", "drafter.max_seq_len=128")
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(short_target.model_dir))
    req = NewRequest("trimmed", LONG, GREEDY, 14, SpecParams(gamma=4, tree_width=3))
    [seq] = SpecEngine(short_target, drafter).generate([req], ignore_eos=True)
    assert seq.output == _target_only(short_target, LONG, 14)


def test_runner_splits_a_batch_whose_padding_would_pass_a_slot_end(tiny_target_dir):
    runner = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=16, pack_weights=False)
    full, empty, alone = runner.allocate(), runner.allocate(), runner.allocate()
    runner.prefill([full, alone], [list(range(2, 16)), list(range(2, 16))])   # 14 of 16 positions
    logits, hidden = runner.extend([full, empty], [[20], [3, 4, 5, 6]], return_hidden=True)
    assert logits.shape[:2] == (2, 4) and hidden.shape[:2] == (2, 4)
    assert runner.length(full) == 15 and runner.length(empty) == 4
    assert torch.allclose(logits[0, 0], runner.extend([alone], [[20]])[0, 0], atol=1e-5)
    trees = runner.extend_trees([full, empty], [[21], [7, 8, 9]], [[-1], [-1, 0, 0]])
    assert trees.shape[:2] == (2, 3) and runner.length(full) == 16
    with pytest.raises(CacheFullError):
        runner.extend([full, empty], [[1], [2]])  # the full slot's own token does not fit
