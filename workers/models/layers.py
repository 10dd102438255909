"""Decoder building blocks in plain torch: Linear (optionally oneDNN pre-packed), RMSNorm, RoPE,
GQA attention over the KVCache (optionally biased, q/k-normed, sliding-window), SwiGLU MLP.

Layout choices made for speed on a 2-core CPU, where one token's forward is dominated by reading
the weights and, after that, by per-op overhead:
- q/k/v and gate/up are fused, so each is one matmul (one weight read, one kernel call);
- q and k rows are stored in an interleaved RoPE layout (see `interleave_rope_rows`), so RoPE on
  q and k together is one complex multiplication instead of ten elementwise ops;
- Linear can use a oneDNN pre-packed weight, measured faster here than MKL's sgemm for few rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.core.kv_cache import KVCache
from specd.workers.models.config import ModelConfig

# oneDNN picks a blocked weight layout for this many rows; measured at least as good for 1..16 rows.
PACK_ROWS_HINT = 16


def can_pack(device: torch.device, dtype: torch.dtype, mode: str = "onednn") -> bool:
    """Whether `mode` packing applies here. oneDNN's bfloat16 reorder needs avx512bw/vl/dq or
    avx_ne_convert and raises on an AVX2-only CPU (seen on an AMD EPYC host of this kind), so a
    bfloat16 model keeps plain weights there; int8 rows need no oneDNN."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if mode == "int8":
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


PACK_MODES = ("none", "onednn", "int8")
# A forward's attention masks, (full layers', sliding-window layers'): [b, 1, n, L] bool or None each
Masks = tuple[torch.Tensor | None, torch.Tensor | None]
# A forward's RoPE, (the model's, the sliding layers' own): [b, n, 1, d/2] complex each (or
# [b, n, 1, d/2, 2] real, see apply_rope), the same tensor
# twice unless the model has a local RoPE base (Gemma 3)
Ropes = tuple[torch.Tensor, torch.Tensor]


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). `weight` stays the source of truth (loading, hot swap);
    `pack(mode)` adds a copy that forward then uses: "onednn" a oneDNN-blocked float copy, "int8"
    int8 rows with one float scale each (weight-only: activations stay float, as in gpt-fast's int8
    mode). int8 reads a quarter of the bytes, which is what a one-token forward waits for here; it
    changes the outputs slightly, so it is for drafters only, whose every token the target verifies."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None   # ([out, in] int8, [out] scales)

    @torch.no_grad()
    def pack(self, mode: str = "onednn") -> None:
        if mode not in PACK_MODES:
            raise ValueError(f"unknown weight packing {mode!r}; choose from {PACK_MODES}")
        self.packed = self.int8 = None
        if mode == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
        elif mode == "int8":
            w = self.weight.float()
            scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.int8 = (q.contiguous(), scales.to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            q, scales = self.int8
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scales)  # [rows, out]
            y = y.reshape(*x.shape[:-1], q.shape[0])
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def interleave_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows of each head from HF's half-split RoPE layout
    (x_0..x_{d/2-1}, y_0..y_{d/2-1}) to interleaved pairs (x_0, y_0, x_1, y_1, ...).

    Applied to both q and k, it leaves every q.k dot product unchanged, and makes each rotated
    pair adjacent so RoPE is a complex multiply. The cache holds keys in this layout too.
    """
    d = w.shape[0] // num_heads
    half = d // 2
    first, second = torch.arange(half, device=w.device), torch.arange(half, d, device=w.device)
    perm = torch.stack((first, second), dim=-1).flatten()  # [d]
    return w.view(num_heads, d, -1)[:, perm].reshape(w.shape)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [b, n, heads, d] in interleaved layout, rope [b, n, 1, d/2] complex, or [b, n, 1, d/2, 2] real
    (cos, sin) -> rotated [b, n, heads, d]. The real form is for torch.compile, whose inductor generates
    no code for complex operators; eager keeps the one complex multiply."""
    if rope.is_complex():
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * rope).flatten(-2).to(x.dtype)
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)   # [b, n, heads, d/2] each
    cos, sin = rope.unbind(-1)                             # [b, n, 1, d/2] each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def window_mask(
    mask: torch.Tensor | None,  # [b, 1, n, L] bool, or None: every key visible
    starts: torch.Tensor,       # [b] long: each row's first new token's cache position
    positions: torch.Tensor,    # [b, n] long: the new tokens' RoPE positions
    window: int,
) -> torch.Tensor:  # [b, 1, n, L]
    """`mask` narrowed to keys fewer than `window` positions behind each query (Mistral's and Qwen2's
    sliding window: key at position j is seen from position i iff i - j < window). Committed keys sit at
    their positions; a new key's position is its token's (a tree node's is start + depth, not its slot)."""
    b, n = positions.shape
    kv_len = mask.shape[-1] if mask is not None else int(starts.max()) + n
    slot = torch.arange(kv_len, device=positions.device)[None, :]                   # [1, L]
    rel = slot - starts[:, None]                                                     # [b, L]
    new_pos = positions.gather(1, rel.clamp(0, n - 1))                               # [b, L]
    key_pos = torch.where(rel >= 0, new_pos, slot)
    near = (positions[:, :, None] - key_pos[:, None, :]) < window                    # [b, n, L]
    return near[:, None] if mask is None else mask & near[:, None]


