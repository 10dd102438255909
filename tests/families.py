"""Tiny random checkpoints of each model family the torch backend serves, written by transformers' own
config and model classes (no hub): what a user's Llama 3.x, Mistral, Qwen2.5 or Qwen3 directory holds,
at 3 layers of hidden 64.

Each family turns on the options that set it apart, at sizes where they matter in a short test: a
sliding window of 8 positions (prompts here are longer), llama3 and yarn RoPE scaling whose original
context is shorter than the test's positions, biases, q/k norms, a head_dim that is not hidden / heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 128
WINDOW = 8

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=0, eos_token_id=1,
    # a wider init than the default 0.02: peaked logits, greedy choices not near-ties, varied continuations
    initializer_range=0.3,
)

FAMILIES = {
    # Llama 3.1/3.2 as shipped: llama3 RoPE scaling
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # yarn scaling (with its attention factor), q/k/v/o and MLP biases, an untied head
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    # Qwen2: q/k/v biases; layer 0 full attention, layers 1-2 windowed
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # Qwen3: q/k RMSNorm per head, head_dim 32 with 4 heads on hidden 64, rope theta 1e6
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1_000_000.0)),
    # Gemma 3 (text): layers 0-1 sliding with the local RoPE base, layer 2 global with linear scaling;
    # 1 + weight norms around attention and MLP, sqrt(hidden)-scaled embeddings, GELU-tanh, q/k norms
    # (transformers' own init range: with 0.3 its sqrt(hidden)-scaled embeddings repeat one token)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        initializer_range=0.02, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
}


def write_family(path: Path, family: str, num_layers: int = 3, seed: int = 0,
                 dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, **overrides) -> Path:
    """A random checkpoint of `family` saved as transformers saves it (config.json + safetensors);
    `overrides` replace config fields (vocab_size, ...)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    fields = {**COMMON, **extra, "num_hidden_layers": num_layers, **overrides}
    if "layer_types" in fields:   # a shallower drafter keeps the first layers' kinds
        fields["layer_types"] = fields["layer_types"][:num_layers]
    cfg = getattr(transformers, config_cls)(**fields)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)   # the init zeroes them; a zero bias would test nothing
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return Path(path)


def reference(path: Path):
    """transformers' own model of a checkpoint, float32, eager attention: what logits must equal."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def mark_drafter(path: Path, version: str) -> Path:
    """Give a checkpoint the metadata file a drafter directory carries."""
    (Path(path) / "specd_drafter.json").write_text(json.dumps({"version": version}))
    return Path(path)
