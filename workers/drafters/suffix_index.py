"""Suffix index for SuffixDecoding (Oliaro et al.; Snowflake Arctic Inference): a trie of every substring of
up to `max_depth` tokens of the sequences it holds, each node counting its occurrences.

The global index (SuffixIndex) keeps the paths of substrings seen once compressed: a node met once keeps,
in place of children, where in which sequence its path goes on (a tail), so a sequence costs about a node
per token instead of about max_depth (docs/decisions/suffix-index-memory.md)
and adding a token updates only the substrings ending there that occur elsewhere too, not max_depth of
them. Removing a sequence walks it again with -1, so the index of many sequences is the plain trie of
their sum (what makes eviction exact); see SuffixIndex.

Drafting: find the longest suffix of the context (up to max_match tokens) that is a path in the trie with
at least one continuation, then grow the continuation best-first by its empirical probability: each child
is scored count(child) / Σ count(siblings), a path by the product along it. A chain follows the most
frequent child; a tree keeps up to `width` children per node and `max_nodes` nodes in all. The score of a
draft is Σ over its nodes of their path probability: the expected number of accepted tokens if the index's
frequencies were the target's probabilities, which is how SuffixDecoding ranks candidates.

Plain python. A node is an id into two lists (its count, its children), not an object: the children are
None, one int packing (token, child) (most nodes have one child), or a {token: child} dict, and neither
ints nor dicts of ints are objects the garbage collector tracks, so a full collection does not walk the
index (as objects, a collection walked them all: a stall in serving; docs/decisions/suffix-index-memory.md).
Ids of removed nodes are reused. A tail is a negative int in the children's place.
"""

from __future__ import annotations

import heapq
from collections import Counter
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

    def ranked(self, node: int) -> list[tuple[int, int, int]]:
        """children() with each child's count: (token, child, count)."""
        return [(t, c, self.count[c]) for t, c in self.children(node)]


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
        """(children, position, matched): children(position) lists (token, position, count) of a node
        of the index, most frequent first; position is the match's node (None: no match)."""
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
        children, node, matched = self._below_match(context, depth, max_match, min_match)
        return _grow(children, node, matched, depth, self.max_depth, width, max_nodes, min_prob)


def _tail(seq: int, start: int, depth: int, mark: bool = False) -> int:
    """The code kept in place of a head node's children: the rest of its path is sequence `seq` from
    `start` on, as far as max_depth allows from the head's `depth` (a negative int: no child id is).
    mark: no path below at all; only where the node's newest occurrence ends (see SuffixIndex._push)."""
    return -1 - ((seq << 29) | (int(mark) << 28) | (start << 8) | depth)


def _untail(code: int) -> tuple[int, int, int, bool]:
    v = -1 - code
    return v >> 29, (v >> 8) & 0xFFFFF, v & 0xFF, bool(v >> 28 & 1)


@dataclass
class Indexing:
    """extend()'s state for a sequence being indexed: its id and the nodes of the substrings ending at its
    last token that occur elsewhere too (shortest first; see SuffixIndex)."""

    seq: int
    walkers: list[int] = field(default_factory=list)


