"""Toy language models whose exact distributions over whole continuations are computable.

Next-token logits are a fixed random table indexed by the last `context` tokens, over a small
vocabulary, so the probability of every continuation of length L (V**L of them) can be enumerated
under the same logits processing the verifier sees.
"""

import itertools
from contextlib import contextmanager
from unittest import mock

import torch

from specd.workers.core.sampling import SamplingParams, logits_to_probs, params_to_tensors


class ToyLM:
    def __init__(self, vocab: int, seed: int, scale: float = 1.5, context: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.context = context
        self.table = torch.randn((vocab,) * context + (vocab,), generator=g, dtype=torch.float64) * scale

    def next_logits(self, last: torch.Tensor) -> torch.Tensor:  # [..., context] long -> [..., vocab]
        return self.table[tuple(last[..., i] for i in range(self.context))]

    def logits_fn(self, tokens: list[int]) -> torch.Tensor:  # [len, vocab]; row i predicts token i + 1
        padded = torch.tensor([0] * (self.context - 1) + list(tokens), dtype=torch.long)
        windows = padded.unfold(0, self.context, 1)  # [len, context]
        return self.next_logits(windows)

    def probs(self, last: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Processed next-token distributions for a batch of contexts: [batch, context] -> [batch, vocab]."""
        temperature, top_k, top_p = params_to_tensors([params], device="cpu")  # [1] each
        batch = last.shape[0]
        settings = (temperature.expand(batch), top_k.expand(batch), top_p.expand(batch))
        return logits_to_probs(self.next_logits(last)[:, None], *settings)[:, 0]


def exact_distribution(model: ToyLM, prompt: list[int], length: int, params: SamplingParams) -> torch.Tensor:
    """Probability of each continuation of `length` tokens, indexed by sum_t x_t * V**t. [V**length]"""
    vocab = model.vocab
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)  # [V^L, L]
    full = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
    prob = torch.ones(seqs.shape[0], dtype=torch.float64)
    for t in range(length):
        pos = len(prompt) + t
        p = model.probs(full[:, pos - model.context : pos], params)  # [V^L, vocab]
        prob *= p.gather(1, full[:, pos : pos + 1])[:, 0]
    return torch.zeros(vocab**length, dtype=torch.float64).index_put_((encode(seqs, vocab),), prob)


def encode(seqs: torch.Tensor, vocab: int) -> torch.Tensor:  # [N, L] -> [N] cell index
    weights = vocab ** torch.arange(seqs.shape[1])
    return (seqs * weights).sum(dim=1)


def greedy_decode(model: ToyLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(model.logits_fn(tokens)[-1].argmax()))
    return tokens[len(prompt) :]


@contextmanager
def residual_skipped():
    """Break verification on purpose (NOT exact): after a rejection, recover from p instead of
    norm(max(0, p - q)), in chains and trees. Tests use it to show they can fail."""
    def p_only(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p

    with mock.patch("specd.workers.core.verify_chain.residual_weights", p_only), \
            mock.patch("specd.workers.core.verify_tree.residual_weights", p_only):
        yield


def path_to(tree, i: int) -> list[int]:
    """Node indices of a TokenTree from the root (0) down to node i, both included."""
    parents = tree.parents.tolist()
    path = [i]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]
