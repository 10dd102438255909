"""The vLLM proposer follows published drafter versions: a version published to the store it watches is
applied between two propose() calls, and drafting goes on across the swap (no vLLM engine is started)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import torch

from specd.configs import load_config
from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.publish import VersionStore
from specd.workers.drafters.versions import target_checksum
from specd.workers.engine.vllm_engine import proposer_settings
from specd.workers.engine.vllm_proposer import SpecdProposer
from tests.drafter_trainer.online_helpers import make_tiny_drafter


def test_published_version_drafts_after_a_swap(tmp_path, tiny_llama_dir):
    token_dir = make_tiny_drafter(tiny_llama_dir, tmp_path / "token")
    store = VersionStore(tmp_path / "store")
    cfg = load_config([f"target.model_path={tiny_llama_dir}", f"drafter.path={token_dir}",
                       "drafter.kind=model", "drafter.dtype=float32", "drafter.pack=none",
                       "spec.policy=fixed", "spec.gamma=3",
                       "spec.gamma_min=3", "target.max_seq_len=128"])
    settings = proposer_settings(cfg, tiny_llama_dir, max_running=2, swap_file=None, versions=str(store.root))
    settings.versions_poll_s = 3600.0          # checked by hand below
    status = tmp_path / "status.json"           # what a proposer in vLLM's own process tells the engine
    settings.status_file = str(status)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=128),
                                  speculative_config=SimpleNamespace(num_speculative_tokens=3))
    proposer = SpecdProposer(vllm_config, settings)
    swapper = proposer.worker._swapper
    swapper.stop()
    start = proposer.worker.version()

    history = np.zeros((1, 128), dtype=np.int32)
    history[0, :6] = [5, 9, 11, 3, 7, 2]
    first = proposer.propose([[2]], np.array([6]), history)
    assert len(first[0]) == 3
    assert json.loads(status.read_text()) == {"version": start, "swaps": 0, "rejected": {}}

    state, config, _ = load_drafter(token_dir)
    torch.manual_seed(0)
    state = {k: (v + torch.randn_like(v) * 0.5 if v.is_floating_point() else v) for k, v in state.items()}
    checksum = target_checksum(tiny_llama_dir)
    new = store.publish(state, config, version=None, parent=None, target_checksum=checksum)
    assert swapper.check() == new and proposer.worker.version() == start     # parked until the next call

    history[0, 6] = first[0][0]
    history[0, 7] = 4                           # one draft accepted, then the target's own token
    second = proposer.propose([[first[0][0], 4]], np.array([8]), history)
    assert proposer.worker.version() == new != start
    assert len(second[0]) == 3                  # the same request kept drafting across the swap
    assert json.loads(status.read_text()) == {"version": new, "swaps": 1, "rejected": {}}
