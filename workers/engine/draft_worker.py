"""DraftWorker: a drafter (any registered kind) on its own device, plus each request's γ policy.

The scheduler sends one DraftItem per request and step: it carries the previous step's verified
outcome (the drafter rolls back and appends the target's tokens) and the step's γ cap. The worker's
γ policy picks the draft length (or tree shape) within that cap, and EGAG may stop a draft early from
the drafter's entropy. Plain Python: Ray wraps it as an actor in cluster/actors.py.

Requests on the goodput policy are planned together: the worker's GoodputController (one per worker,
holding the step cost model) chooses γ and tree width for the whole batch of a propose call, which is
the batch the target verifies next. The cost model starts from set_cost_profile (the target's measured
verify sweep, plus a drafter sweep timed here) and follows measured steps: the caller passes the previous
step's verify time with the next propose (`last_verify`), drafting is timed here. New requests seed their
per-position acceptance from what this worker's drafter has achieved so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from specd.workers.core.gamma import (
    ACCEPTANCE_PRIOR,
    PRIOR_PROFILE,
    GammaPolicy,
    GammaState,
    GoodputGamma,
    build_gamma_policy,
)
from specd.workers.core.goodput import Acceptance, CostProfile, GoodputController, Slot, StepCostModel
from specd.workers.drafters.registry import drafter_class
from specd.workers.engine.gc_freeze import freeze_loaded_objects
from specd.workers.engine.host_memory import keep_freed_memory
from specd.workers.engine.profile import profile_drafter
from specd.workers.engine.target_worker import resolve_device
from specd.workers.engine.types import Draft, DraftItem, NewRequest


@dataclass
class _DraftRequest:
    request: NewRequest
    policy: GammaPolicy
    state: GammaState
    generated: int          # tokens the target has emitted so far (the prefill's first token included)
    last_drafted: int = 0
    last_depth: int | None = None
    hinted: bool = False    # this step is planned from the drafter's DraftHint (a suffix draft), not ρ
    last_hinted: bool = False


def build_policy(name: str, spec_cfg, gamma: int, tree_width: int, **goodput) -> GammaPolicy:
    """One policy object per request: its bounds come from the operator config and the request's γ.
    goodput: the worker's controller and position prior, for the goodput policy."""
    common = dict(gamma_min=min(spec_cfg.gamma_min, gamma), gamma_max=gamma, tree_width=tree_width)
    extra = {
        "egag": {"entropy_threshold": spec_cfg.egag_threshold, "beta": spec_cfg.egag_beta},
        "confidence": {"threshold": spec_cfg.confidence_threshold},
        "goodput": goodput,
    }
    return build_gamma_policy(name, **common, **extra.get(name, {}))


DEFAULT_PRIOR = ACCEPTANCE_PRIOR   # acceptance per position assumed for a drafter with no training record


