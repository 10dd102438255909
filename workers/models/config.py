"""ModelConfig: a decoder described by a few switches, read from a Hugging Face config.json.

One decoder serves the families below, as gpt-fast and vLLM describe a model by its options rather
than a file per family. What a family's config.json asks for and the decoder cannot do is refused
with one line naming it, never loaded as a silently different model.

| family (model_type) | what differs from Llama                                   |
|---------------------|-----------------------------------------------------------|
| llama               | optional q/k/v/o and MLP biases; rope scaling             |
| mistral             | sliding-window attention on every layer (when set)        |
| qwen2               | q/k/v biases; sliding windows on the layers it names      |
| qwen3               | RMSNorm of each head's q and k; optional attention biases |
| gemma3_text         | Gemma 3 (text): norms as 1 + weight, around attention and |
|                     | MLP both; scaled embeddings; GELU-tanh; q/k norms; sliding |
|                     | layers with their own RoPE base; query_pre_attn_scalar     |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}   # config.json's name -> the MLP's
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModelError(ValueError):
    """The checkpoint's family or one of its options is not one the decoder implements."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "llama"
    qkv_bias: bool = False       # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False         # the output projection carries one (Llama's attention_bias)
    mlp_bias: bool = False       # gate/up/down carry one (Llama's mlp_bias)
    qk_norm: bool = False        # RMSNorm over head_dim of each q and k head before RoPE (Qwen3)
    sliding_window: int | None = None  # keys further back than this many positions are not attended
    layer_types: list[str] = field(default_factory=list)  # FULL or SLIDING per layer
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    # sliding layers' own RoPE (Gemma 3: base 10k locally, 1M globally); None: the one above for all
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    activation: str = "silu"     # the MLP's gate activation: silu, or gelu_tanh (Gemma)
    norm_offset: bool = False    # RMSNorm scales by 1 + weight (Gemma); stored as such when loaded
    sandwich_norms: bool = False  # attention and MLP outputs normed before their residual add (Gemma)
    embed_scale: float = 1.0     # token embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and self.layer_types[layer] == SLIDING

    def local_rope(self, layer: int) -> bool:
        """Whether the layer rotates by the sliding layers' own RoPE (Gemma 3's local base)."""
        return self.local_rope_theta is not None and self.layer_types[layer] == SLIDING

    @cached_property
    def has_sliding_layers(self) -> bool:
        """Read by every forward: computed once (the config does not change after loading)."""
        return any(self.is_sliding(i) for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        family = hf.get("model_type", "llama")
        if family not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {family!r} is not supported by the torch backend (supported: "
                f"{', '.join(FAMILIES)}); target.backend=vllm serves it without specd's model drafters")
        gemma = family == "gemma3_text"
        act_key = "hidden_activation" if gemma else "hidden_act"
        for key, allowed in ((act_key, tuple(ACTIVATIONS)), ("partial_rotary_factor", (None, 1.0)),
                             ("attn_logit_softcapping", (None,)), ("final_logit_softcapping", (None,)),
                             ("use_bidirectional_attention", (False, None))):
            if hf.get(key, allowed[0]) not in allowed:
                raise UnsupportedModelError(f"{family}: {key}={hf[key]!r} is not supported (only {allowed})")
        rope, local = _rope(family, hf)
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        bias = bool(hf.get("attention_bias", False))
        window, layer_types = _sliding(family, hf, num_layers)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=(head_dim := hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            model_type=family,
            qkv_bias=family == "qwen2" or bias,
            o_bias=family in ("llama", "qwen3", "gemma3_text") and bias,
            mlp_bias=family == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3_text"),
            sliding_window=window,
            layer_types=layer_types,
            rope_scaling=_scaling(rope),
            local_rope_theta=None if local is None else local.get("rope_theta", 10000.0),
            local_rope_scaling=_scaling(local or {}),
            activation=ACTIVATIONS[hf.get(act_key, "silu")],
            norm_offset=gemma,
            sandwich_norms=gemma,
            embed_scale=float(hf["hidden_size"]) ** 0.5 if gemma else 1.0,
            attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def _rope(family: str, hf: dict) -> tuple[dict, dict | None]:
    """(full layers' RoPE, sliding layers' own or None), each {rope_type, rope_theta?, scaling fields}.
    transformers 5 writes Gemma 3's as rope_parameters keyed by layer type; 4.x wrote rope_theta,
    rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    local = None
    if isinstance(params, dict) and FULL in params:
        full, local = dict(params[FULL] or {}), params.get(SLIDING)
        local = None if local is None else dict(local)
    else:
        full = dict(params or hf.get("rope_scaling") or {})
        if family == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    for rope in (full, local or {}):
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        if rope["rope_type"] not in ROPE_TYPES:
            raise UnsupportedModelError(f"{family}: RoPE type {rope['rope_type']!r} is not supported "
                                        f"(supported: {', '.join(ROPE_TYPES)})")
    return full, local


def _scaling(rope: dict) -> dict:
    """A rope dict's scaling part; empty for the default frequencies."""
    return {} if rope.get("rope_type", "default") == "default" else rope


def _sliding(family: str, hf: dict, num_layers: int) -> tuple[int | None, list[str]]:
    """The sliding window and which layers use it, as each family's transformers class decides:
    Mistral windows every layer when sliding_window is set; Qwen2/Qwen3 only with use_sliding_window,
    on the layers config.json's layer_types names (or from max_window_layers on)."""
    window = hf.get("sliding_window")
    if family == "gemma3_text":   # every sliding_window_pattern-th layer global, unless layer_types says
        # (the layer types also pick each layer's RoPE, so they are kept even without a window)
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        layer_types = hf.get("layer_types") or [
            FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    elif family == "llama" or window is None:
        return None, [FULL] * num_layers
    elif family == "mistral":
        return int(window), [SLIDING] * num_layers
    elif not hf.get("use_sliding_window", False):
        return None, [FULL] * num_layers
    else:
        layer_types = hf.get("layer_types") or [
            SLIDING if i >= hf.get("max_window_layers", num_layers) else FULL for i in range(num_layers)]
    unknown = set(layer_types) - {FULL, SLIDING}
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(f"{family}: layer_types {sorted(unknown) or layer_types} not understood")
    return (None if window is None else int(window)), list(layer_types)
