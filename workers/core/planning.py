"""Plain pieces of the speculation planner (workers/engine/planner.py): per-position acceptance counts,
a request's γ policy from the operator config, and tree fitting. Plain python: no ray, grpc or redis."""

from __future__ import annotations

from dataclasses import replace

from specd.workers.core.gamma import ACCEPTANCE_PRIOR, GammaPolicy, build_gamma_policy
from specd.workers.core.goodput import Acceptance, Slot


def build_policy(name: str, spec_cfg, gamma: int, tree_width: int, **goodput) -> GammaPolicy:
    """One policy object per request: its bounds come from the operator config and the request's γ.
    goodput: the planner's controller and position prior, for the goodput policy."""
    common = dict(gamma_min=min(spec_cfg.gamma_min, gamma), gamma_max=gamma, tree_width=tree_width)
    extra = {
        "egag": {"entropy_threshold": spec_cfg.egag_threshold, "beta": spec_cfg.egag_beta},
        "confidence": {"threshold": spec_cfg.confidence_threshold},
        "goodput": goodput,
    }
    return build_gamma_policy(name, **common, **extra.get(name, {}))


class PositionCounts:
    """Drafted and accepted counts per draft position over every step of a drafter: its measured
    acceptance per position, which seeds new requests' estimates (prior pseudo-counts until data comes)."""

    def __init__(self, depth: int = 16, prior: float = ACCEPTANCE_PRIOR, pseudo: float = 4.0) -> None:
        self.drafted = [0] * depth
        self.accepted = [0] * depth
        self.prior, self.pseudo = prior, pseudo

    def observe(self, drafted_depth: int, accepted: int) -> None:
        tried = min(accepted + (1 if accepted < drafted_depth else 0), len(self.drafted))
        for k in range(tried):
            self.drafted[k] += 1
            self.accepted[k] += k < accepted

    def alpha(self) -> list[float]:
        return [(a + self.prior * self.pseudo) / (d + self.pseudo)
                for a, d in zip(self.accepted, self.drafted, strict=True)]


def fit_tree(depth: int, width: int, room: int) -> tuple[int, int]:
    """(depth, width) of a tree of width * depth draft nodes within `room` nodes: shallower first,
    then narrower (one level of `room` candidates)."""
    if width * depth <= room:
        return depth, width
    if room >= width:
        return room // width, width
    return (1, room) if room > 0 else (0, 1)


def hinted_slot(slot: Slot, hint) -> Slot:
    """The request's slot planned from its DraftHint: the draft's own predicted acceptance and cost."""
    depth = min(slot.max_depth, len(hint.alpha))
    return replace(slot, acceptance=Acceptance(hint.alpha, depth), max_depth=depth,
                   min_depth=min(slot.min_depth, depth), max_width=1, free=hint.free)


def tree_depth(parents: list[int]) -> int:
    """Levels of a tree given each draft node's parent (0 = root, k = draft k-1)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return max(depth)