@dataclass
class BatchPlan:
    """How one forward addresses the cache; computed once, shared by all layers."""

    slots: list[int]
    starts: list[int]  # cache position of each row's first new token (= its committed length)
    # Rows whose slots are consecutive form a run, (first row, end row, keys to attend): each run
    # reads the cache as a view. Gathering scattered slots would instead copy b * L keys per layer,
    # as many bytes as the weights themselves for a batch of 8 at 1000 tokens.
    runs: list[tuple[int, int, int]]
    n: int = 1  # new tokens per row, padding included
    # Ragged rows: flat indices [T] of the real tokens in the [b * n] grid, None when no row is padded.
    # Every matmul (q/k/v, output, MLP, head), RoPE and the cache write then run on the T real tokens
    # once, and only attention runs per group of rows (`groups`): the one-token rows side by side, the
    # longer ones padded among themselves. The T tokens are ordered group by group, so a group's
    # queries and outputs are one contiguous range. A verify at batch 16 where one row drafts 7 tokens
    # costs 22 tokens, not 128.
    real: torch.Tensor | None = None
    groups: list[RowGroup] | None = None
    write_index: torch.Tensor | None = None   # KVCache.run_index / token_index of the new tokens
    rope: Ropes | None = None                 # [T, 1, 1, d/2] each: the real tokens' RoPE (ragged plans)

    @classmethod
    def make(cls, slots: list[int], starts: list[int], n: int, counts: list[int] | None = None,
             device=None) -> BatchPlan:
        runs, first = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                runs.append((first, i, max(starts[first:i]) + n))
                first = i
        if counts is None or sum(counts) == len(slots) * n:
            return cls(slots, starts, runs, n)
        single = [i for i, c in enumerate(counts) if c == 1]
        longer = [i for i, c in enumerate(counts) if c > 1]
        parts = [single, longer] if single and longer else [list(range(len(slots)))]
        order = [i for rows in parts for i in rows]
        real = torch.tensor([i * n + j for i in order for j in range(counts[i])], device=device)
        groups, offset = [], 0
        for rows in parts:
            groups.append(RowGroup.make(rows, slots, starts, counts, offset, device))
            offset += sum(counts[i] for i in rows)
        return cls(slots, starts, runs, n, real, groups)

    def split(self, ropes: Ropes, masks: Masks) -> None:
        """Pack the forward's ropes [b, n, 1, d/2] to the real tokens, and give each row group its rows
        of the masks [b, 1, n, L] (the same for every layer, so done once)."""
        if self.groups is None:
            return
        full = self.pack(ropes[0])[:, None]  # [T, 1, 1, d/2]
        self.rope = (full, full if ropes[1] is ropes[0] else self.pack(ropes[1])[:, None])
        for group in self.groups:
            group.masks = tuple(None if m is None else m[group.index, :, : group.plan.n] for m in masks)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[b, n, ...] -> [T, ...] (the real tokens), or x itself when no row is padded."""
        return x if self.real is None else x.flatten(0, 1).index_select(0, self.real)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [b, n, ...] with zeros at the padding, or x itself when no row is padded."""
        if self.real is None:
            return x
        out = x.new_zeros(len(self.slots) * self.n, *x.shape[1:])
        return out.index_copy_(0, self.real, x).unflatten(0, (len(self.slots), self.n))

    def cache_index(self, cache: KVCache) -> torch.Tensor:
        """Where this forward's new keys go in the cache (KVCache.write_at), built at the first layer:
        [b, kv_heads, n] order for a dense plan, [T, kv_heads] for a ragged one."""
        if self.write_index is None:
            if self.groups is None:
                self.write_index = cache.run_index(self.slots, self.starts, self.n)
            else:
                tokens = [(self.slots[i], self.starts[i] + j) for g in self.groups for i, j in g.tokens]
                self.write_index = cache.token_index(*zip(*tokens, strict=True))
        return self.write_index


