"""Suffix drafter (SuffixDecoding, Oliaro et al.; as in Snowflake's Arctic Inference), combined with the
model drafter.

Two kinds of suffix index (workers/drafters/suffix_index.py):
- a global one over the prompts and outputs this drafter has served, built from traffic: a request is
  queued for indexing when it finishes (remove_request), so the next request that repeats it (an edited
  prompt, a conversation quoting an earlier turn) drafts from it. Indexing costs python operations per
  token, so it is spread over the next steps: each propose indexes at most
  `index_tokens_per_step` queued tokens first (flush() does the rest). Memory is bounded by `max_nodes`
  trie nodes: past the cap the least recently indexed requests are removed (exactly: their counts are
  subtracted), oldest first, which is what lets the index fold paths back to one node when a copy goes.
- one per running request over its own prompt and output, growing at every commit: a ContextIndex, which
  drafts what a SuffixIndex over the sequence would but only records positions as tokens come (an
  O(len × max_depth) index per request was most of what this drafter cost a batch that drafted nothing).

Each step, per request: both indexes draft the most frequent continuation of their longest match (a chain,
or a tree of the most frequent branches for propose_tree), and the one with the higher score (expected
accepted tokens from observed frequencies) is the suffix candidate. With a model drafter beside it, the
candidate with more expected tokens per unit of cost drafts: the suffix step costs one target forward
(lookups are free next to it), a model step also `model_cost` of a forward per drafted level. Both are
priced from measured acceptance per draft position: the suffix draft's frequencies calibrated by what
suffix drafts of its match length achieved, the model's at its best draft length from what its drafts
achieved over all requests (its version's held-out figure until then), shrunk toward this request's own
record. Both drafters see every commit (as in hybrid.py), so either can draft the next step.

Suffix drafts are deterministic: q is one-hot on the drafted token (as for the n-gram drafter), so
verification stays exact for greedy and sampled requests. Request ids starting with SCRATCH_PREFIX
(the start-up profile's) are never indexed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from specd.workers.core.gamma import ACCEPTANCE_PRIOR
from specd.workers.drafters.base import (
    SCRATCH_PREFIX,
    Drafter,
    DraftHint,
    DraftProposal,
    DraftTree,
    check_batch,
)
from specd.workers.drafters.registry import register_drafter
from specd.workers.drafters.suffix_index import ContextIndex, SuffixDraft, SuffixIndex

SOURCES = ("local", "global", "model")
# Match lengths whose suffix drafts are accepted alike: a longer match predicts its continuation better.
MATCH_BUCKETS = (2, 3, 5, 9)      # bucket i holds matches >= MATCH_BUCKETS[i] (and below the next)


class PositionAcceptance:
    """Measured acceptance of drafts per match-length bucket and draft position: P(draft k accepted |
    drafts before it were). For suffix drafts it calibrates the index's frequencies, which overrate rare
    continuations (one occurrence reads as probability 1); the model's drafts use one bucket. Starts from
    prior pseudo-counts."""

    def __init__(self, depth: int, first: float = 0.5, later: float = 0.8, pseudo: float = 4.0,
                 buckets: int = len(MATCH_BUCKETS)) -> None:
        prior = [first] + [later] * (depth - 1)
        self.hits = [[p * pseudo for p in prior] for _ in range(buckets)]
        self.trials = [[pseudo] * depth for _ in range(buckets)]

    def bucket(self, match: int) -> int:
        b = max(i for i, lo in enumerate(MATCH_BUCKETS) if match >= lo or i == 0)
        return min(b, len(self.hits) - 1)

    def alpha(self, match: int, k: int) -> float:
        b, k = self.bucket(match), min(k, len(self.hits[0]) - 1)
        return self.hits[b][k] / self.trials[b][k]

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        b = self.bucket(match)
        for k in range(min(accepted + (1 if accepted < drafted else 0), len(self.hits[b]))):
            self.trials[b][k] += 1
            self.hits[b][k] += k < accepted


def expected_tokens(alphas: list[float]) -> float:
    """Tokens a step emits in expectation when draft k is accepted with probability alphas[k] given the
    drafts before it were: 1 (the recovered or bonus token) + Σ_k Π_j≤k alphas[j]."""
    total, path = 1.0, 1.0
    for a in alphas:
        path *= a
        total += path
    return total


MODEL_PRIOR = ACCEPTANCE_PRIOR   # a model's per-token acceptance assumed where its drafter carries no record
# A request's own model drafts weigh in against the measured figure of all requests as if the latter were
# this many observations per position: a request's first few outcomes move its estimate, not decide it.
MODEL_SHRINK = 4.0


@dataclass
class _Request:
    tokens: list[int]
    index: ContextIndex
    source: str | None = None                     # who drafted the last step
    last_drafted: int = 0                         # and how many tokens
    last_match: int = 0                           # the suffix match it drafted from
    greedy: bool = True                           # its sampling, as draft_hints last saw it
    decided: tuple[SuffixDraft, str | None] | None = None   # draft_hints' choice for the next propose
    fallback: tuple[SuffixDraft, str] | None = None          # its lookup draft where it chose the model
    model_hits: list[float] = field(default_factory=list)    # this request's model drafts accepted
    model_trials: list[float] = field(default_factory=list)  # and reached, per draft position


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    def __init__(
        self,
        model: Drafter | None = None,
        max_depth: int = 24,
        max_match: int = 12,
        min_match: int = 2,
        min_prob: float = 0.1,
        max_nodes: int = 400_000,
        model_cost: float = 0.1,
        model_prior: float | None = None,
        index_tokens_per_step: int = 256,
    ) -> None:
        """model_prior: the per-token acceptance a request's model drafts are expected to get until the model
        drafts for it (None: the model's held-out acceptance, else MODEL_PRIOR)."""
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.model = model
        self.max_depth, self.max_match, self.min_match = max_depth, max_match, min_match
        self.min_prob, self.max_nodes = min_prob, max_nodes
        self.model_cost, self._model_prior = model_cost, model_prior
        self.uses_target_hidden = bool(model is not None and model.uses_target_hidden)
        self.global_index = SuffixIndex(max_depth)
        # LRU of indexed requests: the global index's sequence id -> tokens (the index keeps the tokens)
        self.indexed: OrderedDict[int, int] = OrderedDict()
        self.index_tokens_per_step = index_tokens_per_step
        self._pending: deque[list] = deque()   # [tokens, position, walk state] of requests being indexed
        self.requests: dict[str, _Request] = {}
        self.counts = {s: {"steps": 0, "drafted": 0, "accepted": 0} for s in SOURCES}
        # by greedy (True) and sampled (False) requests
        self.measured = {True: PositionAcceptance(max_depth), False: PositionAcceptance(max_depth)}
        # the version recorded for steps the suffix index drafted (model-drafted steps: the model's)
        self.suffix_version = f"suffix-{self.max_depth}"
        self._model_version: str | None = None
        self.model_measured: dict[bool, PositionAcceptance] = {}
        self._follow_model_version()

    @property
    def version(self) -> str:
        # read each time: a hot swap replaces the model drafter's weights (and version) directly
        return self.suffix_version if self.model is None else f"{self.model.version}+{self.suffix_version}"

    @classmethod
    def has_weights(cls, cfg) -> bool:
        return bool(cfg.suffix_with_model)

    @property
    def weights_drafter(self) -> Drafter | None:
        return self.model

    @property
    def held_out_acceptance(self) -> float | None:
        return self.model.held_out_acceptance if self.model is not None else None

    @property
    def held_out_parent(self) -> float | None:
        return self.model.held_out_parent if self.model is not None else None

    @property
    def model_prior(self) -> float:
        """A new request's model_alpha: as given, else the model's held-out acceptance (the weights
        serving now: an online version has none), else MODEL_PRIOR."""
        if self._model_prior is not None:
            return self._model_prior
        recorded = self.held_out_acceptance
        return MODEL_PRIOR if recorded is None else recorded

    @classmethod
    def from_config(cls, cfg, *, target_model_dir: str, cache_dir: str | None = None, seed: int = 0):
        model = None
        if cfg.suffix_with_model:
            from specd.workers.drafters.model import ModelDrafter  # heavy: only when a model drafts beside it

            model = ModelDrafter.from_config(
                cfg, target_model_dir=target_model_dir, cache_dir=cache_dir, seed=seed
            )
        return cls(
            model, max_depth=cfg.suffix_max_depth, max_match=cfg.suffix_max_match,
            min_match=cfg.suffix_min_match, min_prob=cfg.suffix_min_prob, max_nodes=cfg.suffix_max_nodes,
            model_cost=cfg.suffix_model_cost, index_tokens_per_step=cfg.suffix_index_tokens_per_step,
        )

    @property
    def hidden_size(self) -> int | None:
        return getattr(self.model, "hidden_size", None)

    def pending_context(self, request_id: str) -> int:
        return self.model.pending_context(request_id) if self.model is not None else 0

    def max_slots(self) -> int:
        return self.model.max_slots() if self.model is not None else super().max_slots()

    def stats(self) -> dict:
        """Steps, drafted and accepted tokens by who drafted them (local, global = cross-request, model),
        and the global index's size."""
        return {"sources": {s: dict(c) for s, c in self.counts.items()},
                "global_nodes": self.global_index.num_nodes, "indexed_requests": len(self.indexed),
                "pending_tokens": sum(len(job[0]) - job[1] for job in self._pending)}

    def clear_index(self) -> None:
        """Forget all served traffic (the global index) and the source counts; running requests keep
        their own indexes. Benchmarks call it between cells that replay the same prompts."""
        self.global_index = SuffixIndex(self.max_depth)
        self.indexed.clear()
        self._pending.clear()
        self.counts = {s: {"steps": 0, "drafted": 0, "accepted": 0} for s in SOURCES}

    # ---- request life cycle ---------------------------------------------------------------------
    def add_request(self, request_id, prompt_tokens, seed=None, hidden=None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already tracked")
        if self.model is not None:
            extra = {"hidden": hidden} if self.uses_target_hidden else {}
            self.model.add_request(request_id, prompt_tokens, seed=seed, **extra)
        tokens = [int(t) for t in prompt_tokens]
        index = ContextIndex(self.max_depth)
        index.extend(tokens)
        self.requests[request_id] = _Request(tokens, index)

    def commit(self, request_id, num_accepted, new_tokens, hidden=None) -> None:
        req = self.requests[request_id]
        if not 0 <= num_accepted <= len(new_tokens):
            raise ValueError(f"num_accepted {num_accepted} exceeds the {len(new_tokens)} new tokens")
        if self.model is not None:
            extra = {"hidden": hidden} if self.uses_target_hidden else {}
            self.model.commit(request_id, num_accepted, new_tokens, **extra)
        if req.source is not None:
            if not request_id.startswith(SCRATCH_PREFIX):
                self.counts[req.source]["accepted"] += num_accepted
                if req.source != "model":
                    self.measured[req.greedy].observe(req.last_match, req.last_drafted, num_accepted)
            if req.source == "model":
                self._follow_model_version()
                self.model_measured[req.greedy].observe(0, req.last_drafted, num_accepted)
                reached = min(num_accepted + (1 if num_accepted < req.last_drafted else 0), self.max_depth)
                while len(req.model_trials) < reached:
                    req.model_trials.append(0.0)
                    req.model_hits.append(0.0)
                for k in range(reached):
                    req.model_trials[k] += 1
                    req.model_hits[k] += k < num_accepted
            req.source = None
        new = [int(t) for t in new_tokens]
        req.tokens += new
        req.index.extend(new)

    def remove_request(self, request_id: str) -> None:
        if self.model is not None:
            self.model.remove_request(request_id)
        req = self.requests.pop(request_id, None)
        if req is None or request_id.startswith(SCRATCH_PREFIX) or not req.tokens:
            return
        self._pending.append([req.tokens, 0, None])

    def flush(self) -> None:
        """Index every finished request still queued."""
        self._index_some(None)

    def _index_some(self, budget: int | None) -> None:
        """Index up to budget queued tokens (None: all), oldest request first; evict past the cap."""
        while self._pending and (budget is None or budget > 0):
            job = self._pending[0]
            tokens, pos = job[0], job[1]
            end = len(tokens) if budget is None else min(len(tokens), pos + budget)
            job[2] = self.global_index.extend(tokens[pos:end], job[2])
            job[1] = end
            if budget is not None:
                budget -= end - pos
            if end < len(tokens):
                return
            self._pending.popleft()
            self.indexed[job[2].seq] = len(tokens)
            while self.global_index.num_nodes > self.max_nodes and self.indexed:
                old, _ = self.indexed.popitem(last=False)
                self.global_index.remove(old)

    # ---- drafting -------------------------------------------------------------------------------
    def _suffix(self, request_id: str, depth: int, width: int) -> tuple[SuffixDraft, str]:
        """The better of the local and the global index's drafts (ties: local)."""
        ctx = self.requests[request_id].tokens
        kw = dict(width=width, max_match=self.max_match, min_match=self.min_match, min_prob=self.min_prob)
        local = self.requests[request_id].index.draft(ctx, depth, **kw)
        glob = self.global_index.draft(ctx, depth, **kw)
        return (glob, "global") if glob.score > local.score else (local, "local")

    def _suffix_alphas(self, draft: SuffixDraft, greedy: bool) -> list[float]:
        """The suffix draft's predicted acceptance per position, P(draft k accepted | drafts before it
        were): the index's conditional frequency times what suffix drafts of that match length were
        measured to achieve at that position (the frequencies alone overrate rare continuations)."""
        measured, alpha, prev = self.measured[greedy], [], 1.0
        for k, path in enumerate(draft.probs):
            alpha.append(min(1.0, path / prev) * measured.alpha(draft.match, k))
            prev = path
        return alpha

    def _model_alphas(self, req: _Request, depth: int) -> list[float]:
        """The model draft's predicted acceptance per position for this request: the model's measured
        acceptance at that position over all requests (its version's held-out figure until it has
        drafted), shrunk toward what it got in this request (pseudo-counts: MODEL_SHRINK requests' worth)."""
        self._follow_model_version()
        measured = self.model_measured[req.greedy]
        out = []
        for k in range(depth):
            prior = measured.alpha(0, k)
            hits = req.model_hits[k] if k < len(req.model_hits) else 0.0
            trials = req.model_trials[k] if k < len(req.model_trials) else 0.0
            out.append((hits + MODEL_SHRINK * prior) / (trials + MODEL_SHRINK))
        return out

    def _prefers_suffix(self, draft: SuffixDraft, depth: int, req: _Request) -> bool:
        """Expected tokens per unit of cost: the suffix draft's (1 + Σ_k Π_j≤k α_j) against the model
        draft's best over its lengths d ≤ depth, (1 + Σ_k<d Π_j≤k α_j) / (1 + c·d). Both from measured
        acceptance per position: the model's at its best length, not at the plan's cap (a model draft
        priced at eight positions where the later ones are rarely accepted lost to any suffix match), and
        the suffix draft's calibrated, not its raw frequencies."""
        if not draft.tokens:
            return False
        if self.model is None:
            return True
        return expected_tokens(self._suffix_alphas(draft, req.greedy)) >= self._model_value(req, depth)

    def _model_value(self, req: _Request, depth: int) -> float:
        best, tokens, path = 1.0, 1.0, 1.0
        for d, alpha in enumerate(self._model_alphas(req, depth), start=1):
            path *= alpha
            tokens += path
            best = max(best, tokens / (1.0 + self.model_cost * d))
        return best

    def _follow_model_version(self) -> None:
        """A hot swap replaced the model drafter's weights: its measured acceptance restarts from the new
        version's held-out figure (MODEL_PRIOR where it has none)."""
        version = self.model.version if self.model is not None else None
        if version != self._model_version:
            self._model_version = version
            prior = self.model_prior
            self.model_measured = {g: PositionAcceptance(self.max_depth, first=prior, later=prior,
                                                         buckets=1) for g in (True, False)}

    def _choose(self, request_ids, depths, width: int | list[int]):
        """(draft, source) per request; source None: the model drafts. A choice draft_hints made for the
        step is kept (cut to the planned depth): the plan was made for that draft."""
        widths = width if isinstance(width, list) else [width] * len(request_ids)
        picks = []
        for rid, depth, w in zip(request_ids, depths, widths, strict=True):
            req = self.requests[rid]
            decided, req.decided = req.decided, None
            if decided is not None and w == 1:
                draft, source = decided
                picks.append((draft.cut(depth), source))
                continue
            draft, source = self._suffix(rid, depth, w) if depth > 0 else (SuffixDraft(), "local")
            picks.append((draft, source if self._prefers_suffix(draft, depth, req) else None))
        return picks

    def draft_hints(self, request_ids: list[str], depths: list[int], params) -> list[DraftHint | None]:
        """Where the suffix index would draft (a match that promises more than the model drafter), its draft's
        predicted acceptance per position: the index's conditional frequency times what suffix drafts of that
        match length were measured to achieve at that position (greedy and sampled requests apart: a sampled
        one accepts a deterministic draft with the target's probability of it). Free: a lookup drafts it.
        Elsewhere None."""
        hints: list[DraftHint | None] = []
        for rid, depth, p in zip(request_ids, depths, params, strict=True):
            req = self.requests[rid]
            draft, source = self._suffix(rid, depth, 1) if depth > 0 else (SuffixDraft(), "local")
            req.greedy = p.is_greedy
            prefers = self._prefers_suffix(draft, depth, req)
            req.decided = (draft, source) if prefers else (SuffixDraft(), None)
            # Where the model is preferred, the lookup draft is offered as a fallback: the model's draft
            # may not pay at all (a long context to catch up on, a batch where model drafts cost too
            # much), and its per-request estimate only moves when it drafts.
            req.fallback = None if prefers or not draft.tokens else (draft, source)
            if not draft.tokens:
                hints.append(None)
                continue
            hints.append(DraftHint(self._suffix_alphas(draft, req.greedy), free=True, fallback=not prefers))
        return hints

    def use_fallback(self, request_ids: list[str]) -> None:
        """The plan priced a lookup draft for these requests (from the hint, or the fallback hint where the
        model was preferred). Through Ray the plan was made from the previous step's hints, and this step's
        (draft_hints, just before) may disagree: where the index drafts now its draft stays (the fallback
        lookup where the model is now preferred); where it has no lookup draft now, nothing is drafted (the
        plan priced no model forward for the request)."""
        for rid in request_ids:
            req = self.requests[rid]
            if req.fallback is not None:
                req.decided, req.fallback = req.fallback, None
            elif req.decided is None or req.decided[1] is None:
                req.decided = (SuffixDraft(), "local")

    def _record(self, request_id: str, source: str | None, drafted: int, match: int = 0) -> None:
        req = self.requests[request_id]
        req.source, req.last_drafted = (source, drafted) if drafted else (None, 0)
        req.last_match = match
        if drafted and not request_id.startswith(SCRATCH_PREFIX):   # the start-up profile's are not traffic
            self.counts[source]["steps"] += 1
            self.counts[source]["drafted"] += drafted

    def propose(self, request_ids, gammas, params, policy=None, states=None) -> DraftProposal:
        check_batch(request_ids, gammas, params)
        self._index_some(self.index_tokens_per_step)
        picks = self._choose(request_ids, gammas, 1)
        rows = [i for i, (_, src) in enumerate(picks) if src is None and gammas[i] > 0 and self.model]
        tokens = [list(d.tokens) if src else [] for d, src in picks]
        model_probs = None
        if rows:
            out = self.model.propose(_pick(request_ids, rows), _pick(gammas, rows), _pick(params, rows),
                                     policy=policy, states=_pick(states, rows))
            for j, i in enumerate(rows):
                tokens[i] = list(out.tokens[j])
            model_probs = out.probs
        for i, (rid, (_, src)) in enumerate(zip(request_ids, picks, strict=True)):
            if src and policy is not None and states is not None:
                # Deterministic drafts carry no q: policies only enforce their plan here.
                for drafted in range(1, len(tokens[i])):
                    if not policy.keep_drafting(states[i], drafted, None):
                        tokens[i] = tokens[i][:drafted]
                        break
            self._record(rid, src or ("model" if i in rows else None), len(tokens[i]), picks[i][0].match)
        probs = self._merge_probs(tokens, rows, model_probs, params)
        return DraftProposal(tokens, probs, self.version, self._row_versions(rows, len(tokens)))

    def _row_versions(self, model_rows: list[int], batch: int) -> list[str]:
        model = set(model_rows)
        return [self.model.version if i in model else self.suffix_version for i in range(batch)]

    def propose_tree(self, request_ids, depths, widths, params, policy=None, states=None) -> DraftTree:
        check_batch(request_ids, depths, params)
        self._index_some(self.index_tokens_per_step)
        picks = self._choose(request_ids, depths, list(widths))
        rows = [i for i, (_, src) in enumerate(picks) if src is None and depths[i] > 0 and self.model]
        tokens = [list(d.tokens) if src else [] for d, src in picks]
        parents = [list(d.parents) if src else [] for d, src in picks]
        model_probs = None
        if rows:
            out = self.model.propose_tree(_pick(request_ids, rows), _pick(depths, rows), _pick(widths, rows),
                                          _pick(params, rows), policy=policy, states=_pick(states, rows))
            for j, i in enumerate(rows):
                tokens[i], parents[i] = list(out.tokens[j]), list(out.parents[j])
            model_probs = out.probs
        for i, (rid, (_, src)) in enumerate(zip(request_ids, picks, strict=True)):
            self._record(rid, src or ("model" if i in rows else None), len(tokens[i]), picks[i][0].match)
        probs = self._merge_probs(tokens, rows, model_probs, params)
        return DraftTree(tokens, parents, probs, self.version, self._row_versions(rows, len(tokens)))

    def _merge_probs(self, tokens, model_rows, model_probs, params) -> torch.Tensor | None:
        """q [batch, max nodes, vocab]: the model's rows where it drafted, one-hot elsewhere; None when every
        request is greedy or nothing carries q (all drafts deterministic)."""
        if model_probs is None or all(p.is_greedy for p in params) or not any(tokens):
            return None
        out = torch.zeros(len(tokens), max(len(t) for t in tokens), model_probs.shape[-1])
        where = {i: j for j, i in enumerate(model_rows)}
        for i, toks in enumerate(tokens):
            if not toks:
                continue
            if i in where and not params[i].is_greedy:
                out[i, : len(toks)] = model_probs[where[i], : len(toks)]
            else:
                out[i, torch.arange(len(toks)), torch.tensor(toks)] = 1.0
        return out

    def load(self, path) -> str:
        if self.model is None:
            raise ValueError("this suffix drafter has no model drafter to load weights into")
        self.model.load(path)
        return self.version


def _pick(xs, rows: list[int]):
    return None if xs is None else [xs[i] for i in rows]
