"""Pre-allocated key/value cache for many sequences, one slot per sequence.

Rollback after a rejected draft only moves a length pointer (as in gpt-fast): the stale entries
past the new length are never attended to and get overwritten by the next write. A tree step
writes every node after the committed prefix; `compact` then moves the accepted path down so the
slot holds a plain chain again.

Layout: k, v are [num_layers, num_slots, num_kv_heads, max_seq_len, head_dim]. Keeping one head's
positions contiguous means the keys of a slot (or of a run of consecutive slots) up to some length
are a strided *view* that scaled_dot_product_attention reads directly, with no copy per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


class CacheFullError(RuntimeError):
    """No free slot, or a write past max_seq_len."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        scratch_slot: bool = False,
    ):
        """scratch_slot: one more slot past num_slots that is never allocated: the padded rows of a
        static-shape batch (workers/models/static_decode.py) write there."""
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.scratch = num_slots if scratch_slot else None
        shape = (num_layers, num_slots + int(scratch_slot), num_kv_heads, max_seq_len, head_dim)
        # Zeros, not empty: padded rows of a batch may read past a slot's length, and
        # uninitialised memory could hold NaN/inf that a -inf mask does not neutralise in every kernel.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Committed length per slot. Kept on the CPU whatever the device: the model plans every
        # forward (slices, masks) from these numbers in Python.
        self.lengths = torch.zeros(num_slots + int(scratch_slot), dtype=torch.long, device="cpu")
        # A heap: the lowest free slot is handed out first, so running requests keep to the low slots and a
        # batch's slots tend to be consecutive, which the model reads as one cache view (layers.BatchPlan)
        self._free = list(range(num_slots))
        self._in_use = [False] * num_slots

    # ---- slot bookkeeping -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV cache slots are in use; free one first")
        slot = heapq.heappop(self._free)
        self._in_use[slot] = True
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        self._in_use[slot] = False
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def lengths_of(self, slots: list[int]) -> list[int]:
        """Committed lengths of `slots`: read as one list (indexing the tensor by a list costs 10x)."""
        held = self.lengths.tolist()
        return [held[s] for s in slots]

    def rollback(self, slot: int, new_length: int) -> None:
        """Forget everything at positions >= new_length (e.g. rejected draft tokens)."""
        self._check_slot(slot)
        if not 0 <= new_length <= int(self.lengths[slot]):
            raise ValueError(f"rollback to {new_length} but slot {slot} holds {int(self.lengths[slot])}")
        self.lengths[slot] = new_length

    def rollback_many(self, slots: list[int], new_lengths: list[int]) -> None:
        """rollback(slots[i], new_lengths[i]) for every i, checked first, then written in one go."""
        held = self.lengths.tolist()
        for slot, new_length in zip(slots, new_lengths, strict=True):
            self._check_slot(slot)
            if not 0 <= new_length <= held[slot]:
                raise ValueError(f"rollback to {new_length} but slot {slot} holds {held[slot]}")
        if len(slots) == 1:
            self.lengths[slots[0]] = new_lengths[0]
        else:
            self.lengths[slots] = torch.tensor(new_lengths, dtype=self.lengths.dtype, device="cpu")

    def compact_many(self, slots: list[int], starts: list[int], keeps: list[list[int]]) -> None:
        """compact(slots[i], starts[i], keeps[i]) for every i, with one gather and one write for k and for v
        (per slot: two index_selects and two writes, i.e. kernel launches on a GPU, per row of a batch)."""
        rows, src, dst, lengths = [], [], [], []
        for slot, start, keep in zip(slots, starts, keeps, strict=True):
            self._check_slot(slot)
            n = len(keep)
            if n and (min(keep) < 0 or start + max(keep) >= self.max_seq_len):
                raise ValueError(f"compact indices {list(keep)} out of range for start {start}")
            if list(keep) != list(range(n)):
                rows += [slot] * n
                src += [start + k for k in keep]
                dst += range(start, start + n)
            lengths.append(start + n)
        if rows:
            device = self.k.device
            at = torch.tensor(rows, device=device)
            src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
            # advanced indexing gathers a copy before the write: overlapping moves are safe
            self.k[:, at, :, dst_t] = self.k[:, at, :, src_t]
            self.v[:, at, :, dst_t] = self.v[:, at, :, src_t]
        self.lengths[slots] = torch.tensor(lengths, dtype=torch.long, device="cpu")

    def compact(self, slot: int, start: int, keep: list[int] | torch.Tensor) -> None:
        """Keep only positions start + keep[j], moved to start + j; then length = start + len(keep).

        Used after a tree step: nodes were written at start + node_index, and `keep` lists the
        accepted path's node indices (the root first). Entries before `start` stay as they are.
        """
        self._check_slot(slot)
        keep = torch.as_tensor(keep, dtype=torch.long, device="cpu").flatten()
        n = keep.numel()
        if n and (int(keep.min()) < 0 or start + int(keep.max()) >= self.max_seq_len):
            raise ValueError(f"compact indices {keep.tolist()} out of range for start {start}")
        if n and not torch.equal(keep, torch.arange(n, device=keep.device)):
            src = (start + keep).to(self.k.device)
            # index_select copies before the write, so overlapping source/destination is safe.
            self.k[:, slot, :, start : start + n] = self.k[:, slot].index_select(2, src)
            self.v[:, slot, :, start : start + n] = self.v[:, slot].index_select(2, src)
        self.lengths[slot] = start + n

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots and self._in_use[slot]):
            raise ValueError(f"slot {slot} is not allocated")

    # ---- tensor access used by the model ----------------------------------------------------

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [b]
        positions: torch.Tensor,  # [b, n] storage positions
        k_new: torch.Tensor,  # [b, kv_heads, n, head_dim]
        v_new: torch.Tensor,  # [b, kv_heads, n, head_dim]
    ) -> None:
        """Write new keys/values at arbitrary positions (general form, any pattern)."""
        last = int(positions.max())
        if last >= self.max_seq_len:
            raise CacheFullError(f"write at position {last} >= max_seq_len {self.max_seq_len}")
        slots = slots.to(self.k.device)
        positions = positions.to(self.k.device)
        # Advanced indices around a slice put the indexed dims first: the target is [b, n, heads, dim].
        self.k[layer][slots[:, None], :, positions] = k_new.transpose(1, 2)
        self.v[layer][slots[:, None], :, positions] = v_new.transpose(1, 2)

    def write_runs(
        self,
        layer: int,
        slots: list[int],
        starts: list[int],
        k_new: torch.Tensor,  # [b, kv_heads, n, head_dim]
        v_new: torch.Tensor,  # [b, kv_heads, n, head_dim]
    ) -> None:
        """Row i is written at positions starts[i] .. starts[i] + n - 1 of slot slots[i]."""
        self.write_at(layer, self.run_index(slots, starts, k_new.shape[2]), k_new, v_new)

    def write_at(
        self,
        layer: int,
        index: torch.Tensor,  # [m] from run_index or token_index
        k_new: torch.Tensor,  # [b, kv_heads, n, d] or [T, kv_heads, 1, d]: m vectors in index order
        v_new: torch.Tensor,  # like k_new
    ) -> None:
        """One index_copy_ per tensor into the layer's flat [slots * kv_heads * max_seq_len, head_dim] view
        (the index built once per forward and shared by the layers; cheaper than slice copies per row:
        docs/decisions/ragged-verify.md). The caller checks capacity once per
        forward (see `check_capacity`)."""
        d = k_new.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, index, k_new.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v_new.reshape(-1, d))

    def run_index(self, slots: list[int], starts: list[int], n: int) -> torch.Tensor:
        """Flat indices [b * kv_heads * n] for rows of n new tokens at starts[i] of slot slots[i], in the
        order of k_new's [b, kv_heads, n] vectors."""
        positions = [[s + j for j in range(n)] for s in starts]
        return self._flat_index(slots, positions).transpose(1, 2).flatten().to(self.k.device)

    def token_index(self, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Flat indices [T * kv_heads] for T single tokens, token t at position positions[t] of slot
        slots[t], in [T, kv_heads] order."""
        return self._flat_index(slots, [[p] for p in positions]).flatten().to(self.k.device)

    def _flat_index(self, slots: Sequence[int], positions: list[list[int]]) -> torch.Tensor:
        """[rows, n, kv_heads]: (slot * kv_heads + head) * max_seq_len + position, on the host."""
        heads, cpu = self.k.shape[2], torch.device("cpu")
        slot_heads = torch.tensor(slots, device=cpu)[:, None] * heads + torch.arange(heads, device=cpu)
        pos = torch.tensor(positions, device=cpu)  # [rows, n]
        return slot_heads[:, None, :] * self.max_seq_len + pos[:, :, None]

    def check_capacity(self, starts: list[int], n: int) -> None:
        if max(starts) + n > self.max_seq_len:
            raise CacheFullError(f"{max(starts)} + {n} new tokens exceed max_seq_len {self.max_seq_len}")

    def read(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `slots` at positions [0, length): two [b, kv_heads, length, head_dim].

        A view when the slots are consecutive (always true for batch 1); a gather otherwise.
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return (
                self.k[layer, first : first + len(slots), :, :length],
                self.v[layer, first : first + len(slots), :, :length],
            )
        # Slice the length first: gathering whole max_seq_len rows would copy far more.
        index = torch.tensor(slots, device=self.k.device)
        return (
            self.k[layer, :, :, :length].index_select(0, index),
            self.v[layer, :, :, :length].index_select(0, index),
        )
