"""TargetWorker: the target model on its own device; prefill, one verify forward per step, exact rollback.

Each running request keeps a KV-cache slot holding every committed token except the newest one, the
*pending* token: it is the root of the next step, so one forward over [pending, d1..dγ] yields the
γ+1 target distributions p that verification needs. After verification the cache is rolled back (or
a tree's accepted path compacted) so it again holds exactly the committed prefix.

The class is plain Python: Ray wraps it as an actor in cluster/actors.py, the engine benchmark calls it
in-process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.workers.core.keyed import keyed_sample
from specd.workers.core.sampling import (
    SamplingParams,
    greedy_argmax,
    host_reads_are_cheap,
    logits_to_probs,
    make_generator,
    params_to_tensors,
    pick_rows,
    sample,
)
from specd.workers.core.tree import TokenTree
from specd.workers.core.verify_chain import verify_chain
from specd.workers.core.verify_tree import verify_trees
from specd.workers.engine.gc_freeze import freeze_loaded_objects
from specd.workers.engine.host_memory import keep_freed_memory
from specd.workers.engine.profile import profile_verify
from specd.workers.engine.types import Draft, NewRequest, VerifyResult
from specd.workers.models.device_settings import resolve_decode, resolve_dtype
from specd.workers.models.loader import ensure_target_model
from specd.workers.models.runner import ModelRunner


@dataclass
class _Running:
    slot: int
    sampling: SamplingParams
    generator: torch.Generator | None
    pending: int            # newest committed token, not yet in the KV cache
    num_tokens: int         # prompt + generated, including the pending token
    speculates: bool = True  # the request has speculation on: a drafter may read its hidden states


def resolve_device(device: str) -> str:
    """`cuda` without a visible GPU is a configuration error: say so, rather than crash deep in torch."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was configured but torch sees no CUDA device")
    return device


