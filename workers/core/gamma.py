"""γ policies: how many draft tokens (or how big a token tree) one request drafts in one step.

All policies share one interface and one per-request `GammaState`:

    state = policy.new_state()                       # once per request
    gamma = policy.plan(state, remaining_tokens)     # before drafting: the step's γ budget
    while drafted < gamma and policy.keep_drafting(state, drafted, q_row): draft one more
    policy.observe(state, drafted, accepted)         # after verification

Policies:
- fixed: always γ (the classic setting).
- egag: entropy-guided. Plans gamma_max and stops drafting early once the drafter is unsure: the
  normalised entropy H(q) / log(V_eff) of the drafter's distribution, smoothed by an EMA with factor
  beta, exceeds a threshold. The threshold moves with the request's acceptance EMA, so a drafter that
  keeps being accepted is allowed to continue through less certain positions.
- confidence: plans gamma_max and stops drafting once the drafter's top-1 probability for the token it
  just drafted falls below a threshold. A distilled drafter is well calibrated
  (docs/decisions/gamma-policies.md), so this cuts the drafts that would be rejected anyway and lets
  confident runs go long.
- adaptive: acceptance-adaptive (as in SmartSpec). From a per-request EMA of the per-token acceptance
  probability ρ it picks the γ (and, for trees, the width) that maximises expected emitted tokens per
  unit of cost.
- goodput: γ and tree width per request chosen for the whole batch's tokens per second from measured
  step costs and per-position acceptance (workers/core/goodput.py). The worker that drafts a batch calls
  `plan_batch`; `plan`/`plan_tree` then return the batch's choice (a lone request plans as a batch of one).

Bounds hold everywhere: γ is in [0, gamma_max], at least gamma_min when the budget allows, and never more
than remaining_tokens - 1, because a step emits accepted + 1 tokens and must not overshoot max_new_tokens.
Plain python/torch: no ray, grpc or redis.

ρ, the smoothed chance that the next draft token is accepted (`GammaState.ema_acceptance`, or per
position in `Acceptance`), is an estimate that steers γ; the reported acceptance rate is
α = accepted / drafted (workers/core/stats.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specd.workers.core.goodput import Acceptance, CostProfile, GoodputController, Plan, Slot, StepCostModel


@dataclass
class GammaState:
    """Mutable per-request state of a γ policy."""

    ema_acceptance: float = 0.5  # per-token acceptance ρ, EMA over steps
    ema_entropy: float = 0.0     # normalised drafter entropy, EMA over drafted tokens (egag)
    planned_gamma: int = 0       # budget of the current step, set by plan(); keep_drafting stops there
    planned_width: int = 1       # tree width of the current step, set by plan_tree()
    steps: int = 0               # observed steps
    acceptance: Acceptance | None = None       # goodput: predicted acceptance per draft position
    batch_plan: tuple[int, int] | None = None  # goodput: (depth, width) chosen by plan_batch for this step


def expected_tokens(rho: float, gamma: int) -> float:
    """Expected tokens emitted by one step of γ drafts with i.i.d. per-token acceptance ρ.

    1 + ρ + ρ² + ... + ρ^γ = (1 - ρ^(γ+1)) / (1 - ρ): the accepted prefix plus the recovered or bonus token.
    """
    rho = min(max(rho, 0.0), 1.0)
    if gamma <= 0:
        return 1.0
    if rho > 1.0 - 1e-9:
        return float(gamma + 1)
    return (1.0 - rho ** (gamma + 1)) / (1.0 - rho)


def normalized_entropy(q: torch.Tensor) -> torch.Tensor:
    """H(q) / log(V_eff) in [0, 1], where V_eff counts tokens with q > 0.

    Dividing by the effective support (not the full vocabulary) keeps the scale meaningful after top-k/top-p
    truncation: a uniform choice among the k survivors is maximally unsure, whatever the vocabulary size.
    q: [..., vocab] probabilities. Returns [...].
    """
    q = q.float()
    positive = q > 0
    support = positive.sum(dim=-1)
    plogp = torch.where(positive, q * q.clamp_min(1e-30).log(), torch.zeros_like(q))
    entropy = -plogp.sum(dim=-1)
    log_support = support.clamp_min(2).float().log()
    # One token or none in the support: no uncertainty at all.
    return torch.where(support > 1, entropy / log_support, torch.zeros_like(entropy)).clamp(0.0, 1.0)


class GammaPolicy(ABC):
    """Decides the draft length (and tree shape) of one request's next step.

    gamma_min / gamma_max bound γ; tree_width is the width for tree drafting (the maximum width for the
    adaptive policy). acceptance_prior seeds the acceptance EMA, acceptance_beta is its EMA factor
    (ema = beta * ema + (1 - beta) * new).
    """

    name: ClassVar[str] = ""

    def __init__(
        self,
        gamma_min: int = 1,
        gamma_max: int = 4,
        tree_width: int = 1,
        acceptance_prior: float = 0.5,
        acceptance_beta: float = 0.8,
    ) -> None:
        if not 0 <= gamma_min <= gamma_max:
            raise ValueError(f"need 0 <= gamma_min <= gamma_max, got {gamma_min}, {gamma_max}")
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        if not 0.0 <= acceptance_prior <= 1.0:
            raise ValueError(f"acceptance_prior must be in [0, 1], got {acceptance_prior}")
        if not 0.0 <= acceptance_beta < 1.0:
            raise ValueError(f"acceptance_beta must be in [0, 1), got {acceptance_beta}")
        self.gamma_min = gamma_min
        self.gamma_max = gamma_max
        self.tree_width = tree_width
        self.acceptance_prior = acceptance_prior
        self.acceptance_beta = acceptance_beta

    def new_state(self) -> GammaState:
        return GammaState(ema_acceptance=self.acceptance_prior, planned_gamma=self.gamma_max)

    def _bounds(self, remaining_tokens: int) -> tuple[int, int]:
        """Feasible γ range (lo, hi) for a request that may still emit remaining_tokens tokens."""
        hi = max(0, min(self.gamma_max, remaining_tokens - 1))
        return min(self.gamma_min, hi), hi

    @abstractmethod
    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        """The policy's γ within the feasible range [lo, hi]."""

    def plan(self, state: GammaState, remaining_tokens: int) -> int:
        """γ budget for this step: in [0, gamma_max], <= remaining_tokens - 1, >= gamma_min when possible."""
        lo, hi = self._bounds(remaining_tokens)
        gamma = min(max(self._choose_gamma(state, lo, hi), lo), hi)
        state.planned_gamma = gamma
        state.planned_width = 1
        return gamma

    def plan_tree(self, state: GammaState, remaining_tokens: int) -> tuple[int, int]:
        """(depth, width) for tree drafting. Depth obeys the same bounds as γ (a tree step emits at most
        depth + 1 tokens); width is tree_width, or 1 when nothing is drafted."""
        depth = self.plan(state, remaining_tokens)
        width = self.tree_width if depth > 0 else 1
        state.planned_width = width
        return depth, width

    def keep_drafting(self, state: GammaState, drafted_so_far: int, q_row: torch.Tensor | None) -> bool:
        """Whether to draft one more token after drafted_so_far tokens; q_row [vocab] is the drafter's
        distribution for the token just drafted (None for deterministic drafters). Never past the plan."""
        return drafted_so_far < state.planned_gamma

    def observe(self, state: GammaState, drafted: int, accepted: int, depth: int | None = None) -> None:
        """Update the acceptance EMA after verification.

        The per-token ρ of a step is accepted / (accepted + 1 if a draft was rejected else accepted): drafts
        after the first rejection were never tried, so counting them (accepted / drafted) would bias ρ low.
        depth is the most that could be accepted (chain: drafted, the default; tree: its depth).
        """
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
        state.steps += 1
        reachable = drafted if depth is None else depth
        trials = accepted + (1 if accepted < reachable else 0)
        if trials == 0:
            return  # nothing drafted: no evidence about ρ
        beta = self.acceptance_beta
        state.ema_acceptance = beta * state.ema_acceptance + (1.0 - beta) * (accepted / trials)


