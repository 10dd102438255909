"""Static-shape decode forwards for GPUs: bucketed shapes over the preallocated KV cache, optionally
captured as CUDA graphs.

On a GPU a small model's eager step is bound by Python and kernel launches, not by reading its
weights (docs/gpus.md). A CUDA graph replays a
whole forward as one launch, but only with fixed shapes and fixed input/output buffers. So every
decode forward (the target's verify, the drafter's per-token propose step; never the prefill) is
padded to a bucket:

- batch rows to a power of two (the padded rows use the cache's scratch slot, never a real one);
- tokens per row to a power of two (chains are causal, trees bring their own mask);
- attended cache length to a power of two (at least MIN_KV), so a graph serves many lengths.

Everything shape-dependent is then computed on the device from a few small static inputs (ids,
depth, slot, start, the [n, n] mask among the new tokens): RoPE positions, cache write positions and
the [b, 1, n, kv_len] attention mask. On CUDA each bucket is captured on first use (a warm-up run on
a side stream, then torch.cuda.graph) and replayed afterwards; `capture=False` runs the same padded
function eagerly, which is how CPU tests check it token for token against the normal path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.workers.core.kv_cache import KVCache
from specd.workers.models.llama import Llama

MIN_KV = 128


def bucket(n: int, limit: int | None = None) -> int:
    """The smallest power of two >= n, capped at limit."""
    size = 1 << max(n - 1, 0).bit_length()
    return size if limit is None else min(size, limit)


@dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]     # the static input buffers the graph reads
    outputs: tuple[torch.Tensor, ...]   # the static buffers it writes (logits, hidden)
    graph: object | None                # torch.cuda.CUDAGraph, or None when run eagerly


class StaticDecoder:
    """Runs ModelRunner's decode forwards at static shapes (see the module docstring)."""

    def __init__(self, model: Llama, cache: KVCache, capture: bool, max_tokens: int = 64):
        if cache.scratch is None:
            raise ValueError("static decoding needs a KV cache with a scratch slot")
        if capture and model.embed_tokens.device.type != "cuda":
            raise ValueError("CUDA graph capture needs the model on a CUDA device")
        self.model, self.cache, self.capture = model, cache, capture
        self.max_tokens = max_tokens
        self.device = model.embed_tokens.device
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def handles(self, b: int, n: int) -> bool:
        """Shapes this decoder takes; larger ones (a long prompt chunk) go the normal way."""
        return b <= self.cache.num_slots and n <= self.max_tokens

    def forward(
        self,
        ids: torch.Tensor,        # [b, n] long (host)
        depth: torch.Tensor,      # [b, n] long (host): RoPE offset of each token from its row's start
        tree: torch.Tensor,       # [b, n, n] bool (host): which new tokens each new token sees
        slots: list[int],
        starts: list[int],
        full_vocab: bool,
        return_hidden: bool,
        features: torch.Tensor | None = None,   # [b, n, hidden]
        staleness: torch.Tensor | None = None,  # [b, n] long
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [b, n, vocab] (and hidden [b, n, hidden]) of the real rows and tokens, as new tensors."""
        b, n = ids.shape
        self.cache.check_capacity(starts, n)
        nb = bucket(n, self.max_tokens)
        bb = bucket(b, bucket(self.cache.num_slots))
        kv = bucket(max(max(starts) + n, MIN_KV), bucket(self.cache.max_seq_len))
        kv = min(kv, self.cache.max_seq_len)
        key = (bb, nb, kv, full_vocab, return_hidden, features is not None)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(self._buffers(bb, nb, features is not None), (), None)
        self._fill(graph.inputs, ids, depth, tree, slots, starts, features, staleness)
        if graph.graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        elif self.capture:
            graph.graph, graph.outputs = self._capture(graph.inputs, kv, full_vocab, return_hidden)
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = self._run(graph.inputs, kv, full_vocab, return_hidden)
        logits = outputs[0][:b, :n].clone()
        hidden = outputs[1][:b, :n].clone() if return_hidden else None
        return logits, hidden

    # ---- static buffers ---------------------------------------------------------------------------

    def _buffers(self, bb: int, nb: int, with_features: bool) -> dict[str, torch.Tensor]:
        dev = self.device
        bufs = {
            "ids": torch.zeros(bb, nb, dtype=torch.long, device=dev),
            "depth": torch.zeros(bb, nb, dtype=torch.long, device=dev),
            "tree": torch.zeros(bb, nb, nb, dtype=torch.bool, device=dev),
            "slots": torch.zeros(bb, dtype=torch.long, device=dev),
            "starts": torch.zeros(bb, dtype=torch.long, device=dev),
            "write_slot": torch.zeros(bb, nb, dtype=torch.long, device=dev),
            "write_pos": torch.zeros(bb, nb, dtype=torch.long, device=dev),
        }
        if with_features:
            width = self.model.cfg.hidden_size
            bufs["features"] = torch.zeros(bb, nb, width, dtype=self.model.embed_tokens.dtype, device=dev)
            bufs["staleness"] = torch.zeros(bb, nb, dtype=torch.long, device=dev)
        return bufs

    def _fill(self, bufs, ids, depth, tree, slots, starts, features, staleness) -> None:
        """Copy one call's inputs into the buffers; padded rows and tokens get harmless values."""
        bb, nb = bufs["ids"].shape
        b, n = ids.shape
        host = torch.device("cpu")
        pad_ids = torch.zeros(bb, nb, dtype=torch.long, device=host)
        pad_ids[:b, :n] = ids
        # Padded tokens sit at the depth after their row's last real one and see only themselves.
        pad_depth = torch.arange(nb, dtype=torch.long, device=host).repeat(bb, 1)
        pad_depth[:b, :n] = depth
        pad_tree = torch.eye(nb, dtype=torch.bool, device=host).repeat(bb, 1, 1)
        pad_tree[:b, :n, :n] = tree
        # Padded rows write positions 0..nb-1 of the scratch slot.
        pad_slots = torch.full((bb,), self.cache.scratch, dtype=torch.long, device=host)
        pad_slots[:b] = torch.tensor(slots, dtype=torch.long, device=host)
        pad_starts = torch.zeros(bb, dtype=torch.long, device=host)
        pad_starts[:b] = torch.tensor(starts, dtype=torch.long, device=host)
        # Tokens of the bucket past n go to the scratch slot too: at start + j they could run past
        # max_seq_len, or onto a real token's entry.
        offsets = torch.arange(nb, dtype=torch.long, device=host)
        real = (offsets[None, :] < n) & (torch.arange(bb, device=host)[:, None] < b)  # [bb, nb]
        write_slot = torch.where(real, pad_slots[:, None], self.cache.scratch)
        write_pos = torch.where(real, pad_starts[:, None] + offsets, offsets)
        staged = {
            "ids": pad_ids, "depth": pad_depth, "tree": pad_tree, "slots": pad_slots, "starts": pad_starts,
            "write_slot": write_slot, "write_pos": write_pos,
        }
        for name, value in staged.items():
            bufs[name].copy_(value, non_blocking=True)
        if "features" in bufs:
            bufs["features"].zero_()
            bufs["features"][:b, :n] = features.to(self.device, bufs["features"].dtype)
            bufs["staleness"].zero_()
            bufs["staleness"][:b, :n] = staleness.to(self.device)

    # ---- the forward ------------------------------------------------------------------------------

    def _run(self, bufs, kv_len: int, full_vocab: bool, return_hidden: bool) -> tuple[torch.Tensor, ...]:
        """The padded forward, shapes fixed by the buffers and kv_len: what a CUDA graph captures."""
        model, cache = self.model, self.cache
        ids, depth, tree, slots, starts = (bufs[k] for k in ("ids", "depth", "tree", "slots", "starts"))
        write_slot, write_pos = bufs["write_slot"], bufs["write_pos"]  # [bb, nb] where new K/V go
        # Padded tokens may run past the table; their outputs are never read.
        positions = (starts[:, None] + depth).clamp(max=model.rope.shape[0] - 1)
        rope = model.rope[positions].unsqueeze(2)  # [bb, nb, 1, d/2]
        mask = _attention_mask(starts, tree, kv_len)  # [bb, 1, nb, kv_len]
        x = model.embed(ids, bufs.get("features"), bufs.get("staleness"))  # [bb, nb, hidden]
        for layer, block in enumerate(model.layers):
            attn = block.attn
            q, k, v = attn.qkv(block.input_layernorm(x), rope)
            # Advanced indices around a slice put the indexed dims first: [bb, nb, kv_heads, d].
            cache.k[layer][write_slot, :, write_pos] = k.transpose(1, 2)
            cache.v[layer][write_slot, :, write_pos] = v.transpose(1, 2)
            keys = cache.k[layer, :, :, :kv_len].index_select(0, slots)  # [bb, kv_heads, kv_len, d]
            values = cache.v[layer, :, :, :kv_len].index_select(0, slots)
            out = F.scaled_dot_product_attention(q, keys, values, mask, enable_gqa=True)
            x = x + attn.project(out)
            x = x + block.mlp(block.post_attention_layernorm(x))
        hidden = model.norm(x)
        logits = model._head(hidden, full_vocab)
        return (logits, hidden) if return_hidden else (logits,)

    def _capture(self, bufs, kv_len: int, full_vocab: bool, return_hidden: bool):
        """Warm up on a side stream (as torch.cuda.graphs asks), then capture one forward.

        The warm-up runs write the same keys and values the replay will: same inputs, same slots.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(bufs, kv_len, full_vocab, return_hidden)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._run(bufs, kv_len, full_vocab, return_hidden)
        return graph, outputs


def _attention_mask(
    starts: torch.Tensor,  # [b] long
    tree: torch.Tensor,  # [b, n, n] bool among the new tokens
    kv_len: int,
) -> torch.Tensor:  # [b, 1, n, kv_len] bool
    """Every committed key before a row's start, plus the new tokens its tree mask allows."""
    b, n, _ = tree.shape
    rel = torch.arange(kv_len, device=tree.device)[None, :] - starts[:, None]  # [b, kv_len]
    new = (rel >= 0) & (rel < n)
    among = tree.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, kv_len))  # [b, n, kv_len]
    return ((rel < 0)[:, None, :] | (new[:, None, :] & among))[:, None]
