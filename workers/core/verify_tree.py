"""Tree verification: walk down a token tree, accepting at most one child per node.

Multi-step speculative sampling (SpecInfer, Miao et al. 2024). Start at the root with p = p(root).
At the current node, try its children one after another:
- child c with token x, drafted from q_c, is accepted with probability min(1, p(x) / q_c(x));
  then move to c, set p = p(c), and repeat;
- after each rejection replace p by norm(max(0, p - q_c)) and try the next child;
- when no child is accepted, emit one token sampled from the current p: recovered when the node had
  children, bonus when the node is a leaf (every draft on the path was accepted).
A step emits the accepted path plus that one token, exactly distributed as the target p.

Why it is exact, and what child_draft_probs must hold: by induction over the children tried at a node,
the token finally emitted at that node is distributed as the current p, as long as child c's token was
drafted from q_c *given the siblings tried before it*. The residual after a rejection does not depend
on which token was rejected, only on p and q_c, so the argument goes through when q_c depends on the
earlier siblings. Hence, for each node i > 0, row i of child_draft_probs is:
- children sampled i.i.d. from the parent's drafter distribution q: q itself (repeated tokens are fine,
  they are tried again as separate nodes; do not merge them);
- children sampled without replacement: q with the earlier siblings' tokens removed, renormalised;
- deterministic children (drafter top-k, n-gram, greedy drafter): one-hot on the child's token.
Children are tried in their stored order. Sampled children are already in random order, and
deterministic children are exact in any order (their q does not depend on the order), so the verifier
does not shuffle: shuffling would break the conditional q of children sampled without replacement.

Greedy trees need no separate path: with one-hot p the rule accepts the child equal to argmax p
(if any) and otherwise emits argmax p, whatever the random numbers.

The batched walk below moves all rows down one level per iteration; rows may hold trees of different
shapes, padded to n_max nodes. Randomness per row: one uniform per real node (child c uses u[c]), then
vocab exponentials, whatever the outcome, so a seeded row is reproducible in any batch.
"""

from dataclasses import dataclass

import torch

from specd.workers.core.sampling import (
    exponential_noise,
    host_reads_are_cheap,
    sample_with_noise,
    uniform_noise,
)
from specd.workers.core.tree import TokenTree, pad_trees
from specd.workers.core.verify_chain import residual_weights


@dataclass
class TreeVerifyOutput:
    accepted_nodes: list[int]  # node indices along the accepted path, excluding the root
    output_tokens: list[int]  # accepted draft tokens then the recovered/bonus token
    is_bonus: bool


@dataclass
class TreeBatchVerifyOutput:
    accepted_nodes: torch.Tensor  # [batch, max_depth] long, -1 padded
    output_tokens: torch.Tensor  # [batch, max_depth + 1] long, -1 padded: accepted tokens, then one more
    num_accepted: torch.Tensor  # [batch] long
    is_bonus: torch.Tensor  # [batch] bool

    def rows(self) -> list[TreeVerifyOutput]:
        """Every row, read from the device in one copy (on a GPU each read is a synchronisation)."""
        depth = self.accepted_nodes.shape[1]
        packed = torch.cat([self.accepted_nodes, self.output_tokens, self.num_accepted[:, None],
                            self.is_bonus[:, None].long()], dim=1).tolist()   # [batch, 2 depth + 3]
        out = []
        for row in packed:
            n = row[-2]
            out.append(TreeVerifyOutput(accepted_nodes=row[:n], output_tokens=row[depth : depth + n + 1],
                                        is_bonus=bool(row[-1])))
        return out