class FixedGamma(GammaPolicy):
    """Always drafts γ tokens (fewer only at the end of the sequence)."""

    name = "fixed"

    def __init__(self, gamma: int | None = None, gamma_min: int = 1, gamma_max: int | None = None, **kwargs):
        if gamma_max is None:
            gamma_max = 4 if gamma is None else gamma
        gamma = gamma_max if gamma is None else gamma
        super().__init__(gamma_min=min(gamma_min, gamma), gamma_max=gamma_max, **kwargs)
        if gamma > gamma_max:
            raise ValueError(f"gamma {gamma} exceeds gamma_max {gamma_max}")
        self.gamma = gamma

    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        return self.gamma


class EntropyGamma(GammaPolicy):
    """EGAG: plan gamma_max, stop drafting once the smoothed normalised entropy exceeds the threshold.

    smoothed = beta * smoothed + (1 - beta) * H(q)/log(V_eff), kept across steps of the request so a
    request whose drafter is persistently unsure stops early sooner. The threshold is
    entropy_threshold + threshold_adapt * (ema_acceptance - acceptance_prior), clamped to [0, 1].
    Deterministic drafters (q_row None) give no entropy and draft up to the plan.
    """

    name = "egag"

    def __init__(
        self,
        gamma_min: int = 1,
        gamma_max: int = 8,
        entropy_threshold: float = 0.5,
        beta: float = 0.3,
        threshold_adapt: float = 0.5,
        **kwargs,
    ) -> None:
        super().__init__(gamma_min=gamma_min, gamma_max=gamma_max, **kwargs)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.entropy_threshold = entropy_threshold
        self.beta = beta
        self.threshold_adapt = threshold_adapt

    def threshold(self, state: GammaState) -> float:
        shift = self.threshold_adapt * (state.ema_acceptance - self.acceptance_prior)
        return min(max(self.entropy_threshold + shift, 0.0), 1.0)

    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        return hi

    def keep_drafting(self, state: GammaState, drafted_so_far: int, q_row: torch.Tensor | None) -> bool:
        if drafted_so_far >= state.planned_gamma:
            return False
        if q_row is None:
            return True
        entropy = float(normalized_entropy(q_row))
        state.ema_entropy = self.beta * state.ema_entropy + (1.0 - self.beta) * entropy
        if drafted_so_far < self.gamma_min:
            return True
        return state.ema_entropy <= self.threshold(state)


