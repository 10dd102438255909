"""Logits processing and sampling shared by the target and the drafter.

Exactness rests on one rule: the target's p and the drafter's q go through the *same* processing
(temperature, top-k, top-p) before verification. The verifier then makes the output exactly
distributed as the processed p, for every setting, including greedy:

- greedy rows (temperature == 0) become one-hot on the argmax. With one-hot p (and q one-hot on the
  drafted token) the speculative-sampling accept rule min(1, p/q) is 1 when the draft equals argmax p
  and 0 otherwise, and the recovered token norm(max(0, p - q)) is argmax p, so greedy verification is
  the same code path and no random number can change its outcome.
- -inf logits (a drafter with a reduced vocabulary, banned tokens) get probability exactly 0.

Randomness is drawn per row: a request with a seed owns a torch.Generator, and every random number
for that request comes from it, in an amount that depends only on that request (never on the batch
size or on gamma_max of the batch), so a seeded request is reproducible whatever it is batched with.
Rows without a generator share torch's default generator.

Sampling uses the exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) i.i.d. picks i with
probability w_i / sum(w). It needs no normalisation (handy for the residual max(0, p - q)), never
picks a zero-weight token, and has no cumulative-sum rounding at the end of the vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch

# The smallest positive temperature the server accepts (cluster/validation.py). Smaller ones are still
# computed safely (see logits_to_probs), but they are greedy in all but name.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = 2**64  # torch generators take 64-bit seeds; every seed is reduced modulo this


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 means off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 means off), got {self.top_p}")


def host_reads_are_cheap(device: torch.device) -> bool:
    """Whether reading a value back from `device` costs no synchronisation (the CPU). Code that runs on
    both decides with it whether to read back a flag or to do without one."""
    return device.type == "cpu"


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [...] int64
    """torch.argmax over the last dimension, same result (the first index of the maximum; a NaN counts as
    the maximum in both). On the CPU, numpy's argmax (half types widened to float32): torch's CPU argmax reads
    the vocabulary at a few GB/s, numpy's vectorised one 10-20x faster (0.07 against 1.0 ms for
    [1, 13, 49152] float32 here), and greedy verification and drafting take an argmax over the whole
    vocabulary at every position (docs/decisions/cpu-argmax.md). Elsewhere torch.argmax."""
    if logits.device.type != "cpu" or logits.dim() == 0 or not logits.dtype.is_floating_point:
        return logits.argmax(dim=-1)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()          # bfloat16 / float16 widen exactly: same order, same ties
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))


def greedy_top(logits: torch.Tensor, k: int) -> torch.Tensor:  # [rows, vocab] -> [rows, k] int64
    """The k largest logits' indices per row, best first (ties in either order). On the CPU from 4 rows up,
    by k numpy argmaxes, each pick masked before the next (0.04 against torch.topk's 0.09 ms for
    [16, 4096] bfloat16, k = 3); elsewhere, or where a row has fewer than k finite logits, torch.topk."""
    k = min(k, logits.shape[-1])
    if k == 1:
        return greedy_argmax(logits)[..., None]
    if logits.device.type != "cpu" or not logits.dtype.is_floating_point or logits.shape[0] < 4:
        return torch.topk(logits, k).indices
    left = logits.detach().float().numpy().copy()                   # [rows, vocab], picks masked out
    at = np.arange(left.shape[0])
    picks = []
    for _ in range(k):
        best = left.argmax(axis=-1)
        if picks and np.isneginf(left[at, best]).any():
            return torch.topk(logits, k).indices                   # a row ran out of candidates
        picks.append(best)
        left[at, best] = -np.inf
    return torch.from_numpy(np.stack(picks, axis=-1))


def pick_rows(x: torch.Tensor, rows: list[int], cols: list[int]) -> torch.Tensor:
    """x[rows, cols] of x [b, n, ...]: [len(rows), ...]. On the CPU through numpy, whose gather is 3-5x
    faster than torch's advanced indexing for a drafter's few dozen tree nodes (half types as their
    16-bit patterns, which numpy can hold)."""
    if x.device.type != "cpu":
        return x[rows, cols]
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.from_numpy(x.detach().view(torch.int16).numpy()[rows, cols]).view(x.dtype)
    if x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy()[rows, cols])
    return x[rows, cols]


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A generator for a seeded request; None (use torch's default generator) when unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % SEED_RANGE)
    return generator


def params_to_tensors(
    params: list[SamplingParams], device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request settings as tensors: temperature [batch] float, top_k [batch] long, top_p [batch] float.
    Keep them on the host (the default) for logits_to_probs: it then decides which steps a batch needs
    without reading anything back from the device, and moves the settings there in one copy."""
    for p in params:
        p.validate()
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p


