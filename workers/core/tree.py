"""Token trees: several candidate continuations sharing prefixes, verified in one target forward.

Node 0 is the root: the last committed token, whose KV is not cached yet, so the target forward over
the flattened tree yields p for the root (the distribution of the first draft) and for every draft.
Nodes 1.. are drafted tokens; parents[i] < i, so the flattened order is topological and a node's
ancestors always precede it.

The target sees the flattened nodes as one sequence with
- attention_mask()[i, j] = True when node j is node i itself or one of its ancestors (node i must see
  only its own path, never a sibling branch), to be placed after the committed context, which every
  node sees;
- position_ids(start)[i] = start + depth(i): siblings share a position, as if each path were the
  only continuation.
"""

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)  # tensors have no single truth value, so compare trees by identity
class TokenTree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, parents[0] == -1, parents[i] < i
    _children: list[list[int]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A tree's structure is host-side bookkeeping (lists in, .tolist() out); tensors given keep
        # their device.
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long, device=_device_of(self.tokens))
        self.parents = torch.as_tensor(self.parents, dtype=torch.long, device=_device_of(self.parents))
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or n == 0 or self.parents.shape != (n,):
            raise ValueError(
                f"tokens and parents must be 1-d of the same length >= 1, got "
                f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            )
        parents = self.parents.tolist()
        if parents[0] != -1:
            raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parents[0]}")
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ValueError(f"parents[{i}] must be in [0, {i}) (topological order), got {parents[i]}")
        self._children = [[] for _ in range(n)]
        for i in range(1, n):
            self._children[parents[i]].append(i)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def children(self, i: int) -> list[int]:
        """Children of node i in insertion (draft) order: the order the verifier tries them."""
        return list(self._children[i])

    def depth(self) -> torch.Tensor:  # [n] long, root = 0
        depth = [0] * len(self)
        for i, parent in enumerate(self.parents.tolist()[1:], start=1):
            depth[i] = depth[parent] + 1
        return torch.tensor(depth, dtype=torch.long, device=self.tokens.device)

    def attention_mask(self) -> torch.Tensor:  # [n, n] bool, [i, j] = j is i or an ancestor of i
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.tokens.device)
        mask[0, 0] = True
        for i, parent in enumerate(self.parents.tolist()[1:], start=1):
            mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def position_ids(self, start: int) -> torch.Tensor:  # [n] long; start = position of the root
        return start + self.depth()

    def num_drafted(self) -> int:
        return len(self) - 1

    @staticmethod
    def chain(root_token: int, draft_tokens: list[int]) -> "TokenTree":
        """A chain is the tree where every node has at most one child."""
        n = 1 + len(draft_tokens)
        return TokenTree(tokens=[root_token, *draft_tokens], parents=list(range(-1, n - 1)))

    @staticmethod
    def from_paths(root_token: int, paths: list[list[int]]) -> "TokenTree":
        """The tree holding each path (tokens after the root); shared prefixes become shared nodes.

        Nodes are numbered breadth-first; siblings keep the order in which they first appear in paths.
        Identical sibling tokens are merged, so only use this for children that are distinct by
        construction (top-k, sampled without replacement, n-gram candidates): i.i.d. samples may
        repeat a token, and merging repeats changes what the verifier tries (see verify_tree).
        """
        # A trie first: node -> {token: child}, dicts keep insertion order.
        trie: list[dict[int, int]] = [{}]
        trie_tokens = [root_token]
        for path in paths:
            node = 0
            for token in path:
                if token not in trie[node]:
                    trie[node][token] = len(trie)
                    trie.append({})
                    trie_tokens.append(token)
                node = trie[node][token]
        # Then breadth-first numbering.
        tokens, parents = [root_token], [-1]
        queue = deque([(0, 0)])  # (trie node, tree index)
        while queue:
            trie_node, index = queue.popleft()
            for child in trie[trie_node].values():
                queue.append((child, len(tokens)))
                tokens.append(trie_tokens[child])
                parents.append(index)
        return TokenTree(tokens=tokens, parents=parents)

    def node_of(self, path: list[int]) -> int:
        """The node reached by following path (tokens after the root); the first matching child wins."""
        node = 0
        for token in path:
            matches = [c for c in self._children[node] if int(self.tokens[c]) == token]
            if not matches:
                raise KeyError(f"path {path} is not in the tree")
            node = matches[0]
        return node


def _device_of(data) -> torch.device:
    return data.device if isinstance(data, torch.Tensor) else torch.device("cpu")


def pad_trees(trees: list[TokenTree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees of different sizes as padded tensors for batched verification:
    tokens [batch, n_max] (pad 0), parents [batch, n_max] (pad -1), num_nodes [batch]."""
    n_max = max(len(t) for t in trees)
    device = trees[0].tokens.device
    tokens = torch.zeros(len(trees), n_max, dtype=torch.long, device=device)
    parents = torch.full((len(trees), n_max), -1, dtype=torch.long, device=device)
    for b, tree in enumerate(trees):
        tokens[b, : len(tree)] = tree.tokens
        parents[b, : len(tree)] = tree.parents
    num_nodes = torch.tensor([len(t) for t in trees], dtype=torch.long, device=device)
    return tokens, parents, num_nodes
