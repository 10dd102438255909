"""ModelRunner: one Llama and its KV cache on one device, batched over many sequences.

Both the target (verifies drafts) and a model drafter (proposes them) run through this class.
Every call appends tokens after a slot's committed length and commits them; the caller undoes
rejected ones with `rollback` (chains) or `keep_tree_path` (trees).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from specd.workers.core.kv_cache import CacheFullError, KVCache
from specd.workers.models.device_settings import DECODE_MODES, prefer_shape_free_attention
from specd.workers.models.llama import Llama, iter_safetensors, safetensors_files
from specd.workers.models.static_decode import StaticDecoder


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 16,
        max_seq_len: int = 2048,
        compile: bool = False,
        num_threads: int | None = None,
        prefill_chunk: int = 512,
        full_vocab: bool = True,
        pack_weights: bool | str = True,
        decode: str = "eager",
    ):
        """prefill_chunk: prompt tokens per forward in `prefill` (bounds activation memory).
        full_vocab: for a reduced-vocabulary drafter, False returns [.., V_sub] logits in the
        order of `vocab_ids` (cheaper) instead of scattering them into the full vocabulary.
        pack_weights: True / "onednn": oneDNN pre-packed matmul weights on CPU (faster forwards,
        docs/decisions/cpu-kernels.md, at the price of a second copy of the matmul weights in memory); "int8":
        weight-only int8 (drafters only: it changes the outputs slightly); False / "none": plain.
        decode: how decode forwards (extend, extend_trees; never prefill) run: "eager" (shapes as they
        come, the CPU path), "static" (bucketed static shapes over the preallocated cache, run
        eagerly: the GPU path's logic, testable anywhere), "graph" (static, each bucket captured
        as a CUDA graph on first use; CUDA only) or "compiled" (static with torch.compile's kernels,
        captured on CUDA). See workers/models/static_decode.py.
        compile: torch.compile the forward; off by default: on a CPU it compiles for minutes per graph
        and ran slower than eager with packed weights (docs/decisions/cpu-kernels.md).
        """
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            prefer_shape_free_attention()
        # Inductor cannot trace oneDNN's opaque packed weights: compile works on the plain ones.
        pack = "none" if compile or decode == "compiled" else pack_weights
        self.model = Llama.from_pretrained(model_dir, self.device, dtype, max_seq_len=max_seq_len, pack=pack)
        if decode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {decode!r}; choose from {DECODE_MODES}")
        static = decode != "eager"
        self.cache: KVCache = self.model.make_cache(max_slots, max_seq_len, scratch_slot=static)
        capture = decode == "graph" or (decode == "compiled" and self.device.type == "cuda")
        self.static = (StaticDecoder(self.model, self.cache, capture=capture, compile=decode == "compiled")
                       if static else None)
        self.prefill_chunk = prefill_chunk
        self.full_vocab = full_vocab or self.model.draft_vocab_ids is None
        self._forward = self.model.forward
        # Ragged rows skip their padding in the matmuls (layers.BatchPlan.real); a compiled forward keeps
        # the padded shapes, which it can trace.
        self._ragged = not compile
        if compile:
            # dynamic=True: n (new tokens) and the attended length change every call; one graph
            # per shape would recompile constantly.
            self._forward = torch.compile(self.model.forward, dynamic=True)

    # ---- sizes and slots --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Width of the returned logits: the full vocabulary unless full_vocab=False on a drafter."""
        return self.model.cfg.vocab_size if self.full_vocab else self.model.head_size

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """Target token id of each logit column when logits are reduced, else None."""
        return None if self.full_vocab else self.model.draft_vocab_ids

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    @property
    def num_free(self) -> int:
        return self.cache.num_free

    def length(self, slot: int) -> int:
        return int(self.cache.lengths[slot])

    def first_uses(self) -> tuple[int, float]:
        """(buckets, host seconds) the static decoder spent on buckets' first uses (0, 0.0 eager)."""
        if self.static is None:
            return 0, 0.0
        return self.static.first_uses, self.static.first_use_seconds

    def lengths(self, slots: list[int]) -> list[int]:
        return self.cache.lengths_of(slots)

    # ---- forwards ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        features: list[torch.Tensor] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Append whole prompts; return the logits after each prompt's last token: [b, vocab].

        Long prompts go in chunks of `prefill_chunk` tokens per row; rows whose prompt is done
        drop out of later chunks. The head runs only on each row's last token.
        features: a hidden-state drafter's inputs, one [len(prompt), hidden] per row (all fresh).
        return_hidden: also return each prompt's final hidden states, [len(prompt), hidden] per row.
        """
        if len(slots) != len(prompts) or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs one non-empty prompt per slot")
        out = None
        hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
        longest = max(len(p) for p in prompts)
        for begin in range(0, longest, self.prefill_chunk):
            rows = [i for i, p in enumerate(prompts) if len(p) > begin]
            end = begin + self.prefill_chunk
            chunks = [prompts[i][begin:end] for i in rows]
            last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)[:, None]  # [b, 1]
            feats = None if features is None else [features[i][begin:end] for i in rows]
            res = self._extend([slots[i] for i in rows], chunks, last, feats, None, return_hidden)
            logits = res[0] if return_hidden else res  # [b, 1, vocab]
            if out is None:
                out = logits.new_empty(len(slots), logits.shape[-1])  # [b, vocab]
            for j, i in enumerate(rows):
                if return_hidden:
                    hidden[i].append(res[1][j, : len(chunks[j])])
                if len(prompts[i]) <= end:
                    out[i] = logits[j, 0]
        if return_hidden:
            return out, [torch.cat(h) for h in hidden]
        return out

    @torch.inference_mode()
    def extend(
        self,
        slots: list[int],
        tokens: list[list[int]],
        features: list[torch.Tensor] | None = None,
        staleness: list[list[int]] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append tokens (a different count per row allowed), causally: logits [b, n_max, vocab].

        Row i's logits at index j follow its token j; entries j >= len(tokens[i]) are padding.
        features[i] [len(tokens[i]), hidden] and staleness[i] feed a hidden-state drafter (see
        workers/models/llama.py); return_hidden adds the final hidden states [b, n_max, hidden].
        """
        if len(slots) != len(tokens) or any(len(t) == 0 for t in tokens):
            raise ValueError("extend needs one non-empty token list per slot")
        return self._extend(slots, tokens, None, features, staleness, return_hidden)

    def _extend(
        self, slots, tokens, logit_index=None, features=None, staleness=None, return_hidden=False
    ):
        order = self._slot_order(slots)
        if order is not None:
            # Rows in slot order: consecutive slots are read as one cache view per layer instead of one
            # attention call per row (docs/decisions/slot-order-and-freed-memory.md).
            out = self._extend(_pick(slots, order), _pick(tokens, order),
                               None if logit_index is None else logit_index[order],
                               _pick(features, order), _pick(staleness, order), return_hidden)
            return _unpermute(out, order, return_hidden)
        counts = [len(t) for t in tokens]
        groups = self._fitting_groups(slots, counts)
        if groups is not None:
            def part(rows):
                pick = [slots[i] for i in rows], [tokens[i] for i in rows]
                index = None if logit_index is None else logit_index[rows]
                feats = None if features is None else [features[i] for i in rows]
                stale = None if staleness is None else [staleness[i] for i in rows]
                return self._extend(*pick, index, feats, stale, return_hidden)
            return self._merge_rows(groups, [part(g) for g in groups], len(slots), return_hidden)
        n = max(counts)
        starts = self.cache.lengths[slots]  # [b]
        if self.static is not None and logit_index is None and self.static.handles(len(slots), n):
            return self._extend_static(slots, tokens, counts, n, starts, features, staleness, return_hidden)
        ids = torch.tensor([t + [0] * (n - len(t)) for t in tokens], device=self.device)  # [b, n]
        positions = (starts[:, None] + torch.arange(n, device=starts.device)).to(self.device)  # [b, n]
        feats = stale = None
        if features is not None:
            feats, stale = self._feature_inputs(features, staleness, counts, n)
            stale = stale.to(self.device)
        out = self._forward(
            ids, positions, slots, self.cache, logit_index=logit_index, full_vocab=self.full_vocab,
            features=feats, staleness=stale, return_hidden=return_hidden,
            counts=counts if self._ragged else None,
        )
        self.cache.lengths[slots] = starts + torch.tensor(counts, device=starts.device)
        return out

    def _slot_order(self, slots: list[int]) -> list[int] | None:
        """The row order that sorts `slots`, or None when they are sorted already. The static (GPU)
        decoder gathers its slots by index, where order costs nothing: it keeps the caller's order."""
        if self.static is not None:
            return None
        order = sorted(range(len(slots)), key=slots.__getitem__)
        return None if order == list(range(len(slots))) else order

    def _fitting_groups(self, slots: list[int], counts: list[int]) -> list[list[int]] | None:
        """None when one forward fits; else row groups that each fit, for one forward per group.

        A forward writes every row n = max(counts) positions (padding included), so a row in its last
        positions batched with a wider neighbour would write past its slot: such rows go in a later
        forward of their own width. Only a row whose own tokens do not fit raises CacheFullError.
        """
        cap = self.cache.max_seq_len
        starts = self.cache.lengths_of(slots)
        if max(starts) + max(counts) <= cap:
            return None
        for start, count in zip(starts, counts, strict=True):
            if start + count > cap:
                raise CacheFullError(f"{start} + {count} new tokens exceed max_seq_len {cap}")
        groups, rows = [], list(range(len(slots)))
        while rows:
            width = max(counts[i] for i in rows)
            groups.append([i for i in rows if starts[i] + width <= cap])  # the widest row always fits
            rows = [i for i in rows if starts[i] + width > cap]
        return groups

    @staticmethod
    def _merge_rows(groups, outs, batch: int, return_hidden: bool):
        """Put the per-group outputs ([rows, n_g, ...], or (logits, hidden)) back in row order, padded."""
        parts = [o if return_hidden else (o,) for o in outs]
        merged = []
        for k in range(len(parts[0])):
            width = max(p[k].shape[1] for p in parts)
            full = parts[0][k].new_zeros(batch, width, *parts[0][k].shape[2:])
            for rows, p in zip(groups, parts, strict=True):
                full[rows, : p[k].shape[1]] = p[k]
            merged.append(full)
        return tuple(merged) if return_hidden else merged[0]

    def _extend_static(self, slots, tokens, counts, n, starts, features, staleness, return_hidden):
        """_extend through the static decoder: a causal chain per row."""
        b = len(slots)
        ids = np.array([t + [0] * (n - len(t)) for t in tokens], dtype=np.int64)   # [b, n]
        depth = np.broadcast_to(np.arange(n), (b, n))                               # [b, n]
        causal = np.broadcast_to(np.tri(n, dtype=bool), (b, n, n))                  # [b, n, n]
        feats = stale = None
        if features is not None:
            feats, stale = self._feature_inputs(features, staleness, counts, n)
        logits, hidden = self.static.forward(
            ids, depth, causal, list(slots), starts.tolist(), self.full_vocab, return_hidden, feats, stale
        )
        self.cache.lengths[slots] = starts + torch.tensor(counts, device=starts.device)
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def extend_chain(
        self,
        slots: list[int],
        tokens: list[list[int]],   # each row's feed (the newest token last)
        steps: int,
        features: list[torch.Tensor] | None = None,   # a hidden-state drafter's, [len(tokens[i]), hidden]
    ) -> list[list[int]] | None:
        """Greedy drafting on the static path in one run: append each feed, then draft `steps` tokens per
        row by argmax, feeding all but the last (the cache then holds feed + drafts[:-1], as after `steps`
        calls of extend). [b][steps] target ids; None where the static decoder does not take the shape
        (the caller drafts token by token)."""
        counts = [len(t) for t in tokens]
        n = max(counts)
        if self.static is None or not self.static.handles(len(slots), n):
            return None
        starts = self.cache.lengths_of(slots)
        if max(starts) + n + steps - 1 > self.cache.max_seq_len:   # near the end: token by token
            return None
        ids = np.array([t + [0] * (n - len(t)) for t in tokens], dtype=np.int64)   # [b, n]
        feats = stale = None
        if features is not None:
            feats, stale = self._feature_inputs(features, None, counts, n)
        drafted = self.static.chain(ids, counts, list(slots), starts, steps, feats, stale)
        if drafted is None:
            return None
        ends = [start + count + steps - 1 for start, count in zip(starts, counts, strict=True)]
        self.cache.lengths[slots] = torch.tensor(ends, dtype=torch.long, device="cpu")
        return drafted

    def _feature_inputs(self, features, staleness, counts, n):
        """Right-padded [b, n, hidden] features on the device and [b, n] staleness (0 = fresh) on the host
        (the static decoder stages it with its other integer inputs)."""
        width = self.model.cfg.hidden_size
        for i, c in enumerate(counts):
            if features[i].shape != (c, width):
                raise ValueError(f"row {i}: features {tuple(features[i].shape)} != ({c}, {width})")
        # Assembled where the features arrive (the CPU, from another worker) in one padding copy, then
        # moved once.
        dtype = self.model.embed_tokens.dtype
        feats = pad_sequence([f.to(dtype) for f in features], batch_first=True)      # [b, max(counts), H]
        if feats.shape[1] < n:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, n - feats.shape[1]))
        if staleness is None:
            stale = torch.zeros(len(counts), n, dtype=torch.long)
        else:
            stale = torch.tensor([_as_list(s) + [0] * (n - len(s)) for s in staleness], dtype=torch.long)
        return feats.to(self.device), stale

    @torch.inference_mode()
    def extend_tree(
        self,
        slot: int,
        tree_tokens: list[int] | torch.Tensor,  # [n]: root first, then draft nodes
        parents: list[int] | torch.Tensor,  # [n]: parent node index, -1 for the root; parents[i] < i
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a token tree in one forward with a tree mask: logits [n, vocab] (+ hidden [n, H]).

        Node i gets RoPE position length + depth(i) and cache position length + i, so the slot's
        length grows by n; keep_tree_path then keeps only the accepted path.
        """
        n = len(tree_tokens)
        out = self.extend_trees([slot], [tree_tokens], [parents], return_hidden=return_hidden)
        if return_hidden:
            return out[0][0, :n], out[1][0, :n]
        return out[0, :n]

    @torch.inference_mode()
    def extend_trees(
        self,
        slots: list[int],
        trees_tokens: list[list[int] | torch.Tensor],
        trees_parents: list[list[int] | torch.Tensor],
        return_hidden: bool = False,
        features: list[torch.Tensor] | None = None,
        staleness: list[list[int]] | None = None,
        root_features: list[torch.Tensor] | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Batched extend_tree over several slots (trees padded to the largest): [b, n_max, vocab].

        features[i] [len(trees_tokens[i]), hidden] and staleness[i] feed a hidden-state drafter, per node.
        Or root_features[i] [hidden]: every node of tree i reads that one state, as stale as the node is
        deep (a drafter drafting a tree from the newest target state).
        """
        order = self._slot_order(slots)
        if order is not None:   # rows in slot order, as in _extend
            out = self.extend_trees(_pick(slots, order), _pick(trees_tokens, order),
                                    _pick(trees_parents, order), return_hidden, _pick(features, order),
                                    _pick(staleness, order), _pick(root_features, order))
            return _unpermute(out, order, return_hidden)
        sizes = [len(t) for t in trees_tokens]
        groups = self._fitting_groups(slots, sizes)
        if groups is not None:
            def part(rows):
                return self.extend_trees(
                    [slots[i] for i in rows], [trees_tokens[i] for i in rows],
                    [trees_parents[i] for i in rows], return_hidden, _pick(features, rows),
                    _pick(staleness, rows), _pick(root_features, rows),
                )
            return self._merge_rows(groups, [part(g) for g in groups], len(slots), return_hidden)
        n = max(sizes)
        b = len(slots)
        # The tree layout is planned on the host, then moved once.
        ids, depth, mask = _tree_layout(trees_tokens, trees_parents, n)     # [b, n], [b, n], [b, n, n]
        starts = self.cache.lengths[slots]  # [b]
        feats = stale = None
        if features is not None:
            feats, stale = self._feature_inputs(features, staleness, sizes, n)
        elif root_features is not None:
            roots = torch.stack(list(root_features)).to(self.model.embed_tokens.dtype)    # [b, H]
            feats, stale = roots[:, None].expand(-1, n, -1).to(self.device), depth
        if self.static is not None and self.static.handles(b, n):
            logits, hidden = self.static.forward(
                ids, depth, mask, list(slots), starts.tolist(), self.full_vocab, return_hidden, feats, stale
            )
            self.cache.lengths[slots] = starts + torch.tensor(sizes, device=starts.device)
            return (logits, hidden) if return_hidden else logits
        positions = starts[:, None] + depth  # [b, n]
        logits = self._forward(
            ids.to(self.device),
            positions.to(self.device),
            slots,
            self.cache,
            attn_mask=mask.to(self.device),
            full_vocab=self.full_vocab,
            features=feats,
            staleness=None if stale is None else stale.to(self.device),
            return_hidden=return_hidden,
            counts=sizes if self._ragged else None,
        )
        self.cache.lengths[slots] = starts + torch.tensor(sizes, device=starts.device)
        return logits

    # ---- cache edits ------------------------------------------------------------------------

    def rollback(self, slot: int, new_length: int) -> None:
        self.cache.rollback(slot, new_length)

    def rollback_many(self, slots: list[int], new_lengths: list[int]) -> None:
        self.cache.rollback_many(slots, new_lengths)

    def keep_tree_path(self, slot: int, start: int, node_indices: list[int] | torch.Tensor) -> None:
        """After extend_tree at length `start`: keep nodes `node_indices` (root first, a path) as a chain."""
        self.cache.compact(slot, start, node_indices)

    def keep_tree_paths(self, slots: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """keep_tree_path for several rows of one verify at once."""
        self.cache.compact_many(slots, starts, paths)

    # ---- weights ----------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, source: str | Path | dict[str, torch.Tensor]) -> None:
        """Hot-swap weights in place (same shapes) from a model directory or an HF-named state dict.

        The KV cache is left alone: entries computed with the old weights are stale, so a drafter
        swap should be followed by re-prefilling (or accepting slightly off drafts until rollback).
        """
        if isinstance(source, dict):
            self.model.load_hf_tensors(source.items())
        else:
            self.model.load_hf_tensors(iter_safetensors(safetensors_files(Path(source))))


def _as_list(values: list[int] | torch.Tensor) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@functools.lru_cache(maxsize=512)
def _tree_shape(parents: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [n], mask [n, n] bool) of one tree padded to n nodes: node i sees its ancestors and itself,
    padding only itself. Cached by shape: a batch's trees, and a drafter's levels step after step, mostly
    share a few shapes. Callers must not write into the returned tensors."""
    depth = [0] * n
    mask = [[j == i for j in range(n)] for i in range(n)]
    for i, parent in enumerate(parents):
        if i == 0:
            if parent != -1:
                raise ValueError("node 0 must be the root (parent -1)")
            continue
        if not 0 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: each parent must come before its child")
        depth[i] = depth[parent] + 1
        mask[i] = list(mask[parent])   # ancestors of the parent, then self
        mask[i][i] = True
    host = torch.device("cpu")
    return (torch.tensor(depth, dtype=torch.long, device=host),
            torch.tensor(mask, dtype=torch.bool, device=host))


def _tree_layout(trees_tokens: list, trees_parents: list, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [b, n], depth [b, n], mask [b, n, n]) of a batch of trees padded to n nodes, on the host."""
    ids, depths, masks = [], [], []
    for tokens, parents in zip(trees_tokens, trees_parents, strict=True):
        tokens, parents = _as_list(tokens), tuple(_as_list(parents))
        ids.append(tokens[: len(parents)] + [0] * (n - len(parents)))
        depth, mask = _tree_shape(parents, n)
        depths.append(depth)
        masks.append(mask)
    return torch.tensor(ids, dtype=torch.long, device="cpu"), torch.stack(depths), torch.stack(masks)


def _pick(rows: list | None, order: list[int]) -> list | None:
    return None if rows is None else [rows[i] for i in order]


def _unpermute(out, order: list[int], return_hidden: bool):
    """Outputs of rows run in `order` ([b, n, ...], or (logits, hidden)) back in the caller's row order."""
    first = out[0] if return_hidden else out
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[order] = torch.arange(len(order))
    inverse = inverse.to(first.device)
    return tuple(o.index_select(0, inverse) for o in out) if return_hidden else out.index_select(0, inverse)
