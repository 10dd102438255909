"""A plain-torch Llama that reads Hugging Face safetensors directly and runs on a KVCache.

Serves both the target and drafters: a drafter directory is the same format with fewer layers
and, optionally, a reduced-vocabulary head (`draft_vocab_ids` [V_sub] beside `lm_head.weight`
[V_sub, hidden]); its logits come back scattered into the full vocabulary with -inf elsewhere,
so q is exactly 0 outside the subset.

Speed notes (2-core CPU, every token reads all weights): q/k/v and gate/up are fused into one
matmul each, RoPE tables are precomputed, the attention mask is built once per forward and shared
by all layers, the cache is read as a view (see KVCache.read), and the 49152-wide head runs only
on the positions asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from workers.core.kv_cache import KVCache

DRAFT_VOCAB_IDS = "draft_vocab_ids"


@dataclass
class LlamaConfig:
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

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """Read a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"RoPE type {rope_type!r} is not supported (only 'default')")
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"{model_dir}: model_type {hf.get('model_type')!r} is not llama")
        return cls.from_hf(hf)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like transformers: normalise in float32 whatever the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        # One matmul for q, k and v: the weights are read once, and one kernel call instead of three.
        self.wqkv = nn.Parameter(torch.empty(sum(self.split), cfg.hidden_size))
        self.wo = nn.Parameter(torch.empty(cfg.hidden_size, q_size))

    def forward(
        self,
        x: torch.Tensor,  # [b, n, hidden]
        cos: torch.Tensor,  # [b, 1, n, head_dim]
        sin: torch.Tensor,  # [b, 1, n, head_dim]
        mask: torch.Tensor | None,  # [b, 1, n, L] bool, True = attend; None = attend to all L
        cache: KVCache,
        layer: int,
        plan: _BatchPlan,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = F.linear(x, self.wqkv).split(self.split, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [b, heads, n, d]
        k = k.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, kv_heads, n, d]
        v = v.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.write_runs(layer, plan.slots, plan.starts, k, v)
        keys, values = cache.read(layer, plan.slots, plan.kv_len)  # [b, kv_heads, L, d]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(b, n, -1), self.wo)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size))
        self.w_down = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w_gate_up).split(self.intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, plan):
        x = x + self.attn(self.input_layernorm(x), cos, sin, mask, cache, layer, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _BatchPlan:
    """How one forward addresses the cache; computed once, shared by all layers."""

    slots: list[int]
    starts: list[int]  # storage position of each row's first new token (= its committed length)
    kv_len: int  # keys attended: max(starts) + n


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, draft_vocab_size: int | None = None, max_seq_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if draft_vocab_size is not None:
            # Reduced head: row r scores target token draft_vocab_ids[r].
            self.lm_head = nn.Parameter(torch.empty(draft_vocab_size, cfg.hidden_size))
            self.register_buffer(DRAFT_VOCAB_IDS, torch.zeros(draft_vocab_size, dtype=torch.long))
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
            self.draft_vocab_ids = None
        else:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.draft_vocab_ids = None
        self._build_rope(max_seq_len or cfg.max_position_embeddings)

    @property
    def head_size(self) -> int:
        """Number of logits the head computes (V_sub for a reduced-vocabulary drafter)."""
        return self.lm_head.shape[0]

    def _build_rope(self, max_pos: int) -> None:
        d = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, d], transformers' half-split layout
        self.register_buffer("rope_cos", emb.cos().float(), persistent=False)
        self.register_buffer("rope_sin", emb.sin().float(), persistent=False)

    def make_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        w = self.embed_tokens
        return KVCache(
            self.cfg.num_layers, num_slots, max_seq_len, self.cfg.num_kv_heads, self.cfg.head_dim, w.dtype, w.device
        )

    # ---- forward ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [b, n]
        positions: torch.Tensor,  # [b, n] RoPE positions (length + depth for a tree)
        slots: torch.Tensor | list[int],  # [b]
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # [b, n, n] bool among the new tokens; None = causal
        logit_index: torch.Tensor | None = None,  # [b, m] which of the n positions get logits
        full_vocab: bool = True,
    ) -> torch.Tensor:
        """Logits [b, m or n, vocab] for the new tokens; their K/V land in the cache.

        Row i's new tokens are stored at cache positions lengths[slot_i] + 0..n-1 (storage order,
        independent of `positions`, so tree siblings of equal depth do not collide) and attend to
        the committed cache[:lengths[slot_i]] plus the new tokens allowed by `attn_mask`.
        cache.lengths is NOT changed here: the caller commits (ModelRunner does).
        Rows with fewer real tokens are right-padded; their padded outputs are garbage, and no real
        token attends to them under a causal mask.
        With a reduced head and full_vocab=False the logits are [.., V_sub] in draft_vocab_ids order.
        """
        b, n = input_ids.shape
        slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        starts = cache.lengths[slot_list].tolist()
        cache.check_capacity(starts, n)
        plan = _BatchPlan(slot_list, starts, max(starts) + n)
        mask = self._attention_mask(starts, n, plan.kv_len, attn_mask, input_ids.device)

        positions = positions.to(self.rope_cos.device)
        cos = self.rope_cos[positions].unsqueeze(1)  # [b, 1, n, d]
        sin = self.rope_sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed_tokens)  # [b, n, hidden]
        for layer, block in enumerate(self.layers):
            x = block(x, cos, sin, mask, cache, layer, plan)
        if logit_index is not None:
            x = x.gather(1, logit_index[:, :, None].expand(-1, -1, x.shape[-1]))  # [b, m, hidden]
        return self._head(self.norm(x), full_vocab)

    def _head(self, x: torch.Tensor, full_vocab: bool) -> torch.Tensor:
        logits = F.linear(x, self.lm_head)  # [b, m, head_size]
        if self.draft_vocab_ids is None or not full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        full[..., self.draft_vocab_ids] = logits
        return full

    @staticmethod
    def _attention_mask(
        starts: list[int], n: int, kv_len: int, tree: torch.Tensor | None, device
    ) -> torch.Tensor | None:
        """[b, 1, n, kv_len] bool: committed prefix of each row + allowed new tokens."""
        b = len(starts)
        if tree is None and n == 1 and b == 1:
            return None  # one token sees the whole prefix and itself: no mask, faster kernel
        start = torch.tensor(starts, device=device)[:, None, None]  # [b, 1, 1]
        key = torch.arange(kv_len, device=device)[None, None, :]  # [1, 1, L]
        if tree is None:
            # Key k is visible to new token j of row i iff k <= starts[i] + j (prefix + causal).
            mask = key <= start + torch.arange(n, device=device)[None, :, None]
        else:
            mask = (key < start).expand(b, n, kv_len).clone()
            for i, s in enumerate(starts):
                mask[i, :, s : s + n] = tree[i]
        return mask[:, None]

    # ---- weights ----------------------------------------------------------------------------

    def _hf_targets(self, name: str) -> tuple[torch.Tensor, slice | None] | None:
        """The parameter (and row slice of a fused one) a Hugging Face tensor name maps to."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm.weight, None
        if name == "lm_head.weight":
            # A tied checkpoint may still carry a copy; the embedding is the one that counts.
            return None if self.lm_head is self.embed_tokens else (self.lm_head, None)
        if name == DRAFT_VOCAB_IDS:
            return (self.draft_vocab_ids, None) if self.draft_vocab_ids is not None else None
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5:
            return None
        block = self.layers[int(parts[2])]
        q, kv = block.attn.split[0], block.attn.split[1]
        inter = self.cfg.intermediate_size
        table = {
            "self_attn.q_proj.weight": (block.attn.wqkv, slice(0, q)),
            "self_attn.k_proj.weight": (block.attn.wqkv, slice(q, q + kv)),
            "self_attn.v_proj.weight": (block.attn.wqkv, slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": (block.attn.wo, None),
            "mlp.gate_proj.weight": (block.mlp.w_gate_up, slice(0, inter)),
            "mlp.up_proj.weight": (block.mlp.w_gate_up, slice(inter, 2 * inter)),
            "mlp.down_proj.weight": (block.mlp.w_down, None),
            "input_layernorm.weight": (block.input_layernorm.weight, None),
            "post_attention_layernorm.weight": (block.post_attention_layernorm.weight, None),
        }
        return table.get(".".join(parts[3:]))

    @torch.no_grad()
    def load_hf_tensors(self, tensors, strict: bool = True) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the parameters, in place.

        In place so that a drafter update is a hot swap: same storage, nothing re-allocated, and any
        compiled graph stays valid. strict: every parameter must be covered, no unknown names.
        """
        covered: set[str] = set()
        for name, tensor in tensors:
            target = self._hf_targets(name)
            if target is None:
                if strict and name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq"):
                    raise KeyError(f"unexpected tensor {name!r}")
                continue
            param, rows = target
            dest = param if rows is None else param[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            covered.add(name)
        if strict:
            expected = self._expected_hf_names()
            missing = expected - covered
            if missing:
                raise KeyError(f"missing tensors: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")

    def _expected_hf_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not self.embed_tokens:
            names.add("lm_head.weight")
        if self.draft_vocab_ids is not None:
            names.add(DRAFT_VOCAB_IDS)
        per_layer = [
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight",
        ]  # fmt: skip
        for i in range(self.cfg.num_layers):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seq_len: int | None = None,
    ) -> Llama:
        """Build from a Hugging Face Llama directory (config.json + *.safetensors)."""
        model_dir = Path(model_dir)
        cfg = LlamaConfig.from_dir(model_dir)
        files = safetensors_files(model_dir)
        draft_vocab_size = None
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                if DRAFT_VOCAB_IDS in f.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                    draft_vocab_size = f.get_slice(DRAFT_VOCAB_IDS).get_shape()[0]
        # Allocated uninitialised (no random init of 28M-element matrices), then filled from disk.
        with torch.device(device):
            model = cls(cfg, draft_vocab_size, max_seq_len)
        model.to(dtype)  # floating point tensors only: draft_vocab_ids stays int64
        model.load_hf_tensors(iter_safetensors(files))
        return model.eval().requires_grad_(False)


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def iter_safetensors(files: list[Path]):
    """Yield (name, tensor) one at a time so the whole checkpoint is never held twice in memory."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)
