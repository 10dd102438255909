"""Suffix index for SuffixDecoding (Oliaro et al.; Snowflake Arctic Inference): a trie of every substring of
up to `max_depth` tokens of the sequences it holds, each node counting its occurrences.

Adding a sequence walks it once, keeping the nodes of the substrings that end at the current token (at
most max_depth of them) and stepping each to its child for the next token: O(len × max_depth) counter
updates. Removing a sequence makes the same walk with -1 and drops nodes whose count reaches 0, so the
index of many sequences equals the sum of their indexes (what makes eviction exact).

Drafting: find the longest suffix of the context (up to max_match tokens) that is a path in the trie with
at least one continuation, then grow the continuation best-first by its empirical probability: each child
is scored count(child) / Σ count(siblings), a path by the product along it. A chain follows the most
frequent child; a tree keeps up to `width` children per node and `max_nodes` nodes in all. The score of a
draft is Σ over its nodes of their path probability: the expected number of accepted tokens if the index's
frequencies were the target's probabilities, which is how SuffixDecoding ranks candidates.

Plain python. Nodes use __slots__ and hold a single child inline (most trie nodes have one); README gives
measured bytes per node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("count", "kids", "tok")

    def __init__(self) -> None:
        self.count = 0
        # None, the single child (its token in `tok`), or {token: node}. A single child is held in the
        # node itself, not in a (token, node) tuple: every tuple that holds a node is an object the
        # garbage collector tracks, and a full collection walks them all (0.2-0.6 s per collection at
        # 0.4-0.8 M tracked objects, 1-2% of an engine benchmark cell at batch 8-16).
        self.kids: _Node | dict[int, _Node] | None = None
        self.tok = -1

    def child(self, token: int) -> _Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is _Node:
            return kids if self.tok == token else None
        return kids.get(token)

    def add_child(self, token: int) -> _Node:
        node = _Node()
        kids = self.kids
        if kids is None:
            self.kids, self.tok = node, token
        elif type(kids) is _Node:
            self.kids, self.tok = {self.tok: kids, token: node}, -1
        else:
            kids[token] = node
        return node

    def drop_child(self, token: int) -> None:
        kids = self.kids
        if type(kids) is _Node:
            if self.tok == token:
                self.kids, self.tok = None, -1
        elif kids is not None:
            kids.pop(token, None)
            if len(kids) == 1:
                self.tok, self.kids = next(iter(kids.items()))

    def children(self) -> list[tuple[int, _Node]]:
        """(token, node) pairs, most frequent first (ties: smaller token id first, so drafts are stable)."""
        kids = self.kids
        if kids is None:
            return []
        if type(kids) is _Node:
            return [(self.tok, kids)]
        return sorted(kids.items(), key=lambda kv: (-kv[1].count, kv[0]))


@dataclass
class SuffixDraft:
    """Draft tokens in topological order; parents[n] = 0 for the root (the context's last token), k for draft
    k - 1 (the DraftTree numbering); score = Σ path probabilities; match = tokens of context matched."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    score: float = 0.0
    match: int = 0
    probs: list[float] = field(default_factory=list)   # each node's path probability (score = their sum)

    def cut(self, depth: int) -> SuffixDraft:
        """The first `depth` nodes of a chain."""
        return SuffixDraft(self.tokens[:depth], self.parents[:depth], sum(self.probs[:depth]), self.match,
                           self.probs[:depth])


class _Drafting:
    """draft() of both indexes: the tree below the node of the longest match, grown best-first."""

    max_depth: int

    def _below_match(self, context: list[int], depth: int, max_match: int, min_match: int):
        raise NotImplementedError

    def draft(
        self,
        context: list[int],
        depth: int,
        width: int = 1,
        max_nodes: int | None = None,
        max_match: int = 12,
        min_match: int = 1,
        min_prob: float = 0.1,
    ) -> SuffixDraft:
        """The most probable continuation tree of the longest match: ≤ depth levels, ≤ width children per
        node, ≤ max_nodes nodes (default depth × width), each node's path probability ≥ min_prob."""
        node, matched = self._below_match(context, depth, max_match, min_match)
        return _grow(node, matched, depth, self.max_depth, width, max_nodes, min_prob)


class SuffixIndex(_Drafting):
    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    # ---- building -------------------------------------------------------------------------------
    def add(self, tokens: list[int]) -> None:
        self._walk(tokens, +1, [])

    def remove(self, tokens: list[int]) -> None:
        """Undo add(tokens) for the same tokens (counts and nodes come back to what they were)."""
        self._walk(tokens, -1, [])

    def extend(self, tokens: list[int], active: list | None = None) -> list:
        """Append tokens to a sequence being indexed as it grows; pass back what the previous call returned
        (None to start a sequence). extend(a) then extend(b, state) indexes exactly what add(a + b) does."""
        return self._walk(tokens, +1, active or [])

    def _walk(self, tokens: list[int], sign: int, active: list[_Node]) -> list[_Node]:
        # active: nodes of the substrings ending at the previous token, shortest first
        if sign > 0:
            return self._add_walk(tokens, active)
        for token in tokens:
            active = [self.root, *active[: self.max_depth - 1]]
            stepped = []
            for parent in active:
                node = self._bump(parent, token, sign)
                if node is not None:
                    stepped.append(node)
            active = stepped
        return active

    def _add_walk(self, tokens: list[int], active: list[_Node]) -> list[_Node]:
        """_walk with sign +1, inlined: it runs for every served token (max_depth node updates each), and
        function calls per node made it most of the suffix drafter's cost per step at batch 16."""
        keep, root, created = self.max_depth - 1, self.root, 0
        for token in tokens:
            stepped = []
            for parent in (root, *active[:keep]):
                kids = parent.kids
                if kids is None:
                    node = _Node()
                    parent.kids, parent.tok = node, token
                    created += 1
                elif type(kids) is _Node:
                    if parent.tok == token:
                        node = kids
                    else:
                        node = _Node()
                        parent.kids, parent.tok = {parent.tok: kids, token: node}, -1
                        created += 1
                else:
                    node = kids.get(token)
                    if node is None:
                        node = kids[token] = _Node()
                        created += 1
                node.count += 1
                stepped.append(node)
            active = stepped
        self.num_nodes += created
        return active

    def _bump(self, parent: _Node, token: int, sign: int) -> _Node | None:
        node = parent.child(token)
        if node is None:
            if sign < 0:
                return None  # already gone with an ancestor: nothing of this path is left to count
            node = parent.add_child(token)
            self.num_nodes += 1
        node.count += sign
        if node.count <= 0:
            parent.drop_child(token)
            self.num_nodes -= 1
        return node

    # ---- drafting -------------------------------------------------------------------------------
    def match(self, context: list[int], max_match: int, min_match: int = 1) -> tuple[_Node | None, int]:
        """Node of the longest suffix of context (min_match..max_match tokens) that has a continuation."""
        longest = min(max_match, len(context), self.max_depth - 1)
        found: list[_Node] = []
        for k in range(1, longest + 1):
            node = self.root
            for token in context[len(context) - k:]:
                node = node.child(token)
                if node is None:
                    break
            if node is None:
                break  # a longer suffix contains this one, so it cannot be in the trie either
            found.append(node)
        for k in range(len(found), min_match - 1, -1):
            if found[k - 1].kids is not None:
                return found[k - 1], k
        return None, 0

    def _below_match(self, context: list[int], depth: int, max_match: int, min_match: int):
        return self.match(context, max_match, min_match)

def _grow(node: _Node | None, matched: int, depth: int, max_depth: int, width: int, max_nodes: int | None,
          min_prob: float) -> SuffixDraft:
    """Grow the draft below the match node best-first (see SuffixIndex.draft)."""
    out = SuffixDraft(match=matched)
    if node is None or depth <= 0:
        return out
    budget = depth * width if max_nodes is None else max_nodes
    # The continuation must fit under max_depth with the match above it.
    depth = min(depth, max_depth - matched)
    order = 0  # tie-break: earlier pushes first, so drafts are deterministic
    heap: list = []
    for tok, child, p in _ranked(node, width, 1.0):
        heapq.heappush(heap, (-p, order := order + 1, tok, child, 0, 1))
    while heap and len(out.tokens) < budget:
        neg_p, _, tok, child, parent, level = heapq.heappop(heap)
        if -neg_p < min_prob:
            break
        out.tokens.append(tok)
        out.parents.append(parent)
        out.probs.append(-neg_p)
        out.score += -neg_p
        if level < depth:
            here = len(out.tokens)
            for t, c, p in _ranked(child, width, -neg_p):
                heapq.heappush(heap, (-p, order := order + 1, t, c, here, level + 1))
    return out


def _ranked(node: _Node, width: int, path_p: float) -> list[tuple[int, _Node, float]]:
    kids = node.children()
    total = sum(c.count for _, c in kids)
    return [(t, c, path_p * c.count / total) for t, c in kids[:width]] if total else []


class ContextIndex(_Drafting):
    """What a SuffixIndex over one growing sequence (a request's own prompt and output) drafts, built
    lazily. Appending a token only records its position; a draft finds the longest suffix of the context
    that occurred earlier with a continuation (through the positions of its last token), and counts the
    continuations of those occurrences into a small trie, which is exactly the SuffixIndex's subtree
    below that match. A SuffixIndex pays max_depth node updates per token instead (about 18 new nodes:
    most substrings of a sequence are unique), 1.5% of a batch-16 run on a CPU that drafted nothing."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}   # token -> its positions in self.tokens

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.where.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def match(self, context: list[int], max_match: int, min_match: int = 1) -> tuple[list[int], int]:
        """Ends of the earlier occurrences of the longest suffix of context (min_match..max_match tokens)
        that is followed by a token, and its length; ([], 0) when there is none."""
        seq, n = self.tokens, len(self.tokens)
        longest = min(max_match, len(context), self.max_depth - 1)
        if longest < 1:
            return [], 0
        best, ends = 0, []
        for end in self.where.get(context[-1], ()):
            if end + 1 >= n:
                continue  # nothing follows this occurrence
            m = 1
            while m < longest and end - m >= 0 and seq[end - m] == context[-1 - m]:
                m += 1
            if m > best:
                best, ends = m, [end]
            elif m == best:
                ends.append(end)
        return (ends, best) if best >= min_match else ([], 0)

    def _below_match(self, context: list[int], depth: int, max_match: int, min_match: int):
        """The SuffixIndex's subtree below the match, as deep as this draft can use: counted from the
        continuations of the match's occurrences."""
        ends, matched = self.match(context, max_match, min_match)
        if not ends or depth <= 0:
            return None, matched
        root, span = _Node(), min(depth, self.max_depth - matched)
        for end in ends:
            node = root
            for token in self.tokens[end + 1 : end + 1 + span]:
                node = node.child(token) or node.add_child(token)
                node.count += 1
        return root, matched
