"""Drafter directory: round trip, checksum, atomic replacement, validation, loader compatibility."""

import json

import pytest
import torch
from tiny_configs import TARGET_CONFIG

from specd.drafter_trainer.distill import DrafterLM
from specd.drafter_trainer.drafter_format import (
    META_FILE,
    WEIGHTS_FILE,
    DrafterFormatError,
    load_drafter,
    load_drafter_meta,
    make_drafter_config,
    read_draft_vocab_ids,
    save_drafter,
    verify_checksum,
)
from tests.families import FAMILIES, write_family

HEAD_IDS = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34])


def _drafter(seed=0):
    torch.manual_seed(seed)
    config = make_drafter_config(TARGET_CONFIG, num_layers=2, head_vocab=HEAD_IDS.numel())
    return DrafterLM(config, HEAD_IDS), config


def _save(path, seed=0, meta=None, **kwargs):
    model, config = _drafter(seed)
    meta = {"target": "Tiny-Target", "train": {"steps": 3}} if meta is None else meta
    return model, save_drafter(path, model.state_dict(), config, meta, **kwargs)


def test_make_drafter_config_cuts_layers_unties_head_and_drops_quantization():
    config = make_drafter_config(TARGET_CONFIG, num_layers=2, head_vocab=8)
    assert config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 40  # the target's full vocabulary: the embedding is the target's
    assert config["tie_word_embeddings"] is False
    assert config["specd_draft_vocab_size"] == 8
    assert "quantization_config" not in config
    assert TARGET_CONFIG["num_hidden_layers"] == 6  # input untouched


def test_round_trip_keeps_tensors_config_and_metadata(tmp_path):
    tokenizer_dir = tmp_path / "target"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text("{}")
    model, out = _save(tmp_path / "drafter", tokenizer_dir=tokenizer_dir, version_prefix="boot")

    state, config, meta = load_drafter(out)
    assert state.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert state["draft_vocab_ids"].dtype == torch.int64
    assert config["num_hidden_layers"] == 2 and config["model_type"] == "llama"
    assert meta["version"] == f"boot-{meta['sha256'][:8]}"
    assert meta["parent_version"] is None
    assert meta["target"] == "Tiny-Target" and meta["train"] == {"steps": 3}
    assert meta["created"].startswith("20")
    assert load_drafter_meta(out) == meta
    assert verify_checksum(out)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert torch.equal(read_draft_vocab_ids(out), HEAD_IDS)
    assert torch.equal(DrafterLM.from_state_dict(config, state).lm_head.weight, model.lm_head.weight)


def test_caller_metadata_wins_except_for_the_checksum(tmp_path):
    meta = {"version": "online-7", "parent_version": "boot-1234", "sha256": "forged"}
    _, out = _save(tmp_path / "d", meta=meta)
    saved = load_drafter_meta(out)
    assert saved["version"] == "online-7" and saved["parent_version"] == "boot-1234"
    assert saved["sha256"] != "forged" and verify_checksum(out)


def test_checksum_mismatch_is_detected(tmp_path):
    _, out = _save(tmp_path / "d")
    weights = out / WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the last tensor's data
    weights.write_bytes(bytes(raw))
    assert not verify_checksum(out)
    with pytest.raises(DrafterFormatError, match="sha256"):
        load_drafter(out)
    load_drafter(out, verify=False)  # still parseable: only the checksum is wrong


def test_missing_metadata_is_not_a_drafter(tmp_path):
    _, out = _save(tmp_path / "d")
    (out / META_FILE).unlink()
    with pytest.raises(DrafterFormatError):
        load_drafter_meta(out)


def test_saving_again_replaces_the_directory_and_leaves_no_temporaries(tmp_path):
    _, out = _save(tmp_path / "d", seed=0)
    first = load_drafter_meta(out)["sha256"]
    (out / "stale.txt").write_text("from the old drafter")
    _, out = _save(tmp_path / "d", seed=1)
    assert load_drafter_meta(out)["sha256"] != first
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: s.pop("draft_vocab_ids"), "missing"),
        (lambda s: s.__setitem__("draft_vocab_ids", HEAD_IDS.int()), "int64"),
        (lambda s: s.__setitem__("draft_vocab_ids", torch.zeros(8, dtype=torch.long)), "duplicates"),
        (lambda s: s.__setitem__("draft_vocab_ids", HEAD_IDS + 10), "outside"),
        (lambda s: s.__setitem__("lm_head.weight", torch.zeros(9, 16)), "lm_head"),
        (lambda s: s.pop("model.layers.1.self_attn.q_proj.weight"), "layer 1"),
    ],
)
def test_invalid_tensors_are_refused_before_anything_is_written(tmp_path, corrupt, message):
    model, config = _drafter()
    state = dict(model.state_dict())
    corrupt(state)
    with pytest.raises(DrafterFormatError, match=message):
        save_drafter(tmp_path / "d", state, config, {})
    assert list(tmp_path.iterdir()) == []


def test_plain_torch_llama_loads_the_directory_and_agrees_with_the_trainer(tmp_path):
    from specd.workers.models.llama import Llama

    model, out = _save(tmp_path / "d")
    loaded = Llama.from_pretrained(out)
    tokens = torch.tensor([[1, 4, 9, 16, 25]])
    cache = loaded.make_cache(1, 16)
    logits = loaded(tokens, positions=torch.arange(5)[None], slots=[0], cache=cache, full_vocab=False)
    with torch.no_grad():
        expected = model.eval()(tokens)  # [1, 5, V_sub]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    full = loaded(tokens, positions=torch.arange(5)[None], slots=[0], cache=cache, full_vocab=True)
    outside = torch.ones(40, dtype=torch.bool)
    outside[HEAD_IDS] = False
    assert torch.isinf(full[..., outside]).all()  # q is exactly 0 outside draft_vocab_ids
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 40


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_drafter_cut_from_any_family_is_that_family_and_serves_as_it_trained(tmp_path, family):
    """init_student (the bootstrap's and the first start's quick drafter) from a sharded target of each
    family: the drafter keeps the family's switches, and the plain-torch loader reads what the trainer's
    transformers body computes."""
    from specd.drafter_trainer.bootstrap import init_student
    from specd.workers.models.config import ModelConfig
    from specd.workers.models.llama import Llama

    target = write_family(tmp_path / "target", family, max_shard_size="60KB")
    head_ids = torch.arange(0, 128, 2)
    student = init_student(target, 2, head_ids)
    out = save_drafter(tmp_path / "d", student.state_dict(), student.config, {})
    cfg = ModelConfig.from_dir(out)
    assert cfg.num_layers == 2 and cfg.model_type == ModelConfig.from_dir(target).model_type
    loaded = Llama.from_pretrained(out)
    tokens = torch.tensor([[(5 * i + 2) % 128 for i in range(20)]])   # longer than the sliding windows
    logits = loaded(tokens, torch.arange(20)[None], [0], loaded.make_cache(1, 32), full_vocab=False)
    with torch.no_grad():
        torch.testing.assert_close(logits, student.eval()(tokens), atol=2e-4, rtol=0)
