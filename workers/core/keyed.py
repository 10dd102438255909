"""Keyed sampling for seeded requests: the token at a position is a function of (seed, position, p).

A seeded sampled request samples its token at absolute position t (its index in prompt + output) by the
exponential race

    x_t = argmax_v p_t(v) / E(seed, t, v),        E(seed, t, v) ~ Exp(1),

where E is a hash of (seed, t, v) (a counter-based generator computed with torch integer ops), not a
draw from a stream. The race picks v with probability p_t(v) (the exponential form of Gumbel-max), and
because the noise depends on nothing else, the token at t depends only on the seed and on p_t: not on
the batch, on drafts, on how many numbers anything drew before, or on the device. The target verifies a
seeded row against these samples (workers/engine/target_worker.py): a draft is accepted iff it equals
the target's sample at its position, and the sample where the walk stops is emitted. So a seed gives
the same text with speculation on or off, on any drafter, under any load, and the output is exactly
target sampling: each emitted token is the target's own sample given the prefix before it, and the
noise at t is independent of the noise at earlier positions (the hash mixes t into a 64-bit row key).
A drafter that races its q with the same noise (workers/drafters/model.py) proposes the target's sample
whenever the two races come out alike. Unseeded sampled requests keep speculative sampling with the
residual (workers/core/verify_chain.py, verify_tree.py). docs/decisions/seeded-sampling.md.
"""

import torch

from specd.workers.core.sampling import SEED_RANGE

# splitmix64's finaliser on int64 tensors (torch integer arithmetic wraps modulo 2^64); right shifts of
# int64 are arithmetic in torch, so each is masked to the logical shift.
_MIX64 = (-4658895280553007687, -7723592293110705685)     # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_GOLDEN64 = -7046029254386353131                          # 0x9E3779B97F4A7C15
# murmur3's fmix32 on int32 tensors, used per vocabulary entry (half the memory of int64)
_MIX32 = (-2048144789, -1028477387)                       # 0x85EBCA6B, 0xC2B2AE35
_GOLDEN32 = -1640531527                                   # 0x9E3779B9
# Rows per chunk on a CPU: a 49k vocabulary's temporaries of ~5 rows stay in cache (all rows at once
# spill it and run 2-3x slower here); a GPU takes every row in one go.
_CPU_CHUNK_ELEMENTS = 1 << 18


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX64[0]
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX64[1]
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _fmix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """fmix32 in place on an int32 tensor (tmp: scratch of its shape)."""
    for shift, multiplier in ((16, _MIX32[0]), (13, _MIX32[1]), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_((1 << (32 - shift)) - 1))
        if multiplier is not None:
            x.mul_(multiplier)
    return x


def seeds_tensor(seeds: list[int], device) -> torch.Tensor:
    """Request seeds (any Python ints) as int64: seed mod 2^64 in two's complement."""
    wrapped = [(s % SEED_RANGE) - SEED_RANGE if s % SEED_RANGE >= 2**63 else s % SEED_RANGE for s in seeds]
    return torch.tensor(wrapped, dtype=torch.long, device=device)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [R] int64, positions [R] int64 -> two int32 halves [R] of a 64-bit key per (seed, position)."""
    key = _mix64(_mix64(seeds) + positions * _GOLDEN64)
    low = ((key & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000      # the low 32 bits as a signed value
    return low.to(torch.int32), (key >> 32).to(torch.int32)


def keyed_exponentials(
    seeds: torch.Tensor,  # [R] int64 (seeds_tensor)
    positions: torch.Tensor,  # [R] int64 absolute positions
    vocab_ids: torch.Tensor,  # [V'] long: the vocabulary ids to draw for (a drafter's head may hold a subset)
) -> torch.Tensor:  # [R, V'] float32, Exp(1), finite and > 0
    """E(seed, t, v) for every row's (seed, t) and every v in vocab_ids.

    31 random bits per entry: E = -log(1 - U), U = (h + 1/2) / 2^31, so E lies in [2^-32, 16.6]. An
    outcome of the race can differ from an infinitely precise race's only when two tokens' scores
    p/E agree to about 31 bits, far finer than the float32 rounding of p itself."""
    low, high = row_keys(seeds, positions)
    offsets = vocab_ids.to(torch.int32) * _GOLDEN32                      # [V'] int32, a bijection of v
    x = low[:, None] + offsets[None, :]                                   # [R, V'] int32
    tmp = torch.empty_like(x)
    _fmix32_(x, tmp)
    x.bitwise_xor_(high[:, None])
    _fmix32_(x, tmp)
    u = x.bitwise_and_(0x7FFFFFFF).float().add_(0.5).mul_(2.0**-31).clamp_max_(1.0 - 2.0**-24)
    return u.neg_().log1p_().neg_()


def keyed_race(
    weights: torch.Tensor,  # [R, V'] non-negative, any positive scale
    seeds: torch.Tensor,  # [R] int64
    positions: torch.Tensor,  # [R] int64
    vocab_ids: torch.Tensor | None = None,  # [V'] ids of weights' columns; None = 0..V'-1
    k: int = 1,
) -> torch.Tensor:  # [R, k] long: column indices, best first
    """The race's winner (k = 1), or its top k: an ordered sample without replacement from the weights
    (Gumbel-top-k), keyed to (seed, position)."""
    rows, width = weights.shape
    if vocab_ids is None:
        vocab_ids = _arange(width, weights.device)
    out = torch.empty(rows, k, dtype=torch.long, device=weights.device)
    chunk = rows if weights.device.type != "cpu" else max(1, _CPU_CHUNK_ELEMENTS // max(width, 1))
    for s in range(0, rows, chunk):
        e = keyed_exponentials(seeds[s : s + chunk], positions[s : s + chunk], vocab_ids)
        scores = weights[s : s + chunk].float() / e
        out[s : s + chunk] = scores.argmax(-1, keepdim=True) if k == 1 else scores.topk(k, dim=-1).indices
    return out


_ARANGES: dict[tuple[int, str], torch.Tensor] = {}


def _arange(n: int, device) -> torch.Tensor:
    key = (n, str(device))
    if key not in _ARANGES:
        _ARANGES[key] = torch.arange(n, device=device)
    return _ARANGES[key]



def keyed_sample(
    probs: torch.Tensor,  # [R, V'] non-negative weights (p or q after logits_to_probs)
    seeds: list[int],  # [R] request seeds
    positions: list[int],  # [R] absolute positions being sampled
    vocab_ids: torch.Tensor | None = None,  # [V'] ids of probs' columns; None = 0..V'-1
) -> torch.Tensor:  # [R] long column indices
    """Each row's keyed sample at its (seed, position)."""
    device = probs.device
    return keyed_race(probs, seeds_tensor(seeds, device), torch.tensor(positions, dtype=torch.long,
                                                                       device=device), vocab_ids)[:, 0]
