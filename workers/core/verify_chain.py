"""Chain verification: accept a prefix of each request's drafted tokens, then emit one more token.

Glossary (docs/architecture.md, "Glossary"):
- drafted: the gamma tokens x_1..x_gamma the drafter proposed, x_i ~ q_i.
- accepted: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), left to right, until the first
  rejection.
- recovered: at the first rejection (position j) one token is sampled from norm(max(0, p_j - q_j)).
- bonus: when all gamma drafts are accepted, one token is sampled from p_{gamma+1}.
Each step emits accepted + 1 tokens, and the emitted tokens are exactly distributed as the target p
(Leviathan et al. 2023, Chen et al. 2023).

Greedy needs no separate path: greedy rows have one-hot p (see sampling.logits_to_probs), so the
accept probability is 1 when the draft equals argmax p and 0 otherwise, and the recovered token is
argmax p. The accept test `u * q < p` with u in [0, 1) is then decided without looking at u.

The batch holds requests with different draft lengths: draft_tokens is padded to gamma_max and
num_drafted says how many are real. Padded positions are never accepted, and the bonus of a request
comes from p at its own position num_drafted, not at gamma_max.
"""

from dataclasses import dataclass

import torch

from specd.workers.core.sampling import exponential_noise, sample_with_noise, uniform_noise


@dataclass
class ChainVerifyOutput:
    # [batch, gamma_max + 1] emitted tokens padded with -1: accepted drafts, then one recovered or bonus token
    output_tokens: torch.Tensor
    num_accepted: torch.Tensor  # [batch] long
    is_bonus: torch.Tensor  # [batch] bool: last token is a bonus (all drafts accepted), else recovered

    def emitted(self, row: int) -> list[int]:
        """The tokens row emitted this step (accepted + 1 of them)."""
        return self.output_tokens[row, : int(self.num_accepted[row]) + 1].tolist()

    def to_host(self) -> tuple[list[int], list[bool], list[list[int]]]:
        """(num_accepted, is_bonus, output_tokens) as host lists, in one device-to-host read for the whole
        batch: each read is a GPU synchronisation, and a step should make one."""
        packed = torch.cat([self.num_accepted[:, None], self.is_bonus[:, None].long(), self.output_tokens],
                           dim=1).tolist()                                   # [batch, 2 + gamma_max + 1]
        return [r[0] for r in packed], [bool(r[1]) for r in packed], [r[2:] for r in packed]


def residual_weights(
    p: torch.Tensor,  # [batch, vocab]
    q: torch.Tensor,  # [batch, vocab]
) -> torch.Tensor:  # [batch, vocab], unnormalised
    """max(0, p - q): what p still owes after q's proposal was rejected.

    It sums to zero only when p == q, where a rejection has probability zero; rounding can still get
    there, and then p itself is the right distribution.
    """
    residual = (p - q).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def verify_chain(
    draft_tokens: torch.Tensor,  # [batch, gamma_max] long, padded (any value) after num_drafted
    num_drafted: torch.Tensor,  # [batch] long, 0 <= num_drafted <= gamma_max
    draft_probs: torch.Tensor | None,  # q [batch, gamma_max, vocab]; None = one-hot on each draft token
    target_probs: torch.Tensor,  # p [batch, gamma_max + 1, vocab], already through logits_to_probs
    generators: list[torch.Generator | None],  # one per row; None = torch's default generator
    greedy: list[bool] | None = None,  # rows whose p is one-hot (temperature 0): they draw no randomness
    host_drafted: list[int] | None = None,  # num_drafted as the caller has it on the host: no device read
) -> ChainVerifyOutput:
    batch, gamma_max = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    positions = torch.arange(gamma_max, device=device)  # [gamma_max]
    is_real = positions[None, :] < num_drafted[:, None]  # [batch, gamma_max]
    safe_drafts = torch.where(is_real, draft_tokens, torch.zeros_like(draft_tokens))

    # p(x_i) and q(x_i) of each drafted token.
    p_draft = target_probs[:, :gamma_max].gather(-1, safe_drafts[..., None])[..., 0]  # [batch, gamma_max]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, safe_drafts[..., None])[..., 0]  # [batch, gamma_max]

    # Accept x_i with probability min(1, p/q): u < p/q, written without the division so that q = 0 and
    # one-hot rows need no special case. Randomness per row: num_drafted uniforms, then vocab
    # exponentials, whatever the outcome.
    counts = num_drafted.tolist() if host_drafted is None else host_drafted
    u = uniform_noise(generators, counts, gamma_max, device, greedy)  # [batch, gamma_max]
    accepted = (u * q_draft < p_draft) & is_real
    # The number accepted is the length of the leading run of True.
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    is_bonus = num_accepted == num_drafted

    # The last emitted token: bonus from p at position num_drafted, or recovered from
    # norm(max(0, p - q)) at the first rejected position. Both live at position num_accepted.
    if gamma_max == 0:
        # Nothing drafted (plain decoding steps): every row's token is a bonus from p at position 0; no
        # residual to build over the vocabulary.
        weights = target_probs[:, 0]  # [batch, vocab]
    else:
        p_last = target_probs[rows, num_accepted]  # [batch, vocab]
        last_draft_pos = num_accepted.clamp(max=gamma_max - 1)
        if draft_probs is None:
            rejected_token = safe_drafts[rows, last_draft_pos]
            q_last = torch.zeros_like(p_last).scatter(-1, rejected_token[:, None], 1.0)
        else:
            q_last = draft_probs[rows, last_draft_pos].to(p_last.dtype)
        recover_from = residual_weights(p_last, q_last)
        weights = torch.where(is_bonus[:, None], p_last, recover_from)
    last_token = sample_with_noise(weights, exponential_noise(generators, vocab, device, greedy))  # [batch]

    output_tokens = torch.full((batch, gamma_max + 1), -1, dtype=torch.long, device=device)
    keep = positions[None, :] < num_accepted[:, None]
    output_tokens[:, :gamma_max] = torch.where(keep, safe_drafts, output_tokens[:, :gamma_max])
    output_tokens[rows, num_accepted] = last_token
    return ChainVerifyOutput(output_tokens=output_tokens, num_accepted=num_accepted, is_bonus=is_bonus)

