"""N-gram drafter (prompt lookup): copy what followed the last time the context's suffix appeared.

For each request we keep its context (prompt + committed tokens) and an index from every n-gram
(min_ngram <= n <= max_ngram) to the position of the token that followed its most recent occurrence. To
draft, we look up the context's suffix from the longest n down and copy the tokens from that position on.
The index is updated incrementally on commit (max_ngram - min_ngram + 1 dict writes per token), so a step
never rescans the context.

When the copy reaches the end of the context it continues from the drafts themselves (as LZ77 does), so a
repeating pattern, e.g. "a b a b a b", drafts a full γ instead of stopping at the context's end.

Drafts are deterministic: `probs` is None and the verifier treats q as one-hot, which keeps verification
exact for greedy and sampled requests alike. Drafts are never appended to the context, so rollback after a
rejection is just appending the verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.workers.drafters.base import Drafter, DraftProposal, check_batch
from specd.workers.drafters.registry import register_drafter

if TYPE_CHECKING:
    from specd.workers.core.gamma import GammaPolicy, GammaState
    from specd.workers.core.sampling import SamplingParams


@dataclass
class _Context:
    tokens: list[int] = field(default_factory=list)
    # n-gram -> position of the token that followed its most recent occurrence (n-grams ending at the very
    # end of the context have no follower yet and are added when the next token arrives).
    index: dict[tuple[int, ...], int] = field(default_factory=dict)


@register_drafter("ngram")
class NGramDrafter(Drafter):
    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, version: str | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.version = version or f"ngram-{min_ngram}-{max_ngram}"
        self._contexts: dict[str, _Context] = {}

    @classmethod
    def from_config(cls, cfg, *, target_model_dir: str, cache_dir: str | None = None, seed: int = 0):
        return cls(min_ngram=cfg.min_ngram, max_ngram=cfg.max_ngram)

    def add_request(
        self, request_id: str, prompt_tokens: list[int], seed: int | None = None, hidden=None
    ) -> None:
        if request_id in self._contexts:
            raise ValueError(f"request {request_id!r} is already tracked")
        context = _Context()
        self._extend(context, prompt_tokens)
        self._contexts[request_id] = context

    def remove_request(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._contexts

    def context(self, request_id: str) -> list[int]:
        """A copy of the request's verified context (prompt + committed tokens)."""
        return list(self._get(request_id).tokens)

    def commit(self, request_id: str, num_accepted: int, new_tokens: list[int], hidden=None) -> None:
        if not 0 <= num_accepted <= len(new_tokens):
            raise ValueError(f"num_accepted {num_accepted} exceeds the {len(new_tokens)} new tokens")
        # Drafts never entered the context, so the verified prefix is the context itself: append and go on.
        self._extend(self._get(request_id), new_tokens)

    def propose(
        self,
        request_ids: list[str],
        gammas: list[int],
        params: list[SamplingParams] | None = None,
        policy: GammaPolicy | None = None,
        states: list[GammaState] | None = None,
    ) -> DraftProposal:
        check_batch(request_ids, gammas, params)
        tokens = []
        for i, (request_id, gamma) in enumerate(zip(request_ids, gammas, strict=True)):
            draft = self.lookup(request_id, gamma)
            if policy is not None and states is not None:
                # Deterministic drafts carry no q, so policies only enforce their plan here.
                for drafted in range(1, len(draft)):
                    if not policy.keep_drafting(states[i], drafted, None):
                        draft = draft[:drafted]
                        break
            tokens.append(draft)
        return DraftProposal(tokens=tokens, probs=None, drafter_version=self.version)

    def lookup(self, request_id: str, gamma: int) -> list[int]:
        """Up to gamma tokens following the most recent earlier occurrence of the longest matching suffix."""
        return self.lookup_matched(request_id, gamma)[0]

    def lookup_matched(self, request_id: str, gamma: int) -> tuple[list[int], int]:
        """lookup() and the length of the suffix that matched (0: no match, no draft)."""
        context = self._get(request_id)
        tokens = context.tokens
        length = len(tokens)
        if gamma <= 0:
            return [], 0
        start, n = None, 0
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            start = context.index.get(tuple(tokens[length - n:]))
            if start is not None:
                break
        if start is None:
            return [], 0
        draft: list[int] = []
        for k in range(gamma):
            position = start + k  # in context + draft; start < length, so position - length < k
            draft.append(tokens[position] if position < length else draft[position - length])
        return draft, n

    def _get(self, request_id: str) -> _Context:
        try:
            return self._contexts[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not tracked by the n-gram drafter") from None

    def _extend(self, context: _Context, new_tokens: list[int]) -> None:
        tokens, index = context.tokens, context.index
        for token in new_tokens:
            position = len(tokens)  # where token lands: it follows the n-grams ending just before it
            for n in range(self.min_ngram, min(self.max_ngram, position) + 1):
                index[tuple(tokens[position - n:position])] = position
            tokens.append(int(token))