class ConfidenceGamma(GammaPolicy):
    """Plan gamma_max; after each drafted token keep going only while max(q_row) >= threshold.

    q_row is the drafter's distribution for the token just drafted (the unprocessed softmax for a
    greedy request). gamma_min drafts are always made; deterministic drafters (q_row None) draft up to
    the plan.
    """

    name = "confidence"

    def __init__(self, threshold: float = 0.4, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        return hi

    def keep_drafting(self, state: GammaState, drafted_so_far: int, q_row: torch.Tensor | None) -> bool:
        if drafted_so_far >= state.planned_gamma:
            return False
        if q_row is None or drafted_so_far < self.gamma_min:
            return True
        return float(q_row.max()) >= self.threshold


def linear_verify_cost(slope: float) -> Callable[[int], float]:
    """Relative cost of one target forward over 1 + n tokens: 1 + slope * n (1 = a plain decode step)."""
    return lambda n: 1.0 + slope * n


def table_verify_cost(table: Sequence[float]) -> Callable[[int], float]:
    """Relative verify cost from a measured table (table[n] = cost with n draft tokens), extended linearly
    past its end with the slope of its last two entries."""
    if len(table) < 2:
        raise ValueError("a verify cost table needs at least two entries")
    values = [float(v) for v in table]
    last_slope = values[-1] - values[-2]
    return lambda n: values[n] if n < len(values) else values[-1] + last_slope * (n - len(values) + 1)


class AdaptiveGamma(GammaPolicy):
    """Acceptance-adaptive γ (SmartSpec-like): maximise expected_tokens(ρ, γ) / cost(γ).

    cost(γ) = draft_cost_ratio * γ + verify_cost(γ), in units of one plain target decode step.
    verify_cost is a callable of the number of draft tokens, or a table of measured costs; the default is
    linear with verify_slope per draft token (on this CPU verifying 16 tokens costs about 2x verifying 1).
    For trees of width w and depth d we assume each level accepts one of w candidates with probability
    1 - (1 - ρ)^w (optimistic: it treats candidates as independent), verify d * w nodes, and run d drafter
    forwards over w tokens each, scaled like the verify cost. max_tree_nodes caps depth * width of branching
    trees (a chain is bounded by gamma_max alone).
    """

    name = "adaptive"

    def __init__(
        self,
        gamma_min: int = 1,
        gamma_max: int = 8,
        draft_cost_ratio: float = 0.1,
        verify_cost: Callable[[int], float] | Sequence[float] | None = None,
        verify_slope: float = 0.07,
        acceptance_prior: float = 0.6,
        max_tree_nodes: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(
            gamma_min=gamma_min, gamma_max=gamma_max, acceptance_prior=acceptance_prior, **kwargs
        )
        if draft_cost_ratio < 0:
            raise ValueError(f"draft_cost_ratio must be >= 0, got {draft_cost_ratio}")
        self.draft_cost_ratio = draft_cost_ratio
        if verify_cost is None:
            verify_cost = linear_verify_cost(verify_slope)
        elif not callable(verify_cost):
            verify_cost = table_verify_cost(verify_cost)
        self.verify_cost = verify_cost
        self.max_tree_nodes = max_tree_nodes

    def cost(self, depth: int, width: int = 1) -> float:
        forward_scale = self.verify_cost(width - 1) / self.verify_cost(0)
        return self.draft_cost_ratio * depth * forward_scale + self.verify_cost(depth * width)

    def score(self, rho: float, depth: int, width: int = 1) -> float:
        """Expected emitted tokens per unit of cost."""
        level_rho = 1.0 - (1.0 - rho) ** width
        return expected_tokens(level_rho, depth) / self.cost(depth, width)

    def _best(self, rho: float, lo: int, hi: int, max_width: int) -> tuple[int, int]:
        best, best_score = (lo, 1), -math.inf
        for depth in range(lo, hi + 1):
            for width in range(1, (max_width if depth > 0 else 1) + 1):
                if self.max_tree_nodes is not None and depth * width > self.max_tree_nodes and width > 1:
                    break
                score = self.score(rho, depth, width)
                if score > best_score + 1e-12:  # ties go to the cheaper (earlier) shape
                    best, best_score = (depth, width), score
        return best

    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        return self._best(state.ema_acceptance, lo, hi, max_width=1)[0]

    def plan_tree(self, state: GammaState, remaining_tokens: int) -> tuple[int, int]:
        lo, hi = self._bounds(remaining_tokens)
        depth, width = self._best(state.ema_acceptance, lo, hi, max_width=self.tree_width)
        state.planned_gamma = depth
        state.planned_width = width
        return depth, width


# Seconds of a step before anything was measured: a 30 ms decode step, verify(1 + n) = 30 ms * (1 + 0.07 n)
# (AdaptiveGamma's slope), a drafter forward 0.1 of a decode step, proportional in the batch, and a context
# token caught up on about an eighth of a one-row drafter forward. A measured
# profile (workers/engine/profile.py) replaces it; online corrections move it toward measured steps.
PRIOR_PROFILE = CostProfile(verify={1: [0.03 * (1.0 + 0.07 * n) for n in range(9)]}, draft={1: 0.003},
                            catch_up=0.0004)


class GoodputGamma(GammaPolicy):
    """Goodput-maximising γ and tree width for a batch (SmartSpec; see workers/core/goodput.py).

    Per request it keeps `Acceptance` (per-position ρ, seeded from position_prior, the drafter's measured
    acceptance per position, or acceptance_prior everywhere). The controller (with the worker's measured
    cost model) is shared by every request of a worker: pass it in; the default uses a prior cost model.
    """

    name = "goodput"

    def __init__(
        self,
        gamma_min: int = 0,
        gamma_max: int = 8,
        controller: GoodputController | None = None,
        position_prior: Sequence[float] | None = None,
        acceptance_prior: float = 0.6,
        **kwargs,
    ) -> None:
        super().__init__(
            gamma_min=gamma_min, gamma_max=gamma_max, acceptance_prior=acceptance_prior, **kwargs
        )
        self.controller = controller or GoodputController(StepCostModel(PRIOR_PROFILE))
        self.position_prior = list(position_prior) if position_prior else [acceptance_prior]

    def new_state(self) -> GammaState:
        state = super().new_state()
        state.acceptance = Acceptance(self.position_prior, self.gamma_max, beta=1.0 - self.acceptance_beta)
        return state

    def slot(self, state: GammaState, remaining_tokens: int, cap: int | None = None) -> Slot:
        """The request as the controller sees it: its acceptance and bounds (cap: the step's γ cap)."""
        lo, hi = self._bounds(remaining_tokens)
        if cap is not None:
            hi = min(hi, cap)
        return Slot(state.acceptance, max_depth=hi, max_width=self.tree_width, min_depth=min(lo, hi))

    @staticmethod
    def plan_batch(controller: GoodputController, slots: list[Slot], states: list[GammaState | None]) -> Plan:
        """Plan a batch; states[i] (None for a request another policy drafts) receives its (depth, width)."""
        return GoodputGamma.assign(controller.plan(slots), states)

    @staticmethod
    def assign(plan: Plan, states: list[GammaState | None]) -> Plan:
        """Hand each state its (depth, width) of the plan (states[i] None: another policy drafts it)."""
        for state, depth, width in zip(states, plan.depths, plan.widths, strict=True):
            if state is not None:
                state.batch_plan = (depth, width)
        return plan

    def _take(self, state: GammaState, remaining_tokens: int) -> tuple[int, int]:
        if state.batch_plan is None:
            self.plan_batch(self.controller, [self.slot(state, remaining_tokens)], [state])
        depth, width = state.batch_plan
        state.batch_plan = None
        return depth, width

    def _choose_gamma(self, state: GammaState, lo: int, hi: int) -> int:
        return state.planned_gamma

    def plan(self, state: GammaState, remaining_tokens: int) -> int:
        state.planned_gamma = self._take(state, remaining_tokens)[0]
        return super().plan(state, remaining_tokens)

    def plan_tree(self, state: GammaState, remaining_tokens: int) -> tuple[int, int]:
        depth, width = self._take(state, remaining_tokens)
        state.planned_gamma = depth
        depth = super().plan(state, remaining_tokens)
        state.planned_width = width if depth > 0 else 1
        return depth, state.planned_width

    def observe(self, state: GammaState, drafted: int, accepted: int, depth: int | None = None) -> None:
        super().observe(state, drafted, accepted, depth=depth)
        # A tree level succeeds when any candidate does: the per-position ρ absorbs that (optimistic).
        state.acceptance.observe(drafted if depth is None else depth, accepted)


GAMMA_POLICIES: dict[str, type[GammaPolicy]] = {
    FixedGamma.name: FixedGamma,
    EntropyGamma.name: EntropyGamma,
    ConfidenceGamma.name: ConfidenceGamma,
    AdaptiveGamma.name: AdaptiveGamma,
    GoodputGamma.name: GoodputGamma,
}


def build_gamma_policy(name: str, **kwargs) -> GammaPolicy:
    """Build the policy registered under name with its keyword settings (unknown keys raise TypeError)."""
    try:
        cls = GAMMA_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown gamma policy {name!r}; known: {sorted(GAMMA_POLICIES)}") from None
    return cls(**kwargs)
