"""DraftWorker: a drafter (any registered kind) on its own device, plus each request's γ policy.

The scheduler sends one DraftItem per request and step: it carries the previous step's verified
outcome (the drafter rolls back and appends the target's tokens) and the step's γ cap. The worker's
γ policy picks the draft length (or tree shape) within that cap, and EGAG may stop a draft early from
the drafter's entropy. Plain Python: Ray wraps it as an actor in cluster/actors.py.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

from workers.core.gamma import GammaPolicy, GammaState, build_gamma_policy
from workers.drafters.registry import DRAFTERS
from workers.engine.target_worker import resolve_device
from workers.engine.types import Draft, DraftItem, NewRequest


@dataclass
class _DraftRequest:
    request: NewRequest
    policy: GammaPolicy
    state: GammaState
    generated: int          # tokens the target has emitted so far (the prefill's first token included)
    last_drafted: int = 0
    last_depth: int | None = None


def build_policy(name: str, spec_cfg, gamma: int, tree_width: int) -> GammaPolicy:
    """One policy object per request: its bounds come from the operator config and the request's γ."""
    common = dict(gamma_min=min(spec_cfg.gamma_min, gamma), gamma_max=gamma, tree_width=tree_width)
    extra = {
        "egag": {"entropy_threshold": spec_cfg.egag_threshold, "beta": spec_cfg.egag_beta},
        "confidence": {"threshold": spec_cfg.confidence_threshold},
    }
    return build_gamma_policy(name, **common, **extra.get(name, {}))


