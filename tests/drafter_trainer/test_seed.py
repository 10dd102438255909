"""The seed drafter (drafter_trainer/seed.py) on the real target: both forms load as serving drafters,
the hidden one drafts exactly what the token one does (its projection is zero), and the held-out figure
the planner reads is the measured greedy match."""

from __future__ import annotations

import json

import torch

from specd.drafter_trainer.seed import build_seed_drafter
from specd.workers.drafters.versions import held_out_acceptance


def test_seed_drafter_is_measured_and_loads(real_target_dir, tmp_path) -> None:
    from specd.workers.drafters.model import ModelDrafter

    token_dir, hidden_dir = build_seed_drafter(real_target_dir, tmp_path / "seed", tmp_path / "seed-hidden",
                                               eval_prompts=2, eval_tokens=8)
    meta = json.loads((hidden_dir / "specd_drafter.json").read_text())
    stats = meta["train"]["eval_after"]
    assert stats["labelled"] == 16 and meta["train"]["steps"] == 0
    assert held_out_acceptance(meta) == stats["greedy_match"]
    assert 0.0 <= stats["greedy_match"] <= stats["head_coverage"] <= 1.0
    assert meta["parent_version"] == json.loads((token_dir / "specd_drafter.json").read_text())["version"]

    token = ModelDrafter(str(token_dir), max_slots=1)
    hidden = ModelDrafter(str(hidden_dir), max_slots=1)
    assert hidden.uses_target_hidden and not token.uses_target_hidden
    prompt = [1, 9690, 198, 2683, 359, 253]
    torch.manual_seed(0)
    width = hidden.hidden_size
    token.add_request("r", prompt)
    hidden.add_request("r", prompt, hidden=torch.randn(len(prompt) - 1, width))
    from specd.workers.core.sampling import SamplingParams

    greedy = [SamplingParams()]
    assert token.propose(["r"], [3], greedy).tokens == hidden.propose(["r"], [3], greedy).tokens