def logits_to_probs(
    logits: torch.Tensor,  # [batch, n, vocab]
    temperature: torch.Tensor,  # [batch] float, 0 => greedy
    top_k: torch.Tensor,  # [batch] long, 0 => off
    top_p: torch.Tensor,  # [batch] float, 1 => off
) -> torch.Tensor:  # [batch, n, vocab]
    """Processed next-token distributions, one per position; greedy rows are one-hot on the argmax.

    Settings that are off leave a row untouched (no rounding can drop a token), and a batch where no
    row uses top-k or top-p skips those sorts: with a 49k vocabulary they cost about a millisecond a row.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    batch, n, vocab = logits.shape
    # Which steps the batch needs is decided on host copies of the settings (free when the caller kept
    # them there, as params_to_tensors does): on a GPU each flag read from the device is a synchronisation.
    host_greedy = temperature.cpu() == 0  # [batch]
    host_top_k, host_top_p = top_k.cpu(), top_p.cpu()
    use_top_k = (host_top_k > 0) & (host_top_k < vocab) & ~host_greedy  # [batch]
    use_top_p = (host_top_p < 1.0) & ~host_greedy  # [batch]
    k_max = int(torch.where(use_top_k, host_top_k, 1).max())
    any_top_k, any_top_p = bool(use_top_k.any()), bool(use_top_p.any())
    if not host_reads_are_cheap(logits.device):
        # the settings and the flags above, to the device in one copy
        packed = torch.stack([temperature.cpu().double(), host_top_k.double(), host_top_p.double(),
                              use_top_k.double(), use_top_p.double()]).to(logits.device)
        temperature, top_k, top_p = packed[0].float(), packed[1].long(), packed[2].float()
        use_top_k, use_top_p = packed[3].bool(), packed[4].bool()
    greedy = temperature == 0  # [batch]
    one_hot = torch.zeros_like(logits).scatter(-1, greedy_argmax(logits).unsqueeze(-1), 1.0)
    if bool(host_greedy.all()):
        return one_hot

    # Temperature: greedy rows divide by 1; their values are replaced by the one-hot at the end.
    # Shifting by the row max first changes nothing mathematically (softmax and top-k are
    # shift-invariant) but keeps a tiny temperature finite: (l - max) / T lies in [-inf, 0], where
    # l / T could reach +inf and softmax would compute inf - inf = NaN. As T -> 0 this yields the limit
    # distribution, uniform over the tied maxima.
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    scaled = shifted / safe_temperature.to(dtype)[:, None, None]

    # Top-k keeps every token whose logit is >= the k-th largest, so tied logits are kept together and
    # the mask does not depend on how ties are ordered.
    if any_top_k:
        k = torch.where(use_top_k, top_k, torch.ones_like(top_k))  # [batch]
        top_values = scaled.topk(k_max, dim=-1).values  # [batch, n, k_max], descending
        kth_value = top_values.gather(-1, (k - 1)[:, None, None].expand(-1, n, 1))  # [batch, n, 1]
        below = (scaled < kth_value) & use_top_k[:, None, None]
        scaled = scaled.masked_fill(below, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)

    # Top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token is dropped
    # when the mass strictly before it (in descending order) is already >= top_p. A stable sort makes
    # the choice among tied tokens deterministic.
    if any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [batch, n, vocab]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = (mass_before >= top_p.to(dtype)[:, None, None]) & use_top_p[:, None, None]
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    return torch.where(greedy[:, None, None], one_hot, probs)


def _per_row_noise(
    generators: list[torch.Generator | None], counts: list[int], width: int, device, draw,
    fill: float = 0.0, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [batch, width] float32
    """Random numbers per row: row b takes counts[b] numbers from its own generator (`fill` after them);
    rows without a generator take theirs in one call to the default generator (a row with count 0 none).
    draw(t, g) fills t (of `dtype`) in place from g."""
    b = len(generators)
    full = all(c == width for c in counts)
    noise = torch.empty(b, width, device=device) if full else torch.full((b, width), fill, device=device)
    shared_rows = [i for i, g in enumerate(generators) if g is None and counts[i] > 0]
    if shared_rows:
        drawn = draw(torch.empty(len(shared_rows), width, device=device, dtype=dtype), None)
        noise[shared_rows] = drawn.to(noise.dtype)
    for i, g in enumerate(generators):
        if g is not None and counts[i] > 0:
            own = draw(torch.empty(counts[i], device=g.device, dtype=dtype), g)
            noise[i, : counts[i]] = own.to(device)
    return noise


def uniform_noise(
    generators: list[torch.Generator | None], counts: list[int], width: int, device="cpu",
    greedy: list[bool] | None = None,
) -> torch.Tensor:  # [batch, width], uniform in [0, 1)
    """greedy rows (p one-hot) draw nothing and get 0: u·q < p then accepts exactly the argmax."""
    if greedy is not None:
        counts = [0 if g else c for c, g in zip(counts, greedy, strict=True)]
    return _per_row_noise(generators, counts, width, device, lambda t, g: t.uniform_(generator=g))


def exponential_noise(
    generators: list[torch.Generator | None], width: int, device="cpu", greedy: list[bool] | None = None
) -> torch.Tensor:  # [batch, width], Exp(1), strictly positive
    """greedy rows (p one-hot) draw nothing and get 1: the race then picks the one token with weight.

    Drawn by inversion, -log(1 - U): the same Exp(1), and on a CPU faster than Tensor.exponential_
    (docs/decisions/sampling-by-inversion.md). U is float64: float32 uniforms are multiples of 2^-24,
    and U = 0 (E = 0, a win in the race whatever the token's weight)
    would come about once in 340 draws of such a row."""
    counts = [0 if greedy is not None and greedy[b] else width for b in range(len(generators))]
    noise = _per_row_noise(generators, counts, width, device, _exponential_by_inversion, fill=1.0,
                           dtype=torch.float64)
    # E = 0 is still possible (U = 0, 2^-53 a draw); 0/0 would give NaN, which argmax prefers.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _exponential_by_inversion(t: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
    """Fill t with Exp(1) draws in place: -log1p(-U), U ~ uniform [0, 1) from g."""
    return t.uniform_(generator=g).neg_().log1p_().neg_()


def sample_with_noise(
    weights: torch.Tensor,  # [batch, vocab] non-negative, any positive scale
    noise: torch.Tensor,  # [batch, vocab] Exp(1) from exponential_noise
) -> torch.Tensor:  # [batch] long
    """Exponential race: token i wins with probability weights[i] / sum(weights)."""
    return (weights / noise.to(weights.dtype)).argmax(dim=-1)


def sample(
    probs: torch.Tensor,  # [batch, vocab]
    generators: list[torch.Generator | None],
    greedy: list[bool] | None = None,  # rows whose probs are one-hot: no randomness drawn
) -> torch.Tensor:  # [batch] long
    """One token per row from probs; row b draws its randomness from generators[b]."""
    noise = exponential_noise(generators, probs.shape[-1], device=probs.device, greedy=greedy)
    return sample_with_noise(probs, noise)
