"""The model drafter as a plain Llama checkpoint (workers/drafters/native_export.py): the reduced head
scattered into the full vocabulary, the same logits on the drafter's ids, hidden-state drafters refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specd.workers.drafters.native_export import (
    check_same_shapes,
    export_native_dir,
    full_vocab_tensors,
    tensor_shapes,
)
from specd.workers.drafters.versions import VersionError
from tests.drafter_trainer.online_helpers import make_tiny_drafter


def test_reduced_head_rows_land_on_their_target_ids():
    head = torch.tensor([[1.0, 2.0], [3.0, 4.0]])                 # [V_sub=2, hidden=2]
    tensors = {"model.embed_tokens.weight": torch.zeros(5, 2), "lm_head.weight": head,
               "draft_vocab_ids": torch.tensor([3, 0])}
    out = full_vocab_tensors(tensors)
    assert "draft_vocab_ids" not in out
    assert out["lm_head.weight"].tolist() == [[3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]
    assert out["model.embed_tokens.weight"] is tensors["model.embed_tokens.weight"]


def test_full_heads_pass_and_bad_heads_are_refused():
    full = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2)}
    assert full_vocab_tensors(full)["lm_head.weight"].shape == (4, 2)
    tied = full_vocab_tensors({"model.embed_tokens.weight": torch.ones(4, 2)})
    assert torch.equal(tied["lm_head.weight"], torch.ones(4, 2))
    with pytest.raises(ValueError, match="does not index"):
        bad_ids = {**full, "lm_head.weight": torch.ones(2, 2), "draft_vocab_ids": torch.tensor([1, 9])}
        full_vocab_tensors(bad_ids)
    with pytest.raises(ValueError, match="hidden states"):
        full_vocab_tensors({**full, "model.feature_proj.weight": torch.ones(2, 4)})


def test_exported_checkpoint_scores_the_drafters_ids_as_the_drafter_does(tmp_path, tiny_llama_dir):
    from transformers import LlamaForCausalLM

    from specd.workers.models.runner import ModelRunner

    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    out = export_native_dir(drafter, tmp_path / "native")
    config = json.loads((out / "config.json").read_text())
    assert "specd_draft_vocab_size" not in config and not config["tie_word_embeddings"]
    assert (out / "tokenizer.json").exists() == (drafter / "tokenizer.json").exists()
    native = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = load_file(str(drafter / "model.safetensors"))["draft_vocab_ids"].long()

    runner = ModelRunner(drafter, max_slots=1, max_seq_len=64)
    prompt = [5, 9, 11, 3, 7, 2, 13]
    slot = runner.allocate()
    ours = runner.prefill([slot], [prompt])[0]                  # [V]: -inf outside the head's ids
    with torch.no_grad():
        theirs = native(torch.tensor([prompt])).logits[0, -1]   # [V]
    assert ours.shape == theirs.shape and ids.numel() < theirs.shape[-1]
    torch.testing.assert_close(theirs[ids], ours[ids].float(), rtol=1e-4, atol=1e-4)
    outside = torch.ones(theirs.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.all(torch.isneginf(ours[outside]))
    assert torch.all(theirs[outside] == 0)


def test_versions_must_match_the_served_names_and_shapes(tmp_path, tiny_llama_dir):
    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    reference = tensor_shapes(drafter / "model.safetensors")
    tensors = load_file(str(drafter / "model.safetensors"))
    check_same_shapes(reference, tensors)
    with pytest.raises(VersionError, match="shape"):
        check_same_shapes(reference, {**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1]})
    with pytest.raises(VersionError, match="missing"):
        check_same_shapes(reference, {k: v for k, v in tensors.items() if k != "model.norm.weight"})
