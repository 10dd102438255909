"""The one interface every drafter implements (model drafter, n-gram drafter, ...).

A drafter keeps per-request context. Each step the scheduler asks it to `propose` up to γ draft tokens per
request, the target verifies them, and `commit` hands back the verified outcome: the accepted drafts plus
the recovered or bonus token. The drafter then rolls back to the verified prefix (dropping whatever it
drafted past the first rejection) and continues from the target's token, so rollback is exact.

A drafter may read the target's hidden states (`uses_target_hidden`): then add_request and commit also
get `hidden`, row j being the target's final hidden state that predicted token j of what they hand over
(the target computes it anyway; the drafter learns to predict the token after).

Drafts are either sampled from a distribution q (the model drafter: `probs` carries q so the verifier can
accept with min(1, p/q) and sample the recovered token from norm(max(0, p - q))) or deterministic (the
n-gram drafter: `probs` is None and the verifier treats q as one-hot on the drafted token).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from specd.workers.core.gamma import GammaPolicy, GammaState
    from specd.workers.core.sampling import SamplingParams


# Request ids with this prefix are the system's own scratch requests (the start-up cost profile): drafters
# that learn from served traffic (the suffix drafter) must not learn from them.
SCRATCH_PREFIX = "__scratch-"


@dataclass
class DraftProposal:
    """Chain drafts for a batch of requests.

    tokens[i] holds request i's drafts; its length is the drafted count, which may be below the planned γ
    (a γ policy stopped early, or the n-gram drafter found no match). probs[i, j] is the q that draft j of
    request i was sampled from; rows at j >= len(tokens[i]) are padding and must be ignored.
    """

    tokens: list[list[int]]
    probs: torch.Tensor | None = None  # [batch, max γ of the batch, vocab]; None = deterministic (one-hot)
    drafter_version: str = ""
    # Who drafted each row when a combined drafter mixes sources (the model drafter's weights version, or
    # the suffix / n-gram source); None = drafter_version for every row. Recorded per step, so acceptance
    # per version (metrics, the trainer's rollback check) counts only the steps that version drafted.
    row_versions: list[str] | None = None

    def version_of(self, row: int) -> str:
        return self.row_versions[row] if self.row_versions is not None else self.drafter_version

    @property
    def num_drafted(self) -> list[int]:
        return [len(t) for t in self.tokens]


@dataclass
class DraftTree:
    """Token-tree drafts for a batch of requests, nodes in topological order (a parent before its children).

    Numbering follows workers/core/tree.py TokenTree, whose node 0 is the root (the last committed token) and
    whose node n + 1 is draft n: parents[i][n] is the tree index of draft n's parent (0 = the root, k = draft
    k - 1), so TokenTree(tokens=[root, *tokens[i]], parents=[-1, *parents[i]]) is request i's tree. A chain
    has parents [0, 1, 2, ...]. probs[i, n] is q_child, the distribution draft n was drafted from: the
    parent's q for i.i.d. children, renormalised over the unused tokens for children drawn without
    replacement, one-hot for deterministic ones (see workers/core/verify_tree.py); the root has no row.
    """

    tokens: list[list[int]]
    parents: list[list[int]]
    probs: torch.Tensor | None = None  # [batch, max nodes of the batch, vocab]; None = deterministic
    drafter_version: str = ""
    row_versions: list[str] | None = None   # as DraftProposal.row_versions

    def version_of(self, row: int) -> str:
        return self.row_versions[row] if self.row_versions is not None else self.drafter_version


@dataclass
class DraftHint:
    """What a drafter can say about one request's next step before the γ plan (the goodput policy reads it).

    alpha[k]: predicted chance that draft k is accepted given drafts 0..k-1 were; len(alpha) is the most it
    would draft. free: those drafts cost no drafter forward (a lookup, not a model, drafts them).
    fallback: the drafter would rather its model drafted this step, and this is its lookup draft instead:
    the plan takes it only where it leaves the model's draft undrafted (then Drafter.use_fallback).
    """

    alpha: list[float]
    free: bool = True
    fallback: bool = False


class Drafter(ABC):
    """Proposes draft tokens for many requests at once; see the module docstring for the step protocol.

    name is the registry key (set by `register_drafter`); version identifies the weights (or settings) that
    proposed a step and is recorded per step in the statistics and replay records.
    """

    name: ClassVar[str] = ""
    version: str = ""
    # What this drafter's first drafts were measured to get accepted on held-out prompts when it was
    # trained (None: unknown); the goodput policy's estimates start there (DraftWorker).
    held_out_acceptance: float | None = None
    # the version it replaced, scored by the same gate on the same records
    # (versions.parent_held_out_acceptance)
    held_out_parent: float | None = None
    uses_target_hidden: bool = False   # True: add_request and commit need the target's hidden states

    @classmethod
    def has_weights(cls, cfg) -> bool:
        """Whether a drafter built from this DrafterConfig holds a model drafter whose weights online
        distillation trains and hot-swaps (the trainer starts only then)."""
        return False

    @property
    def weights_drafter(self) -> Drafter | None:
        """The model drafter inside this one whose weights the trainer's versions replace (itself for the
        model drafter, the inner one for combined drafters); None when it has no weights."""
        return None

    @classmethod
    @abstractmethod
    def from_config(
        cls, cfg, *, target_model_dir: str, cache_dir: str | None = None, seed: int = 0
    ) -> Drafter:
        """Build from a DrafterConfig (configs/schema.py); each drafter reads the keys it needs."""

    def max_slots(self) -> int:
        """How many requests it can hold at once (model drafters have a KV cache of fixed size)."""
        return 1 << 30

    @abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt_tokens: list[int],
        seed: int | None = None,
        hidden: torch.Tensor | None = None,  # [len(prompt_tokens) - 1, H]: predicted tokens 1..
    ) -> None:
        """Start tracking a request whose context is prompt_tokens; seed makes sampled drafts reproducible."""

    @abstractmethod
    def propose(
        self,
        request_ids: list[str],
        gammas: list[int],
        params: list[SamplingParams],
        policy: GammaPolicy | None = None,
        states: list[GammaState] | None = None,
    ) -> DraftProposal:
        """Draft up to gammas[i] tokens for each request.

        params[i] gives the logits processing (temperature, top-k, top-p) that q must share with the target.
        When policy and states are given the drafter asks policy.keep_drafting(states[i], drafted, q_row)
        after each drafted token and stops that request early when it says no (EGAG).
        """

    @abstractmethod
    def commit(
        self,
        request_id: str,
        num_accepted: int,
        new_tokens: list[int],
        hidden: torch.Tensor | None = None,  # [len(new_tokens), H]: predicted each new token
    ) -> None:
        """Apply a verified step: new_tokens = num_accepted accepted drafts + the recovered or bonus token.

        The drafter rolls back to the verified prefix and appends new_tokens, so its next proposal continues
        from the target's token.
        """

    @abstractmethod
    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request and free its state."""

    def pending_context(self, request_id: str) -> int:
        """Tokens of the request's context a model drafter has not taken in yet (it takes them in before it
        next drafts for the request: a prompt, or what was committed while it did not draft). 0 here."""
        return 0

    def draft_hints(
        self, request_ids: list[str], depths: list[int], params: list[SamplingParams]
    ) -> list[DraftHint | None]:
        """Called before propose with the same requests, their γ caps and sampling: a DraftHint where this
        drafter knows what its next draft is worth (then it drafts that draft, cut to the planned γ), None
        where the caller's own estimate should plan (the default: every row)."""
        return [None] * len(request_ids)

    def use_fallback(self, request_ids: list[str]) -> None:
        """The plan drafts these requests' fallback hints (DraftHint.fallback) at their next propose."""
        if request_ids:
            raise NotImplementedError(f"{self.name} gives no fallback hints")

    def propose_tree(
        self,
        request_ids: list[str],
        depths: list[int],
        widths: list[int],
        params: list[SamplingParams],
        policy: GammaPolicy | None = None,
        states: list[GammaState] | None = None,
    ) -> DraftTree:
        """Draft a token tree of depths[i] levels and up to widths[i] candidates per level.

        Default for drafters without branching: a chain of depths[i] tokens (width ignored), which the tree
        verifier handles like any other tree. Drafters that can branch (the model drafter, from its top-w
        candidates) override this. Said once per drafter in the log, so a tree_width that runs as a
        chain is never silent.
        """
        if any(w > 1 for w in widths) and not getattr(self, "_said_chain", False):
            self._said_chain = True
            log.warning("drafter %s (%s) cannot branch: tree_width > 1 runs as a chain", self.name,
                        self.version)
        chain = self.propose(request_ids, depths, params, policy=policy, states=states)
        parents = [list(range(len(tokens))) for tokens in chain.tokens]
        return DraftTree(
            tokens=chain.tokens, parents=parents, probs=chain.probs, drafter_version=chain.drafter_version,
            row_versions=chain.row_versions,
        )


def check_batch(request_ids: list[str], gammas: list[int], params: list | None = None) -> None:
    """Raise ValueError when the per-request lists of a propose call disagree in length or γ < 0."""
    if len(gammas) != len(request_ids) or (params is not None and len(params) != len(request_ids)):
        raise ValueError(
            f"propose got {len(request_ids)} request ids, {len(gammas)} gammas"
            + ("" if params is None else f", {len(params)} sampling params")
        )
    if any(g < 0 for g in gammas):
        raise ValueError(f"gammas must be >= 0, got {gammas}")
