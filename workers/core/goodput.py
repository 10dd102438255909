"""Goodput controller: γ and tree width per request per step, chosen for the whole batch's tokens/second.

SmartSpec / TurboSpec (arXiv 2406.14066): speculation pays only while the tokens it adds are worth more
than the time drafting and the longer verify cost, and that trade moves with load. Each step, for the
requests verified together in one target forward, we pick (γ_i, w_i) to maximise

    goodput = Σ_i E[tokens_i | γ_i, w_i] / (draft_seconds(b, shape) + verify_seconds(b, shape))

- E[tokens_i] comes from the request's predicted acceptance per draft position, α_i[k] (`Acceptance`):
  1 + Σ_{k<γ} Π_{j<=k} a_j with a_j = 1 - (1 - α_i[j])^w for a tree level of width w (optimistic: the w
  candidates are treated as independent). α_i is seeded from the drafter's per-position acceptance and
  moves with the request's own verification results (EMA per position).
- Seconds come from `StepCostModel`: a table of measured verify forwards over (batch rows, tokens per row)
  and drafter forwards per batch size, profiled at start-up on the actual device and corrected online from
  measured step times (EMA). A verify forward over rows of different lengths costs between its mean and its
  longest row: the runner's matmuls skip the padding but attention does not (workers/models/layers.py), so
  the profile measures `pad_weight` w and a batch is priced as n = mean + w · (longest − mean) tokens per
  row (w = 1: fully padded, the CUDA-graph buckets; `padded=True/False` forces 1 or 0), plus what going
  ragged costs at all (`ragged[b]`: the row groups' extra gathers and attention calls).
- A step that drafts also pays host work no forward accounts for: the plan itself, suffix lookups, the
  drafter's commits, longer bookkeeping: small beside a CPU forward, most of a drafting step on a GPU
  (docs/decisions/goodput-host-cost.md). Where drafter and target share a thread (the in-process
  engine) each step's wall time less its verify and priced drafter forwards is measured (`observe_host`), and
  what drafting steps take beyond steps that draft nothing is charged to every plan that drafts
  (`host_seconds`), a fixed cost per step. Through Ray the same is measured on steps that ran alone (no
  other pipeline group's step in flight) and charged to plans made alone: there it is the drafter call's
  round trip, which a step that drafts nothing no longer waits for, and which a second group's verify hides.

Optimisation is greedy: start from γ = 0 everywhere and repeatedly apply the move with the best goodput,
among "one more draft token for request i", "one more tree candidate for request i" and "lift every
request to the next level" (that move matters with padded rows, where one row alone never pays for the
longer forward but all rows together may); stop when no move raises goodput. The fixed host cost of a
drafting step would stop the first move of every climb (one draft token rarely pays a whole step's
host work, eight may), so the climb runs without it, goes on with it, and the result must then beat
drafting nothing with it. γ = 0 for every request is plain target-only decoding, which is what the
controller falls back to when drafting cannot pay.

Plain python: no torch, ray, grpc or redis.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

HOST_DRIFT = 0.005  # per step without drafts: the drafting host figure's pull toward the plain one
HOST_BETA_UP = 0.5  # EMA factor of a drafting step's host seconds above the current figure
# per measured verify: the pull of every other cell of its batch size (and of the drafter's figure)
# toward the start-up profile's shape, scaled by what that verify measured
PROFILE_DRIFT = 0.005


def _interpolated(table: dict[int, float], x: float) -> float:
    """interpolate() over a sparse {x: y} table, clipped at 0; 0 when empty."""
    if not table:
        return 0.0
    xs = sorted(table)
    return max(interpolate(xs, [table[k] for k in xs], x), 0.0) if len(xs) > 1 else table[xs[0]]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending; extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0]) if xs[0] else ys[0]  # one point: proportional
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostProfile:
    """Measured seconds: verify[b][n-1] = one target forward over b rows of n tokens (n = 1 + drafts);
    draft[b] = one drafter forward over b rows of one token (0 for deterministic drafters); pad_weight:
    what the longest row of a ragged batch costs beyond the mean (see the module docstring); catch_up:
    seconds per context token a model drafter takes in before it drafts for a request that did not draft
    for a while (the tokens committed meanwhile go in a prefill first)."""

    verify: dict[int, list[float]]
    draft: dict[int, float] = field(default_factory=dict)
    pad_weight: float = 1.0
    ragged: dict[int, float] = field(default_factory=dict)   # b -> fixed seconds of a ragged forward
    catch_up: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify or any(not row for row in self.verify.values()):
            raise ValueError("a cost profile needs at least one batch size with one measured forward")
        if any(t < 0 for row in self.verify.values() for t in row) or any(t < 0 for t in self.draft.values()):
            raise ValueError("measured seconds must be >= 0")
        if any(t < 0 for t in self.ragged.values()) or self.catch_up < 0:
            raise ValueError("measured seconds must be >= 0")
        if not 0.0 <= self.pad_weight <= 1.0:
            raise ValueError(f"pad_weight must be in [0, 1], got {self.pad_weight}")


class StepCostModel:
    """Seconds of one step as a function of the batch's shape, from a CostProfile and online corrections.

    verify_seconds(b, n): interpolated over the profiled batch sizes and tokens per row (linear past the
    table). observe_verify() moves the one-token cell of the nearest profiled batch size toward plain
    verifies and a drafting factor per batch size toward drafting ones (EMA with factor `beta` on the new
    value), so a profile taken on a quiet machine at short contexts follows the real load.
    """

    def __init__(self, profile: CostProfile, padded: bool | None = None, beta: float = 0.2) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.batches = sorted(profile.verify)
        self.verify_table = {b: list(profile.verify[b]) for b in self.batches}
        self.draft_batches = sorted(profile.draft)
        self.draft_table = dict(profile.draft)
        self.profile = profile
        self.pad_weight = profile.pad_weight if padded is None else float(padded)
        self.ragged_batches = sorted(profile.ragged)
        self.ragged_table = dict(profile.ragged)
        # batch bucket -> host seconds of a step that drafted / drafted nothing (EMA; see observe_host)
        self.host_draft: dict[int, float] = {}
        self.host_plain: dict[int, float] = {}
        self._host_last: dict[int, float] = {}     # the latest drafting step's seconds, per bucket
        self._verify_last: dict[tuple, float] = {}  # (batch, 0) or ("draft", batch) -> latest ratio
        self.draft_factor: dict[int, float] = {}      # batch -> drafting verifies' measured / table seconds
        self._draft_last: dict[int, float] = {}                 # batch -> latest seconds per level
        self.beta = beta

    def _verify_row(self, b: int, n: float) -> float:
        row = self.verify_table[b]
        if n == int(n) and 1 <= n <= len(row):
            return row[int(n) - 1]   # a measured cell (interpolate would return it, slower)
        return interpolate(range(1, len(row) + 1), row, n)

    def verify_seconds(self, b: int, n: float) -> float:
        """One forward over b rows of n tokens each (n may be fractional: a ragged batch's mean); a
        drafting shape (n > 1) as drafting verifies at this load have measured against the table."""
        return self._table_seconds(b, n) * (self.drafting_factor(b) if n > 1 else 1.0)

    def _table_seconds(self, b: int, n: float) -> float:
        if b <= 0:
            return 0.0
        per_b = [self._verify_row(bb, n) for bb in self.batches]
        return max(interpolate(self.batches, per_b, b), 0.0)

    def _near(self, b: int) -> int:
        """The profiled batch size nearest b (log scale): the one a measurement at b corrects."""
        return min(self.batches, key=lambda x: abs(math.log(x) - math.log(b)))

    def drafting_factor(self, b: int) -> float:
        """Measured over predicted seconds of the drafting verifies at this load (1 until measured)."""
        return self.draft_factor.get(self._near(b), 1.0) if b > 0 else 1.0

    def ragged_seconds(self, rows: Sequence[int]) -> float:
        """What a forward whose rows differ in length costs beyond its priced tokens (0 when they agree)."""
        return self._ragged_at(len(rows)) if rows and min(rows) != max(rows) else 0.0

    def _ragged_at(self, b: int) -> float:
        if not self.ragged_table:
            return 0.0
        per = [self.ragged_table[x] for x in self.ragged_batches]
        return max(interpolate(self.ragged_batches, per, b), 0.0) if len(per) > 1 else per[0]

    def draft_seconds(self, b: int, depth: int) -> float:
        """depth drafter forwards over b rows (the batched drafter runs to the deepest row)."""
        if depth <= 0 or b <= 0 or not self.draft_table:
            return 0.0
        per = interpolate(self.draft_batches, [self.draft_table[x] for x in self.draft_batches], b)
        return max(per, 0.0) * depth

    def catch_up_seconds(self, tokens: int) -> float:
        """What a model drafter's prefill of `tokens` context tokens it has not seen yet costs."""
        return max(tokens, 0) * self.profile.catch_up

    def host_seconds(self, b: int) -> float:
        """What a step over b requests that drafts costs beyond the forwards priced here and beyond a
        step that drafts nothing (0 until drafting steps were measured)."""
        drafting = _interpolated(self.host_draft, b)
        return max(drafting - _interpolated(self.host_plain, b), 0.0) if drafting else 0.0

    def observe_host(self, b: int, seconds: float, drafted: bool) -> None:
        """A measured step over b requests: its wall time less its verify and priced drafter forwards.

        Steps that draft and steps that do not are kept apart (nearest profiled batch size); their
        difference is what drafting costs the host. A drafting step counts with the lesser of its figure
        and the previous drafting step's, so one slow moment (the OS, a collection) cannot stop drafting,
        two in a row can; rising figures weigh HOST_BETA_UP. While nothing drafts, the drafting figure
        drifts toward the plain one (HOST_DRIFT per step), so drafting is tried again now and then (a
        retry that is still slow sends the figure most of the way back)."""
        if b <= 0 or seconds < 0:
            return
        near = min(self.batches, key=lambda x: abs(math.log(x) - math.log(b)))
        if not drafted:
            old = self.host_plain.get(near)
            self.host_plain[near] = seconds if old is None else (1 - self.beta) * old + self.beta * seconds
            if near in self.host_draft:
                self.host_draft[near] -= HOST_DRIFT * (self.host_draft[near] - self.host_plain[near])
            return
        previous, self._host_last[near] = self._host_last.get(near), seconds
        if previous is None:
            return
        seconds = min(seconds, previous)
        old = self.host_draft.get(near)
        beta = HOST_BETA_UP if old is not None and seconds > old else self.beta
        self.host_draft[near] = seconds if old is None else (1 - beta) * old + beta * seconds

    def step_seconds(
        self,
        rows: Sequence[int],
        depths: Sequence[int],
        widths: Sequence[int] | None = None,
        free: Sequence[bool] | None = None,
    ) -> float:
        """rows[i]: tokens request i sends to the target (1 + its draft nodes); depths[i]: its draft levels;
        widths[i]: candidates per level (a tree level drafts that many rows); free[i]: request i's drafts
        cost no drafter forward (a lookup drafts them: the suffix index)."""
        return self.at(len(rows)).step_seconds(rows, depths, widths, free) if rows else 0.0

    def at(self, b: int) -> BatchCosts:
        """This model's prices for steps over b requests, as they stand now (see BatchCosts)."""
        # _table_seconds at whole token counts: batch interpolation is linear in the rows' values and each
        # row is piecewise linear between whole counts, so interpolating these over n gives _table_seconds
        # (up to rounding) at any n.
        longest = max(len(row) for row in self.verify_table.values())
        per_n = [[self._verify_row(bb, n) for bb in self.batches] for n in range(1, longest + 1)]
        verify = [interpolate(self.batches, ys, b) for ys in per_n]
        return BatchCosts(verify, self.pad_weight, self._ragged_at(b), self.drafting_factor(b),
                          self.host_seconds(b), self.draft_seconds)

    def _tokens_per_row(self, rows: Sequence[int]) -> float:
        """The uniform row length a batch of these rows costs like."""
        mean = sum(rows) / len(rows)
        return mean + self.pad_weight * (max(rows) - mean)

    def observe_verify(self, rows: Sequence[int], seconds: float) -> None:
        """A measured verify forward of len(rows) requests with rows[i] tokens each.

        A plain one (one token per row) corrects the one-token cell of the nearest profiled batch size, and
        the other cells follow it in the profile's shape (_drift_toward_profile). A drafting one corrects
        that batch size's drafting factor instead: the profile runs at short contexts, and at real ones a
        drafting verify costs more against a plain one than the table says
        (docs/decisions/goodput-pricing.md); charged to the
        table's cells, a drafting verify averaging under 1.5 tokens per row raised the plain price, and
        the plain steps' pull toward the profile's shape undid the rest. Either rises only as far as the
        lesser of its last two measurements: one slow forward (the OS, a collection) priced a drafting
        shape out, and a shape no plan picks is never measured again to bring it back (as observe_host)."""
        b = len(rows)
        if b == 0 or seconds <= 0:
            return
        n = self._tokens_per_row(rows)
        near = self._near(b)
        if max(rows) > 1:
            factor = self.draft_factor.get(near, 1.0)
            predicted = (self._table_seconds(b, n) + self.ragged_seconds(rows)) * factor
            if predicted <= 0:
                return
            ratio = self._limited_rise(("draft", near), seconds / predicted)
            self.draft_factor[near] = factor * ((1 - self.beta) + self.beta * ratio)
            return
        predicted = self._table_seconds(b, n)
        if predicted <= 0:
            return
        row = self.verify_table[near]
        ratio = self._limited_rise((near, 0), seconds / predicted)
        row[0] = (1 - self.beta) * row[0] + self.beta * row[0] * ratio
        self._drift_toward_profile(near, 0)
        if near in self.draft_factor:
            # while nothing drafts, the drafting factor returns toward the table, so drafting is tried again
            self.draft_factor[near] += PROFILE_DRIFT * (1.0 - self.draft_factor[near])

    def _limited_rise(self, key, ratio: float) -> float:
        previous, self._verify_last[key] = self._verify_last.get(key, 1.0), ratio
        return max(min(ratio, previous), 1.0) if ratio > 1.0 else ratio

    def _drift_toward_profile(self, near: int, k: int) -> None:
        """Pull the cells no step measures toward the profile's shape, scaled as cell k now measures.

        Cells of shapes no plan picks are never measured: a load that slowed every forward for a while (the
        online trainer's rounds beside serving) left drafting shapes priced high after it passed, and
        the plain one-token forward, always measured, had come back. Each measured verify moves the other
        cells of its batch size, and the drafter's figure, PROFILE_DRIFT of the way toward the profile
        times cell k's measured-to-profiled ratio."""
        base = self.profile.verify[near]
        row = self.verify_table[near]
        if base[k] <= 0:
            return
        scale = row[k] / base[k]
        for j in range(len(row)):
            if j != k:
                row[j] += PROFILE_DRIFT * (base[j] * scale - row[j])
        if self.draft_table:
            d = min(self.draft_batches, key=lambda x: abs(math.log(x) - math.log(near)))
            self.draft_table[d] += PROFILE_DRIFT * (self.profile.draft[d] * scale - self.draft_table[d])

    def observe_draft(self, b: int, depth: int, seconds: float) -> None:
        """A measured propose call: depth forwards over b rows."""
        if b <= 0 or depth <= 0 or seconds <= 0 or not self.draft_table:
            return
        near = min(self.draft_batches, key=lambda x: abs(math.log(x) - math.log(b)))
        per = seconds / depth
        # as observe_verify: a rise counts only as far as the lesser of the last two measurements
        previous, self._draft_last[near] = self._draft_last.get(near, self.draft_table[near]), per
        if per > self.draft_table[near]:
            per = max(min(per, previous), self.draft_table[near])
        self.draft_table[near] = (1 - self.beta) * self.draft_table[near] + self.beta * per


class BatchCosts:
    """StepCostModel's prices for steps over one batch size, frozen when made: a plan prices hundreds of
    shapes of one batch (a climb's every candidate move), and interpolating the tables over batch sizes,
    the host figures and the drafting factor for each was most of the planning time, which on a GPU host
    is paid beside a step of a few milliseconds (docs/decisions/goodput-pricing.md)."""

    def __init__(self, verify: list[float], pad_weight: float, ragged: float, factor: float, host: float,
                 draft_seconds) -> None:
        self.verify = verify                  # unclipped seconds of a forward of n = 1.. tokens per row
        self.tokens = list(range(1, len(verify) + 1))
        self.pad_weight = pad_weight
        self.ragged = ragged                  # the fixed cost of a forward whose rows differ in length
        self.factor = factor                  # drafting verifies' measured / table seconds
        self.host = host                      # host work of a step that drafts (StepCostModel.host_seconds)
        self._draft_seconds = draft_seconds   # (rows, depth) -> seconds of the drafter's forwards

    def verify_seconds(self, n: float) -> float:
        """One forward over the batch's rows of n tokens each (the table alone, no drafting factor)."""
        return max(interpolate(self.tokens, self.verify, n), 0.0)

    def ragged_seconds(self, rows: Sequence[int]) -> float:
        return 0.0 if min(rows) == max(rows) else self.ragged

    def step_seconds(self, rows: Sequence[int], depths: Sequence[int], widths: Sequence[int] | None = None,
                     free: Sequence[bool] | None = None) -> float:
        """As StepCostModel.step_seconds, for rows of this batch size."""
        longest, mean = max(rows), sum(rows) / len(rows)
        verify = self.verify_seconds(mean + self.pad_weight * (longest - mean))
        if longest == 1:
            return verify
        verify = (verify + self.ragged_seconds(rows)) * self.factor
        drafting, depth = 0, 0
        for i, d in enumerate(depths):
            if d > 0 and not (free is not None and free[i]):
                drafting += widths[i] if widths is not None else 1
                depth = max(depth, d)
        return verify + self._draft_seconds(drafting, depth)


class Acceptance:
    """One request's predicted acceptance per draft position: alpha[k] = P(draft k accepted | k-1 were).

    Seeded from the drafter's per-position acceptance (a prior list; its last entry repeats further out);
    observe() applies an EMA with factor beta to the positions the step actually tried.
    """

    def __init__(self, prior: Sequence[float], depth: int, beta: float = 0.3) -> None:
        if not prior:
            raise ValueError("an acceptance prior needs at least one position")
        if any(not 0.0 <= a <= 1.0 for a in prior):
            raise ValueError(f"acceptance priors must be in [0, 1], got {list(prior)}")
        self.alpha = [float(prior[min(k, len(prior) - 1)]) for k in range(max(depth, 1))]
        self.beta = beta
        self.steps = 0

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """A verified step: positions < accepted succeeded; position `accepted` failed when it was drafted."""
        if not 0 <= accepted <= drafted_depth:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted_depth}")
        self.steps += 1
        tried = min(accepted + (1 if accepted < drafted_depth else 0), len(self.alpha))
        for k in range(tried):
            hit = 1.0 if k < accepted else 0.0
            self.alpha[k] = (1 - self.beta) * self.alpha[k] + self.beta * hit

    def expected_tokens(self, depth: int, width: int = 1) -> float:
        """E[tokens emitted] by a step of `depth` levels with `width` candidates per level."""
        total, reach = 1.0, 1.0
        for k in range(min(depth, len(self.alpha))):
            level = 1.0 - (1.0 - self.alpha[k]) ** width
            reach *= level
            total += reach
        return total


