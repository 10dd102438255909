"""The vLLM proposer's planner follows vLLM's measured steps: the time between two propose() calls over the
same rows is priced as a verify of the drafts returned by the first (no vLLM engine is started)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from specd.configs import load_config
from specd.workers.engine.vllm_engine import proposer_settings
from specd.workers.engine.vllm_proposer import SpecdProposer
from tests.drafter_trainer.online_helpers import make_tiny_drafter


def test_a_step_between_two_calls_is_priced_and_a_prefill_step_is_not(tmp_path, tiny_llama_dir, monkeypatch):
    token_dir = make_tiny_drafter(tiny_llama_dir, tmp_path / "token")
    cfg = load_config([f"target.model_path={tiny_llama_dir}", f"drafter.path={token_dir}",
                       "drafter.kind=model", "drafter.dtype=float32", "drafter.pack=none",
                       "spec.policy=fixed", "spec.gamma=3", "spec.gamma_min=3", "target.max_seq_len=128"])
    settings = proposer_settings(cfg, tiny_llama_dir, max_running=2, swap_file=None)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=128),
                                  speculative_config=SimpleNamespace(num_speculative_tokens=3))
    proposer = SpecdProposer(vllm_config, settings)
    priced = []
    monkeypatch.setattr(proposer.planner.costs, "observe_verify",
                        lambda rows, seconds: priced.append((list(rows), seconds)))
    history = np.zeros((1, 128), dtype=np.int32)
    history[0, :6] = [5, 9, 11, 3, 7, 2]
    first = proposer.propose([[2]], np.array([6]), history)        # a new row: its prefill was this step
    assert priced == [] and len(first[0]) == 3
    history[0, 6:8] = [first[0][0], 4]
    proposer.propose([[first[0][0], 4]], np.array([8]), history)
    # the first call's row started (its prefill): the step after it is the first one priced next call
    assert priced == []
    history[0, 8] = 6
    proposer.propose([[6]], np.array([9]), history)
    assert [rows for rows, _ in priced] == [[4]] and priced[0][1] > 0     # 1 + 3 drafts of that row
    # a call with a mid-prefill row (no sampled tokens) is not one whole step of the same rows
    history2 = np.vstack([history, history])
    proposer.propose([[7], []], np.array([10, 4]), history2)
    assert len(priced) == 1
