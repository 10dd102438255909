"""Start-up cost profile for the goodput controller, timed on the device that serves.

A short sweep: target forwards of b rows × n tokens (the shape of a verify step with n - 1 drafts per
row) at a few batch sizes, two ragged forwards per batch size (one row of 2 tokens, then of max tokens,
the others of one: what going ragged costs at all, `ragged`, and how much the longest row costs beyond
the mean, `pad_weight`), and drafter proposals of depth 1 and 3 at the same batch sizes. The ragged
forwards and the two-token one are timed in interleaved pairs beside a plain forward: the few
milliseconds they differ by were lost in the noise of forwards timed apart. Cells not measured are
interpolated (workers/core/goodput.py extends the table linearly), so the sweep stays ten-odd seconds
on a CPU. The numbers only steer γ: output is exact whatever they say.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from specd.workers.core.goodput import interpolate
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import SCRATCH_PREFIX

PROFILE_TOKENS = (1, 2, 3, 5, 9)   # tokens per row measured; the rest of 1..max is interpolated
RAGGED_PAIRS = 6                   # interleaved (plain, ragged) pairs per ragged shape and batch size


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def profile_verify(
    runner,
    batch_sizes: Sequence[int] = (1, 4, 16),
    max_tokens: int = 9,
    prompt_len: int = 64,
    repeats: int = 2,
    budget_s: float | None = None,
) -> dict:
    """{"verify": {b: [seconds of a forward over b rows of n tokens, n = 1..max_tokens]}, "pad_weight": w,
    "ragged": {b: seconds}, "skipped": [b]} on the runner's device; a ragged batch costs ragged[b] plus the
    uniform one of n = mean + w · (longest − mean) tokens per row (w = 1: every row padded to the longest;
    0: only real tokens cost).

    Uses free KV slots of the runner and frees them again; batch sizes above the free slots are skipped.
    budget_s: the smallest batch size is always swept; a larger one only while the sweep so far plus its
    estimate (its forwards priced from the last size swept, in proportion to rows: an upper bound where a
    batch is cheaper per row) fits in it. A large target on a CPU takes minutes for the full sweep, and
    the cost model extends its table past the sizes measured.
    """
    table: dict[int, list[float]] = {}
    weights: list[float] = []
    ragged_fixed: dict[int, float] = {}
    skipped: list[int] = []
    measured_n = sorted({n for n in PROFILE_TOKENS if n < max_tokens} | {max_tokens})
    # a short context (max_seq_len) gets a shorter profile prompt rather than a full cache
    prompt_len = max(1, min(prompt_len, runner.max_seq_len - max_tokens))
    t0 = time.perf_counter()
    for b in sorted(set(batch_sizes)):
        if b > runner.num_free:
            continue
        if budget_s is not None and table:
            last = max(table)
            estimate = _sweep_forwards(measured_n, repeats, b > 1) * statistics.mean(table[last]) * b / last
            if time.perf_counter() - t0 + estimate > budget_s:
                skipped.extend(x for x in sorted(set(batch_sizes)) if x >= b and x <= runner.num_free)
                break
        slots = [runner.allocate() for _ in range(b)]
        try:
            runner.prefill(slots, [[1] * prompt_len for _ in slots])
            seconds = [_timed_extend(runner, slots, [n] * b, repeats) for n in measured_n]
            if len(measured_n) > 1 and measured_n[1] == 2:
                # The first draft token's price decides most plans at high load: what two tokens a row
                # cost beyond one, timed in pairs (apart, the difference moved with the machine's
                # noise between start-ups: docs/decisions/goodput-pricing.md).
                extra = _paired_extra(runner, slots, [1] * b, [2] * b, RAGGED_PAIRS)
                seconds[1] = seconds[0] + max(extra, 0.0)
            table[b] = [interpolate(measured_n, seconds, n) for n in range(1, max_tokens + 1)]
            if b > 1 and max_tokens > 1:
                # Each ragged forward against a plain one, in interleaved pairs: a few milliseconds
                # between two forwards timed apart were lost in their noise
                # (docs/decisions/goodput-pricing.md).
                plain = [1] * b
                small = _paired_extra(runner, slots, plain, [2] + plain[1:], RAGGED_PAIRS)
                ragged_fixed[b] = max(small - (table[b][1] - table[b][0]) / b, 0.0)
                longest = _paired_extra(runner, slots, plain, [max_tokens] + plain[1:], RAGGED_PAIRS)
                ragged = table[b][0] + longest - ragged_fixed[b]
                weights.append(_pad_weight(table[b], ragged, b, max_tokens))
        finally:
            for s in slots:
                runner.free(s)
    if not table:
        raise ValueError(f"no batch size of {list(batch_sizes)} fits the runner's free slots")
    pad_weight = statistics.median(weights) if weights else 1.0
    return {"verify": table, "pad_weight": pad_weight, "ragged": ragged_fixed, "skipped": skipped}


def _sweep_forwards(measured_n: Sequence[int], repeats: int, ragged: bool) -> int:
    """Forwards one batch size's sweep runs: each measured n (a warm-up and `repeats`), the paired
    two-token price, and for several rows the two ragged shapes (each a warm-up and its pairs); the
    prefill is counted as one more."""
    pairs = 1 + 2 * RAGGED_PAIRS
    return 1 + len(measured_n) * (1 + repeats) + pairs + (2 * pairs if ragged else 0)


def _pad_weight(row: list[float], ragged_seconds: float, b: int, longest: int) -> float:
    """w such that the uniform row at n = mean + w · (longest − mean) takes ragged_seconds."""
    mean = (longest + b - 1) / b
    # the uniform row's n that costs ragged_seconds, on the row's running maximum (timing noise can make
    # a longer row measure faster)
    rising = [max(row[: k + 1]) for k in range(len(row))]
    n_equal = float(len(row))
    for k in range(1, len(rising)):
        if rising[k] >= ragged_seconds:
            low, high = rising[k - 1], rising[k]
            n_equal = k + (min(max((ragged_seconds - low) / (high - low), 0.0), 1.0) if high > low else 1.0)
            break
    return min(max((n_equal - mean) / (longest - mean), 0.0), 1.0)


def _timed_extend(runner, slots: list[int], counts: list[int], repeats: int) -> float:
    return _timed(_extend_forward(runner, slots, counts), repeats)


def _extend_forward(runner, slots: list[int], counts: list[int]):
    """A verify-shaped forward of counts[i] tokens for slot i, rolled back after (a callable)."""
    base = [runner.length(s) for s in slots]

    def forward() -> None:
        runner.extend(slots, [[1] * n for n in counts])
        for s, length in zip(slots, base, strict=True):
            runner.rollback(s, length)
        _sync(runner)

    return forward


def _paired_extra(runner, slots: list[int], counts: list[int], other: list[int], pairs: int) -> float:
    """Median over `pairs` pairs of what a forward of `other` takes beyond one of `counts` run beside it
    (in ABBA order, so drift falls on both alike)."""
    first, second = _extend_forward(runner, slots, counts), _extend_forward(runner, slots, other)
    second()  # warm-up: a new shape allocates
    extra = []
    for i in range(pairs):
        seconds = {}
        for name, fn in (("a", first), ("b", second)) if i % 2 == 0 else (("b", second), ("a", first)):
            t0 = time.perf_counter()
            fn()
            seconds[name] = time.perf_counter() - t0
        extra.append(seconds["b"] - seconds["a"])
    return statistics.median(extra)


def profile_drafter(
    drafter, batch_sizes: Sequence[int] = (1, 4, 16), prompt_len: int = 64, repeats: int = 2,
    max_seq_len: int | None = None, catch_up_tokens: int = 32,
) -> dict:
    """{"draft": {b: seconds per drafted level for b rows}, "catch_up": seconds per context token}.

    Levels: the slope between proposals of depth 3 and depth 1. Catch-up: what a proposal costs beyond a
    plain one when each row first takes in `catch_up_tokens` committed tokens it has not seen (a request
    that did not draft for a while), per token, at the largest batch size; the batched catch-up costs
    about the same per token at any size. A combined drafter (suffix, hybrid) is timed through its model
    drafter: its lookups draft for free and would time at zero (the suffix drafter drafts the profile's
    own repeated tokens), while the model forwards are what the goodput plan must price.
    max_seq_len: the drafter's context; the profile's requests fit in it."""
    drafter = drafter.weights_drafter or drafter
    table: dict[int, float] = {}
    if max_seq_len is not None:
        # each timed level step commits one token and drafts up to 3 more; each catch-up step commits
        # catch_up_tokens and drafts one (a warm-up and `repeats` timed calls of each)
        prompt_len = max(2, min(prompt_len, max_seq_len - 2 * (repeats + 1) - 4))
        catch_up_tokens = min(catch_up_tokens, (max_seq_len - prompt_len - 4) // (repeats + 1) - 2)
    sizes = [b for b in sorted(set(batch_sizes)) if b <= drafter.max_slots()]
    for b in sizes:
        table[b] = _drafter_level_seconds(drafter, b, prompt_len, repeats)
    catch_up = 0.0
    if sizes and drafter.weights_drafter is not None and catch_up_tokens >= 2:
        catch_up = _drafter_catch_up_seconds(drafter, sizes[-1], prompt_len, repeats, catch_up_tokens)
    return {"draft": table, "catch_up": catch_up}


def _hidden_size(drafter) -> int | None:
    inner = getattr(drafter, "model", None)
    return getattr(drafter, "hidden_size", None) or getattr(inner, "hidden_size", None)


def _profile_requests(drafter, b: int, prompt_len: int, name: str) -> list[str]:
    """b scratch requests with the same prompt (and zero hidden states for a drafter that reads them)."""
    ids = [f"{SCRATCH_PREFIX}profile-{name}-{i}" for i in range(b)]
    prompt = [(7 * k) % 97 + 1 for k in range(prompt_len)]
    for rid in ids:
        hidden = drafter.uses_target_hidden
        extra = {"hidden": torch.zeros(prompt_len - 1, _hidden_size(drafter))} if hidden else {}
        drafter.add_request(rid, prompt, seed=0, **extra)
    return ids


def _reject_and_commit(drafter, ids: list[str], depth: int, tokens: int) -> None:
    """Propose `depth` per row, then reject everything: the drafter rolls back and takes `tokens` target
    tokens, which it reads at its next proposal."""
    drafter.propose(ids, [depth] * len(ids), [SamplingParams() for _ in ids])
    for rid in ids:
        extra = {"hidden": torch.zeros(tokens, _hidden_size(drafter))} if drafter.uses_target_hidden else {}
        drafter.commit(rid, 0, [5] * tokens, **extra)


def _drafter_level_seconds(drafter, b: int, prompt_len: int, repeats: int) -> float:
    ids = _profile_requests(drafter, b, prompt_len, "level")
    try:
        one = _timed(lambda: _reject_and_commit(drafter, ids, 1, 1), repeats)
        three = _timed(lambda: _reject_and_commit(drafter, ids, 3, 1), repeats)
    finally:
        for rid in ids:
            drafter.remove_request(rid)
    return max((three - one) / 2, 0.0)


def _drafter_catch_up_seconds(drafter, b: int, prompt_len: int, repeats: int, tokens: int) -> float:
    ids = _profile_requests(drafter, b, prompt_len, "catch-up")
    try:
        plain = _timed(lambda: _reject_and_commit(drafter, ids, 1, 1), repeats)
        behind = _timed(lambda: _reject_and_commit(drafter, ids, 1, tokens), repeats)
    finally:
        for rid in ids:
            drafter.remove_request(rid)
    return max((behind - plain) / (b * (tokens - 1)), 0.0)


def _sync(runner) -> None:
    device = str(getattr(runner, "device", "cpu"))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