class DraftWorker:
    def __init__(self, cfg, spec, target_model_dir: str, seed: int = 0, cache_dir: str | None = None):
        resolve_device(cfg.device)
        self.drafter = _drafter_class(cfg.kind).from_config(
            cfg, target_model_dir=str(target_model_dir), cache_dir=cache_dir, seed=seed
        )
        self.spec = spec
        # The context both caches have (the drafter's follows the target's; configs.load_config).
        self.max_seq_len: int | None = getattr(cfg, "max_seq_len", None)
        self.requests: dict[str, _DraftRequest] = {}
        self._busy = 0.0

    def version(self) -> str:
        return self.drafter.version

    def max_slots(self) -> int:
        return self.drafter.max_slots()

    def uses_target_hidden(self) -> bool:
        """The drafter reads the target's hidden states: start and verify must return them."""
        return self.drafter.uses_target_hidden

    def busy_seconds(self) -> float:
        return self._busy

    def start(self, requests: list[NewRequest], first_tokens: list[list[int]], prompt_hidden=None) -> None:
        """prompt_hidden: the target's start(..., return_hidden=True) states, one per request, when
        uses_target_hidden()."""
        t0 = time.perf_counter()
        if self.drafter.uses_target_hidden and prompt_hidden is None:
            raise ValueError(f"drafter {self.drafter.version} reads target hidden states: pass prompt_hidden")
        for i, (req, first) in enumerate(zip(requests, first_tokens, strict=True)):
            policy = build_policy(req.spec.policy, self.spec, req.spec.gamma, req.spec.tree_width)
            extra = {"hidden": prompt_hidden[i]} if self.drafter.uses_target_hidden else {}
            self.drafter.add_request(
                req.request_id, list(req.prompt_token_ids) + list(first), seed=req.sampling.seed, **extra
            )
            self.requests[req.request_id] = _DraftRequest(req, policy, policy.new_state(), len(first))
        self._busy += time.perf_counter() - t0

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                self.drafter.remove_request(rid)

    def load_drafter(self, path: str) -> str:
        """Hot swap: same shapes, new weights; the next proposal uses them."""
        return self.drafter.load(path)

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        t0 = time.perf_counter()
        chains: dict[str, list[tuple[DraftItem, _DraftRequest, int]]] = {}
        trees: dict[str, list[tuple[DraftItem, _DraftRequest, int, int]]] = {}
        for item in items:
            r = self.requests[item.request_id]
            if item.commit_tokens:
                extra = {"hidden": item.commit_hidden} if self.drafter.uses_target_hidden else {}
                self.drafter.commit(item.request_id, item.commit_accepted, item.commit_tokens, **extra)
                r.policy.observe(r.state, r.last_drafted, item.commit_accepted, depth=r.last_depth)
                r.generated += len(item.commit_tokens)
            remaining = r.request.max_new_tokens - r.generated
            room = self._kv_room(r, remaining)
            if r.request.spec.tree_width > 1:
                depth, width = r.policy.plan_tree(r.state, remaining)
                depth, width = fit_tree(min(depth, item.gamma), width, room)
                trees.setdefault(r.request.spec.policy, []).append((item, r, depth, width))
            else:
                gamma = min(r.policy.plan(r.state, remaining), item.gamma, room)
                chains.setdefault(r.request.spec.policy, []).append((item, r, gamma))
        drafts: dict[str, Draft] = {}
        # Requests that share a policy kind are drafted in one batch (their states stay per request).
        for group in chains.values():
            self._propose_chains(group, drafts)
        for group in trees.values():
            self._propose_trees(group, drafts)
        self._busy += time.perf_counter() - t0
        return [drafts[item.request_id] for item in items]

    def _kv_room(self, r: _DraftRequest, remaining: int) -> int:
        """Draft nodes this step may add: the target writes 1 + nodes positions after the committed
        context (prompt + generated - 1). At least `remaining`, since every request is admitted with
        prompt + max_new_tokens <= max_seq_len; more when the context is known to leave more."""
        if self.max_seq_len is None:
            return remaining
        context = len(r.request.prompt_token_ids) + r.generated
        return max(remaining, self.max_seq_len - context)

    def _propose_chains(self, group, drafts: dict[str, Draft]) -> None:
        rids = [item.request_id for item, _, _ in group]
        out = self.drafter.propose(
            rids,
            [g for _, _, g in group],
            [r.request.sampling for _, r, _ in group],
            policy=group[0][1].policy,
            states=[r.state for _, r, _ in group],
        )
        for i, ((item, r, _), toks) in enumerate(zip(group, out.tokens, strict=True)):
            r.last_drafted, r.last_depth = len(toks), None
            probs = None if out.probs is None or not toks else out.probs[i, : len(toks)]
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, None, out.drafter_version)

    def _propose_trees(self, group, drafts: dict[str, Draft]) -> None:
        out = self.drafter.propose_tree(
            [item.request_id for item, *_ in group],
            [d for _, _, d, _ in group],
            [w for *_, w in group],
            [r.request.sampling for _, r, _, _ in group],
            policy=group[0][1].policy,
            states=[r.state for _, r, _, _ in group],
        )
        for i, ((item, r, _, _), toks, pars) in enumerate(zip(group, out.tokens, out.parents, strict=True)):
            depth = _depth(pars)
            r.last_drafted, r.last_depth = len(toks), depth
            probs = None if out.probs is None or not toks else out.probs[i, : len(toks)]
            parents = [-1, *pars] if toks else None
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, parents, out.drafter_version)


def _drafter_class(kind: str):
    if kind not in DRAFTERS:
        # A drafter module registers itself on import (the registry's convention).
        importlib.import_module(f"workers.drafters.{kind}")
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {sorted(DRAFTERS)}")
    return DRAFTERS[kind]


def fit_tree(depth: int, width: int, room: int) -> tuple[int, int]:
    """(depth, width) of a tree of width * depth draft nodes within `room` nodes: shallower first,
    then narrower (one level of `room` candidates)."""
    if width * depth <= room:
        return depth, width
    if room >= width:
        return room // width, width
    return (1, room) if room > 0 else (0, 1)


def _depth(parents: list[int]) -> int:
    """Levels of a tree given each draft node's parent (0 = root, k = draft k-1)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return max(depth)
