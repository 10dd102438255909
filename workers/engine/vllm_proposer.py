"""specd's drafters inside a vLLM engine: the proposer class of vLLM's speculative method "custom_class".

Why this route. vLLM keeps the target's scheduler, paged KV cache, kernels and rejection sampler; the one
place it takes draft tokens from outside is speculative_config={"method": "custom_class", "model":
"specd.workers.engine.vllm_proposer.SpecdProposer"}. After every engine step its model runner calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` with each batch row's token history and
takes back one list of draft ids per row, which the next step verifies. The alternatives are worse:
vLLM's "draft_model" method runs the drafter as a vLLM model (no reduced-vocabulary head, no n-gram
drafter, no specd γ policy, no way for our trainer to hot-swap it), and vLLM's request API has no way to
hand in drafts from outside its engine at all.

What vLLM gives us and what it does not (0.32, vllm/v1/worker/gpu_model_runner.py):
- Rows carry no request id and move between rows as requests come and go. We therefore key each tracked
  request by a hash of its committed token prefix: the row whose history *before* this step's sampled
  tokens hashes to a tracked prefix is that request, so the drafter only takes in the new tokens (the
  accepted drafts plus the recovered or bonus token) and rolls back past its rejected drafts, exactly as on
  the torch backend. A row that matches nothing (a new request, or one whose state was evicted) starts a
  fresh drafter request from its whole history. Rows with equal histories are interchangeable, so each key
  holds a list.
- vLLM tells nobody when a request ends: a tracked request that no row continued for `max_idle_steps`
  calls is released (preempted requests that come back later are simply rebuilt).
- Drafts are verified as one-hot (vLLM reads draft probabilities only from its own model drafters), which
  is lossless at every temperature; so the drafter always drafts greedily, and sampled drafts with q
  (min(1, p/q) acceptance) and token trees are torch-backend features.
- No per-request settings reach the proposer through vLLM: γ policy and budget are the engine's
  (spec.policy, spec.gamma), and γ never exceeds num_speculative_tokens. Through the link (below) a
  request's speculation on/off and γ cap do: a row claims its request's settings when it first appears,
  and a request with speculation off is tracked (so its row is known the next step) but never drafted for.

Where the proposer runs in the engine's process it shares a `ProposerLink` with VllmEngine
(workers/engine/vllm_link.py): it files what it drafted (vLLM reports per-step counts only), reports its
serving version and swaps, and runs the engine's start-up sweep of verify costs.

Published drafter versions (the online trainer's) are followed by the DraftWorker itself when the
settings name a version store (`versions`): it watches CURRENT in the background and swaps between two
propose() calls, so no request fails across a swap.

The settings come from a JSON file named by the SPECD_VLLM_PROPOSER_CONFIG environment variable, because
vLLM builds the class itself (with only its VllmConfig) in its worker process, which inherits the
environment of the process that created the engine. The same file names a swap file: when its mtime
changes, the proposer hot-swaps the drafter weights it names (the trainer's publish, through
VllmEngine.load_drafter).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from specd.configs.schema import DrafterConfig, SpecConfig
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.planner import SpeculationPlanner
from specd.workers.engine.types import DraftItem, NewRequest, SpecParams
from specd.workers.engine.vllm_link import PrefixHasher, ProposerLink, proposer_link

ENV_SETTINGS = "SPECD_VLLM_PROPOSER_CONFIG"
PROPOSER_CLASS = f"{__name__}.SpecdProposer"

log = logging.getLogger(__name__)


@dataclass
class ProposerSettings:
    """Everything the proposer needs, written by VllmEngine and read in vLLM's worker process."""

    drafter: dict                       # DrafterConfig fields
    spec: dict                          # SpecConfig fields (policy, gamma, gamma_min, egag_*)
    target_model_dir: str
    cache_dir: str | None = None
    seed: int = 0
    swap_file: str | None = None        # {"path": drafter dir}; a new mtime means "load these weights"
    max_idle_steps: int = 16
    # A published version store to follow (a directory, or {"redis": ..., "prefix": ...}): the DraftWorker
    # watches its CURRENT and applies new versions between steps, as on the torch backend.
    versions: str | dict | None = None
    versions_poll_s: float = 2.0
    # {"version", "swaps", "rejected"} of the drafter, rewritten when its version changes: how the engine
    # learns which weights draft where the proposer runs in a process of vLLM's own (no ProposerLink)
    status_file: str | None = None

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, path: str | Path) -> ProposerSettings:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_env(cls) -> ProposerSettings:
        path = os.environ.get(ENV_SETTINGS)
        if not path:
            raise RuntimeError(
                f"{PROPOSER_CLASS} needs ${ENV_SETTINGS} (a JSON file of ProposerSettings); "
                "build the engine with specd.workers.engine.vllm_engine.VllmEngine"
            )
        return cls.read(path)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Tracked:
    """One specd request of the DraftWorker, standing for whichever vLLM row continues its prefix."""

    request_id: str
    key: bytes                          # prefix_key of the committed context the drafter holds
    drafted: list[int] = field(default_factory=list)   # drafts of the open step
    idle: int = 0                       # propose calls since a row last continued it
    enabled: bool = True                # the request's speculation on (off: tracked, never drafted for)
    gamma_cap: int | None = None        # the request's γ budget (None: the engine's)


