"""The model drafter's token trees (ModelDrafter.propose_tree), apart from its chains in model.py.

A tree's first level takes the request's feed in with its root, as a chain's first drafting forward does;
each level below re-runs the partial tree with a tree mask and rolls it back, so the cache never holds
uncommitted nodes. The mixin uses the drafter's runner, sequences and helpers (_catch_up, _q,
_to_target_ids, _full, _keyed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd.workers.core.sampling import greedy_top, pick_rows, sample
from specd.workers.drafters.base import DraftTree, check_batch

if TYPE_CHECKING:
    from specd.workers.drafters.model import _DraftSeq


class TreeDrafting:
    """Token-tree drafting for ModelDrafter."""

    def propose_tree(self, request_ids, depths, widths, params, policy=None, states=None) -> DraftTree:
        return self._propose_tree(request_ids, depths, widths, params)

    def _propose_tree(self, request_ids, depths, widths, params) -> DraftTree:
        """Top-`width` first tokens, each continued as a chain to `depth`: one forward per level.

        The partial tree is re-run with a tree mask at every level and then rolled back, so the cache
        never holds uncommitted nodes; at depth ≤ 5 and width ≤ 4 that costs a few dozen drafter
        tokens, less than one target token here. First-level children of sampled requests are drawn
        without replacement (q_child renormalised over the unused tokens); greedy ones are top-w and
        deterministic (one-hot q_child); deeper nodes follow q (argmax when greedy).
        """
        check_batch(request_ids, depths, params)
        seqs = [self.seqs[r] for r in request_ids]
        rows = [i for i, d in enumerate(depths) if d > 0]
        trees = {i: ([seqs[i].feed[-1]], [-1]) for i in rows}           # (tokens, parents), root first
        q_child: dict[int, list[torch.Tensor | None]] = {i: [None] for i in rows}
        # As in propose: a short feed goes in with the first level's forward.
        self._catch_up([seqs[i] for i in rows])
        frontier = {i: [0] for i in rows}
        for level in range(max((depths[i] for i in rows), default=0)):
            rows = [i for i in rows if level < depths[i]]
            if not rows:
                break
            slots = [seqs[i].slot for i in rows]
            if level == 0:
                starts, logits = self._tree_first_level([seqs[i] for i in rows])
            else:
                starts = self.runner.lengths(slots)
                # A hidden-state drafter reads, at every node, the newest target state there is (the
                # root's), marked as stale as the node is deep, as in a chain.
                roots = [seqs[i].feed_hidden[-1] for i in rows] if self.uses_target_hidden else None
                logits = self.runner.extend_trees(
                    slots, [trees[i][0] for i in rows], [trees[i][1] for i in rows], root_features=roots
                )
                self.runner.rollback_many(slots, starts)
            greedy: dict[int, list[tuple[int, int]]] = {}     # width -> (batch row, request) of greedy rows
            for j, i in enumerate(rows):
                width = widths[i] if level == 0 else 1
                if params[i].is_greedy:
                    greedy.setdefault(width, []).append((j, i))
                    continue
                nodes = frontier[i]
                q = self._q(logits[j, nodes], [params[i]] * len(nodes))        # [len(nodes), V']
                new_frontier = []
                for k, node in enumerate(nodes):
                    # the children sit at depth level + 1: absolute position starts[j] + 1 + level
                    children = (self._keyed_children(q[k], width, params[i].seed, starts[j] + 1 + level)
                                if _is_keyed(params[i]) else
                                self._children(q[k], width, params[i], seqs[i].generator))
                    for tok, qc in children:
                        trees[i][0].append(tok)
                        trees[i][1].append(node)
                        q_child[i].append(qc)
                        new_frontier.append(len(trees[i][0]) - 1)
                frontier[i] = new_frontier
            for width, members in greedy.items():
                self._greedy_children(logits, members, width, trees, q_child, frontier)
        return self._tree_result(seqs, trees, q_child, params)

    def _tree_first_level(self, seqs: list[_DraftSeq]) -> tuple[list[int], torch.Tensor]:
        """The first level of a tree: each row's feed (the root last) in one causal forward, as a chain
        drafts its first token. The feed before the root stays in the cache; the root does not, since the
        levels below re-run it with its children. (start of each row's root, the root's logits
        [b, 1, V'], indexed as node 0 of the tree.)"""
        slots = [s.slot for s in seqs]
        extra = {}
        if self.uses_target_hidden:
            extra = dict(features=[s.feed_hidden for s in seqs], staleness=[[0] * len(s.feed) for s in seqs])
        logits = self.runner.extend(slots, [s.feed for s in seqs], **extra)     # [b, max feed, V']
        root = pick_rows(logits, list(range(len(seqs))), [len(s.feed) - 1 for s in seqs])[:, None]
        starts = [n - 1 for n in self.runner.lengths(slots)]
        self.runner.rollback_many(slots, starts)
        for s in seqs:
            s.feed = s.feed[-1:]
            if s.feed_hidden is not None:
                s.feed_hidden = s.feed_hidden[-1:]
        return starts, root

    def _greedy_children(self, logits, members, width, trees, q_child, frontier) -> None:
        """The top-`width` candidates of every frontier node of greedy rows `members` at once: greedy q is
        one-hot, so they are ranked by the raw logits; deterministic, one-hot q_child (None). One child
        (every level below the first) is the argmax, as a chain drafts."""
        batch_rows = [j for j, i in members for _ in frontier[i]]
        nodes = [node for _, i in members for node in frontier[i]]
        best = greedy_top(pick_rows(logits, batch_rows, nodes), width)           # [nodes, w]
        top = self._to_target_ids(best)                                          # [nodes][w]
        k = 0
        for _, i in members:
            tokens, parents = trees[i]
            new_frontier = []
            for node in frontier[i]:
                new_frontier.extend(range(len(tokens), len(tokens) + len(top[k])))
                tokens.extend(top[k])
                parents.extend([node] * len(top[k]))
                k += 1
            q_child[i].extend([None] * (len(tokens) - len(q_child[i])))
            frontier[i] = new_frontier

    def _children(self, q: torch.Tensor, width: int, p, gen) -> list[tuple[int, torch.Tensor | None]]:
        """`width` children of a sampled request's node, drawn without replacement from q [V'], the
        drafter's distribution: (target id, q_child)."""
        width = min(width, int((q > 0).sum()))
        out, remaining = [], q.clone()
        for _ in range(width):
            qc = remaining / remaining.sum()
            tok = sample(qc[None], [gen])[0]
            out.append((self._to_target_ids(tok[None])[0], qc))
            remaining[tok] = 0.0
        return out

    def _keyed_children(self, q: torch.Tensor, width: int, seed: int, position: int):
        """A seeded request's `width` children of a node: the top `width` of q's keyed race at the
        children's position (Gumbel-top-k, an ordered sample without replacement from q), so the first
        child is the target's own sample whenever the two races agree. (target id, None): the target
        verifies seeded rows against its keyed samples and reads no q."""
        width = min(width, int((q > 0).sum()))
        top = self._keyed(q[None], [seed], [position], k=width)[0]
        return [(tok, None) for tok in self._to_target_ids(top)]

    def _tree_result(self, seqs, trees, q_child, params) -> DraftTree:
        tokens, parents, probs_rows = [], [], []
        for i, seq in enumerate(seqs):
            toks, pars = trees.get(i, ([0], [-1]))
            tokens.append(toks[1:])
            parents.append(pars[1:])
            probs_rows.append(q_child.get(i, [None])[1:])
            seq.drafted, seq.tree = list(toks[1:]), True
        probs = None
        if not all(p.is_greedy for p in params) and any(tokens):
            nmax = max(len(t) for t in tokens)
            probs = torch.zeros(len(seqs), max(nmax, 1), self.full_vocab_size, device=self.runner.device)
            for i, (toks, rows) in enumerate(zip(tokens, probs_rows, strict=True)):
                for n, (tok, qc) in enumerate(zip(toks, rows, strict=True)):
                    if qc is None:
                        probs[i, n, tok] = 1.0
                    else:
                        probs[i, n] = self._full(qc)
        return DraftTree(tokens, parents, probs, self.version)


def _is_keyed(sampling) -> bool:
    """Seeded sampled requests draft with the target's keyed noise (workers/core/keyed.py)."""
    return sampling.seed is not None and not sampling.is_greedy
