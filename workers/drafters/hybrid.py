"""Hybrid drafter: prompt lookup where the context repeats itself, the model drafter everywhere else.

Each step, per request: when the n-gram drafter's longest matching suffix has at least `min_match`
tokens (the text is copying something it has seen: a number from the question, a variable name), its
deterministic drafts are used; otherwise the model drafter drafts. Both keep their own state of every
request and both see every commit, so either can draft the next step. A model drafter that did not
draft a step just appends the verified tokens at its next commit (its cache was not touched).

Verification needs nothing new: n-gram drafts carry one-hot q (deterministic), model drafts their q.
"""

from __future__ import annotations

import torch

from specd.workers.drafters.base import Drafter, DraftProposal, check_batch
from specd.workers.drafters.model import ModelDrafter
from specd.workers.drafters.ngram import NGramDrafter
from specd.workers.drafters.registry import register_drafter


@register_drafter("hybrid")
class HybridDrafter(Drafter):
    def __init__(self, model: ModelDrafter, ngram: NGramDrafter, min_match: int = 2):
        self.model, self.ngram, self.min_match = model, ngram, min_match
        self.uses_target_hidden = model.uses_target_hidden

    @property
    def version(self) -> str:
        # read each time: a hot swap replaces the model drafter's weights (and version) directly
        return f"{self.model.version}+{self.ngram.version}"

    @classmethod
    def has_weights(cls, cfg) -> bool:
        return True

    @property
    def weights_drafter(self) -> ModelDrafter:
        return self.model

    @classmethod
    def from_config(cls, cfg, *, target_model_dir: str, cache_dir: str | None = None, seed: int = 0):
        model = ModelDrafter.from_config(
            cfg, target_model_dir=target_model_dir, cache_dir=cache_dir, seed=seed
        )
        ngram = NGramDrafter.from_config(cfg, target_model_dir=target_model_dir)
        return cls(model, ngram, min_match=cfg.hybrid_min_match)

    def pending_context(self, request_id: str) -> int:
        return self.model.pending_context(request_id) if self.model is not None else 0

    def max_slots(self) -> int:
        return self.model.max_slots()

    def add_request(self, request_id, prompt_tokens, seed=None, hidden=None) -> None:
        self.model.add_request(request_id, prompt_tokens, seed=seed, hidden=hidden)
        self.ngram.add_request(request_id, prompt_tokens, seed=seed)

    def commit(self, request_id, num_accepted, new_tokens, hidden=None) -> None:
        self.model.commit(request_id, num_accepted, new_tokens, hidden=hidden)
        self.ngram.commit(request_id, num_accepted, new_tokens)

    def remove_request(self, request_id: str) -> None:
        self.model.remove_request(request_id)
        self.ngram.remove_request(request_id)

    def propose(self, request_ids, gammas, params, policy=None, states=None) -> DraftProposal:
        check_batch(request_ids, gammas, params)
        lookups = [self.ngram.lookup_matched(r, g) for r, g in zip(request_ids, gammas, strict=True)]
        copied = [bool(d) and n >= self.min_match for d, n in lookups]
        # The model drafts only where nothing was copied (γ 0 elsewhere: its state stays untouched).
        model_gammas = [0 if c else g for c, g in zip(copied, gammas, strict=True)]
        out = self.model.propose(request_ids, model_gammas, params, policy=policy, states=states)
        tokens = [d if c else t for (d, _), c, t in zip(lookups, copied, out.tokens, strict=True)]
        rows = [self.ngram.version if c else self.model.version for c in copied]
        return DraftProposal(tokens, self._probs(tokens, copied, out.probs, params), self.version, rows)

    def _probs(self, tokens, copied, model_probs, params) -> torch.Tensor | None:
        """q [batch, γmax, vocab]: the model's rows, one-hot rows for copied drafts; None if all greedy."""
        if all(p.is_greedy for p in params) or not any(tokens):
            return None
        gmax = max(len(t) for t in tokens)
        out = torch.zeros(len(tokens), gmax, self.model.full_vocab_size, device=self.model.runner.device)
        for i, toks in enumerate(tokens):
            if not toks:
                continue
            if copied[i] or params[i].is_greedy or model_probs is None:
                at = torch.arange(len(toks), device=out.device)
                out[i, at, torch.tensor(toks, device=out.device)] = 1.0
            else:
                out[i, : len(toks)] = model_probs[i, : len(toks)]
        return out

    def load(self, path) -> str:
        self.model.load(path)
        return self.version
