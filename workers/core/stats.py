"""Per-request speculation statistics, in glossary words.

One step emits accepted + 1 tokens: the accepted drafts, then either the recovered token (a draft was
rejected) or the bonus token (every draft was accepted, including the case of nothing drafted).
Per-position counts say, for draft position j (0 = first draft of a step), how often a draft was made
there and how often it was accepted; broken down per drafter version they are the acceptance metrics the
drafter trainer's gate and the dashboards read. Plain python: records cross process boundaries as dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _add_padded(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two per-position lists of unequal length."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class RequestStats:
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    steps: int = 0
    drafting_steps: int = 0  # steps that drafted at least one token
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    gamma_history: list[int] = field(default_factory=list)  # draft positions used per step (chain: γ)
    drafter_versions: list[str] = field(default_factory=list)  # in order of first use
    by_version: dict[str, RequestStats] = field(default_factory=dict)  # same counts per drafter version

    def record_step(
        self,
        drafted: int,
        accepted: int,
        is_bonus: bool,
        drafter_version: str | None = None,
        depth: int | None = None,
    ) -> None:
        """Count one step. For a token tree, drafted is the number of nodes and depth its number of
        levels; per-position counts and gamma_history then use depth (default: drafted, a chain)."""
        positions = drafted if depth is None else depth
        if not 0 <= accepted <= positions <= drafted:
            raise ValueError(
                f"need 0 <= accepted <= depth <= drafted, got {accepted}, {positions}, {drafted}"
            )
        if not is_bonus and accepted == positions:
            raise ValueError("a step without a bonus token must have a rejected draft (accepted < depth)")
        # In a tree a path may end at a shallow leaf (bonus with accepted < depth); in a chain it cannot.
        if is_bonus and depth is None and accepted != drafted:
            raise ValueError("a chain step with a bonus token must have accepted every draft")
        self.drafted += drafted
        self.accepted += accepted
        self.bonus += int(is_bonus)
        self.recovered += int(not is_bonus)
        self.steps += 1
        self.drafting_steps += int(drafted > 0)
        self.drafted_per_position = _add_padded(self.drafted_per_position, [1] * positions)
        self.accepted_per_position = _add_padded(self.accepted_per_position, [1] * accepted)
        self.gamma_history.append(positions)
        if drafter_version is not None:
            if drafter_version not in self.by_version:
                self.drafter_versions.append(drafter_version)
                self.by_version[drafter_version] = RequestStats()
            self.by_version[drafter_version].record_step(drafted, accepted, is_bonus, depth=depth)

    @property
    def emitted(self) -> int:
        """Tokens produced by the speculative steps: accepted + recovered + bonus."""
        return self.accepted + self.recovered + self.bonus

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """(accepted + recovered + bonus) / steps: tokens emitted per step (0 before the first step)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """MAL as vLLM and the papers use it: 1 + accepted / steps that drafted (0 before one drafted).
        It differs from tokens_per_step when some steps draft nothing."""
        return 1.0 + self.accepted / self.drafting_steps if self.drafting_steps else 0.0

    def acceptance_per_position(self) -> list[float]:
        """P(draft j accepted | a draft was made at j), per position j."""
        accepted = _add_padded(self.accepted_per_position, [0] * len(self.drafted_per_position))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.drafted_per_position, strict=True)]

    def merge(self, other: RequestStats) -> RequestStats:
        """A new RequestStats with the counts of both (e.g. to aggregate requests); self is unchanged."""
        versions = list(self.drafter_versions) + [v for v in other.drafter_versions
                                                  if v not in self.drafter_versions]
        by_version = {}
        for version in versions:
            mine, theirs = self.by_version.get(version), other.by_version.get(version)
            if mine is not None and theirs is not None:
                by_version[version] = mine.merge(theirs)
            else:
                by_version[version] = (mine if mine is not None else theirs).merge(RequestStats())
        return RequestStats(
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            recovered=self.recovered + other.recovered,
            bonus=self.bonus + other.bonus,
            steps=self.steps + other.steps,
            drafting_steps=self.drafting_steps + other.drafting_steps,
            accepted_per_position=_add_padded(self.accepted_per_position, other.accepted_per_position),
            drafted_per_position=_add_padded(self.drafted_per_position, other.drafted_per_position),
            gamma_history=self.gamma_history + other.gamma_history,
            drafter_versions=versions,
            by_version=by_version,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, floats, strings, lists and dicts (msgpack/JSON ready), with the derived rates."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "recovered": self.recovered,
            "bonus": self.bonus,
            "steps": self.steps,
            "drafting_steps": self.drafting_steps,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.tokens_per_step,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "gamma_history": list(self.gamma_history),
            "drafter_versions": list(self.drafter_versions),
            "by_version": {v: s.to_dict() for v, s in self.by_version.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestStats:
        """Inverse of to_dict (derived rates are recomputed, not read)."""
        return cls(
            drafted=d["drafted"],
            accepted=d["accepted"],
            recovered=d["recovered"],
            bonus=d["bonus"],
            steps=d["steps"],
            drafting_steps=d.get("drafting_steps", 0),   # absent from records written before it existed
            accepted_per_position=list(d["accepted_per_position"]),
            drafted_per_position=list(d["drafted_per_position"]),
            gamma_history=list(d["gamma_history"]),
            drafter_versions=list(d["drafter_versions"]),
            by_version={v: cls.from_dict(s) for v, s in d.get("by_version", {}).items()},
        )