class TargetWorker:
    def __init__(self, cfg, seed: int = 0, cache_dir: str | None = None):
        self.cfg = cfg
        self.seed = seed
        self.model_dir = ensure_target_model(cfg.model_path, cache_dir, getattr(cfg, "model", None))
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        keep_freed_memory(getattr(cfg, "keep_freed_memory", True))
        self.device = resolve_device(cfg.device)
        self.runner = ModelRunner(
            self.model_dir,
            device=self.device,
            dtype=resolve_dtype(cfg.dtype, self.device),
            max_slots=cfg.max_slots,
            max_seq_len=cfg.max_seq_len,
            decode=resolve_decode(getattr(cfg, "decode", "auto"), self.device),
        )
        self.running: dict[str, _Running] = {}
        self._busy = 0.0
        # Unseeded requests draw from this worker's own stream (not torch's global one), so replicas,
        # seeded apart by cluster/actors.py, never draw the same numbers.
        self.unseeded = make_generator(seed)
        freeze_loaded_objects()     # the model and its imports stay out of every full collection

    # ---- introspection -------------------------------------------------------------------------
    def info(self) -> dict:
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        eos = config.get("eos_token_id")
        gen_cfg_path = Path(self.model_dir) / "generation_config.json"
        if gen_cfg_path.exists():
            eos = json.loads(gen_cfg_path.read_text()).get("eos_token_id", eos)
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return {
            "model": Path(self.model_dir).name,
            "model_dir": str(self.model_dir),
            "vocab_size": self.runner.vocab_size,
            "eos_token_ids": eos_ids,
            "max_seq_len": self.cfg.max_seq_len,
            "max_slots": self.cfg.max_slots,
            "free_slots": self.free_slots(),
            "device": self.device,
        }

    def free_slots(self) -> int:
        return self.cfg.max_slots - len(self.running)

    def first_uses(self) -> tuple[int, float]:
        """Static-decode buckets first used so far and the seconds that took (ModelRunner.first_uses)."""
        return self.runner.first_uses()

    def busy_seconds(self) -> float:
        return self._busy

    # ---- requests ------------------------------------------------------------------------------
    def start(
        self, requests: list[NewRequest], return_hidden: bool = False
    ) -> list[list[int]] | tuple[list[list[int]], list[torch.Tensor]]:
        """Prefill each prompt and sample its first token from p at the last prompt position.

        return_hidden: also return each prompt's final hidden states [len(prompt), hidden] (float32,
        cpu); row j is the state that predicted token j + 1 (the last one predicted the first token).
        A hidden-state drafter reads them (workers/drafters/model.py).
        """
        t0 = time.perf_counter()
        for req in requests:
            if req.request_id in self.running:
                raise ValueError(f"request {req.request_id!r} is already running")
            if not req.prompt_token_ids:
                raise ValueError(f"request {req.request_id!r} has an empty prompt")
            if len(req.prompt_token_ids) + req.max_new_tokens > self.cfg.max_seq_len:
                raise ValueError(
                    f"request {req.request_id!r}: prompt ({len(req.prompt_token_ids)} tokens) + "
                    f"max_new_tokens ({req.max_new_tokens}) exceeds max_seq_len {self.cfg.max_seq_len}"
                )
        if len(requests) > self.free_slots():
            raise RuntimeError(f"no free KV slots: {len(requests)} asked, {self.free_slots()} free")
        slots = [self.runner.allocate() for _ in requests]
        try:
            with torch.inference_mode():
                prompts = [r.prompt_token_ids for r in requests]
                hidden = None
                if return_hidden:
                    logits, hidden = self.runner.prefill(slots, prompts, return_hidden=True)  # [b, vocab]
                    # a request with speculation off never reaches the drafter: its states are not carried
                    hidden = [h.float().cpu() if r.spec.enabled else None
                              for h, r in zip(hidden, requests, strict=True)]
                else:
                    logits = self.runner.prefill(slots, prompts)  # [b, vocab]
                params = [r.sampling for r in requests]
                generators = [make_generator(p.seed) or self.unseeded for p in params]
                probs = self._probs(logits[:, None, :], params)[:, 0]                      # [b, vocab]
                first = sample(probs, generators, [p.is_greedy for p in params]).tolist()
                keyed = [i for i, p in enumerate(params) if _is_keyed(p)]
                if keyed:
                    # a seeded row's first token is its keyed sample at position len(prompt)
                    won = keyed_sample(probs[keyed], [params[i].seed for i in keyed],
                                       [len(requests[i].prompt_token_ids) for i in keyed]).tolist()
                    for i, tok in zip(keyed, won, strict=True):
                        first[i] = tok
        except Exception:
            for slot in slots:
                self.runner.free(slot)
            raise
        for req, slot, gen, tok in zip(requests, slots, generators, first, strict=True):
            self.running[req.request_id] = _Running(
                slot, req.sampling, gen, pending=tok, num_tokens=len(req.prompt_token_ids) + 1,
                speculates=req.spec.enabled,
            )
        self._busy += time.perf_counter() - t0
        if return_hidden:
            return [[tok] for tok in first], hidden
        return [[tok] for tok in first]

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            run = self.running.pop(rid, None)
            if run is not None:
                self.runner.free(run.slot)

    def profile_verify(self, batch_sizes: list[int], max_tokens: int, budget_s: float | None = None) -> dict:
        """Timed verify-shaped forwards for the goodput controller's cost model (see engine/profile.py):
        {"verify": {b: seconds per n}, "pad_weight": w, "ragged": {b: seconds}, "skipped": [b]}."""
        t0 = time.perf_counter()
        table = profile_verify(self.runner, batch_sizes=batch_sizes, max_tokens=max_tokens, budget_s=budget_s)
        self._busy += time.perf_counter() - t0
        return table

    # ---- verification --------------------------------------------------------------------------
    def verify(self, drafts: list[Draft], return_hidden: bool = False) -> list[VerifyResult]:
        """One target forward for the whole batch: chains, token trees and empty drafts together.

        Without trees the forward is causal over [pending, drafts]; with any tree, every row goes
        through one tree-masked forward (a chain is a path). return_hidden fills VerifyResult.hidden:
        the hidden state that predicted each new token.
        """
        t0 = time.perf_counter()
        unknown = [d.request_id for d in drafts if d.request_id not in self.running]
        if unknown:
            raise KeyError(f"verify for requests that are not running: {unknown}")
        runs = [self.running[d.request_id] for d in drafts]
        slots = [r.slot for r in runs]
        starts = self.runner.lengths(slots)
        drafts = [d if d.parents is None else _fit_tree(d, self.runner.max_seq_len - start - 1)
                  for d, start in zip(drafts, starts, strict=True)]
        inputs = [[r.pending, *d.tokens] for r, d in zip(runs, drafts, strict=True)]
        with torch.inference_mode():
            if all(d.parents is None for d in drafts):
                out = self.runner.extend(slots, inputs, return_hidden=return_hidden)
            else:
                parents = [[-1, *d.parents[1:]] if d.parents is not None else list(range(-1, len(d.tokens)))
                           for d in drafts]
                out = self.runner.extend_trees(slots, inputs, parents, return_hidden=return_hidden)
            logits, hidden = out if return_hidden else (out, None)   # [b, n_max, vocab], [b, n_max, H]
            greedy = [i for i, r in enumerate(runs) if r.sampling.is_greedy]
            results: dict[int, VerifyResult] = {}
            if greedy:
                results.update(self._verify_greedy(greedy, drafts, runs, starts, logits, hidden))
            if len(greedy) < len(runs):
                p = self._probs(logits, [r.sampling for r in runs])   # [b, n_max, vocab]
                keyed = [i for i, r in enumerate(runs) if _is_keyed(r.sampling)]
                if keyed:
                    states = _states_to_host(hidden, keyed, drafts)     # before the samples' read
                    samples = self._keyed_samples(keyed, drafts, starts, p, runs)
                    results.update(self._verify_by_choice(keyed, samples, drafts, runs, starts, states))
                sampled = [i for i in range(len(runs))
                           if not runs[i].sampling.is_greedy and not _is_keyed(runs[i].sampling)]
                chains = [i for i in sampled if drafts[i].parents is None]
                trees = [i for i in sampled if drafts[i].parents is not None]
                if chains:
                    results.update(self._verify_chains(chains, drafts, runs, starts, p, hidden))
                if trees:
                    results.update(self._verify_trees(trees, drafts, runs, starts, p, hidden))
        seconds = time.perf_counter() - t0
        self._busy += seconds
        for i, res in results.items():
            res.verify_seconds = seconds
            if not runs[i].speculates:
                res.hidden = None       # never read (see start): not carried back
        return [results[i] for i in range(len(drafts))]

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits [b, n, vocab] -> p [b, n, vocab], float32 so the accept ratios are computed exactly alike
        temperature, top_k, top_p = params_to_tensors(params)
        return logits_to_probs(logits.float(), temperature, top_k, top_p)

    def _verify_greedy(self, rows, drafts, runs, starts, logits, hidden) -> dict[int, VerifyResult]:
        """Greedy rows: the target's choice after every node is the argmax of its logits (one
        device-to-host read for the batch; each read is a GPU synchronisation). On the CPU a tree row's
        argmaxes are taken as its walk reads them (_ArgmaxByNode)."""
        lazy = ([i for i in rows if drafts[i].parents is not None] if host_reads_are_cheap(logits.device)
                else [])
        choices: dict[int, list[int] | _ArgmaxByNode] = {i: _ArgmaxByNode(logits[i]) for i in lazy}
        batched = [i for i in rows if i not in choices]
        states = _states_to_host(hidden, rows, drafts)     # queued before the choices' read
        if batched:
            n = max(1 + len(drafts[i].tokens) for i in batched)
            picked = logits[:, :n] if len(batched) == logits.shape[0] else logits[batched, :n]
            choices.update(zip(batched, greedy_argmax(picked).tolist(), strict=True))
        return self._verify_by_choice(rows, [choices[i] for i in rows], drafts, runs, starts, states)

    def _keyed_samples(self, rows, drafts, starts, p, runs) -> list[list[int]]:
        """The target's keyed sample (workers/core/keyed.py) after the root and after every draft node of
        each seeded row: node j's next token sits at absolute position start + 1 + depth(j). One
        device-to-host read for the batch."""
        flat_rows, flat_nodes, seeds, positions, sizes = [], [], [], [], []
        for i in rows:
            depths = _node_depths(drafts[i])
            flat_rows += [i] * len(depths)
            flat_nodes += range(len(depths))
            seeds += [runs[i].sampling.seed] * len(depths)
            positions += [starts[i] + 1 + d for d in depths]
            sizes.append(len(depths))
        won = keyed_sample(p[flat_rows, flat_nodes], seeds, positions).tolist()
        out, at = [], 0
        for size in sizes:
            out.append(won[at : at + size])
            at += size
        return out

    def _verify_by_choice(self, rows, choices, drafts, runs, starts, states) -> dict[int, VerifyResult]:
        """Rows whose target token after every node is already chosen (`choices[j][node]`), chains and trees
        alike: greedy rows (the argmax of their logits) and seeded sampled rows (their keyed samples).

        A draft, or a tree node's first child in stored order, is accepted exactly when it equals the
        target's choice after its parent, and the choice where the walk stops is emitted. For greedy
        rows this is what the residual verifiers do with one-hot p (sampling.logits_to_probs), without p
        over the vocabulary or a walk on the device; for seeded rows it is keyed sampling's rule.
        """
        results, kept = {}, []       # kept: (slot, start, path) of tree rows, compacted together
        read_rows, read_nodes = [], []   # the states each result carries, gathered at once
        for j, i in enumerate(rows):
            d, run, top = drafts[i], runs[i], choices[j]
            if d.parents is None:
                accepted = 0
                while accepted < len(d.tokens) and d.tokens[accepted] == top[accepted]:
                    accepted += 1
                path = list(range(1, accepted + 1))
                new_tokens = [*d.tokens[:accepted], top[accepted]]
                # keep the old pending token and the accepted drafts; the last emitted token becomes pending
                self.runner.rollback(run.slot, starts[i] + 1 + accepted)
                bonus = accepted == len(d.tokens)
                res = VerifyResult(d.request_id, len(d.tokens), accepted, new_tokens, bonus)
            else:
                path, leaf, depth = _tree_path_by_choice(d, top)
                new_tokens = [*(d.tokens[c - 1] for c in path), top[path[-1] if path else 0]]
                kept.append((run.slot, starts[i], [0, *path]))
                res = VerifyResult(d.request_id, len(d.tokens), len(path), new_tokens, leaf,
                                   accepted_nodes=path, depth=depth)
            run.pending = new_tokens[-1]
            run.num_tokens += len(new_tokens)
            # the states at the root and each accepted node predicted the next token on the path
            read_rows += [j] * (1 + len(path))
            read_nodes += [0, *path]
            results[i] = res
        if states is not None:
            parts = pick_rows(states, read_rows, read_nodes).split([len(results[i].new_tokens) for i in rows])
            for i, part in zip(rows, parts, strict=True):
                results[i].hidden = part
        if kept:
            self.runner.keep_tree_paths(*(list(x) for x in zip(*kept, strict=True)))
        return results

    def _verify_chains(self, rows, drafts, runs, starts, p, hidden) -> dict[int, VerifyResult]:
        """Rows `rows` of the batch are chains: verify them together, roll each cache back."""
        chain = [drafts[i] for i in rows]
        gamma_max = max(len(d.tokens) for d in chain)
        if len(rows) < p.shape[0]:
            p = p[rows]
        p = p[:, : gamma_max + 1]                                         # [c, γmax+1, vocab]
        # Built from Python lists in one host-to-device copy each, on the device verification runs on.
        drafted = [len(d.tokens) for d in chain]
        num_drafted = torch.tensor(drafted, dtype=torch.long, device=p.device)
        padded = [list(d.tokens) + [0] * (gamma_max - len(d.tokens)) for d in chain]
        draft_tokens = torch.tensor(padded, dtype=torch.long, device=p.device).view(len(chain), gamma_max)
        q = self._stack_q(chain, gamma_max, p.shape[-1], draft_tokens, p.device)
        out = verify_chain(draft_tokens, num_drafted, q, p, [runs[i].generator for i in rows],
                           [runs[i].sampling.is_greedy for i in rows], host_drafted=drafted)
        states = _states_to_host(hidden, rows, drafts)                    # [c, γmax+1, H], queued first
        num_accepted, is_bonus, output_tokens = out.to_host()      # the step's outcome, read once
        results = {}
        for j, i in enumerate(rows):
            d, run = drafts[i], runs[i]
            accepted = int(num_accepted[j])
            new_tokens = output_tokens[j][: accepted + 1]
            # keep the old pending token and the accepted drafts; the last emitted token becomes pending
            self.runner.rollback(run.slot, starts[i] + 1 + accepted)
            run.pending = new_tokens[-1]
            run.num_tokens += len(new_tokens)
            res = VerifyResult(d.request_id, len(d.tokens), accepted, new_tokens, bool(is_bonus[j]))
            if states is not None:
                # the states at [pending, accepted drafts] predicted [accepted drafts, recovered|bonus]
                res.hidden = states[j, : accepted + 1].clone()
            results[i] = res
        return results

    @staticmethod
    def _stack_q(drafts, gamma_max, vocab, draft_tokens, device) -> torch.Tensor | None:
        """q [b, γmax, vocab]; deterministic drafts (greedy or n-gram) are one-hot on their token."""
        if gamma_max == 0 or all(d.probs is None for d in drafts):
            return None
        q = torch.zeros(len(drafts), gamma_max, vocab, device=device)
        for i, d in enumerate(drafts):
            n = len(d.tokens)
            if n == 0:
                continue
            if d.probs is None:
                q[i, torch.arange(n, device=device), draft_tokens[i, :n]] = 1.0
            else:
                q[i, :n] = d.probs.to(device=device, dtype=torch.float32)
        return q

    def _verify_trees(self, rows, drafts, runs, starts, p, hidden) -> dict[int, VerifyResult]:
        """Rows `rows` of the batch are token trees: verify them together, keep each accepted path."""
        # The trees' structure lives on the host (the verifier walks it level by level)
        host = torch.device("cpu")
        trees = [TokenTree(tokens=torch.tensor([runs[i].pending, *drafts[i].tokens], device=host),
                           parents=torch.tensor([-1, *drafts[i].parents[1:]], device=host))
                 for i in rows]
        vocab = p.shape[-1]
        q_list = [None if drafts[i].probs is None
                  else torch.cat([p.new_zeros(1, vocab), drafts[i].probs.to(p.device, torch.float32)])
                  for i in rows]                                          # each [n, vocab], row 0 unread
        p_list = [p[i, : len(t)] for i, t in zip(rows, trees, strict=True)]  # each [n, vocab]
        outs = verify_trees(trees, q_list, p_list, [runs[i].generator for i in rows],
                            [runs[i].sampling.is_greedy for i in rows])
        results = {}
        self.runner.keep_tree_paths([runs[i].slot for i in rows], [starts[i] for i in rows],
                                    [[0, *out.accepted_nodes] for out in outs])
        states = [None] * len(rows)
        if hidden is not None:
            # the root and each accepted node predicted the next token on the path: one gather, one read
            paths = [[0, *out.accepted_nodes] for out in outs]
            read = pick_rows(hidden, [i for i, path in zip(rows, paths, strict=True) for _ in path],
                             [node for path in paths for node in path])
            states = read.float().cpu().split([len(path) for path in paths])
        for i, tree, out, state in zip(rows, trees, outs, states, strict=True):
            d, run = drafts[i], runs[i]
            run.pending = out.output_tokens[-1]
            run.num_tokens += len(out.output_tokens)
            results[i] = VerifyResult(
                d.request_id,
                len(d.tokens),
                len(out.accepted_nodes),
                list(out.output_tokens),
                out.is_bonus,
                accepted_nodes=list(out.accepted_nodes),
                depth=int(tree.depth().max()),
                hidden=state,
            )
        return results