class PositionCounts:
    """Drafted and accepted counts per draft position over every step of a worker: the drafter's measured
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


class DraftWorker:
    def __init__(self, cfg, spec, target_model_dir: str, seed: int = 0, cache_dir: str | None = None,
                 versions: dict | None = None):
        """versions: where published drafter versions live when they are not on this machine's disk
        ({"redis": endpoint fields, "prefix": key prefix}; workers/drafters/redis_versions.py). The
        worker then starts from the version serving names there (version 0 is the router's first-start
        drafter), wherever it runs, and follows it; None: cfg.path, as configured."""
        resolve_device(cfg.device)
        keep_freed_memory(getattr(cfg, "keep_freed_memory", True))
        self._versions, self._cache_dir = versions, cache_dir
        if versions is not None and drafter_class(cfg.kind).has_weights(cfg):
            cfg = replace(cfg, path=str(self._serving_drafter_dir(cfg, target_model_dir)))
        self.drafter = drafter_class(cfg.kind).from_config(
            cfg, target_model_dir=str(target_model_dir), cache_dir=cache_dir, seed=seed
        )
        self.spec = spec
        # The context both caches have (the drafter's follows the target's; configs.load_config).
        self.max_seq_len: int | None = getattr(cfg, "max_seq_len", None)
        self.requests: dict[str, _DraftRequest] = {}
        self._busy = 0.0
        self.costs = StepCostModel(PRIOR_PROFILE)
        self.controller = GoodputController(self.costs)
        # greedy and sampled requests apart: the same drafter's drafts are accepted less under sampling, and
        # sampled requests seeded from greedy figures overdrafted (GSM8K, batch 16, T = 0.7: first-position
        # estimates of 0.5-0.7, 28 of 99 drafts accepted)
        self.positions = self._fresh_positions()
        self.last_plan = None              # the goodput plan of the latest propose (None: nobody on it)
        self._last_draft_seconds = 0.0
        self._priced_seconds = 0.0         # what the cost model priced of the latest propose (observe_steps)
        self.goodput_ema = {"predicted": 0.0, "measured": 0.0}
        # True when this worker shares the target's device and thread (the in-process engine sets it): its
        # catch-up prefills then add to the step's time and the goodput plan charges them
        self.colocated = False
        self._swapper = None
        freeze_loaded_objects()     # the drafter and its imports stay out of every full collection

    def version(self) -> str:
        return self.drafter.version

    def max_slots(self) -> int:
        return self.drafter.max_slots()

    def uses_target_hidden(self) -> bool:
        """The drafter reads the target's hidden states: start and verify must return them."""
        return self.drafter.uses_target_hidden

    def busy_seconds(self) -> float:
        return self._busy

    def set_cost_profile(self, verify: dict[int, list[float]], draft: dict[int, float] | None = None,
                         pad_weight: float = 1.0, ragged: dict[int, float] | None = None,
                         catch_up: float | None = None) -> None:
        """The target's measured verify sweep and pad weight (workers/engine/profile.py); draft None times
        this drafter (its levels and its catch-up per context token; catch_up None keeps the measured one)."""
        measured = None
        if draft is None:
            measured = profile_drafter(self.drafter, max_seq_len=self.max_seq_len)
            draft = measured["draft"]
        if catch_up is None:
            catch_up = measured["catch_up"] if measured is not None else PRIOR_PROFILE.catch_up
        table = {int(b): list(v) for b, v in verify.items()}
        fixed = {int(b): float(t) for b, t in (ragged or {}).items()}
        profile = CostProfile(verify=table, draft=draft, pad_weight=pad_weight, ragged=fixed,
                              catch_up=catch_up)
        self.costs = StepCostModel(profile)
        self.controller.costs = self.costs

    def cost_profile_request(self) -> dict | None:
        """What the target should sweep for set_cost_profile (TargetWorker.profile_verify kwargs), or None
        when no request can use the goodput policy's cost model (another default policy)."""
        if self.spec.policy != GoodputGamma.name:
            return None
        return {"batch_sizes": list(self.spec.goodput_profile_batch_sizes),
                "max_tokens": 1 + max(self.spec.gamma_max, 1)}

    def observe_verify(self, rows: list[int], seconds: float, emitted: int | None = None) -> None:
        """A measured verify forward over len(rows) requests, rows[i] tokens each (1 + drafts); emitted:
        tokens it produced, for the measured goodput beside the predicted one."""
        self.costs.observe_verify(rows, seconds)
        if emitted is not None and seconds > 0:
            measured = emitted / (seconds + self._last_draft_seconds)
            g = self.goodput_ema
            g["measured"] = measured if not g["measured"] else 0.8 * g["measured"] + 0.2 * measured

    def goodput_stats(self) -> dict:
        """Predicted vs measured tokens/s of this worker's steps (EMAs), and the latest plan's γ."""
        plan = self.last_plan
        return {**self.goodput_ema, "depths": list(plan.depths) if plan else [],
                "widths": list(plan.widths) if plan else []}

    def start(self, requests: list[NewRequest], first_tokens: list[list[int]], prompt_hidden=None) -> None:
        """prompt_hidden: the target's start(..., return_hidden=True) states, one per request, when
        uses_target_hidden()."""
        t0 = time.perf_counter()
        if self.drafter.uses_target_hidden and prompt_hidden is None:
            raise ValueError(f"drafter {self.drafter.version} reads target hidden states: pass prompt_hidden")
        for i, (req, first) in enumerate(zip(requests, first_tokens, strict=True)):
            prior = self.positions[req.sampling.is_greedy].alpha()
            goodput = {"controller": self.controller, "position_prior": prior}
            policy = build_policy(req.spec.policy, self.spec, req.spec.gamma, req.spec.tree_width, **goodput)
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

    def _versions_root(self) -> Path:
        from specd.workers.models.loader import default_cache_dir

        return Path(self._cache_dir or default_cache_dir()) / "drafters" / "served"

    def _serving_drafter_dir(self, cfg, target_model_dir: str, wait_s: float = 60.0) -> Path:
        """The serving version from the version source, as a drafter directory in this process's own
        cache; the configured cfg.path only when the source has none and that path exists here."""
        from specd.workers.drafters.redis_versions import (
            SourceUnavailable,
            materialize_drafter,
            version_source,
        )

        source = version_source(self._versions, self._versions_root())
        deadline = time.monotonic() + wait_s
        while True:
            try:
                version = source.current()
                if version is not None:
                    full = self._versions_root() / "full" / version
                    return materialize_drafter(source.version_dir(version), target_model_dir, full)
                break
            except SourceUnavailable:
                if time.monotonic() > deadline:
                    break
                time.sleep(1.0)
        if cfg.path and Path(cfg.path, "config.json").is_file():
            return Path(cfg.path)
        raise RuntimeError(f"no serving drafter version at {source} and no drafter at {cfg.path!r} here")

    def load_drafter(self, path: str) -> str:
        """Hot swap: same shapes, new weights; the next proposal uses them."""
        return self.drafter.load(path)

    def watch_versions(self, root: str | dict, target_model_dir: str, poll_s: float = 2.0) -> str:
        """Follow the online trainer's version store at `root`, a directory or a Redis source such as the
        constructor's `versions` (workers/engine/hot_swap.py): new versions
        are loaded and verified in the background and applied between steps. Returns the serving version."""
        from specd.workers.engine.hot_swap import DrafterSwapper

        weights = self.drafter.weights_drafter
        if weights is None:
            raise ValueError(f"drafter kind {type(self.drafter).__name__} has no weights to swap")
        if self._swapper is None:
            model = weights.runner.model
            self._swapper = DrafterSwapper(root, target_model_dir, model, weights.version, poll_s,
                                           cache_root=self._versions_root()).start()
        return weights.version

    def pin_version(self, version: str | None) -> str:
        """Serve `version` of the version store and no other (None: follow CURRENT again). Loaded and
        verified in the background and applied between steps, like any swap; returns the serving one."""
        if self._swapper is None:
            raise ValueError("this drafter follows no version store (online training is off)")
        self._swapper.source.pin(version or None)   # VersionError for an unpublished version
        self._swapper.pin = version or None
        return self.drafter.weights_drafter.version

    def swap_stats(self) -> dict:
        s, weights = self._swapper, self.drafter.weights_drafter
        return {"version": (weights or self.drafter).version, "swaps": s.swaps if s else 0,
                "rejected": dict(s.rejected) if s else {}}

    def _fresh_positions(self) -> dict[bool, PositionCounts]:
        prior = self.spec.goodput_prior
        if prior is None:
            # what the drafter's first drafts got accepted on held-out prompts when it was trained: a
            # general drafter on GSM8K accepts ~0.1, and a flat 0.6 had the plan try ~20 model drafts a
            # worker before its counts said so
            recorded = self.drafter.held_out_acceptance
            prior = DEFAULT_PRIOR if recorded is None else recorded
        return {greedy: PositionCounts(max(self.spec.gamma_max, 1), prior=prior) for greedy in (True, False)}

    def _apply_pending_swap(self) -> None:
        # Called first thing in a step's call: every draft of that call comes from one version.
        ready = self._swapper.take() if self._swapper is not None else None
        if ready is not None:
            version, tensors, meta = ready
            self.drafter.weights_drafter.load_tensors(tensors, version, meta)
            self._swapper.applied(version)
            # The counts measured the old weights. Kept, they seeded new requests with what the old version
            # achieved, and where that was too little to draft (HumanEval after GSM8K in `specd bench osd`)
            # nothing drafted again, so no version's improvement was ever tried: measure the new one afresh.
            self.positions = self._fresh_positions()

    def propose(self, items: list[DraftItem], last_verify: tuple | None = None,
                step_times: list[tuple[int, bool, bool, float]] | None = None,
                plain_verifies: list[tuple[int, float]] | None = None) -> list[Draft]:
        """last_verify: (rows, seconds, emitted) of the previous verify of this batch (see observe_verify);
        step_times: see observe_steps; plain_verifies: (requests, seconds) of the one-token verifies of
        steps since then that did not ask this worker."""
        t0 = time.perf_counter()
        self._apply_pending_swap()
        if last_verify is not None:
            self.observe_verify(*last_verify)
        for b, seconds in plain_verifies or ():     # they came after it
            self.costs.observe_verify([1] * b, seconds)
        if step_times:
            self.observe_steps(step_times)
        planned = []
        for item in items:
            r = self.requests[item.request_id]
            if item.commit_new_tokens:
                extra = {"hidden": item.commit_hidden} if self.drafter.uses_target_hidden else {}
                self.drafter.commit(item.request_id, item.commit_accepted, item.commit_new_tokens, **extra)
                if not r.last_hinted:
                    # ρ and the worker's per-position counts describe the model drafter; a hinted step's
                    # outcome is the hinting drafter's to learn (the suffix drafter's measured acceptance)
                    r.policy.observe(r.state, r.last_drafted, item.commit_accepted, depth=r.last_depth)
                    self.positions[r.request.sampling.is_greedy].observe(r.last_depth or r.last_drafted,
                                                                         item.commit_accepted)
                r.generated += len(item.commit_new_tokens)
            planned.append((item, r, r.request.max_new_tokens - r.generated))
        self._plan_goodput(planned)
        chains: dict[str, list[tuple[DraftItem, _DraftRequest, int]]] = {}
        trees: dict[str, list[tuple[DraftItem, _DraftRequest, int, int]]] = {}
        for item, r, remaining in planned:
            room = self._kv_room(r, remaining)
            if r.request.spec.tree_width > 1:
                depth, width = r.policy.plan_tree(r.state, remaining)
                depth, width = fit_tree(min(depth, item.gamma), width, room)
                trees.setdefault(r.request.spec.policy, []).append((item, r, depth, width))
            else:
                gamma = min(r.policy.plan(r.state, remaining), item.gamma, room)
                chains.setdefault(r.request.spec.policy, []).append((item, r, gamma))
        drafts: dict[str, Draft] = {}
        t1 = time.perf_counter()
        # Requests that share a policy kind are drafted in one batch (their states stay per request).
        for group in chains.values():
            self._propose_chains(group, drafts)
        for group in trees.values():
            self._propose_trees(group, drafts)
        t2 = time.perf_counter()
        for item, r, _ in planned:
            r.last_hinted, r.hinted = r.hinted and bool(drafts[item.request_id].tokens), False
        modelled = [drafts[item.request_id] for item, r, _ in planned if not r.last_hinted]
        self._priced_seconds = self._observe_drafting(modelled, t2 - t1)
        self._last_draft_seconds = t2 - t1
        self._busy += t2 - t0
        return [drafts[item.request_id] for item in items]

    def observe_steps(self, step_times: list[tuple[int, bool, bool, float]]) -> None:
        """Host work of the steps since the previous propose: (requests, drafted, asked, seconds of the
        step beyond its verify). A step that asked this worker is the previous propose's: the drafter
        forwards it priced are taken off. Only a drafter that shares the target's thread sends them (a
        Ray actor of its own works while the target verifies)."""
        for b, drafted, asked, seconds in step_times:
            self.costs.observe_host(b, max(seconds - (self._priced_seconds if asked else 0.0), 0.0), drafted)

    def _kv_room(self, r: _DraftRequest, remaining: int) -> int:
        """Draft nodes this step may add: the target writes 1 + nodes positions after the committed
        context (prompt + generated - 1). At least `remaining`, since every request is admitted with
        prompt + max_new_tokens <= max_seq_len; more when the context is known to leave more."""
        if self.max_seq_len is None:
            return remaining
        context = len(r.request.prompt_token_ids) + r.generated
        return max(remaining, self.max_seq_len - context)

    def _plan_goodput(self, planned: list[tuple[DraftItem, _DraftRequest, int]]) -> None:
        """One goodput plan for the requests on that policy; the others enter it at their γ cap."""
        if not any(isinstance(r.policy, GoodputGamma) for _, r, _ in planned):
            self.last_plan = None
            return
        hints = self._hints(planned)
        slots, states, fallbacks = [], [], {}
        for i, (item, r, remaining) in enumerate(planned):
            if isinstance(r.policy, GoodputGamma):
                slot = r.policy.slot(r.state, remaining, cap=item.gamma)
                hint = hints.get(item.request_id)
                if hint is not None and not hint.fallback:
                    # this step's draft is known: plan it from its own predicted acceptance and cost
                    slot = _hinted(slot, hint)
                    r.hinted = True
                else:
                    if hint is not None:
                        fallbacks[i] = _hinted(slot, hint)
                    slot.setup_seconds = self._catch_up_seconds(item.request_id)
                slots.append(slot)
                states.append(r.state)
            else:
                cap = max(0, min(item.gamma, remaining - 1))
                slots.append(Slot(Acceptance([r.state.ema_acceptance], cap), cap, min_depth=cap))
                states.append(None)
        plan = self.controller.plan(slots)
        # Where the plan drafts nothing for a request the drafter would rather have had its model draft
        # for, its lookup draft may still pay: plan those with it, and keep what plans better.
        idle = [i for i in fallbacks if plan.depths[i] == 0]
        if idle:
            alternative = [fallbacks[i] if i in idle else slot for i, slot in enumerate(slots)]
            other = self.controller.plan(alternative)
            if other.goodput > plan.goodput:
                plan, taken = other, [i for i in idle if other.depths[i] > 0]
                for i in taken:
                    planned[i][1].hinted = True
                self.drafter.use_fallback([planned[i][0].request_id for i in taken])
        self.last_plan = GoodputGamma.assign(plan, states)
        g = self.goodput_ema
        g["predicted"] = self.last_plan.goodput if not g["predicted"] else (
            0.8 * g["predicted"] + 0.2 * self.last_plan.goodput)

    def _catch_up_seconds(self, request_id: str) -> float:
        """What a model draft for this request costs first: its untaken context goes in (a prefill), priced
        per token as the start-up profile measured it (workers/engine/profile.py). Only where the drafter
        shares the target's thread: an actor of its own catches up while the target verifies."""
        pending = self.drafter.pending_context(request_id) if self.colocated else 0
        return self.costs.catch_up_seconds(pending)

    def _hints(self, planned: list[tuple[DraftItem, _DraftRequest, int]]) -> dict:
        """The drafter's DraftHints for the goodput policy's chain requests (request id -> hint)."""
        rows = [(item, r, remaining) for item, r, remaining in planned
                if isinstance(r.policy, GoodputGamma) and r.request.spec.tree_width == 1]
        if not rows:
            return {}
        caps = [max(0, min(item.gamma, remaining - 1)) for item, _, remaining in rows]
        hints = self.drafter.draft_hints([item.request_id for item, _, _ in rows], caps,
                                         [r.request.sampling for _, r, _ in rows])
        return {item.request_id: h for (item, _, _), h in zip(rows, hints, strict=True) if h is not None}

    def _observe_drafting(self, drafts: list[Draft], seconds: float) -> float:
        """The drafter's cost model follows the measured propose time of the drafts a model drafted;
        returns the seconds it priced that way (0 when no model drafted)."""
        depths = [_depth(d.parents[1:]) if d.parents else len(d.tokens) for d in drafts]
        drafting = [x for x in depths if x > 0]
        if not drafting:
            return 0.0
        self.costs.observe_draft(len(drafting), max(drafting), seconds)
        return seconds

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
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, None, out.version_of(i))

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
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, parents, out.version_of(i))


def fit_tree(depth: int, width: int, room: int) -> tuple[int, int]:
    """(depth, width) of a tree of width * depth draft nodes within `room` nodes: shallower first,
    then narrower (one level of `room` candidates)."""
    if width * depth <= room:
        return depth, width
    if room >= width:
        return room // width, width
    return (1, room) if room > 0 else (0, 1)


def _hinted(slot: Slot, hint) -> Slot:
    """The request's slot planned from its DraftHint: the draft's own predicted acceptance and cost."""
    depth = min(slot.max_depth, len(hint.alpha))
    return replace(slot, acceptance=Acceptance(hint.alpha, depth), max_depth=depth,
                   min_depth=min(slot.min_depth, depth), max_width=1, free=hint.free)


def _depth(parents: list[int]) -> int:
    """Levels of a tree given each draft node's parent (0 = root, k = draft k-1)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return max(depth)
