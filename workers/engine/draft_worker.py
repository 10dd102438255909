"""DraftWorker: a drafter (any registered kind) on its own device, and nothing else.

It hosts the drafter: start, propose(plan), commit, release, hot swaps. The scheduler's
SpeculationPlanner (workers/engine/planner.py) decides every step's plan (γ, tree width, the stopping rule
of EGAG / confidence) and owns the cost model; one DraftItem per request and step carries the plan and the
previous step's verified outcome (the drafter rolls back and appends the target's tokens first). What the
planner learns from the drafter comes back on the Draft: the drafter's hint for the request's draft, its
pending catch-up context, EGAG's entropy EMA, a swap of its weights. Plain Python: Ray wraps it as an
actor in cluster/actors.py.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path

from specd.workers.drafters.base import DraftHint
from specd.workers.drafters.registry import drafter_class
from specd.workers.engine.gc_freeze import freeze_loaded_objects
from specd.workers.engine.host_memory import keep_freed_memory
from specd.workers.engine.profile import profile_drafter
from specd.workers.engine.target_worker import resolve_device
from specd.workers.engine.types import Draft, DraftItem, NewRequest


class DraftWorker:
    def __init__(self, cfg, spec, target_model_dir: str, seed: int = 0, cache_dir: str | None = None,
                 versions: dict | None = None):
        """versions: where published drafter versions live when they are not on this machine's disk
        ({"redis": endpoint fields, "prefix": key prefix}; workers/drafters/redis_versions.py). The
        worker then starts from the version serving names there (version 0 is the router's first-start
        drafter), wherever it runs, and follows it; None: cfg.path, as configured."""
        if getattr(cfg, "device", "cpu") is None:
            # configs.load_config sets the target's device; a DrafterConfig built in code has none: cpu
            cfg = replace(cfg, device="cpu")
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
        self.requests: dict[str, NewRequest] = {}
        self._busy = 0.0
        self._swapped = False      # weights swapped since the latest draft told the planner
        self._swapper = None
        freeze_loaded_objects()     # the drafter and its imports stay out of every full collection

    def version(self) -> str:
        return self.drafter.version

    def max_slots(self) -> int:
        return self.drafter.max_slots()

    def uses_target_hidden(self) -> bool:
        """The drafter reads the target's hidden states: start and verify must return them."""
        return self.drafter.uses_target_hidden

    def first_uses(self) -> tuple[int, float]:
        """Static-decode buckets first used so far and the seconds that took (ModelRunner.first_uses)."""
        weights = self.drafter.weights_drafter
        return weights.runner.first_uses() if weights is not None else (0, 0.0)

    def busy_seconds(self) -> float:
        return self._busy

    def planning_info(self) -> dict:
        """What the scheduler's SpeculationPlanner needs of this worker once, at start-up: the operator's
        speculation config, the context the caches hold, and the drafter's held-out acceptance."""
        return {"spec": self.spec, "max_seq_len": self.max_seq_len,
                "held_out_acceptance": self.drafter.held_out_acceptance}

    def profile_drafting(self) -> dict:
        """Time this drafter's forwards (its levels and its catch-up per context token) for the planner's
        cost model, once at start-up (workers/engine/profile.py)."""
        return profile_drafter(self.drafter, max_seq_len=self.max_seq_len)

    def start(self, requests: list[NewRequest], first_tokens: list[list[int]], prompt_hidden=None) -> None:
        """prompt_hidden: the target's start(..., return_hidden=True) states, one per request, when
        uses_target_hidden()."""
        t0 = time.perf_counter()
        if self.drafter.uses_target_hidden and prompt_hidden is None:
            raise ValueError(f"drafter {self.drafter.version} reads target hidden states: pass prompt_hidden")
        for i, (req, first) in enumerate(zip(requests, first_tokens, strict=True)):
            extra = {"hidden": prompt_hidden[i]} if self.drafter.uses_target_hidden else {}
            self.drafter.add_request(
                req.request_id, list(req.prompt_token_ids) + list(first), seed=req.sampling.seed, **extra
            )
            self.requests[req.request_id] = req
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
        from specd.workers.drafters.versions import check_fits
        from specd.workers.engine.hot_swap import DrafterSwapper

        weights = self.drafter.weights_drafter
        if weights is None:
            raise ValueError(f"drafter kind {type(self.drafter).__name__} has no weights to swap")
        if self._swapper is None:
            fits = functools.partial(check_fits, weights.runner.model)
            self._swapper = DrafterSwapper(root, target_model_dir, fits, weights.version, poll_s,
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

    def _apply_pending_swap(self) -> None:
        # Called first thing in a step's call: every draft of that call comes from one version.
        ready = self._swapper.take() if self._swapper is not None else None
        if ready is not None:
            version, tensors, meta = ready
            self.drafter.weights_drafter.load_tensors(tensors, version, meta)
            self._swapper.applied(version)
            # the planner's per-position counts measured the old weights: the next drafts tell it
            self._swapped = True

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        """Commit each item's previous outcome, then draft its plan (DraftItem: γ or a tree's depth and
        width, the stopping rule); the drafts carry what the planner reads for the next plan."""
        t0 = time.perf_counter()
        self._apply_pending_swap()
        self._commit(items)
        hints = self._hints(items)
        fallback = [item.request_id for item in items if item.fallback]
        if fallback:
            self.drafter.use_fallback(fallback)
        # Requests that share a shape and a stopping rule are drafted in one batch (states stay per request).
        groups: dict[tuple[bool, str], list[DraftItem]] = {}
        for item in items:
            tree = self.requests[item.request_id].spec.tree_width > 1
            groups.setdefault((tree, item.stop.name if item.stop is not None else ""), []).append(item)
        drafts: dict[str, Draft] = {}
        t1 = time.perf_counter()
        for (tree, _), group in groups.items():
            (self._propose_trees if tree else self._propose_chains)(group, drafts)
        t2 = time.perf_counter()
        swapped, self._swapped = self._swapped and bool(items), self._swapped and not items
        for item in items:
            d = drafts[item.request_id]
            d.hint, d.draft_seconds = hints.get(item.request_id), t2 - t1
            d.pending = self.drafter.pending_context(item.request_id)
            if item.stop_state is not None:
                d.ema_entropy = item.stop_state.ema_entropy
            if swapped:
                d.version_changed, d.held_out_acceptance = True, self.drafter.held_out_acceptance
                d.held_out_parent = self.drafter.held_out_parent
        self._busy += t2 - t0
        return [drafts[item.request_id] for item in items]

    def prepare(self, items: list[DraftItem]) -> dict[str, tuple[DraftHint | None, int]]:
        """Commit each item's previous outcome and look up the hints its plan asks for (hint_cap > 0):
        request id -> (DraftHint or None, pending context). A planner in this process (the in-process
        engine, the vLLM proposer) calls this before it plans, so it plans from this step's hints; through
        Ray, propose does both and the hints reach the next plan (one round trip a step)."""
        t0 = time.perf_counter()
        self._apply_pending_swap()
        self._commit(items)
        hints = self._hints(items)
        self._busy += time.perf_counter() - t0
        return {item.request_id: (hints.get(item.request_id), self.drafter.pending_context(item.request_id))
                for item in items}

    def _commit(self, items: list[DraftItem]) -> None:
        for item in items:
            if item.commit_new_tokens:
                extra = {"hidden": item.commit_hidden} if self.drafter.uses_target_hidden else {}
                self.drafter.commit(item.request_id, item.commit_accepted, item.commit_new_tokens, **extra)

    def _hints(self, items: list[DraftItem]) -> dict:
        """The drafter's DraftHints where the plan asked for them (request id -> hint)."""
        rows = [item for item in items if item.hint_cap > 0]
        if not rows:
            return {}
        hints = self.drafter.draft_hints([item.request_id for item in rows], [item.hint_cap for item in rows],
                                         [self.requests[item.request_id].sampling for item in rows])
        return {item.request_id: h for item, h in zip(rows, hints, strict=True) if h is not None}

    def _propose_chains(self, group: list[DraftItem], drafts: dict[str, Draft]) -> None:
        out = self.drafter.propose(
            [item.request_id for item in group],
            [item.gamma for item in group],
            [self.requests[item.request_id].sampling for item in group],
            policy=group[0].stop,
            states=[item.stop_state for item in group] if group[0].stop is not None else None,
        )
        for i, (item, toks) in enumerate(zip(group, out.tokens, strict=True)):
            probs = None if out.probs is None or not toks else out.probs[i, : len(toks)]
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, None, out.version_of(i))

    def _propose_trees(self, group: list[DraftItem], drafts: dict[str, Draft]) -> None:
        out = self.drafter.propose_tree(
            [item.request_id for item in group],
            [item.gamma for item in group],
            [item.width for item in group],
            [self.requests[item.request_id].sampling for item in group],
            policy=group[0].stop,
            states=[item.stop_state for item in group] if group[0].stop is not None else None,
        )
        for i, (item, toks, pars) in enumerate(zip(group, out.tokens, out.parents, strict=True)):
            probs = None if out.probs is None or not toks else out.probs[i, : len(toks)]
            parents = [-1, *pars] if toks else None
            drafts[item.request_id] = Draft(item.request_id, list(toks), probs, parents, out.version_of(i))