def _is_keyed(sampling: SamplingParams) -> bool:
    """Seeded sampled rows are sampled by keyed noise (workers/core/keyed.py); the rest as before."""
    return sampling.seed is not None and not sampling.is_greedy


def _states_to_host(hidden: torch.Tensor | None, rows: list[int], drafts: list[Draft]) -> torch.Tensor | None:
    """The rows' hidden states up to their longest draft, float32 on the host: [len(rows), n, H] of hidden
    [b, n_max, H]. The copy is queued, not waited for: on a GPU it lands in pinned memory behind the
    step's forward, and the outcome's read that the caller makes next (a synchronisation) finds it done,
    so a verify that returns hidden states still synchronises once. Read the result only after that read.
    On the CPU it is the tensor itself."""
    if hidden is None:
        return None
    n = max(1 + len(drafts[i].tokens) for i in rows)
    part = hidden[:, :n] if len(rows) == hidden.shape[0] else hidden[rows, :n]
    return part.float().to("cpu", non_blocking=True)


def _node_depths(draft: Draft) -> list[int]:
    """Depth of the root (0, the pending token) and of each draft node: a chain's node j is at depth j."""
    if draft.parents is None:
        return list(range(len(draft.tokens) + 1))
    depth = [0] * len(draft.parents)
    for node in range(1, len(draft.parents)):
        depth[node] = depth[draft.parents[node]] + 1
    return depth


