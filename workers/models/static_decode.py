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
function eagerly, which is how CPU tests check it token for token against the normal path. With
`compile=True` (decode=compiled) the padded layers run as torch.compile's fused kernels, inside those
graphs on CUDA (docs/decisions/compiled-decode.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specd.workers.core.kv_cache import KVCache
from specd.workers.models.layers import attention, window_mask
from specd.workers.models.llama import Llama

MIN_KV = 128
log = logging.getLogger(__name__)


def bucket(n: int, limit: int | None = None) -> int:
    """The smallest power of two >= n, capped at limit."""
    size = 1 << max(n - 1, 0).bit_length()
    return size if limit is None else min(size, limit)


@dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]     # the static input buffers the graph reads
    outputs: tuple[torch.Tensor, ...]   # the static buffers it writes (logits, hidden)
    graph: object | None                # torch.cuda.CUDAGraph, or None when run eagerly
    staged: dict[str, np.ndarray]       # numpy views of the host copy of inputs["packed"], by name


class StaticDecoder:
    """Runs ModelRunner's decode forwards at static shapes (see the module docstring)."""

    def __init__(self, model: Llama, cache: KVCache, capture: bool, max_tokens: int = 64,
                 compile: bool = False):
        if cache.scratch is None:
            raise ValueError("static decoding needs a KV cache with a scratch slot")
        if capture and model.embed_tokens.device.type != "cuda":
            raise ValueError("CUDA graph capture needs the model on a CUDA device")
        self.model, self.cache, self.capture = model, cache, capture
        self.max_tokens = max_tokens
        self.device = model.embed_tokens.device
        self.graphs: dict[tuple, _Graph] = {}
        # Buckets first used so far and the host seconds their first use took beyond a replay (buffers,
        # compiles, a CUDA graph's capture): a first use while requests wait stalls them, and a benchmark
        # whose timed run meets new buckets times their capture too (bench/runners.py reports both).
        self.first_uses = 0
        self.first_use_seconds = 0.0
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._pending: torch.cuda.Event | None = None   # the last host-to-device copy of the inputs
        self.chains = True                               # drafter chains in one run (see chain)
        # compile: the padded layers as inductor kernels (fused norms, RoPE, masks, MLP), one compiled
        # graph for every bucket (dynamic shapes; sizes 1 are specialised, so a few compiles in all);
        # on CUDA each bucket's replay is still one CUDA graph, of the compiled kernels.
        self._compiled = torch.compile(self._layers, dynamic=True) if compile else None
        self.real_rope = compile
        if compile:
            model.rope_tables(real=True)    # built here, once, not inside the traced code
            # Every decoder's method shares one code object, so one dynamo cache: a target and a drafter
            # in one process, each with a few specialisations, pass the default limit of 8, past which
            # dynamo would silently run the rest eagerly.
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)

    def handles(self, b: int, n: int) -> bool:
        """Shapes this decoder takes; larger ones (a long prompt chunk) go the normal way."""
        return b <= self.cache.num_slots and n <= self.max_tokens

    def forward(
        self,
        ids,                      # [b, n] long (host: a CPU tensor or a numpy array, as are depth and tree)
        depth,                    # [b, n] long: RoPE offset of each token from its row's start
        tree,                     # [b, n, n] bool: which new tokens each new token sees
        slots: list[int],
        starts: list[int],
        full_vocab: bool,
        return_hidden: bool,
        features: torch.Tensor | None = None,   # [b, n, hidden]
        staleness=None,                         # [b, n] long, on the host like ids
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [b, n, vocab] (and hidden [b, n, hidden]) of the real rows and tokens, as new tensors."""
        b, n = ids.shape
        self.cache.check_capacity(starts, n)
        nb = bucket(n, self.max_tokens)
        bb = bucket(b, bucket(self.cache.num_slots))
        kv = bucket(max(max(starts) + n, MIN_KV), bucket(self.cache.max_seq_len))
        kv = min(kv, self.cache.max_seq_len)
        leading = _leading(slots, bb)
        key = (bb, nb, kv, full_vocab, return_hidden, features is not None, leading)
        graph = self.graphs.get(key)
        fresh = graph is None
        began = time.perf_counter()
        if fresh:
            inputs = self._buffers(bb, nb, features is not None)
            graph = self.graphs[key] = _Graph(inputs, (), None, self._staged(inputs["host"], bb, nb))
        self._fill(graph, ids, depth, tree, slots, starts, features, staleness)
        if fresh:
            self._compile_both(
                leading, bb, lambda lead: self._run(graph.inputs, kv, full_vocab, return_hidden, lead))
        if graph.graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        elif self.capture:
            graph.graph, graph.outputs = self._capture(
                lambda: self._run(graph.inputs, kv, full_vocab, return_hidden, leading))
            self._first_use(began)
            graph.graph.replay()
            outputs = graph.outputs
        else:
            if fresh:
                self._first_use(began)
            outputs = self._run(graph.inputs, kv, full_vocab, return_hidden, leading)
        logits = outputs[0][:b, :n].clone()
        hidden = outputs[1][:b, :n].clone() if return_hidden else None
        return logits, hidden

    def chain(
        self,
        ids: np.ndarray,            # [b, n] long: each row's feed, left-aligned
        counts: list[int],          # [b] tokens of each row's feed
        slots: list[int],
        starts: list[int],
        steps: int,
        features: torch.Tensor | None = None,   # [b, n, hidden]
        staleness=None,                         # [b, n] long, on the host
    ) -> list[list[int]] | None:
        """A greedy drafter's chain of `steps` tokens per row in one static run (one CUDA graph per bucket
        and chain length): [b][steps] target ids, read once. The feed and the first steps - 1 drafts go
        into the cache, as the per-token path leaves it; the caller sets the slots' lengths. None when
        chains cannot be captured here (the caller drafts token by token)."""
        if not self.chains:
            return None
        b, n = ids.shape
        self.cache.check_capacity(starts, n + steps - 1)
        nb = bucket(n, self.max_tokens)
        bb = bucket(b, bucket(self.cache.num_slots))
        kv = min(bucket(max(max(starts) + n + steps - 1, MIN_KV), bucket(self.cache.max_seq_len)),
                 self.cache.max_seq_len)
        leading = _leading(slots, bb)
        key = ("chain", bb, nb, kv, steps, features is not None, leading)
        graph = self.graphs.get(key)
        fresh = graph is None
        began = time.perf_counter()
        if fresh:
            inputs = self._buffers(bb, nb, features is not None)
            graph = self.graphs[key] = _Graph(inputs, (), None, self._staged(inputs["host"], bb, nb))
        depth = np.broadcast_to(np.arange(n), (b, n))
        causal = np.broadcast_to(np.tri(n, dtype=bool), (b, n, n))
        self._fill(graph, ids, depth, causal, slots, starts, features, staleness, counts)
        if fresh:
            self._compile_both(leading, bb, lambda lead: self._run_chain(graph.inputs, kv, steps, lead))
        if graph.graph is None and self.capture:
            try:
                graph.graph, graph.outputs = self._capture(
                    lambda: self._run_chain(graph.inputs, kv, steps, leading))
            except RuntimeError as err:     # not measured on a GPU yet: drafting token by token still works
                log.warning("capturing a drafter chain failed (%s); drafting token by token from now on", err)
                self.chains = False
                del self.graphs[key]
                return None
        if fresh:
            self._first_use(began)
        if graph.graph is not None:
            graph.graph.replay()
            drafted = graph.outputs[0]
        else:
            drafted = self._run_chain(graph.inputs, kv, steps, leading)[0]
        return drafted[:b].tolist()

    def _first_use(self, began: float) -> None:
        self.first_uses += 1
        self.first_use_seconds += time.perf_counter() - began

    def _compile_both(self, leading: bool, bb: int, run) -> None:
        """decode=compiled: a new bucket runs the other `leading` case once too, so both are compiled in a
        server's warm-up (which fills slots 0.. in order) and not at their first use while serving, where
        a compile stalls every request for seconds. Its outputs are discarded; its cache writes are the
        ones the real run makes. A view of rows 0..bb-1 standing in for other rows gives a wrong output
        and nothing else."""
        if self._compiled is not None and (leading or bb <= self.cache.num_slots):
            run(not leading)

    # ---- static buffers ---------------------------------------------------------------------------

    # The integer inputs, in the order they sit in one packed int64 buffer: (name, shape given bb, nb).
    # One buffer means one host-to-device copy per forward where seven cost a launch each (the H100
    # profile put _fill at 0.36 ms a call, 2026-11-26); the tree mask rides along as 0/1 and the graph
    # itself turns it into booleans.
    PACKED = (("ids", lambda bb, nb: (bb, nb)), ("depth", lambda bb, nb: (bb, nb)),
              ("tree", lambda bb, nb: (bb, nb, nb)), ("slots", lambda bb, nb: (bb,)),
              ("starts", lambda bb, nb: (bb,)), ("write_slot", lambda bb, nb: (bb, nb)),
              ("write_pos", lambda bb, nb: (bb, nb)), ("staleness", lambda bb, nb: (bb, nb)),
              ("counts", lambda bb, nb: (bb,)), ("last", lambda bb, nb: (bb,)))

    def _buffers(self, bb: int, nb: int, with_features: bool) -> dict[str, torch.Tensor]:
        """The static inputs: views of one packed device buffer ("packed"), staged through a host copy
        of it ("host", pinned on CUDA), plus the features of a hidden-state drafter."""
        shapes = [(name, shape(bb, nb)) for name, shape in self.PACKED]
        total = sum(torch.Size(shape).numel() for _, shape in shapes)
        packed = torch.zeros(total, dtype=torch.long, device=self.device)
        host = torch.zeros(total, dtype=torch.long, device="cpu", pin_memory=self.device.type == "cuda")
        bufs = {"packed": packed, "host": host}
        offset = 0
        for name, shape in shapes:
            size = torch.Size(shape).numel()
            if name != "staleness" or with_features:    # the forward reads staleness only with features
                bufs[name] = packed[offset : offset + size].view(shape)
            offset += size
        if with_features:
            width = self.model.cfg.hidden_size
            dtype = self.model.embed_tokens.dtype
            bufs["features"] = torch.zeros(bb, nb, width, dtype=dtype, device=self.device)
        return bufs

    def _staged(self, host: torch.Tensor, bb: int, nb: int) -> dict[str, np.ndarray]:
        flat, views, offset = host.numpy(), {}, 0
        for name, shape in self.PACKED:
            dims = shape(bb, nb)
            size = int(np.prod(dims))
            views[name] = flat[offset : offset + size].reshape(dims)
            offset += size
        return views

    def _fill(self, graph: _Graph, ids, depth, tree, slots, starts, features, staleness,
              counts: list[int] | None = None) -> None:
        """Copy one call's inputs into the buffers; padded rows and tokens get harmless values. Built in
        numpy on the host buffer (microseconds), then one copy to the device."""
        bufs, views = graph.inputs, graph.staged
        bb, nb = bufs["ids"].shape
        b, n = ids.shape
        if self._pending is not None:
            self._pending.synchronize()     # the host buffer's previous copy has left it
        views["ids"][:] = 0
        views["ids"][:b, :n] = np.asarray(ids)
        # Padded tokens sit at the depth after their row's last real one and see only themselves.
        views["depth"][:] = np.arange(nb)
        views["depth"][:b, :n] = np.asarray(depth)
        views["tree"][:] = np.eye(nb, dtype=np.int64)
        views["tree"][:b, :n, :n] = np.asarray(tree)
        # Padded rows write positions 0..nb-1 of the scratch slot.
        views["slots"][:] = self.cache.scratch
        views["slots"][:b] = slots
        views["starts"][:] = 0
        views["starts"][:b] = starts
        # Tokens of the bucket past n go to the scratch slot too: at start + j they could run past
        # max_seq_len, or onto a real token's entry.
        offsets = np.arange(nb)
        views["write_slot"][:] = self.cache.scratch
        views["write_slot"][:b, :n] = views["slots"][:b, None]
        views["write_pos"][:] = offsets
        views["write_pos"][:b, :n] += views["starts"][:b, None]
        # Each row's real tokens (a chain's feed: ids are left-aligned), for the drafter's chain.
        views["counts"][:] = 0
        views["counts"][:b] = n if counts is None else counts
        views["last"][:] = np.maximum(views["counts"] - 1, 0)
        views["staleness"][:] = 0
        if features is not None:
            views["staleness"][:b, :n] = np.asarray(staleness)
        bufs["packed"].copy_(bufs["host"], non_blocking=True)
        if self.device.type == "cuda":
            self._pending = self._pending or torch.cuda.Event()
            self._pending.record()
        if "features" in bufs:
            bufs["features"].zero_()
            bufs["features"][:b, :n] = features.to(self.device, bufs["features"].dtype)

    # ---- the forward ------------------------------------------------------------------------------

    def _run(self, bufs, kv_len: int, full_vocab: bool, return_hidden: bool,
             leading: bool) -> tuple[torch.Tensor, ...]:
        """The padded forward, shapes fixed by the buffers and kv_len: what a CUDA graph captures."""
        hidden = self.layers(bufs["ids"], bufs["depth"], bufs["tree"].bool(), bufs["slots"], bufs["starts"],
                             bufs["write_slot"], bufs["write_pos"], bufs.get("features"),
                             bufs.get("staleness"), kv_len, leading)
        logits = self.model._head(hidden, full_vocab)
        return (logits, hidden) if return_hidden else (logits,)

    def layers(self, *args) -> torch.Tensor:
        """_layers, compiled where decode=compiled. Where compiling fails (no C++ compiler or Triton on
        the host, a torch bug), the decoder warns once and runs the plain layers from then on: compiled
        decoding degrades to the static path's speed, never to failed requests. Compiling happens in a
        bucket's warm-up runs, before any CUDA graph capture starts."""
        if self._compiled is not None:
            try:
                return self._compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as err:
                log.warning("decode=compiled: compiling the decode forward failed, running it uncompiled "
                            "from now on: %s", err)
                self._compiled = None
        return self._layers(*args)

    def _layers(
        self,
        ids: torch.Tensor,         # [bb, nb] long
        depth: torch.Tensor,       # [bb, nb] long
        tree: torch.Tensor,        # [bb, nb, nb] bool
        slots: torch.Tensor,       # [bb] long
        starts: torch.Tensor,      # [bb] long
        write_slot: torch.Tensor,  # [bb, nb] long: where new K/V go
        write_pos: torch.Tensor,   # [bb, nb] long
        features: torch.Tensor | None,   # [bb, nb, hidden]
        staleness: torch.Tensor | None,  # [bb, nb] long
        kv_len: int,
        leading: bool,             # the rows are slots 0..bb-1 in order (_leading)
    ) -> torch.Tensor:  # [bb, nb, hidden], normed
        model, cache = self.model, self.cache
        # Padded tokens may run past the table; their outputs are never read.
        positions = (starts[:, None] + depth).clamp(max=model.rope.shape[0] - 1)
        ropes = model.ropes(positions, real=self.real_rope)  # [bb, nb, 1, d/2] complex, or [.., d/2, 2]
        mask = _attention_mask(starts, tree, kv_len)  # [bb, 1, nb, kv_len]
        window = model.cfg.sliding_window
        # sliding layers' mask (Mistral, Qwen2); built whenever the model has one, as shapes are fixed here
        masks = (mask, window_mask(mask, starts, positions, window) if model.cfg.has_sliding_layers else mask)
        x = model.embed(ids, features, staleness)  # [bb, nb, hidden]
        for layer, block in enumerate(model.layers):
            attn = block.attn
            q, k, v = attn.qkv(block.input_layernorm(x), ropes[attn.local])
            # Advanced indices around a slice put the indexed dims first: [bb, nb, kv_heads, d].
            cache.k[layer][write_slot, :, write_pos] = k.transpose(1, 2)
            cache.v[layer][write_slot, :, write_pos] = v.transpose(1, 2)
            if leading:     # a view of the cache's first rows: no copy
                rows = ids.shape[0]
                keys, values = cache.k[layer, :rows, :, :kv_len], cache.v[layer, :rows, :, :kv_len]
            else:
                keys = cache.k[layer, :, :, :kv_len].index_select(0, slots)  # [bb, kv_heads, kv_len, d]
                values = cache.v[layer, :, :, :kv_len].index_select(0, slots)
            out = attention(q, keys, values, masks[attn.sliding], attn.scale)
            x = block.add_mlp(block.add_attention(x, attn.project(out)))
        return model.norm(x)

    def _run_chain(self, bufs, kv_len: int, steps: int, leading: bool) -> tuple[torch.Tensor]:
        """A greedy drafter's whole chain: the feed's forward drafts token 1, then `steps` - 1 one-token
        forwards each feed the token before and draft the next, the argmax and its target id taken on the
        device. -> ([bb, steps] target ids,). As the per-token path: draft k goes in at start + count + k - 1
        and, for a hidden-state drafter, reads the feed's newest state, k steps stale."""
        bb = bufs["ids"].shape[0]
        rows = torch.arange(bb, device=self.device)
        last = bufs["last"]                                        # [bb] each row's newest feed token
        hidden = self.layers(bufs["ids"], bufs["depth"], bufs["tree"].bool(), bufs["slots"], bufs["starts"],
                             bufs["write_slot"], bufs["write_pos"], bufs.get("features"),
                             bufs.get("staleness"), kv_len, leading)
        token = self._argmax_ids(hidden[rows, last][:, None])     # [bb, 1]
        drafted = [token]
        root = None if "features" not in bufs else bufs["features"][rows, last][:, None]   # [bb, 1, hidden]
        after_feed = bufs["starts"] + bufs["counts"]               # [bb] where draft 1 goes in
        depth = torch.zeros(bb, 1, dtype=torch.long, device=self.device)
        sees_itself = torch.ones(bb, 1, 1, dtype=torch.bool, device=self.device)
        slots = bufs["slots"]                                      # padded rows: the scratch slot
        for k in range(1, steps):
            start = after_feed + (k - 1)                           # [bb]; padded rows: scratch positions
            stale = None if root is None else torch.full((bb, 1), k, dtype=torch.long, device=self.device)
            hidden = self.layers(token, depth, sees_itself, slots, start, slots[:, None], start[:, None],
                                 root, stale, kv_len, leading)
            token = self._argmax_ids(hidden)
            drafted.append(token)
        return (torch.cat(drafted, dim=1),)

    def _argmax_ids(self, hidden: torch.Tensor) -> torch.Tensor:  # [bb, 1, hidden] -> [bb, 1] target ids
        best = self.model._head(hidden, False).argmax(dim=-1)     # [bb, 1] head rows
        vocab_ids = self.model.draft_vocab_ids
        return best if vocab_ids is None else vocab_ids[best]

    def _capture(self, run):
        """Warm up on a side stream (as torch.cuda.graphs asks), then capture one run() (a forward, or a
        drafter's chain). The warm-up runs write the same keys and values the replay will: same inputs,
        same slots."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run()
        return graph, outputs


def _leading(slots, bb: int) -> bool:
    """Whether a bucket's rows are the cache's first slots in order, none padded (the allocator hands
    out the lowest free slot, so a steady batch usually is). Attention then reads the rows' keys and
    values as a view of the cache; otherwise it gathers them, two copies per layer (on the H200 12% of a
    compiled step's kernel time at batch 1, docs/gpus.md). Each case is a bucket of its own."""
    return len(slots) == bb and all(int(s) == i for i, s in enumerate(slots))


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
