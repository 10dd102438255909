"""A plain-torch Llama-family decoder that reads Hugging Face safetensors directly and runs on a
KVCache: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 checkpoints, by the switches of config.py.

Serves both the target and drafters: a drafter directory is the same format with fewer layers
and, optionally, a reduced-vocabulary head (`draft_vocab_ids` [V_sub] beside `lm_head.weight`
[V_sub, hidden]); its logits come back scattered into the full vocabulary with -inf elsewhere,
so q is exactly 0 outside the subset.

Speed notes (2-core CPU, every token reads all weights): see layers.py for the per-layer choices;
here the RoPE table is precomputed, the attention mask is built once per forward and shared by all
layers, and the 49152-wide head runs only on the positions asked for (`logit_index`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from specd.workers.core.kv_cache import KVCache
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import (
    PACK_MODES,
    BatchPlan,
    Block,
    Linear,
    Masks,
    RMSNorm,
    Ropes,
    can_pack,
    interleave_rope_rows,
    window_mask,
)
from specd.workers.models.rope import rope_table

DRAFT_VOCAB_IDS = "draft_vocab_ids"
# A drafter that reads the target's hidden states (see workers/drafters/model.py) adds to each token's
# embedding proj(feature) + staleness[s]: feature is the target's final hidden state that predicted the
# token, or, for a drafted token the target has not seen yet, the newest one it has, s steps stale.
FEATURE_PROJ = "model.feature_proj.weight"
FEATURE_STALENESS = "model.feature_staleness"


class Llama(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        draft_vocab_size: int | None = None,
        max_seq_len: int | None = None,
        feature_staleness: int | None = None,
    ):
        """feature_staleness: number of staleness embeddings of a drafter that reads target hidden
        states (None: an ordinary model)."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(draft_vocab_size or cfg.vocab_size, cfg.hidden_size)
        self.tied = draft_vocab_size is None and cfg.tie_word_embeddings
        if self.tied:
            self.lm_head.weight = self.embed_tokens  # one tensor: loading the embedding sets the head
        if draft_vocab_size is not None:
            # Reduced head: row r scores target token draft_vocab_ids[r].
            ids = torch.zeros(draft_vocab_size, dtype=torch.long, device=self.embed_tokens.device)
            self.register_buffer(DRAFT_VOCAB_IDS, ids)
        else:
            self.draft_vocab_ids = None
        self.feature_proj: Linear | None = None
        self.feature_staleness: nn.Parameter | None = None
        if feature_staleness is not None:
            self.feature_proj = Linear(cfg.hidden_size, cfg.hidden_size)
            self.feature_staleness = nn.Parameter(torch.empty(feature_staleness, cfg.hidden_size))
        max_pos = max_seq_len or cfg.max_position_embeddings
        # A plain attribute, not a buffer: Module.to(dtype) would cast a complex buffer to real.
        device = self.embed_tokens.device
        self.rope = rope_table(cfg.head_dim, cfg.rope_theta, max_pos, device, cfg.rope_scaling,
                               cfg.max_position_embeddings)  # [max_pos, d/2] complex64
        self.rope_local = None if cfg.local_rope_theta is None else rope_table(
            cfg.head_dim, cfg.local_rope_theta, max_pos, device, cfg.local_rope_scaling,
            cfg.max_position_embeddings)  # sliding layers' own (Gemma 3)
        self._rope_real: tuple[torch.Tensor, torch.Tensor | None] | None = None   # see rope_tables
        self.packed = "none"

    @property
    def head_size(self) -> int:
        """Number of logits the head computes (V_sub for a reduced-vocabulary drafter)."""
        return self.lm_head.weight.shape[0]

    def make_cache(self, num_slots: int, max_seq_len: int, scratch_slot: bool = False) -> KVCache:
        if max_seq_len > self.rope.shape[0]:
            raise ValueError(f"max_seq_len {max_seq_len} > the {self.rope.shape[0]} RoPE positions built")
        cfg, w = self.cfg, self.embed_tokens
        shape = (cfg.num_layers, num_slots, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(*shape, w.dtype, w.device, scratch_slot=scratch_slot)

    def pack_weights(self, mode: bool | str = True) -> None:
        """Pack every matmul weight (see layers.Linear.pack); re-packed after loads.

        True / "onednn": oneDNN pre-packed float weights; "int8": weight-only int8 rows. Both on CPU
        with float32/bfloat16 weights, plain weights elsewhere. Either keeps a second copy of the
        matmul weights in memory.
        """
        mode = {True: "onednn", False: "none"}.get(mode, mode)
        if mode not in PACK_MODES:
            raise ValueError(f"unknown weight packing {mode!r}; choose from {PACK_MODES}")
        # Both are CPU layouts; elsewhere (CUDA) the plain weights are what the GPU kernels want.
        if mode != "none" and not can_pack(self.embed_tokens.device, self.embed_tokens.dtype, mode):
            mode = "none"
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(mode)
        self.packed = mode

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
        features: torch.Tensor | None = None,  # [b, n, hidden] target hidden states (hidden-state drafters)
        staleness: torch.Tensor | None = None,  # [b, n] int: steps each feature is behind its token
        return_hidden: bool = False,
        counts: list[int] | None = None,  # real tokens per row (the rest is padding); None = all n
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, m or n, vocab] for the new tokens; their K/V land in the cache.

        return_hidden: also return the final-norm hidden states of all n new tokens, [b, n, hidden]
        (what the head reads; a hidden-state drafter consumes the target's).

        Row i's new tokens are stored at cache positions lengths[slot_i] + 0..n-1 (storage order,
        independent of `positions`, so tree siblings of equal depth do not collide) and attend to
        the committed cache[:lengths[slot_i]] plus the new tokens allowed by `attn_mask`.
        cache.lengths is NOT changed here: the caller commits (ModelRunner does).
        Rows with fewer real tokens are right-padded; their padded outputs are garbage, and no real
        token attends to them under a causal mask. With `counts`, the matmuls skip the padding (see
        BatchPlan.real) and padded outputs are zeros.
        With a reduced head and full_vocab=False the logits are [.., V_sub] in draft_vocab_ids order.
        """
        b, n = input_ids.shape
        slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        starts = cache.lengths_of(slot_list)
        cache.check_capacity(starts, n)
        plan = BatchPlan.make(slot_list, starts, n, counts, input_ids.device)
        masks = self._masks(starts, positions, n, attn_mask, input_ids.device)

        ropes = self.ropes(positions)
        plan.split(ropes, masks)
        x = plan.pack(self.embed(input_ids, features, staleness))  # [b, n, hidden] or [T, hidden]
        for layer, block in enumerate(self.layers):
            x = block(x, ropes, masks, cache, layer, plan)
        h = self.norm(x)  # [b, n, hidden] or [T, hidden]
        if logit_index is None:
            logits = plan.unpack(self._head(h, full_vocab))  # [b, n, vocab]: the head on real tokens only
        else:
            picked = plan.unpack(h).gather(1, logit_index[:, :, None].expand(-1, -1, h.shape[-1]))
            logits = self._head(picked, full_vocab)  # [b, m, vocab]
        return (logits, plan.unpack(h)) if return_hidden else logits

    def ropes(self, positions: torch.Tensor, real: bool = False) -> Ropes:
        """The RoPE of every layer kind at positions [b, n] (one tensor twice without a local base):
        [b, n, 1, d/2] complex each, or with real=True [b, n, 1, d/2, 2] (cos, sin) for compiled code."""
        positions = positions.to(self.rope.device)
        tables = self.rope_tables(real)
        rope = tables[0][positions].unsqueeze(2)
        return rope, rope if tables[1] is None else tables[1][positions].unsqueeze(2)

    def rope_tables(self, real: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the RoPE table, the sliding layers' own or None): [max_pos, d/2] complex, or real=True
        [max_pos, d/2, 2] (cos, sin), built once."""
        if not real:
            return self.rope, self.rope_local
        if self._rope_real is None:
            self._rope_real = tuple(None if t is None else torch.view_as_real(t).contiguous()
                                    for t in (self.rope, self.rope_local))
        return self._rope_real

    def embed(
        self,
        input_ids: torch.Tensor,  # [b, n]
        features: torch.Tensor | None = None,  # [b, n, hidden]
        staleness: torch.Tensor | None = None,  # [b, n]
    ) -> torch.Tensor:  # [b, n, hidden]
        """Token embeddings, plus the target-state terms of a hidden-state drafter."""
        x = F.embedding(input_ids, self.embed_tokens)
        if self.cfg.embed_scale != 1.0:   # Gemma: sqrt(hidden), in the weights' dtype as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        if self.feature_proj is not None:
            if features is None or staleness is None:
                raise ValueError("this drafter reads target hidden states: pass features and staleness")
            stale = staleness.clamp(max=self.feature_staleness.shape[0] - 1)
            x = x + self.feature_proj(features.to(x.dtype)) + self.feature_staleness[stale]
        return x

    def _head(self, x: torch.Tensor, full_vocab: bool) -> torch.Tensor:
        logits = self.lm_head(x)  # [b, m, head_size]
        if self.draft_vocab_ids is None or not full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        full[..., self.draft_vocab_ids] = logits
        return full

    def _masks(self, starts: list[int], positions: torch.Tensor, n: int, tree: torch.Tensor | None,
               device) -> Masks:
        """(full layers' mask, sliding-window layers' mask); the second is the first while every key is
        inside the window."""
        mask = self._attention_mask(starts, n, max(starts) + n, tree, device)
        window = self.cfg.sliding_window
        if not self.cfg.has_sliding_layers or max(starts) + n <= window:
            return mask, mask
        start = torch.tensor(starts, device=device)
        return mask, window_mask(mask, start, positions.to(device), window)

    @staticmethod
    def _attention_mask(
        starts: list[int], n: int, kv_len: int, tree: torch.Tensor | None, device
    ) -> torch.Tensor | None:
        """[b, 1, n, kv_len] bool: committed prefix of each row + allowed new tokens."""
        b = len(starts)
        if tree is None and n == 1 and b == 1:
            return None  # one token sees the whole prefix and itself: no mask needed
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

    def _hf_targets(self, name: str) -> tuple[torch.Tensor, slice | None, int] | None:
        """Where a Hugging Face tensor goes: (parameter, row slice of a fused one or None,
        number of heads whose rows are re-ordered for interleaved RoPE, or 0)."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None, 0
        if name == "model.norm.weight":
            return self.norm.weight, None, 0
        if name == "lm_head.weight":
            # A tied checkpoint may still carry a copy; the embedding is the one that counts.
            return None if self.tied else (self.lm_head.weight, None, 0)
        if name == DRAFT_VOCAB_IDS:
            return (self.draft_vocab_ids, None, 0) if self.draft_vocab_ids is not None else None
        if name == FEATURE_PROJ and self.feature_proj is not None:
            return self.feature_proj.weight, None, 0
        if name == FEATURE_STALENESS and self.feature_staleness is not None:
            return self.feature_staleness, None, 0
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5 or int(parts[2]) >= len(self.layers):
            return None
        block = self.layers[int(parts[2])]
        attn, mlp = block.attn, block.mlp
        q, kv, inter = attn.q_size, attn.kv_size, self.cfg.intermediate_size
        fused = {  # HF name without .weight/.bias -> (fused Linear, its rows, heads whose rows interleave)
            "self_attn.q_proj": (attn.wqkv, slice(0, q), attn.num_heads),
            "self_attn.k_proj": (attn.wqkv, slice(q, q + kv), attn.num_kv_heads),
            "self_attn.v_proj": (attn.wqkv, slice(q + kv, q + 2 * kv), 0),
            "self_attn.o_proj": (attn.wo, None, 0),
            "mlp.gate_proj": (mlp.w_gate_up, slice(0, inter), 0),
            "mlp.up_proj": (mlp.w_gate_up, slice(inter, 2 * inter), 0),
            "mlp.down_proj": (mlp.w_down, None, 0),
        }
        table = {
            "input_layernorm.weight": (block.input_layernorm.weight, None, 0),
            "post_attention_layernorm.weight": (block.post_attention_layernorm.weight, None, 0),
        }
        if block.attn_out_norm is not None:   # Gemma: post_attention_layernorm norms attention's output
            table.update({
                "post_attention_layernorm.weight": (block.attn_out_norm.weight, None, 0),
                "pre_feedforward_layernorm.weight": (block.post_attention_layernorm.weight, None, 0),
                "post_feedforward_layernorm.weight": (block.mlp_out_norm.weight, None, 0),
            })
        for hf, (linear, rows, heads) in fused.items():
            table[f"{hf}.weight"] = (linear.weight, rows, heads)
            if linear.bias is not None:
                table[f"{hf}.bias"] = (linear.bias, rows, heads)
        if attn.q_norm is not None:   # one head's worth of weights, interleaved like each head's rows
            table["self_attn.q_norm.weight"] = (attn.q_norm.weight, None, 1)
            table["self_attn.k_norm.weight"] = (attn.k_norm.weight, None, 1)
        return table.get(".".join(parts[3:]))

    @torch.no_grad()
    def load_hf_tensors(self, tensors, strict: bool = True) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the parameters, in place.

        In place so that a drafter update is a hot swap: same storage, nothing re-allocated.
        strict: every parameter must be covered and no name may be unknown.
        """
        covered: set[str] = set()
        for name, tensor in tensors:
            target = self._hf_targets(name)
            if target is None:
                if strict and name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq"):
                    raise KeyError(f"unexpected tensor {name!r}")
                continue
            param, rows, rope_heads = target
            if self.cfg.norm_offset and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0   # Gemma's norms scale by 1 + weight: stored as such
            dest = param if rows is None else param[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(interleave_rope_rows(tensor, rope_heads) if rope_heads else tensor)
            covered.add(name)
        if strict:
            missing = self._expected_hf_names() - covered
            if missing:
                raise KeyError(f"missing tensors: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
        if self.packed != "none":
            self.pack_weights(self.packed)

    def _expected_hf_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.tied:
            names.add("lm_head.weight")
        if self.draft_vocab_ids is not None:
            names.add(DRAFT_VOCAB_IDS)
        if self.feature_proj is not None:
            names.update((FEATURE_PROJ, FEATURE_STALENESS))
        cfg = self.cfg
        per_layer = [
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight",
        ]  # fmt: skip
        if cfg.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if cfg.o_bias:
            per_layer.append("self_attn.o_proj.bias")
        if cfg.mlp_bias:
            per_layer += ["mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"]
        if cfg.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if cfg.sandwich_norms:
            per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        for i in range(cfg.num_layers):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seq_len: int | None = None,
        pack: bool | str = False,
    ) -> Llama:
        """Build from a Hugging Face directory of a supported family (config.json + *.safetensors shards).

        pack: pack the matmul weights: True / "onednn" or "int8" (see pack_weights).
        """
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        files = safetensors_files(model_dir)
        draft_vocab_size = feature_staleness = None
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                if DRAFT_VOCAB_IDS in names:
                    draft_vocab_size = f.get_slice(DRAFT_VOCAB_IDS).get_shape()[0]
                if FEATURE_STALENESS in names:
                    feature_staleness = f.get_slice(FEATURE_STALENESS).get_shape()[0]
        # Allocated uninitialised (no random init of 28M-element matrices), then filled from disk.
        with torch.device(device):
            model = cls(cfg, draft_vocab_size, max_seq_len, feature_staleness)
        model.to(dtype)  # floating point tensors only: draft_vocab_ids stays int64
        model.load_hf_tensors(iter_safetensors(files))
        model.eval().requires_grad_(False)
        if pack:
            model.pack_weights(pack)
        return model


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
