"""Requests at the edges of the context: long targets, last tokens, neighbours that draft, trees at the end.

Each case was a failure before (a CacheFullError in the target or the drafter that failed the whole group).
"""

from __future__ import annotations

import pytest

from configs import load_config
from workers.core.sampling import SamplingParams
from workers.engine.draft_worker import DraftWorker
from workers.engine.spec_engine import SpecEngine
from workers.engine.target_worker import TargetWorker
from workers.engine.types import NewRequest, SpecParams

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
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "target.max_seq_len=512", "drafter.max_seq_len=256")
    assert (cfg.target.max_seq_len, cfg.drafter.max_seq_len) == (512, 256)
    with pytest.raises(ValueError, match="drafter.max_seq_len"):
        _config(tiny_target_dir, tiny_drafter_dir, "drafter.max_seq_len=0")
