"""The model drafter: a small Llama (its own KV cache, often a reduced-vocabulary head) proposes drafts.

Per request the drafter's cache holds the committed context except its newest tokens, the *feed*:
they enter the cache at the start of the next proposal, in the same forward that yields the first
draft's q. A new request's whole prompt starts as its feed, and a long feed (the prompt, or what was
committed while the γ policy did not draft for it) goes in by a prefill of its own first (_catch_up), so
a request that is never drafted for costs no drafter forward. Drafts are fed one at a time; after
verification the cache rolls back to the verified prefix and the target's token joins the feed, so
rollback is exact and nothing is recomputed.

A hidden-state drafter (bootstrapped by drafter_trainer/hidden_stage.py) also reads the target's hidden
states: each token's input gets the target state that predicted it. Drafted tokens the target has not
seen yet get the newest state there is, marked k steps stale, as in training. After verification the
drafts leave the cache and the verified tokens are fed again with their fresh states, so the cache
only ever holds fresh ones, like the training data.

Token trees (propose_tree) are drafted in model_tree.py, a mixin of this class.

A reduced head gives logits over V_sub target ids; logits processing on those equals processing the
full vocabulary with -inf elsewhere, so q is computed small and scattered to the full vocabulary only
when the verifier needs it (sampled requests). q is exactly zero outside the head's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specd.workers.core.keyed import keyed_race, seeds_tensor
from specd.workers.core.sampling import (
    SEED_RANGE,
    greedy_argmax,
    logits_to_probs,
    make_generator,
    params_to_tensors,
    sample,
)
from specd.workers.drafters.base import Drafter, DraftProposal, check_batch
from specd.workers.drafters.model_tree import TreeDrafting, _is_keyed
from specd.workers.drafters.registry import register_drafter
from specd.workers.drafters.versions import META_FILE, held_out_acceptance, parent_held_out_acceptance
from specd.workers.models.device_settings import resolve_decode, resolve_dtype
from specd.workers.models.loader import default_cache_dir
from specd.workers.models.runner import ModelRunner


def default_drafter_dir(cache_dir: str | Path | None = None, target_hidden: bool = False) -> Path:
    """Where `specd bootstrap-drafter` writes its drafters and serving looks for them: the token-only
    drafter (boot-default) and the one fine-tuned from it to read target hidden states (boot-hidden)."""
    name = "boot-hidden" if target_hidden else "boot-default"
    return Path(cache_dir or default_cache_dir()) / "drafters" / name


def resolve_drafter_dir(
    path: str | Path | None, cache_dir: str | Path | None = None, target_hidden: bool = False
) -> Path:
    resolved = Path(path) if path else default_drafter_dir(cache_dir, target_hidden)
    if not (resolved / "config.json").exists():
        raise FileNotFoundError(
            f"no drafter at {resolved}: create the default one with `specd bootstrap-drafter` "
            "(or set drafter.path to a drafter directory, or drafter.kind=ngram)"
        )
    return resolved


def read_drafter_version(path: str | Path) -> str:
    meta = Path(path) / META_FILE
    if meta.exists():
        return str(json.loads(meta.read_text()).get("version", Path(path).name))
    return Path(path).name


def read_held_out_figures(path: str | Path) -> tuple[float | None, float | None]:
    """(held_out_acceptance, parent_held_out_acceptance) of a drafter directory's specd_drafter.json; Nones
    without one."""
    meta = Path(path) / META_FILE
    record = json.loads(meta.read_text()) if meta.exists() else {}
    return held_out_acceptance(record), parent_held_out_acceptance(record)


# Feeds of at most this many tokens catch up together in one forward; longer ones (prompts, long stretches
# without drafting) go in prefills of feeds within CATCH_UP_SPREAD times each other's length. The runner's
# matmuls skip the padding of a ragged batch and its attention does not, so only alike lengths batch well;
# requests that stopped drafting together (a drafter pause, a load the goodput plan found too high) come
# back with feeds of the same length (docs/decisions/goodput-pricing.md).
CATCH_UP_BATCHED = 16
CATCH_UP_SPREAD = 2.0


@dataclass
class _DraftSeq:
    slot: int
    generator: torch.Generator | None
    feed: list[int]                       # committed tokens not yet in the cache
    drafted: list[int] = field(default_factory=list)   # drafts of the open step
    tree: bool = False                    # the open step was a tree (its nodes never entered the cache)
    # target states that predicted the feed, in the chunks commits brought them: joined only when read, since
    # a request the drafter does not draft for gets a commit every step (a torch.cat of its whole feed per
    # commit would be paid every step, for nothing)
    hidden_parts: list[torch.Tensor] = field(default_factory=list)

    @property
    def feed_hidden(self) -> torch.Tensor | None:
        """[len(feed), H], or None for a drafter that reads no target states."""
        if len(self.hidden_parts) > 1:
            self.hidden_parts = [torch.cat(self.hidden_parts)]
        return self.hidden_parts[0] if self.hidden_parts else None

    @feed_hidden.setter
    def feed_hidden(self, value: torch.Tensor | None) -> None:
        self.hidden_parts = [] if value is None else [value]


@register_drafter("model")
class ModelDrafter(TreeDrafting, Drafter):
    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 16,
        max_seq_len: int = 2048,
        seed: int = 0,
        num_threads: int | None = None,
        pack: str = "onednn",
        decode: str = "eager",
    ):
        self.path = Path(path)
        self.runner = ModelRunner(
            self.path, device=device, dtype=dtype, max_slots=max_slots, max_seq_len=max_seq_len,
            num_threads=num_threads, full_vocab=False, pack_weights=pack, decode=decode,
        )
        self.full_vocab_size = self.runner.model.cfg.vocab_size
        self.vocab_ids = self.runner.vocab_ids          # [V_sub] target ids, or None for a full head
        self.version = read_drafter_version(self.path)
        self.held_out_acceptance, self.held_out_parent = read_held_out_figures(self.path)
        self.uses_target_hidden = self.runner.model.feature_proj is not None
        self.hidden_size = self.runner.model.cfg.hidden_size
        # Greedy chains on the static path as one run per step (_chain_in_one_run); tests turn it off to
        # compare with drafting token by token.
        self.chain_in_one_run = True
        self.seed = seed
        # Unseeded requests draw from the drafter's own stream, seeded by its worker (one per replica).
        self.unseeded = make_generator(seed)
        self.seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def has_weights(cls, cfg) -> bool:
        return True

    @property
    def weights_drafter(self) -> ModelDrafter:
        return self

    @classmethod
    def from_config(cls, cfg, *, target_model_dir: str, cache_dir: str | None = None, seed: int = 0):
        return cls(
            resolve_drafter_dir(cfg.path, cache_dir, getattr(cfg, "target_hidden", False)),
            device=cfg.device,
            dtype=resolve_dtype(cfg.dtype, cfg.device),
            max_slots=cfg.max_slots,
            # None when the config did not go through configs.load_config: target.max_seq_len's default.
            max_seq_len=getattr(cfg, "max_seq_len", None) or 2048,
            seed=seed,
            pack=getattr(cfg, "pack", "onednn"),
            decode=resolve_decode(getattr(cfg, "decode", "auto"), cfg.device),
        )

    def max_slots(self) -> int:
        return self.runner.cache.num_slots

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_tokens: list[int], seed: int | None = None, hidden=None
    ) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} already has drafter state")
        feats = self._check_hidden(hidden, len(prompt_tokens) - 1, "add_request")
        if feats is not None:
            # token 0 has no predecessor state: zeros (the training data does the same)
            feats = torch.cat([feats.new_zeros(1, self.hidden_size), feats])  # [len(prompt), H]
        slot = self.runner.allocate()
        # The drafter's randomness is its own stream: seeded requests stay reproducible end to end.
        gen = self.unseeded if seed is None else make_generator((seed + 0x5EED) % SEED_RANGE)
        # The whole prompt waits in the feed: it enters the cache when this drafter first drafts for the
        # request (_catch_up). A request the γ policy never drafts for (high load) costs no drafter forward.
        self.seqs[request_id] = _DraftSeq(slot, gen, feed=list(prompt_tokens),
                                          hidden_parts=[] if feats is None else [feats])

    def pending_context(self, request_id: str) -> int:
        return len(self.seqs[request_id].feed) - 1

    def _catch_up(self, seqs: list[_DraftSeq], short_feeds: bool = False) -> None:
        """Put all but the newest token of each long feed (a prompt, or tokens committed while the request
        did not draft) into the cache, in prefills of alike lengths (CATCH_UP_SPREAD). Feeds of at most
        CATCH_UP_BATCHED tokens stay whole, for the first drafting forward to take in: one drafter forward
        a step fewer. short_feeds True also puts those in, together in one prefill, so that drafting runs
        one token per row (what drafting did before; the tests compare the two)."""
        waiting = [s for s in seqs if len(s.feed) > 1]
        short = [s for s in waiting if len(s.feed) <= CATCH_UP_BATCHED] if short_feeds else []
        groups: list[list[_DraftSeq]] = [short] if short else []
        for s in sorted((s for s in waiting if len(s.feed) > CATCH_UP_BATCHED), key=lambda s: len(s.feed)):
            last = groups[-1] if groups and groups[-1] is not short else None
            if last is not None and len(s.feed) <= CATCH_UP_SPREAD * len(last[0].feed):
                last.append(s)
            else:
                groups.append([s])
        for group in groups:
            feats = None
            if self.uses_target_hidden:
                feats = [s.feed_hidden[:-1] for s in group]
            self.runner.prefill([s.slot for s in group], [s.feed[:-1] for s in group], features=feats)
            for s in group:
                s.feed = s.feed[-1:]
                if s.feed_hidden is not None:
                    s.feed_hidden = s.feed_hidden[-1:]

    def _check_hidden(self, hidden, rows: int, where: str) -> torch.Tensor | None:
        if not self.uses_target_hidden:
            return None
        if hidden is None or tuple(hidden.shape) != (rows, self.hidden_size):
            shape = None if hidden is None else tuple(hidden.shape)
            raise ValueError(
                f"{where}: this drafter needs target hidden states [{rows}, {self.hidden_size}], got {shape}"
            )
        return hidden.float()

    def remove_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq.slot)

    def commit(self, request_id: str, num_accepted: int, new_tokens: list[int], hidden=None) -> None:
        seq = self.seqs[request_id]
        n = len(seq.drafted)
        feats = self._check_hidden(hidden, len(new_tokens), "commit")
        if feats is not None:
            if n and not seq.tree:
                # drafts went in with stale states: drop them all, re-feed the verified tokens fresh
                self.runner.rollback(seq.slot, self.runner.length(seq.slot) - (n - 1))
                seq.feed, seq.feed_hidden = list(new_tokens), feats
            else:
                seq.feed.extend(new_tokens)
                seq.hidden_parts.append(feats)
        elif seq.tree or n == 0:
            # Tree nodes were never committed to the cache (see propose_tree): feed the accepted path.
            seq.feed.extend(new_tokens)
        else:
            # Cache holds feed + d1..d_{n-1}; keep the accepted drafts that are there, feed the rest.
            keep = min(num_accepted, n - 1)
            self.runner.rollback(seq.slot, self.runner.length(seq.slot) - (n - 1) + keep)
            seq.feed = list(new_tokens[keep:])
        seq.drafted, seq.tree = [], False

    # ---- drafting -------------------------------------------------------------------------------
    def _q(self, logits: torch.Tensor, params) -> torch.Tensor:
        # logits [b, V'] -> q [b, V'] under each request's own processing (the target applies the same)
        temperature, top_k, top_p = params_to_tensors(params)
        return logits_to_probs(logits.float()[:, None, :], temperature, top_k, top_p)[:, 0]

    def _to_target_ids(self, tokens: torch.Tensor) -> list[int]:
        if self.vocab_ids is None:
            return tokens.tolist()
        return self.vocab_ids[tokens].tolist()

    def _full(self, q: torch.Tensor) -> torch.Tensor:
        # q [..., V_sub] -> [..., vocab] with zeros outside the head's vocabulary
        if self.vocab_ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.full_vocab_size)
        out[..., self.vocab_ids] = q
        return out

    def propose(self, request_ids, gammas, params, policy=None, states=None) -> DraftProposal:
        check_batch(request_ids, gammas, params)
        seqs = [self.seqs[r] for r in request_ids]
        tokens: list[list[int]] = [[] for _ in request_ids]
        qs: list[list[torch.Tensor]] = [[] for _ in request_ids]
        active = [i for i, g in enumerate(gammas) if g > 0]
        # A short feed (the previous step's accepted drafts and target token) goes in with the forward that
        # drafts the first token, on the static (CUDA-graph) path too, where a catch-up would be an eager
        # prefill (docs/decisions/static-inputs.md).
        self._catch_up([seqs[i] for i in active])
        if active and policy is None and self.chain_in_one_run and self.runner.static is not None \
                and all(params[i].is_greedy for i in active) and self._chain_in_one_run(seqs, gammas, active,
                                                                                         tokens):
            active = []
        # absolute position of each row's first draft (the cache holds everything before the feed)
        first_at = {i: self.runner.length(seqs[i].slot) + len(seqs[i].feed) for i in active}
        inputs = {i: seqs[i].feed for i in active}
        feats = {i: seqs[i].feed_hidden for i in active}
        while active:
            extra = {}
            if self.uses_target_hidden:
                # feed: fresh states; the k-th draft: the newest state there is, k steps stale
                extra = dict(
                    features=[feats[i] for i in active],
                    staleness=[[len(tokens[i])] * len(inputs[i]) for i in active],
                )
            logits = self.runner.extend([seqs[i].slot for i in active], [inputs[i] for i in active], **extra)
            last = torch.tensor([len(inputs[i]) - 1 for i in active], device=logits.device)
            logits = logits[torch.arange(len(active), device=logits.device), last]  # [b, V']
            greedy = [params[i].is_greedy for i in active]
            if all(greedy):
                # greedy q is one-hot on the argmax, and sampling it draws nothing (sampling.py)
                q, picked = None, greedy_argmax(logits)                          # [b]
            else:
                q = self._q(logits, [params[i] for i in active])                # [b, V']
                picked = sample(q, [seqs[i].generator for i in active], greedy)  # [b]
                keyed = [j for j, i in enumerate(active) if _is_keyed(params[i])]
                if keyed:
                    # coupled drafting: race q with the noise the target samples this position with
                    rows = [active[j] for j in keyed]
                    picked[keyed] = self._keyed(q[keyed], [params[i].seed for i in rows],
                                                [first_at[i] + len(tokens[i]) for i in rows])[:, 0]
            ids = self._to_target_ids(picked)
            still = []
            for j, i in enumerate(active):
                if seqs[i].feed_hidden is not None and not tokens[i]:
                    feats[i] = seqs[i].feed_hidden[-1:]
                seqs[i].feed, seqs[i].feed_hidden = [], None
                tokens[i].append(ids[j])
                qs[i].append(None if q is None else q[j])
                more = len(tokens[i]) < gammas[i]
                if more and policy is not None and states is not None:
                    soft = None
                    if policy.reads_draft_probs:
                        # EGAG reads the drafter's uncertainty: the softmax, not a greedy one-hot
                        soft = q[j] if not params[i].is_greedy else torch.softmax(logits[j].float(), -1)
                    more = policy.keep_drafting(states[i], len(tokens[i]), soft)
                if more:
                    still.append(i)
                    inputs[i] = [ids[j]]
            active = still
        for seq, toks in zip(seqs, tokens, strict=True):
            seq.drafted, seq.tree = list(toks), False
        return DraftProposal(tokens, self._stack_probs(tokens, qs, params), self.version)

    def _chain_in_one_run(self, seqs, gammas, active, tokens) -> bool:
        """Greedy chains on the static (CUDA-graph) path: the whole γ-token loop as one run of the static
        decoder (one graph per bucket), the drafts read once, where drafting token by token replays a graph
        and reads its argmax back per token. False where the decoder does not take the shape."""
        steps = max(gammas[i] for i in active)
        slots = [seqs[i].slot for i in active]
        feats = [seqs[i].feed_hidden for i in active] if self.uses_target_hidden else None
        drafted = self.runner.extend_chain(slots, [seqs[i].feed for i in active], steps, features=feats)
        if drafted is None:
            return False
        # A row that planned fewer drafts keeps only those, and the cache only those it fed.
        short = [j for j, i in enumerate(active) if gammas[i] < steps]
        if short:
            rows = [slots[j] for j in short]
            unfed = [steps - gammas[active[j]] for j in short]
            held = self.runner.lengths(rows)
            self.runner.rollback_many(rows, [n - u for n, u in zip(held, unfed, strict=True)])
        for j, i in enumerate(active):
            tokens[i] = drafted[j][: gammas[i]]
            seqs[i].feed, seqs[i].feed_hidden = [], None
        return True

    def _stack_probs(self, tokens, qs, params) -> torch.Tensor | None:
        """q [batch, γmax, vocab] for sampled requests; None when every request is greedy (one-hot)."""
        if all(p.is_greedy for p in params) or not any(tokens):
            return None
        gmax = max(len(t) for t in tokens)
        out = torch.zeros(len(tokens), gmax, self.full_vocab_size, device=self.runner.device)
        for i, (toks, rows, p) in enumerate(zip(tokens, qs, params, strict=True)):
            if not toks:
                continue
            if p.is_greedy:
                at = torch.arange(len(toks), device=out.device)
                out[i, at, torch.tensor(toks, device=out.device)] = 1.0
            else:
                out[i, : len(toks)] = self._full(torch.stack(rows))
        return out

    # ---- token trees ----------------------------------------------------------------------------
    def _keyed(self, q: torch.Tensor, seeds: list[int], positions: list[int], k: int = 1) -> torch.Tensor:
        """q [R, V'] raced with the target's keyed noise (workers/core/keyed.py) over the head's target ids:
        the top k head columns per row [R, k], best first."""
        at = torch.tensor(positions, dtype=torch.long, device=q.device)
        return keyed_race(q, seeds_tensor(seeds, q.device), at, self.vocab_ids, k=k)

    # ---- weights --------------------------------------------------------------------------------
    def load(self, path: str | Path) -> str:
        """Hot-swap to new drafter weights of the same shape; returns the new version.

        Cached K/V of running requests were computed by the old weights; drafts from them may be a
        little worse for a few steps, never wrong: the target verifies every draft.
        """
        self.runner.load_weights(Path(path))
        self.path = Path(path)
        self.version = read_drafter_version(path)
        self.held_out_acceptance, self.held_out_parent = read_held_out_figures(path)
        return self.version

    def load_tensors(self, tensors: dict[str, torch.Tensor], version: str, meta: dict | None = None) -> str:
        """Hot-swap to verified HF-named tensors (workers/engine/hot_swap.py) of a version whose record is
        `meta`; same caveat as load()."""
        self.runner.load_weights(tensors)
        self.version = version
        self.held_out_acceptance = held_out_acceptance(meta or {})
        self.held_out_parent = parent_held_out_acceptance(meta or {})
        return version