@dataclass
class RowGroup:
    """Rows of a ragged batch that attend together, padded to their own longest row (plan.n)."""

    index: torch.Tensor          # [g] the rows, as batch indices
    plan: BatchPlan              # the group's own (dense) plan: its slots, starts, runs and n
    tokens: list[tuple[int, int]]  # (row, j) of the group's real tokens, in packed order
    offset: int                  # where they start in the packed [T] order
    dest: torch.Tensor | None    # [T_g] where they go in the group's [g * n] grid; None: nowhere padded
    masks: Masks = (None, None)  # the group's rows of the forward's masks (BatchPlan.split)

    @classmethod
    def make(cls, rows, slots, starts, counts, offset, device) -> RowGroup:
        n = max(counts[i] for i in rows)
        tokens = [(i, j) for i in rows for j in range(counts[i])]
        dest = [k * n + j for k, i in enumerate(rows) for j in range(counts[i])]
        plan = BatchPlan.make([slots[i] for i in rows], [starts[i] for i in rows], n)
        return cls(torch.tensor(rows, device=device), plan, tokens, offset,
                   None if len(dest) == len(rows) * n else torch.tensor(dest, device=device))

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The packed queries [T, heads, 1, d] -> the group's [g, heads, n, d], zeros at its padding."""
        part = q[self.offset : self.offset + len(self.tokens)]  # [T_g, heads, 1, d], a view
        g, n = len(self.plan.slots), self.plan.n
        if n == 1:
            return part
        flat = part.squeeze(2)  # [T_g, heads, d]
        if self.dest is not None:
            flat = flat.new_zeros(g * n, *flat.shape[1:]).index_copy_(0, self.dest, flat)
        return flat.reshape(g, n, *flat.shape[1:]).transpose(1, 2)

    def real_of(self, grid: torch.Tensor) -> torch.Tensor:
        """The group's attention output [g, n, f] -> its real tokens [T_g, f], in packed order."""
        flat = grid.reshape(-1, grid.shape[-1])
        return flat if self.dest is None else flat.index_select(0, self.dest)


def attention(
    q: torch.Tensor,       # [b, heads, n, d]
    keys: torch.Tensor,    # [b, kv_heads, L, d]
    values: torch.Tensor,  # [b, kv_heads, L, d]
    mask: torch.Tensor | None,  # [b, 1, n, L] bool, True = attend; None: attend to all L
    scale: float | None,
) -> torch.Tensor:  # [b, heads, n, d]
    """SDPA with grouped-query heads. On CUDA the query heads that share a KV head are folded into
    that head's query rows (`fold_gqa`): with a mask, SDPA's enable_gqa has only its math path there
    (a dozen small kernels and float32 copies of q, k and v per layer in the H200 profile), while
    the folded form runs in one memory-efficient attention kernel. On the CPU enable_gqa's kernel
    is the faster one (docs/decisions/gqa-fold.md)."""
    if q.device.type == "cuda":
        return fold_gqa(q, keys, values, mask, scale)
    return F.scaled_dot_product_attention(q, keys, values, mask, enable_gqa=True, scale=scale)


