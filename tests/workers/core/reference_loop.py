"""A readable reference loop for speculative decoding (gpt-fast style), used only by tests.

No KV cache: every call recomputes the logits of the whole sequence, so the loop shows the algorithm
and nothing else: the tests check the verifiers against it. The step the engine and the router run
(workers/engine/step.py) does the same with caches, batching and rollback.

    target_logits_fn(tokens: list[int]) -> logits [len(tokens), vocab]   (row i predicts token i+1)
    draft_logits_fn(tokens: list[int])  -> logits [len(tokens), vocab]

One step: the drafter proposes gamma tokens (or a token tree), the target scores all of them in one
call, and the verifier keeps the accepted drafts plus one recovered or bonus token.
"""

from collections.abc import Callable

import torch

from specd.workers.core.sampling import (
    SamplingParams,
    logits_to_probs,
    make_generator,
    params_to_tensors,
    sample,
)
from specd.workers.core.tree import TokenTree
from specd.workers.core.verify_chain import verify_chain
from specd.workers.core.verify_tree import verify_tree

LogitsFn = Callable[[list[int]], torch.Tensor]


def speculative_generate(
    target_logits_fn: LogitsFn,
    draft_logits_fn: LogitsFn,
    prompt: list[int],
    max_new_tokens: int,
    gamma: int,
    params: SamplingParams,
    tree_width: int = 1,
) -> tuple[list[int], dict]:
    """Generate max_new_tokens after prompt; tree_width > 1 drafts a tree instead of a chain.

    Returns the new tokens and step statistics: steps, drafted, accepted, bonus, recovered,
    acceptance_rate (accepted / drafted), tokens_per_step ((accepted + recovered + bonus) / steps),
    accepted_histogram (steps by number of accepted drafts, 0..gamma).
    """
    params.validate()
    if gamma < 0 or tree_width < 1:
        raise ValueError(f"need gamma >= 0 and tree_width >= 1, got gamma={gamma}, tree_width={tree_width}")
    generator = make_generator(params.seed)
    settings = params_to_tensors([params], device="cpu")

    def probs_of(logits: torch.Tensor) -> torch.Tensor:  # [len, vocab] -> [len, vocab]
        return logits_to_probs(logits[None], *settings)[0]

    tokens = list(prompt)
    new_tokens: list[int] = []
    stats = {
        "steps": 0,
        "drafted": 0,
        "accepted": 0,
        "bonus": 0,
        "recovered": 0,
        "accepted_histogram": [0] * (gamma + 1),
    }
    while len(new_tokens) < max_new_tokens:
        if tree_width == 1:
            emitted, num_drafted, num_accepted, is_bonus = _chain_step(
                target_logits_fn, draft_logits_fn, probs_of, tokens, gamma, generator
            )
        else:
            emitted, num_drafted, num_accepted, is_bonus = _tree_step(
                target_logits_fn, draft_logits_fn, probs_of, tokens, gamma, tree_width, params, generator
            )
        tokens += emitted
        new_tokens += emitted
        stats["steps"] += 1
        stats["drafted"] += num_drafted
        stats["accepted"] += num_accepted
        stats["bonus" if is_bonus else "recovered"] += 1
        stats["accepted_histogram"][num_accepted] += 1
    stats["acceptance_rate"] = stats["accepted"] / max(stats["drafted"], 1)
    stats["tokens_per_step"] = (stats["accepted"] + stats["steps"]) / max(stats["steps"], 1)
    return new_tokens[:max_new_tokens], stats


def _draft_chain(
    draft_logits_fn, probs_of, context, length, generator
) -> tuple[list[int], list[torch.Tensor]]:
    """Sample `length` tokens from the drafter after context; also return each q [vocab] used."""
    drafts, q_rows = [], []
    for _ in range(length):
        q = probs_of(draft_logits_fn(context + drafts)[-1:])[0]  # [vocab]
        drafts.append(int(sample(q[None], [generator])[0]))
        q_rows.append(q)
    return drafts, q_rows


def _chain_step(target_logits_fn, draft_logits_fn, probs_of, tokens, gamma, generator):
    drafts, q_rows = _draft_chain(draft_logits_fn, probs_of, tokens, gamma, generator)
    # p for each draft position and one more for the bonus: rows len(tokens)-1 .. len(tokens)-1+gamma.
    p = probs_of(target_logits_fn(tokens + drafts)[len(tokens) - 1 :])  # [gamma + 1, vocab]
    q = torch.stack(q_rows) if q_rows else p.new_zeros(0, p.shape[-1])  # [gamma, vocab]
    out = verify_chain(
        draft_tokens=torch.tensor([drafts], dtype=torch.long, device=p.device).reshape(1, gamma),
        num_drafted=torch.tensor([gamma], device=p.device),
        draft_probs=q[None],
        target_probs=p[None],
        generators=[generator],
    )
    return out.emitted(0), gamma, int(out.num_accepted[0]), bool(out.is_bonus[0])


def _tree_step(target_logits_fn, draft_logits_fn, probs_of, tokens, gamma, width, params, generator):
    """Tree: `width` children of the root, each continued by a chain, gamma levels deep.

    Greedy: the root's children are the drafter's top-`width` tokens (distinct, one-hot q).
    Sampled: they are i.i.d. from q, so their q row is q itself; a repeated token stays a separate node.
    """
    root_logits = draft_logits_fn(tokens)[-1:]  # [1, vocab]
    q_root = probs_of(root_logits)[0]
    if params.is_greedy:
        first = root_logits[0].topk(min(width, root_logits.shape[-1])).indices.tolist()
    else:
        first = [int(sample(q_root[None], [generator])[0]) for _ in range(width)]
    width = len(first)
    branches = []  # per branch: (tokens along it, q each token was drafted from)
    for token in first:
        rest, q_rest = _draft_chain(draft_logits_fn, probs_of, tokens + [token], gamma - 1, generator)
        branches.append(([token, *rest], [q_root, *q_rest]))

    # Breadth-first numbering: branch w at depth d (1-based) is node 1 + (d - 1) * width + w.
    n = 1 + gamma * width
    node_tokens, parents = [tokens[-1]] + [0] * (n - 1), [-1] + [0] * (n - 1)
    vocab = q_root.shape[-1]
    like = dict(dtype=q_root.dtype, device=q_root.device)
    q_nodes = torch.zeros(n, vocab, **like)  # [n, vocab] q each node was drafted from
    p_nodes = torch.zeros(n, vocab, **like)  # [n, vocab] target p after each node
    for w, (path, q_path) in enumerate(branches):
        # One target call per branch scores the root and every node on it (the engine uses one tree
        # forward with TokenTree.attention_mask instead).
        p_path = probs_of(target_logits_fn(tokens + path)[len(tokens) - 1 :])  # [gamma + 1, vocab]
        p_nodes[0] = p_path[0]
        for d in range(1, gamma + 1):
            node = 1 + (d - 1) * width + w
            node_tokens[node] = path[d - 1]
            parents[node] = 0 if d == 1 else node - width
            q_nodes[node] = q_path[d - 1]
            p_nodes[node] = p_path[d]
    tree = TokenTree(tokens=node_tokens, parents=parents)
    # Greedy drafts are deterministic: one-hot q for every child (None), which also covers top-k children.
    out = verify_tree(tree, None if params.is_greedy else q_nodes, p_nodes, generator)
    return out.output_tokens, n - 1, len(out.accepted_nodes), out.is_bonus
