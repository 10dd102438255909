"""RoPE tables: the default frequencies and the scalings checkpoints ship with (linear, llama3, yarn).

Each returns a [max_pos, head_dim // 2] complex table e^{i * pos * inv_freq_j}, times yarn's attention
factor where it has one (transformers multiplies cos and sin by it, so q and k both carry it once).
The formulas are transformers' (modeling_rope_utils), computed in float64 here; tests compare logits
against transformers for every type.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int,
                    ) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim // 2] float64, attention factor) for a rope_scaling dict (empty: default)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    raise NotImplementedError(f"RoPE type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_position_embeddings: int,
          ) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    extrapolate = 1 - ramp   # 1: keep the original frequency, 0: interpolate it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def rope_table(head_dim: int, theta: float, max_pos: int, device=None, scaling: dict[str, Any] | None = None,
               max_position_embeddings: int | None = None) -> torch.Tensor:
    """[max_pos, head_dim // 2] complex64: attention_factor * e^{i * pos * inv_freq}."""
    device = torch.device("cpu") if device is None else device
    inv_freq, attention = inv_frequencies(head_dim, theta, scaling or {}, max_position_embeddings or max_pos)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    table = torch.polar(torch.full_like(angles, attention), angles)
    return table.to(device=device, dtype=torch.complex64)