@dataclass
class Slot:
    """One request as the controller sees it this step: its acceptance, γ cap and tree width cap."""

    acceptance: Acceptance
    max_depth: int                # γ cap (remaining tokens, operator bounds, the request's own γ)
    max_width: int = 1            # 1 = chains only
    min_depth: int = 0
    free: bool = False            # this step's drafts cost no drafter forward (a lookup drafts them)
    setup_seconds: float = 0.0    # drafter work before its first draft (catching up on a long context)


@dataclass
class Plan:
    depths: list[int]
    widths: list[int]
    expected_tokens: float        # Σ_i E[tokens_i] of the plan
    seconds: float                # predicted step seconds

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else 0.0


class GoodputController:
    """Greedy goodput maximisation over a batch; see the module docstring."""

    def __init__(self, costs: StepCostModel, min_gain: float = 1e-9) -> None:
        self.costs = costs
        self.min_gain = min_gain  # relative: a move must raise goodput by more than this share

    def seconds(
        self, depths: Sequence[int], widths: Sequence[int], slots: Sequence[Slot] | None = None,
        host: bool = True, costs: BatchCosts | None = None,
    ) -> float:
        """Predicted step seconds; host=False leaves out the fixed host work of a drafting step; costs:
        the batch's prices frozen for this plan (made here when not given)."""
        if not depths:
            return 0.0
        costs = costs or self.costs.at(len(depths))
        rows = [1 + d * w for d, w in zip(depths, widths, strict=True)]
        free = [s.free for s in slots] if slots is not None else None
        setup = sum(s.setup_seconds for s, d in zip(slots, depths, strict=True) if d > 0) if slots else 0.0
        fixed = costs.host if host and any(d > 0 for d in depths) else 0.0
        return costs.step_seconds(rows, depths, widths, free) + setup + fixed

    def evaluate(self, slots: Sequence[Slot], depths: Sequence[int], widths: Sequence[int],
                 costs: BatchCosts | None = None) -> Plan:
        tokens = sum(_per_slot_tokens(slots, depths, widths))
        return Plan(list(depths), list(widths), tokens, self.seconds(depths, widths, slots, costs=costs))

    def _moves(self, slots: Sequence[Slot], depths: list[int], widths: list[int]):
        """(changed request or None for all, new depths, new widths) of every move from here."""
        for i, s in enumerate(slots):
            if depths[i] < s.max_depth:
                yield i, [*depths[:i], depths[i] + 1, *depths[i + 1:]], widths
            if depths[i] > 0 and widths[i] < s.max_width:
                yield i, depths, [*widths[:i], widths[i] + 1, *widths[i + 1:]]
        if len(slots) == 1:
            return      # lifting one request's depth is its own depth move, yielded above
        level = max(depths, default=0) + 1
        lifted = [max(d, min(level, s.max_depth)) for d, s in zip(depths, slots, strict=True)]
        if lifted != depths:
            yield None, lifted, widths

    def plan(self, slots: Sequence[Slot], host_work: bool = True) -> Plan:
        """The greedy plan: deterministic (ties go to the earliest, cheapest move). host_work False: the
        fixed host work of a drafting step is not charged (it overlaps another step's forward)."""
        costs = self.costs.at(len(slots)) if slots else None
        if costs is not None and not host_work:
            costs.host = 0.0
        base = self.evaluate(slots, [min(s.min_depth, s.max_depth) for s in slots], [1] * len(slots), costs)
        climbed = self._climb(slots, base.depths, base.widths, False, costs)
        if (climbed.depths, climbed.widths) == (base.depths, base.widths):
            return base
        climbed = self._climb(slots, climbed.depths, climbed.widths, True, costs)
        return climbed if climbed.goodput > base.goodput * (1 + self.min_gain) else base

    def _climb(self, slots: Sequence[Slot], depths: list[int], widths: list[int], host: bool,
               costs: BatchCosts) -> Plan:
        """Apply the best move until none raises goodput (priced with or without the host work)."""
        gains = _per_slot_tokens(slots, depths, widths)
        best = Plan(depths, widths, sum(gains), self.seconds(depths, widths, slots, host, costs))
        while True:
            candidate = None
            for i, d, w in self._moves(slots, best.depths, best.widths):
                if i is None:
                    tokens = sum(_per_slot_tokens(slots, d, w))
                else:
                    tokens = best.expected_tokens - gains[i] + slots[i].acceptance.expected_tokens(d[i], w[i])
                plan = Plan(d, w, tokens, self.seconds(d, w, slots, host, costs))
                if plan.goodput > (candidate or best).goodput * (1 + self.min_gain):
                    candidate = plan
            if candidate is None:
                return best if host else self.evaluate(slots, best.depths, best.widths, costs)
            best = candidate
            gains = _per_slot_tokens(slots, best.depths, best.widths)


def _per_slot_tokens(slots: Sequence[Slot], depths: Sequence[int], widths: Sequence[int]) -> list[float]:
    return [s.acceptance.expected_tokens(d, w) for s, d, w in zip(slots, depths, widths, strict=True)]
