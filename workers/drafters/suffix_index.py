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

Plain python. A node is an id into two lists (its count, its children), not an object: the children are
None, one int packing (token, child) (most nodes have one child), or a {token: child} dict, and neither
ints nor dicts of ints are objects the garbage collector tracks, so a full collection does not walk the
index (as objects, 0.2-0.6 s a collection at 0.3-0.8 M nodes, 1-2% of an engine benchmark cell at batch
8-16, and a stall of that length in serving). Ids of removed nodes are reused. README gives measured
bytes per node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

SHIFT = 1 << 32   # a single child is kept as token * SHIFT + child id (ids stay below 2**32)


class _Trie:
    """Nodes 0.. (0 is the root): count[n], and kids[n] = None, token * SHIFT + child, or {token: child}."""

    __slots__ = ("count", "kids", "free")

    def __init__(self) -> None:
        self.count: list[int] = [0]
        self.kids: list[int | dict[int, int] | None] = [None]
        self.free: list[int] = []       # ids of removed nodes, reused first

    def new(self) -> int:
        if self.free:
            node = self.free.pop()
            self.count[node], self.kids[node] = 0, None
            return node
        self.count.append(0)
        self.kids.append(None)
        return len(self.count) - 1

    def child(self, node: int, token: int) -> int:
        """The child of `node` along `token`, or -1."""
        kids = self.kids[node]
        if kids is None:
            return -1
        if type(kids) is int:
            return kids % SHIFT if kids // SHIFT == token else -1
        return kids.get(token, -1)

    def add_child(self, node: int, token: int) -> int:
        child = self.new()
        kids = self.kids[node]
        if kids is None:
            self.kids[node] = token * SHIFT + child
        elif type(kids) is int:
            self.kids[node] = {kids // SHIFT: kids % SHIFT, token: child}
        else:
            kids[token] = child
        return child

    def drop_child(self, node: int, token: int) -> None:
        """Unlink the child along `token`; its id is reused by a later new() (its own entries stay until
        then, so a removal walk still reaches its descendants through it)."""
        kids = self.kids[node]
        if type(kids) is int:
            if kids // SHIFT == token:
                self.kids[node] = None
                self.free.append(kids % SHIFT)
        elif kids is not None and token in kids:
            self.free.append(kids.pop(token))
            if len(kids) == 1:
                (tok, only), = kids.items()
                self.kids[node] = tok * SHIFT + only

    def children(self, node: int) -> list[tuple[int, int]]:
        """(token, child) pairs, most frequent first (ties: smaller token id first, so drafts are stable)."""
        kids = self.kids[node]
        if kids is None:
            return []
        if type(kids) is int:
            return [(kids // SHIFT, kids % SHIFT)]
        count = self.count
        return sorted(kids.items(), key=lambda kv: (-count[kv[1]], kv[0]))


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
        trie, node, matched = self._below_match(context, depth, max_match, min_match)
        return _grow(trie, node, matched, depth, self.max_depth, width, max_nodes, min_prob)


class SuffixIndex(_Drafting):
    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.trie = _Trie()
        self.root = 0
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

    def _walk(self, tokens: list[int], sign: int, active: list[int]) -> list[int]:
        # active: nodes of the substrings ending at the previous token, shortest first
        if sign > 0:
            return self._add_walk(tokens, active)
        for token in tokens:
            active = [self.root, *active[: self.max_depth - 1]]
            stepped = []
            for parent in active:
                node = self._drop_one(parent, token)
                if node >= 0:
                    stepped.append(node)
            active = stepped
        return active

    def _add_walk(self, tokens: list[int], active: list[int]) -> list[int]:
        """_walk with sign +1, inlined: it runs for every served token (max_depth node updates each), and
        function calls per node made it most of the suffix drafter's cost per step at batch 16."""
        keep, trie, created = self.max_depth - 1, self.trie, 0
        count, kids, new = trie.count, trie.kids, trie.new
        for token in tokens:
            stepped = []
            for parent in (self.root, *active[:keep]):
                below = kids[parent]
                if below is None:
                    node = new()
                    kids[parent] = token * SHIFT + node
                    created += 1
                elif type(below) is int:
                    if below // SHIFT == token:
                        node = below % SHIFT
                    else:
                        node = new()
                        kids[parent] = {below // SHIFT: below % SHIFT, token: node}
                        created += 1
                else:
                    node = below.get(token, -1)
                    if node < 0:
                        node = below[token] = new()
                        created += 1
                count[node] += 1
                stepped.append(node)
            active = stepped
        self.num_nodes += created
        return active

    def _drop_one(self, parent: int, token: int) -> int:
        """One occurrence less of parent's child along token (unlinked at 0); -1 when it is gone already
        (with an ancestor: nothing of this path is left to count)."""
        node = self.trie.child(parent, token)
        if node < 0:
            return -1
        self.trie.count[node] -= 1
        if self.trie.count[node] <= 0:
            self.trie.drop_child(parent, token)
            self.num_nodes -= 1
        return node

    # ---- drafting -------------------------------------------------------------------------------
    def count(self, pattern: list[int]) -> int:
        """Occurrences of `pattern` in the indexed sequences (0 when absent or longer than max_depth)."""
        node = self.root
        for token in pattern:
            node = self.trie.child(node, token)
            if node < 0:
                return 0
        return self.trie.count[node]

    def match(self, context: list[int], max_match: int, min_match: int = 1) -> tuple[int | None, int]:
        """Node of the longest suffix of context (min_match..max_match tokens) that has a continuation."""
        longest = min(max_match, len(context), self.max_depth - 1)
        found: list[int] = []
        child = self.trie.child
        for k in range(1, longest + 1):
            node = self.root
            for token in context[len(context) - k:]:
                node = child(node, token)
                if node < 0:
                    break
            if node < 0:
                break  # a longer suffix contains this one, so it cannot be in the trie either
            found.append(node)
        for k in range(len(found), min_match - 1, -1):
            if self.trie.kids[found[k - 1]] is not None:
                return found[k - 1], k
        return None, 0

    def _below_match(self, context: list[int], depth: int, max_match: int, min_match: int):
        node, matched = self.match(context, max_match, min_match)
        return self.trie, node, matched


def _grow(trie: _Trie, node: int | None, matched: int, depth: int, max_depth: int, width: int,
          max_nodes: int | None, min_prob: float) -> SuffixDraft:
    """Grow the draft below the match node best-first (see SuffixIndex.draft)."""
    out = SuffixDraft(match=matched)
    if node is None or depth <= 0:
        return out
    budget = depth * width if max_nodes is None else max_nodes
    # The continuation must fit under max_depth with the match above it.
    depth = min(depth, max_depth - matched)
    order = 0  # tie-break: earlier pushes first, so drafts are deterministic
    heap: list = []
    for tok, child, p in _ranked(trie, node, width, 1.0):
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
            for t, c, p in _ranked(trie, child, width, -neg_p):
                heapq.heappush(heap, (-p, order := order + 1, t, c, here, level + 1))
    return out


def _ranked(trie: _Trie, node: int, width: int, path_p: float) -> list[tuple[int, int, float]]:
    kids = trie.children(node)
    total = sum(trie.count[c] for _, c in kids)
    return [(t, c, path_p * trie.count[c] / total) for t, c in kids[:width]] if total else []


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
            return None, None, matched
        trie, span = _Trie(), min(depth, self.max_depth - matched)
        for end in ends:
            node = 0
            for token in self.tokens[end + 1 : end + 1 + span]:
                below = trie.child(node, token)
                node = below if below >= 0 else trie.add_child(node, token)
                trie.count[node] += 1
        return trie, 0, matched