def fold_gqa(q, keys, values, mask, scale) -> torch.Tensor:
    """`attention` without repeating keys and values: KV head j serves query heads j*g..j*g+g-1
    (g = heads / kv_heads, enable_gqa's order), which become its g*n query rows, row i*n + t being
    head j*g+i's token t; each row keeps its token's mask row. Shapes as `attention`."""
    b, heads, n, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if group == 1:
        return F.scaled_dot_product_attention(q, keys, values, mask, scale=scale)
    rows = q.reshape(b, kv_heads, group * n, d)
    if mask is not None:
        width = mask.shape[-1]
        mask = mask[:, :, None].expand(b, 1, group, n, width).reshape(b, 1, group * n, width)
    out = F.scaled_dot_product_attention(rows, keys, values, mask, scale=scale)  # [b, kv_heads, g*n, d]
    return out.reshape(b, heads, n, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        num_heads, num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.wqkv = Linear(self.q_size + 2 * self.kv_size, hidden, cfg.qkv_bias)  # rows: q | k | v
        self.wo = Linear(hidden, self.q_size, cfg.o_bias)
        # Qwen3: each head's q and k RMS-normed before RoPE; the weights are stored interleaved like the rows
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sliding = cfg.is_sliding(layer)   # picks the sliding-window mask of the forward's Masks
        self.local = cfg.local_rope(layer)     # picks the local RoPE of the forward's Ropes
        self.scale = cfg.attn_scale            # None: SDPA's head_dim ** -0.5

    def forward(
        self,
        x: torch.Tensor,  # [b, n, hidden], or [T, hidden] when plan.real packs ragged rows
        ropes: Ropes,  # [b, n, 1, head_dim/2] complex each
        masks: Masks,  # (full, sliding) [b, 1, n, L] bool, True = attend; None = attend to all L
        cache: KVCache,
        layer: int,
        plan: BatchPlan,
    ) -> torch.Tensor:  # like x
        fused = self.wqkv(x)  # [b, n, q + 2 kv] or [T, q + 2 kv]
        if plan.groups is None:
            q, k, v = self.rotate(fused, ropes[self.local])
            cache.write_at(layer, plan.cache_index(cache), k, v)
            return self.wo(self._attend(q, masks[self.sliding], cache, layer, plan))
        # Ragged: RoPE and the cache write once over the packed tokens (as T rows of one token), then
        # attention per row group, each reading its queries as a range of the packed ones.
        q, k, v = self.rotate(fused[:, None], plan.rope[self.local])  # q [T, heads, 1, d], k, v [T, kv, 1, d]
        cache.write_at(layer, plan.cache_index(cache), k, v)
        outs = [group.real_of(self._attend(group.queries(q), group.masks[self.sliding], cache, layer,
                                           group.plan)) for group in plan.groups]
        return self.wo(torch.cat(outs) if len(outs) > 1 else outs[0])  # [T, hidden]

    def _attend(self, q, mask, cache: KVCache, layer: int, plan: BatchPlan) -> torch.Tensor:
        """Queries [b, heads, n, d] of `plan`'s dense rows, whose keys are in the cache already ->
        attention output [b, n, q]."""
        outs = []
        for first, end, kv_len in plan.runs:
            keys, values = cache.read(layer, plan.slots[first:end], kv_len)  # [rows, kv_heads, L, d]
            run_mask = None if mask is None else mask[first:end, :, :, :kv_len]
            run_q = q[first:end]  # [rows, heads, n, d]
            outs.append(attention(run_q, keys, values, run_mask, self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [b, heads, n, d]
        b, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b, n, self.q_size)

    def qkv(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, n, hidden] -> rotated q [b, heads, n, d], rotated k and v [b, kv_heads, n, d]."""
        return self.rotate(self.wqkv(x), rope)

    def rotate(
        self, qkv: torch.Tensor, rope: torch.Tensor  # qkv [b, n, q + 2 kv] (the fused projection)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> rotated q [b, heads, n, d], rotated k and v [b, kv_heads, n, d]."""
        qk = qkv[..., : self.q_size + self.kv_size].unflatten(-1, (-1, self.head_dim))  # [b, n, h + kv, d]
        if self.q_norm is not None:
            heads = self.num_heads
            qk = torch.cat((self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])), 2)
        qk = apply_rope(qk, rope)
        q = qk[:, :, : self.num_heads].transpose(1, 2)  # [b, heads, n, d]
        k = qk[:, :, self.num_heads :].transpose(1, 2)  # [b, kv_heads, n, d]
        v = qkv[..., self.q_size + self.kv_size :].unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        return q, k, v

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [b, heads, n, d] -> [b, n, hidden]."""
        b, _, n, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, n, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.w_gate_up = Linear(2 * intermediate, hidden, bias)  # rows: gate | up
        self.w_down = Linear(hidden, intermediate, bias)
        self.tanh_gelu = activation == "gelu_tanh"   # Gemma's gelu_pytorch_tanh; else SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.intermediate, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.w_down(gate * up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); Gemma also norms each output before adding it
    (sandwich norms). `post_attention_layernorm` is the MLP's input norm, as Llama names it."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, cfg.intermediate_size, cfg.mlp_bias, cfg.activation)
        self.attn_out_norm = RMSNorm(hidden, eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(hidden, eps) if cfg.sandwich_norms else None

    def forward(self, x, ropes: Ropes, masks: Masks, cache: KVCache, layer: int, plan: BatchPlan):
        out = self.attn(self.input_layernorm(x), ropes, masks, cache, layer, plan)
        return self.add_mlp(self.add_attention(x, out))

    def add_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual after attention, whose projected output is `out` (like x)."""
        return x + (out if self.attn_out_norm is None else self.attn_out_norm(out))

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.post_attention_layernorm(x))
        return x + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))