def children_table(
    parents: torch.Tensor,  # [batch, n] long, -1 for the root and for padding
    num_nodes: torch.Tensor,  # [batch] long
) -> torch.Tensor:  # [batch, n, max_children] long: children[b, i, s] = s-th child of node i, or -1
    """On the device parents are on; the walk builds it on the host, where the trees' shapes are known."""
    batch, n = parents.shape
    index = torch.arange(n, device=parents.device)
    is_child = (index[None, :] > 0) & (index[None, :] < num_nodes[:, None])  # [batch, n]
    # A node's slot = how many earlier nodes share its parent, which keeps siblings in stored order.
    same_parent = (parents[:, :, None] == parents[:, None, :]) & is_child[:, :, None] & is_child[:, None, :]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(diagonal=-1)  # [j, k]: k < j
    slot = (same_parent & earlier).sum(dim=-1)  # [batch, n]
    max_children = int(slot[is_child].max()) + 1 if bool(is_child.any()) else 0
    children = torch.full((batch, n, max_children), -1, dtype=torch.long, device=parents.device)
    rows, nodes = is_child.nonzero(as_tuple=True)
    children[rows, parents[rows, nodes], slot[rows, nodes]] = nodes
    return children


def verify_tree_batch(
    tokens: torch.Tensor,  # [batch, n] long, node 0 = root
    parents: torch.Tensor,  # [batch, n] long, parents[:, 0] == -1, parents[b, i] < i for real nodes
    num_nodes: torch.Tensor,  # [batch] long, real nodes per row (the rest is padding)
    child_draft_probs: torch.Tensor | None,  # q_c [batch, n, vocab] per node (see module doc); None = one-hot
    target_probs: torch.Tensor,  # p [batch, n, vocab]: row i = distribution after the path to node i
    generators: list[torch.Generator | None],  # one per row; None = torch's default generator
    greedy: list[bool] | None = None,  # rows whose p is one-hot (temperature 0): they draw no randomness
) -> TreeBatchVerifyOutput:
    batch, n, vocab = target_probs.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    # The trees' shape is planned on the host (a no-op copy when the caller's trees are there already),
    # so no loop bound below is read back from the device.
    host_parents, host_nodes = parents.cpu(), num_nodes.cpu()
    children = children_table(host_parents, host_nodes)  # [batch, n, max_children]
    max_children = children.shape[-1]
    children = children.to(device)
    # Depth of each node bounds the number of levels to walk.
    host_rows = torch.arange(batch)
    depth = torch.zeros(batch, n, dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth[host_rows, host_parents[:, i].clamp_min(0)] + 1
    real = torch.arange(n)[None, :] < host_nodes[:, None]
    max_depth = int(depth[real].max())
    # On the CPU a walk stops as soon as no row has work left; on a GPU reading that back would cost a
    # synchronisation per slot and level, and the remaining iterations change nothing (no row tries a
    # child, none stops), so it runs them.
    early_exit = host_reads_are_cheap(device)
    tokens = tokens.to(device)

    u = uniform_noise(generators, host_nodes.tolist(), n, device, greedy)  # [batch, n]: u[b, c] tests child c
    exp_noise = exponential_noise(generators, vocab, device, greedy)  # [batch, vocab]: samples the last token

    node = torch.zeros(batch, dtype=torch.long, device=device)  # current node of each row
    p = target_probs[:, 0]  # [batch, vocab] current target distribution at the current node
    searching = torch.ones(batch, dtype=torch.bool, device=device)  # rows still walking down
    last_weights = torch.zeros_like(p)  # [batch, vocab] where each row samples its last token
    accepted_nodes = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    is_bonus = torch.zeros(batch, dtype=torch.bool, device=device)

    for level in range(max_depth + 1):
        chosen = torch.full((batch,), -1, dtype=torch.long, device=device)
        for slot in range(max_children):
            child = children[rows, node, slot]  # [batch], -1 when the node has no such child
            trying = searching & (chosen < 0) & (child >= 0)
            if early_exit and not bool(trying.any()):
                break  # slots are filled in order, so no row has a later one either
            safe_child = child.clamp_min(0)
            x = torch.where(trying, tokens[rows, safe_child], 0)  # [batch] drafted token of the child
            if child_draft_probs is None:
                q = torch.zeros_like(p).scatter(-1, x[:, None], 1.0)
            else:
                q = child_draft_probs[rows, safe_child].to(p.dtype)  # [batch, vocab]
            p_x = p.gather(-1, x[:, None])[:, 0]
            q_x = q.gather(-1, x[:, None])[:, 0]
            accept = trying & (u[rows, safe_child] * q_x < p_x)  # probability min(1, p/q)
            chosen = torch.where(accept, child, chosen)
            rejected = trying & ~accept
            residual = residual_weights(p, q)
            residual = residual / residual.sum(dim=-1, keepdim=True)
            p = torch.where(rejected[:, None], residual, p)

        moved = chosen >= 0
        stopping = searching & ~moved
        last_weights = torch.where(stopping[:, None], p, last_weights)
        # Stopping at a leaf means every draft on the path was accepted: the last token is a bonus.
        is_leaf = children[rows, node, 0] < 0 if max_children > 0 else torch.ones_like(stopping)
        is_bonus |= stopping & is_leaf
        if level < max_depth:
            accepted_nodes[:, level] = torch.where(moved, chosen, accepted_nodes[:, level])
        num_accepted += moved.long()
        searching = moved
        node = torch.where(moved, chosen, node)
        p = torch.where(moved[:, None], target_probs[rows, node].to(p.dtype), p)
        if early_exit and not bool(searching.any()):
            break

    last_token = sample_with_noise(last_weights, exp_noise)  # [batch]
    output_tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    path_tokens = tokens.gather(1, accepted_nodes.clamp_min(0))  # [batch, max_depth]
    output_tokens[:, :max_depth] = torch.where(accepted_nodes >= 0, path_tokens, output_tokens[:, :max_depth])
    output_tokens[rows, num_accepted] = last_token
    return TreeBatchVerifyOutput(
        accepted_nodes=accepted_nodes,
        output_tokens=output_tokens,
        num_accepted=num_accepted,
        is_bonus=is_bonus,
    )


def verify_tree(
    tree: TokenTree,
    child_draft_probs: torch.Tensor | None,  # [n, vocab] or None (all children one-hot)
    target_probs: torch.Tensor,  # [n, vocab]
    generator: torch.Generator | None,
) -> TreeVerifyOutput:
    q = None if child_draft_probs is None else child_draft_probs[None]
    out = verify_tree_batch(
        tree.tokens[None], tree.parents[None], torch.tensor([len(tree)]), q, target_probs[None], [generator]
    )
    return out.rows()[0]


def verify_trees(
    trees: list[TokenTree],
    child_draft_probs_list: list[torch.Tensor | None],  # each [n_b, vocab] or None (one-hot)
    target_probs_list: list[torch.Tensor],  # each [n_b, vocab]
    generators: list[torch.Generator | None],
    greedy: list[bool] | None = None,  # rows whose p is one-hot (temperature 0): they draw no randomness
) -> list[TreeVerifyOutput]:
    """A batch of trees of any shapes, padded and verified together."""
    device = target_probs_list[0].device
    tokens, parents, num_nodes = pad_trees(trees)   # on the host, where the trees are built
    batch, n_max = tokens.shape
    vocab = target_probs_list[0].shape[-1]
    target_probs = torch.zeros(batch, n_max, vocab, dtype=target_probs_list[0].dtype, device=device)
    for b, probs in enumerate(target_probs_list):
        target_probs[b, : probs.shape[0]] = probs
    q = None
    if any(c is not None for c in child_draft_probs_list):
        drafted = tokens.to(device, copy=True)
        drafted[:, 0] = 0  # the root was not drafted: its q row is never read
        q = torch.zeros_like(target_probs).scatter(-1, drafted[..., None], 1.0)  # one-hot where None
        for b, probs in enumerate(child_draft_probs_list):
            if probs is not None:
                q[b, : probs.shape[0]] = probs
    out = verify_tree_batch(tokens, parents, num_nodes, q, target_probs, generators, greedy)
    return out.rows()