class _ArgmaxByNode:
    """The argmax of one row's logits after a node, taken when the verification walk first reads it. A
    tree's walk reads depth + 1 of its nodes, and on the CPU the argmax over the vocabulary at every node
    was most of a tree's verify (2.3 ms of 3.5 for 16 trees of 13 nodes; a GPU takes them all in one
    kernel and one read). Same values as greedy_argmax over the row."""

    __slots__ = ("logits", "rows", "done")

    def __init__(self, logits: torch.Tensor):   # [nodes, vocab], on the CPU
        self.logits = logits
        # float32 rows are read through numpy directly, as greedy_argmax does, without a tensor per node
        self.rows = logits.detach().numpy() if logits.dtype in (torch.float32, torch.float64) else None
        self.done: dict[int, int] = {}

    def __getitem__(self, node: int) -> int:
        if node not in self.done:
            self.done[node] = (int(greedy_argmax(self.logits[node])) if self.rows is None
                               else int(self.rows[node].argmax()))
        return self.done[node]


def _tree_path_by_choice(draft: Draft, top: list[int] | _ArgmaxByNode) -> tuple[list[int], bool, int]:
    """(accepted nodes, stopped at a leaf, the tree's depth) of a tree walk by the target's choices: from
    the root, the first child (in stored order) whose token is the target's choice `top[node]`, until
    none is."""
    parents = draft.parents
    children: dict[int, list[int]] = {}
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
        depth[node] = depth[parents[node]] + 1
    path, node = [], 0
    while True:
        nxt = next((c for c in children.get(node, ()) if draft.tokens[c - 1] == top[node]), None)
        if nxt is None:
            return path, node not in children, max(depth)
        path.append(nxt)
        node = nxt


def _fit_tree(draft: Draft, room: int) -> Draft:
    """Keep the first `room` draft nodes when the tree does not fit the slot (a drafter planning with a
    longer context than this target's). Nodes are in topological order, so a prefix is a tree in which
    each node keeps a prefix of its children, in the order they were drafted: the verifier tries
    children in that order, each against q given the earlier siblings, so it stays exact, as if the
    drafter had drafted fewer nodes."""
    if len(draft.tokens) <= room:
        return draft
    probs = None if draft.probs is None else draft.probs[:room]
    parents = draft.parents[: room + 1]
    return Draft(draft.request_id, draft.tokens[:room], probs, parents, draft.drafter_version)