class SuffixIndex(_Drafting):
    """The trie of every substring of up to max_depth tokens, path-compressed where a substring occurs once.

    A substring seen once has a path of count-1 nodes down to max_depth whose tokens are just the rest of
    the one sequence it occurs in, and most substrings of served text are seen once. So the first node of
    such a path (a head) keeps, in place of children, a code naming the sequence and the position its
    path continues from (`_tail`); the index keeps the sequences it holds. Adding a token then updates
    only the substrings ending there that occur elsewhere too (`Indexing.walkers`, a few on prose) and
    makes one head for each that just became unique, instead of max_depth node updates; the nodes below a
    head are materialised (the head's tail pushed one node down) only when a second occurrence walks
    into them. Removing a sequence walks it again with -1, frees a path whose count reaches 0, and turns
    a path left with one occurrence back into a head with a tail where it can (`_collapse`).
    Counts, matches and drafts are those of the plain trie; num_nodes counts the nodes kept."""

    def __init__(self, max_depth: int = 24) -> None:
        if not 2 <= max_depth < 256:
            raise ValueError(f"max_depth must be in [2, 255], got {max_depth}")
        self.max_depth = max_depth
        self.trie = _Trie()
        self.root = 0
        self.num_nodes = 0
        self.seqs: dict[int, list[int]] = {}    # the sequences indexed, by id (tails point into them)
        self._next_seq = 0
        self._open: int | None = None           # the one sequence extend() may still grow

    # ---- building -------------------------------------------------------------------------------
    def add(self, tokens: list[int]) -> int:
        """Index a whole sequence; returns its id (for remove)."""
        return self.extend(tokens).seq

    def extend(self, tokens: list[int], state: Indexing | None = None) -> Indexing:
        """Append tokens to the sequence being indexed; pass back what the previous call returned (None
        starts a new sequence). Only the sequence started last may grow, and only until a remove():
        tails and marks may point at its end. extend(a) then extend(b, state) indexes what add(a + b)
        does."""
        if state is None:
            state = Indexing(self._next_seq)
            self._next_seq += 1
            self.seqs[state.seq] = []
            self._open = state.seq
        elif state.seq != self._open:
            raise ValueError(f"sequence {state.seq} is closed: only the one started last may grow")
        if len(self.seqs[state.seq]) + len(tokens) >= 1 << 20:
            raise ValueError("a sequence of 2**20 tokens or more cannot be indexed")
        state.walkers = self._add_walk(state.seq, tokens, state.walkers)
        return state

    def _add_walk(self, seq_id: int, tokens: list[int], walkers: list[int]) -> list[int]:
        """Inlined: it runs for every served token."""
        keep, trie, created = self.max_depth - 1, self.trie, 0
        count, kids, new = trie.count, trie.kids, trie.new
        seq = self.seqs[seq_id]
        for token in tokens:
            seq.append(token)
            after = len(seq)            # where a substring ending at this token continues
            stepped = []
            # walkers: nodes at depth 1, 2, ... (met twice at least: they hold no tail, at most a mark)
            for depth, parent in enumerate((self.root, *walkers[:keep])):
                below = kids[parent]
                if below is None or type(below) is int and below < 0:
                    node, below = -1, None      # nothing below, or a mark (see _push)
                elif type(below) is int:
                    node = below % SHIFT if below // SHIFT == token else -1
                else:
                    node = below.get(token, -1)
                if node < 0:
                    # first time this substring occurs: a head whose path is the rest of this sequence
                    node = new()
                    count[node] = 1
                    kids[node] = _tail(seq_id, after, depth + 1)
                    created += 1
                    if below is None:
                        kids[parent] = token * SHIFT + node
                    elif type(below) is int:
                        kids[parent] = {below // SHIFT: below % SHIFT, token: node}
                    else:
                        below[token] = node
                    continue
                count[node] += 1
                below = kids[node]
                if type(below) is int and below < 0:
                    created += self._push(node, below, seq_id, after)
                stepped.append(node)
            walkers = stepped
        self.num_nodes += created
        return walkers

    def _push(self, node: int, code: int, seq_id: int, after: int) -> int:
        """`node`, which held a tail or a mark, is met again (by sequence seq_id, continuing at `after`):
        the tail's first node becomes a node (a head with the rest of the tail). Returns the nodes made.
        Where nothing is below (max_depth, or the tail's sequence ended there) the node keeps a mark of
        where its newest occurrence ends: what lets a path left with one occurrence fold back into a tail
        (`_collapse`; requests are evicted oldest first)."""
        ref, start, depth, mark = _untail(code)
        seq = self.seqs.get(ref, ()) if depth < self.max_depth and not mark else ()
        if start >= len(seq):
            # Nothing below (max_depth, or its sequence ended there): a mark of where the newest
            # occurrence ends. A walker going on from the node replaces it with children.
            self.trie.kids[node] = _tail(seq_id, after, depth, mark=True)
            return 0
        child = self.trie.new()
        self.trie.count[child] = 1
        self.trie.kids[child] = _tail(ref, start + 1, depth + 1)
        self.trie.kids[node] = seq[start] * SHIFT + child
        return 1

    def remove(self, seq_id: int) -> None:
        """Undo add() of the sequence with this id: counts come back to what they were without it; paths
        left with one occurrence become heads again where their occurrence's position is known. A walker
        stops at a tail: a node holding one is met once, by this walk, and the tail is its own."""
        seq = self.seqs[seq_id]
        # The sequence being extended ends here: its walkers may stand on nodes a fold frees.
        self._open = None
        trie, keep = self.trie, self.max_depth - 1
        count = trie.count
        walkers: list[int] = []
        single: list[tuple[int, int, int]] = []   # (parent, node, depth) of nodes left at count 1
        for token in seq:
            stepped = []
            for depth, parent in enumerate((self.root, *walkers[:keep])):
                node = trie.child(parent, token)
                if node < 0:
                    continue    # below a tail, or past where the path was cut: nothing more is counted
                count[node] -= 1
                if count[node] == 0:
                    # Unlinked now; the walk goes on through it (its entries stay until its id is reused),
                    # since this sequence's other occurrences below it are counted off later.
                    trie.drop_child(parent, token)
                    self.num_nodes -= 1
                elif count[node] == 1:
                    single.append((parent, node, depth + 1))
                stepped.append(node)
            walkers = stepped
        del self.seqs[seq_id]
        for parent, node, depth in single:
            if count[node] == 1 and (parent == self.root or count[parent] >= 2):
                self.num_nodes -= self._collapse(node, depth)

    def _free_below(self, node: int) -> int:
        """Free the nodes below `node` (a path: one occurrence has one continuation); returns how many."""
        trie, freed = self.trie, 0
        trie.count[node] = 0
        below = trie.kids[node]
        while type(below) is int and below >= 0:
            child = below % SHIFT
            trie.kids[node] = None
            trie.free.append(child)
            trie.count[child] = 0
            freed += 1
            node, below = child, trie.kids[child]
        trie.kids[node] = None
        return freed

    def _collapse(self, head: int, depth: int) -> int:
        """`head` (count 1, its parent met more often) keeps a path of count-1 nodes: fold it into a tail
        when its end names the occurrence's sequence. Returns the nodes freed."""
        trie, node, steps = self.trie, head, 0
        below = trie.kids[head]
        while type(below) is int and below >= 0:
            node = below % SHIFT
            below = trie.kids[node]
            steps += 1
        if steps == 0 or type(below) is not int:
            return 0      # nothing to fold, or a path that ends without a tail (its end was met twice)
        seq_id, start, _, _ = _untail(below)
        if seq_id not in self.seqs:
            return 0      # the tail named an occurrence removed since (removals out of order)
        freed = self._free_below(head)
        trie.count[head] = 1
        trie.kids[head] = _tail(seq_id, start - steps, depth)
        return freed

    # ---- drafting -------------------------------------------------------------------------------
    def _step(self, node: int, off: int, token: int) -> tuple[int, int]:
        """From position (node, off) (off > 0: that many tokens into node's tail) along token (-1: none)."""
        below = self.trie.kids[node]
        if type(below) is int and below < 0:
            seq_id, start, depth, mark = _untail(below)
            seq, i = self._tail_seq(seq_id, depth + off, mark), start + off
            return (node, off + 1) if i < len(seq) and seq[i] == token else (-1, 0)
        return self.trie.child(node, token), 0

    def _children(self, pos: tuple[int, int]) -> list[tuple[int, tuple[int, int], int]]:
        """(token, position, count) below a position, most frequent first (ties: smaller token first)."""
        node, off = pos
        below = self.trie.kids[node]
        if type(below) is int and below < 0:
            seq_id, start, depth, mark = _untail(below)
            seq, i = self._tail_seq(seq_id, depth + off, mark), start + off
            return [(seq[i], (node, off + 1), 1)] if i < len(seq) else []
        count = self.trie.count
        return [(t, (c, 0), count[c]) for t, c in self.trie.children(node)]

    def _tail_seq(self, seq_id: int, depth: int, mark: bool) -> list[int] | tuple:
        """The tokens a tail reads from at `depth`: none for a mark or at max_depth."""
        return () if mark or depth >= self.max_depth else self.seqs.get(seq_id, ())

    def count(self, pattern: list[int]) -> int:
        """Occurrences of `pattern` in the indexed sequences (0 when absent or longer than max_depth)."""
        node, off = self.root, 0
        for token in pattern:
            node, off = self._step(node, off, token)
            if node < 0:
                return 0
        return 1 if off else self.trie.count[node]

    def match(self, context: list[int], max_match: int,
              min_match: int = 1) -> tuple[tuple[int, int] | None, int]:
        """Position of the longest suffix of context (min_match..max_match tokens) that has a continuation."""
        longest = min(max_match, len(context), self.max_depth - 1)
        found: list[tuple[int, int]] = []
        for k in range(1, longest + 1):
            node, off = self.root, 0
            for token in context[len(context) - k:]:
                node, off = self._step(node, off, token)
                if node < 0:
                    break
            if node < 0:
                break  # a longer suffix contains this one, so it cannot be in the trie either
            found.append((node, off))
        for k in range(len(found), min_match - 1, -1):
            if self._children(found[k - 1]):
                return found[k - 1], k
        return None, 0

    def _below_match(self, context: list[int], depth: int, max_match: int, min_match: int):
        pos, matched = self.match(context, max_match, min_match)
        return self._children, pos, matched


def _grow(children, node, matched: int, depth: int, max_depth: int, width: int,
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
    for tok, child, p in _ranked(children, node, width, 1.0):
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
            for t, c, p in _ranked(children, child, width, -neg_p):
                heapq.heappush(heap, (-p, order := order + 1, t, c, here, level + 1))
    return out


def _ranked(children, node, width: int, path_p: float) -> list[tuple[int, object, float]]:
    kids = children(node)
    total = sum(c for _, _, c in kids)
    return [(t, pos, path_p * c / total) for t, pos, c in kids[:width]] if total else []


class ContextIndex(_Drafting):
    """What a SuffixIndex over one growing sequence (a request's own prompt and output) drafts, built
    lazily. Appending a token only records its position; a draft finds the longest suffix of the context
    that occurred earlier with a continuation (through the positions of its last token), and counts the
    continuations of those occurrences into a small trie, which is exactly the SuffixIndex's subtree
    below that match. A SuffixIndex pays max_depth node updates per token instead (about 18 new nodes:
    most substrings of a sequence are unique), paid even in a batch that drafts nothing.

    A match reads only the newest `max_occurrences` occurrences of the context's last token, so a draft
    costs at most max_occurrences × max_match comparisons however long the request and however often it
    repeats a token (a run of one token, blank lines, indentation: unbounded, every occurrence matched and
    counted, it cost a batch of 8 about 1 ms per request per step at 300 tokens). With fewer occurrences
    than that the draft is exactly the SuffixIndex's; beyond, it is the SuffixIndex's over those newest
    occurrences: the request's recent text, which is also what its next tokens most resemble."""

    def __init__(self, max_depth: int = 24, max_occurrences: int = 64) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}   # token -> its positions in self.tokens

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.where.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def match(self, context: list[int], max_match: int, min_match: int = 1) -> tuple[list[int], int]:
        """Ends of the earlier occurrences of the longest suffix of context (min_match..max_match tokens)
        that is followed by a token, and its length; ([], 0) when there is none. Only the newest
        max_occurrences occurrences of context[-1] are read."""
        seq, n = self.tokens, len(self.tokens)
        longest = min(max_match, len(context), self.max_depth - 1)
        if longest < 1:
            return [], 0
        best, ends, whole = 0, [], context[len(context) - longest:]
        for end in self.where.get(context[-1], ())[-self.max_occurrences:]:
            if end + 1 >= n:
                continue  # nothing follows this occurrence
            if end + 1 >= longest and seq[end + 1 - longest : end + 1] == whole:
                m = longest     # the whole suffix, compared at once (repetitive text matches it often)
            else:
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
        trie, span, seq = _Trie(), min(depth, self.max_depth - matched), self.tokens
        # equal continuations walk the trie once, with their number: repetitive text has few distinct ones
        for continuation, times in Counter(tuple(seq[end + 1 : end + 1 + span]) for end in ends).items():
            node = 0
            for token in continuation:
                below = trie.child(node, token)
                node = below if below >= 0 else trie.add_child(node, token)
                trie.count[node] += times
        return trie.ranked, 0, matched