class SpecdProposer:
    """vLLM custom_class proposer backed by a specd DraftWorker (any registered drafter, any γ policy)."""

    def __init__(self, vllm_config, settings: ProposerSettings | None = None):
        own = settings is not None
        self.link = ProposerLink() if own else proposer_link(os.environ.get(ENV_SETTINGS, ""))
        self.settings = settings or ProposerSettings.from_env()
        spec_cfg = SpecConfig(**self.settings.spec)
        self.worker = DraftWorker(
            DrafterConfig(**self.settings.drafter),
            spec_cfg,
            self.settings.target_model_dir,
            seed=self.settings.seed,
            cache_dir=self.settings.cache_dir,
        )
        if self.worker.uses_target_hidden():
            raise ValueError(
                f"drafter {self.worker.version()} reads the target's hidden states, which vLLM does not hand "
                "to a proposer: use a token-only drafter (drafter.target_hidden=false or a drafter.path)"
            )
        if self.settings.versions is not None:
            if self.worker.drafter.weights_drafter is None:
                log.warning("drafter %s has no weights: published versions are not followed",
                            self.worker.version())
            else:
                self.worker.watch_versions(self.settings.versions, self.settings.target_model_dir,
                                           self.settings.versions_poll_s)
        self.link.swap_stats = self.worker.swap_stats
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.gamma = min(spec_cfg.gamma, int(vllm_config.speculative_config.num_speculative_tokens))
        # vLLM's rows may never draft more than num_speculative_tokens; the request's policy plans within it.
        self.spec = replace(SpecParams.from_config(spec_cfg, enabled=True), gamma=self.gamma, tree_width=1)
        # the γ plan, as the in-process engine's and the router's; its cost model starts from the prior and
        # follows vLLM's measured steps (_observe_step)
        self.planner = SpeculationPlanner(spec_cfg, max_seq_len=self.worker.max_seq_len,
                                          held_out_acceptance=self.worker.drafter.held_out_acceptance)
        self._last_step: tuple[list[int], float] | None = None   # rows' tokens to verify, when proposed
        self.tracked: dict[bytes, list[_Tracked]] = {}
        self._next_id = 0
        self._swap_mtime = self._swap_stat()
        self._status_version: str | None = None      # the version last written to settings.status_file
        self.calls = 0

    # ---- vLLM's interface -----------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner hands every drafter the target model; ours has its own weights already."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        """Draft ids per batch row; row i's history is token_ids_cpu[i, :num_tokens_no_spec[i]] (its newest
        tokens, sampled_token_ids[i], included). Rows without sampled tokens are mid-prefill: no drafts."""
        self.calls += 1
        now = time.perf_counter()
        if self.link.force_gamma is not None:
            return self._sweep_step(now, sampled_token_ids, num_tokens_no_spec)
        if self.link.profile is not None:
            self._take_profile()
        self._maybe_swap()
        rows: list[tuple[int, _Tracked, bytes]] = []      # (row, request, key after this step)
        items: list[DraftItem] = []
        starts: list[tuple[NewRequest, list[int]]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            n = int(num_tokens_no_spec[i])
            history = token_ids_cpu[i, :n]
            # A step emits accepted + 1 tokens and the row may not grow past max_model_len.
            gamma = max(0, min(self.gamma, self.max_model_len - n - 1))
            # one pass over the history per row: the key before this step's tokens, then after them
            hasher = PrefixHasher(history[: n - len(sampled)])
            before = hasher.key()
            hasher.update(history[n - len(sampled):])
            after = hasher.key()
            seq = self._take(before)
            if seq is None:
                # a new request's first row: its history before the first token is its prompt
                enabled, cap = self.link.claim(before) or (True, None)
                seq = _Tracked(self._new_id(), b"", enabled=enabled, gamma_cap=cap)
            if seq.gamma_cap is not None:
                gamma = min(gamma, seq.gamma_cap)
            seq.idle = 0
            if not seq.enabled:
                seq.key = after
                self.tracked.setdefault(seq.key, []).append(seq)
                continue
            if seq.key == b"":
                request = NewRequest(
                    seq.request_id, history[:-1].tolist(), SamplingParams(), self.max_model_len, self.spec
                )
                starts.append((request, [int(history[-1])]))
                items.append(DraftItem(seq.request_id, gamma))
            else:
                # Accepted = the drafts vLLM kept, read off the tokens rather than trusted from the count:
                # vLLM may have trimmed the drafts, and whatever it did, the drafter continues from them.
                accepted = common_prefix(seq.drafted, list(sampled[:-1]))
                items.append(DraftItem(seq.request_id, gamma, accepted, [int(t) for t in sampled]))
            rows.append((i, seq, after))
        self._evict(needed=len(starts))
        if starts:
            self.worker.start([r for r, _ in starts], [f for _, f in starts])
            self.planner.start([r for r, _ in starts], [f for _, f in starts])
        whole = not starts and len(rows) == len(sampled_token_ids)
        self._observe_step(now, len(rows), whole)
        self.planner.plan_items(items, prepare=self.worker.prepare)
        drafts = self.worker.propose(items) if items else []
        depths = [d for d in self.planner.observe_drafts(drafts) if d > 0]
        if depths:
            self.planner.costs.observe_draft(len(depths), max(depths), drafts[0].draft_seconds)
        self._last_step = ([1 + len(d.tokens) for d in drafts], time.perf_counter()) if whole else None
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        for (i, seq, after), draft in zip(rows, drafts, strict=True):
            seq.drafted = list(draft.tokens)
            seq.key = after
            self.tracked.setdefault(seq.key, []).append(seq)
            out[i] = list(draft.tokens)
            if draft.tokens:
                self.link.put(seq.key, out[i], draft.drafter_version)
        self.link.serving_version = self.serving_version()
        self._write_status()
        return out

    def _write_status(self) -> None:
        """The serving version and swaps into settings.status_file when they changed (atomic rename)."""
        path = self.settings.status_file
        version = self.link.serving_version
        if not path or version == self._status_version:
            return
        self._status_version = version
        status = {**self.worker.swap_stats(), "version": version}
        tmp = Path(f"{path}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)

    def serving_version(self) -> str:
        """The version of the weights drafting now (a swap changes it), else the drafter's own."""
        drafter = self.worker.drafter
        return (drafter.weights_drafter or drafter).version

    def _observe_step(self, now: float, rows: int, whole: bool) -> None:
        """Price vLLM's step between the previous call and this one (its verify of the drafts returned then,
        sampling and scheduling) in the planner's cost model, so that γ follows what verifying drafts
        costs this engine at this batch size. Only steps of the same rows and no prefill are priced: a
        prefill in the step, or a row that came or went, is not a verify of what was proposed."""
        last, self._last_step = self._last_step, None
        if last is None or not whole or rows != len(last[0]):
            return
        self.planner.costs.observe_verify(last[0], now - last[1])

    # ---- the engine's start-up sweep (vllm_link.py) ----------------------------------------------
    def _sweep_step(self, now: float, sampled_token_ids: list[list[int]],
                    num_tokens_no_spec: np.ndarray) -> list[list[int]]:
        """Throwaway drafts (the row's newest token, link.force_gamma times) for every row, and the time vLLM
        took to verify the previous call's, when it verified the same rows with no prefill among them.
        The drafter is not asked: the sweep's requests are aborted afterwards and never drafted for."""
        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        last, self._last_step = self._last_step, None
        whole = bool(rows) and len(rows) == len(sampled_token_ids)
        if whole and last is not None and len(last[0]) == len(rows):
            self.link.samples.append((len(rows), last[0][0], now - last[1]))
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        for i in rows:
            gamma = max(0, min(self.link.force_gamma, self.max_model_len - int(num_tokens_no_spec[i]) - 1))
            out[i] = [int(sampled_token_ids[i][-1])] * gamma
        if whole and len({len(d) for d in out}) == 1:
            self._last_step = ([1 + len(out[0])] * len(rows), time.perf_counter())
        return out

    def _take_profile(self) -> None:
        """The sweep's verify table and this drafter's own timings become the planner's cost profile."""
        verify, self.link.profile = self.link.profile["verify"], None
        drafting = self.worker.profile_drafting()
        # vLLM packs a batch's rows without padding: a ragged batch costs its tokens (pad weight 0)
        self.planner.set_cost_profile(verify, drafting["draft"], pad_weight=0.0,
                                      catch_up=drafting["catch_up"])
        log.info("specd proposer: cost profile from vLLM's steps, batch sizes %s", sorted(verify))

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _take(self, key: bytes) -> _Tracked | None:
        bucket = self.tracked.get(key)
        if not bucket:
            return None
        seq = bucket.pop()
        if not bucket:
            del self.tracked[key]
        return seq

    def _new_id(self) -> str:
        self._next_id += 1
        return f"vllm-row-{self._next_id}"

    def _evict(self, needed: int) -> None:
        """Age the requests no row continued this call; release the stale ones and, when the drafter is
        short of slots for `needed` new requests, the longest idle ones first."""
        idle = [seq for bucket in self.tracked.values() for seq in bucket]
        for seq in idle:
            seq.idle += 1
        drop = [s for s in idle if s.idle > self.settings.max_idle_steps]
        # only requests that draft hold a drafter slot; one with speculation off stays until it goes stale
        free = self.worker.max_slots() - len(self.worker.requests) + sum(s.enabled for s in drop)
        stale = {id(s) for s in drop}
        for seq in sorted((s for s in idle if s.enabled and id(s) not in stale), key=lambda s: -s.idle):
            if free >= needed:
                break
            drop.append(seq)
            free += 1
        for seq in drop:
            bucket = self.tracked[seq.key]
            bucket.remove(seq)
            if not bucket:
                del self.tracked[seq.key]
        drafted = [s.request_id for s in drop if s.enabled]     # requests with speculation off never started
        if drafted:
            self.worker.release(drafted)
            self.planner.release(drafted)

    def _swap_stat(self) -> float | None:
        swap = self.settings.swap_file
        try:
            return os.stat(swap).st_mtime if swap else None
        except FileNotFoundError:
            return None

    def _maybe_swap(self) -> None:
        mtime = self._swap_stat()
        if mtime is None or mtime == self._swap_mtime:
            return
        self._swap_mtime = mtime
        path = json.loads(Path(self.settings.swap_file).read_text())["path"]
        if not hasattr(self.worker.drafter, "load"):
            log.warning("drafter %s has no weights to swap; ignoring %s", self.worker.drafter.name, path)
            return
        version = self.worker.load_drafter(path)
        log.info("specd proposer: drafter hot-swapped to %s (%s)", version, path)
