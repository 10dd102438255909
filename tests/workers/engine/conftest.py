"""Tiny random Llama target and drafter directories, in the formats the real ones use.

Random weights are enough here: losslessness must hold for any drafter, so a bad one exercises the
rejection, recovered-token and rollback paths far more than a good one would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def _write_llama(path: Path, layers: int, seed: int, head_ids: torch.Tensor | None = None) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=head_ids is None, eos_token_id=1, bos_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Sharper logits than the default init, so greedy choices are far from ties and sampling is peaked.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if head_ids is not None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][head_ids].clone()
        tensors["draft_vocab_ids"] = head_ids.to(torch.int64)
    elif "lm_head.weight" in tensors:
        del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    cfg.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return _write_llama(tmp_path_factory.mktemp("tiny_target"), layers=2, seed=0)


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory) -> Path:
    """One layer and a reduced head over 3/4 of the vocabulary: q is zero on the rest."""
    head_ids = torch.arange(0, VOCAB, dtype=torch.int64)[torch.arange(VOCAB) % 4 != 3]
    path = _write_llama(tmp_path_factory.mktemp("tiny_drafter"), layers=1, seed=1, head_ids=head_ids)
    (path / "specd_drafter.json").write_text(json.dumps({"version": "tiny-1"}))
    return path
