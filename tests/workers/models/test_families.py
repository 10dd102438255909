"""Every family the torch backend takes, against transformers' own model of the same checkpoint: logits at
prefill and over 32 decode steps (eager and static decode), batched rows of different lengths, rollback,
sharded and bfloat16 checkpoints; and a family it does not take, refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from specd.workers.models.config import ModelConfig, UnsupportedModelError
from specd.workers.models.llama import Llama
from specd.workers.models.runner import ModelRunner
from tests.families import FAMILIES, VOCAB, WINDOW, reference, write_family

ATOL = 2e-4
PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]   # 40 tokens: five sliding windows long
STEPS = 32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = write_family(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, reference(path)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _greedy_continuation(hf, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
    return ids


def test_the_config_reads_each_familys_switches(family):
    name, path, _ = family
    cfg = ModelConfig.from_dir(path)
    families = {"llama3": "llama", "llama-yarn": "llama", "gemma3": "gemma3_text"}
    assert cfg.model_type == families.get(name, name)
    expected = {
        "llama3": dict(rope_type="llama3"),
        "llama-yarn": dict(rope_type="yarn", qkv_bias=True, o_bias=True, mlp_bias=True),
        "mistral": dict(sliding_window=WINDOW, has_sliding_layers=True),
        "qwen2": dict(qkv_bias=True, o_bias=False, sliding_window=WINDOW),
        "qwen3": dict(qk_norm=True, head_dim=32),
        "gemma3": dict(norm_offset=True, sandwich_norms=True, activation="gelu_tanh", qk_norm=True,
                       local_rope_theta=10000.0, embed_scale=8.0, attn_scale=24 ** -0.5,
                       sliding_window=WINDOW),
    }[name]
    assert {k: getattr(cfg, k) for k in expected} == expected
    if name == "qwen2":
        assert [cfg.is_sliding(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_prefill_and_32_decode_steps_match_transformers(family, decode):
    """The prompt in one prefill, then one token a step (the sliding window moves every step): each step's
    logits equal transformers' full forward over the same tokens."""
    _, path, hf = family
    ids = _greedy_continuation(hf, PROMPT, STEPS)
    reference_logits = _hf_logits(hf, ids)   # [40 + 32, vocab]
    runner = ModelRunner(path, max_slots=2, max_seq_len=128, decode=decode)
    slot = runner.allocate()
    last = runner.prefill([slot], [PROMPT])[0]
    torch.testing.assert_close(last, reference_logits[len(PROMPT) - 1], atol=ATOL, rtol=0)
    for i in range(len(PROMPT), len(ids)):
        step = runner.extend([slot], [[ids[i]]])[0, 0]
        torch.testing.assert_close(step, reference_logits[i], atol=ATOL, rtol=0)
    # the model is not degenerate: its greedy continuation is not one token repeated
    assert len(set(ids[len(PROMPT):])) > 3


def test_batched_rows_of_different_lengths_and_a_rollback_match_transformers(family):
    _, path, hf = family
    runner = ModelRunner(path, max_slots=3, max_seq_len=128)
    prompts = [PROMPT, PROMPT[:11], PROMPT[5:30]]
    slots = [runner.allocate() for _ in prompts]
    runner.prefill(slots, prompts)
    out = runner.extend(slots, [[4, 5, 6], [9], [10, 11]])   # ragged: padding skipped
    for row, (prompt, new) in enumerate(zip(prompts, [[4, 5, 6], [9], [10, 11]], strict=True)):
        expected = _hf_logits(hf, prompt + new)[-len(new):]
        torch.testing.assert_close(out[row, : len(new)], expected, atol=ATOL, rtol=0)
    runner.rollback(slots[0], len(PROMPT) + 1)            # drafts 5 and 6 rejected
    again = runner.extend([slots[0]], [[20, 21]])[0]
    torch.testing.assert_close(again, _hf_logits(hf, PROMPT + [4, 20, 21])[-2:], atol=ATOL, rtol=0)


def test_a_sharded_bfloat16_checkpoint_loads_as_transformers_reads_it(tmp_path):
    path = write_family(tmp_path / "qwen2", "qwen2", dtype=torch.bfloat16, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = reference(path)
    model = Llama.from_pretrained(path)
    cache = model.make_cache(1, 64)
    with torch.inference_mode():
        ours = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], [0], cache)[0]
    torch.testing.assert_close(ours, _hf_logits(hf, PROMPT), atol=ATOL, rtol=0)


@pytest.mark.parametrize("config,named", [
    ({"model_type": "gemma2"}, "'gemma2'"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}, "'longrope'"),
])
def test_what_the_decoder_cannot_do_is_refused_by_name(config, named):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    base["num_attention_heads"] = 2
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf({**base, **config})


def test_each_target_keeps_its_drafters_in_its_own_cache(tmp_path):
    """A drafter built or learned for one target is never found when serving another: the default target
    keeps the cache's top level, a target.model_path gets <cache>/targets/<name>-<digest>."""
    from specd.workers.models.loader import scoped_cache_dir

    qwen = write_family(tmp_path / "models" / "qwen3", "qwen3")
    mistral = write_family(tmp_path / "models" / "mistral", "mistral")
    cache = str(tmp_path / "cache")
    assert scoped_cache_dir(cache, None, "/anything") == cache
    scoped = {scoped_cache_dir(cache, str(d), d) for d in (qwen, mistral)}
    assert len(scoped) == 2 and all(s.startswith(f"{cache}/targets/") for s in scoped)
    once = scoped_cache_dir(cache, str(qwen), qwen)
    assert scoped_cache_dir(once, str(qwen), qwen) == once       # a trainer given the router's config
