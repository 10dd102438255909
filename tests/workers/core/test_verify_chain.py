import torch
from toy import residual_skipped

from specd.workers.core.sampling import make_generator
from specd.workers.core.verify_chain import verify_chain

VOCAB = 6


def one_hot(tokens, vocab=VOCAB):  # [..] -> [.., vocab]
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def greedy_verify(drafts, target_argmax, num_drafted=None, generators=None):
    """One row; p one-hot on target_argmax (len(drafts) + 1), q one-hot on the drafts."""
    gamma = len(drafts)
    return verify_chain(
        draft_tokens=torch.tensor([drafts], dtype=torch.long).reshape(1, gamma),
        num_drafted=torch.tensor([gamma if num_drafted is None else num_drafted]),
        draft_probs=one_hot(drafts)[None].reshape(1, gamma, VOCAB),
        target_probs=one_hot(target_argmax)[None],
        generators=generators or [make_generator(0)],
    )


def test_perfect_match_accepts_all_and_adds_bonus():
    out = greedy_verify([2, 4, 1], [2, 4, 1, 5])
    assert out.output_tokens.tolist() == [[2, 4, 1, 5]]
    assert out.num_accepted.tolist() == [3] and out.is_bonus.tolist() == [True]
    assert out.emitted(0) == [2, 4, 1, 5]


def test_early_mismatch_recovers_target_argmax():
    out = greedy_verify([3, 4, 1], [2, 4, 1, 5])
    assert out.output_tokens.tolist() == [[2, -1, -1, -1]]
    assert out.num_accepted.tolist() == [0] and out.is_bonus.tolist() == [False]


def test_mismatch_in_the_middle():
    out = greedy_verify([2, 4, 1], [2, 4, 0, 5])
    assert out.output_tokens.tolist() == [[2, 4, 0, -1]]
    assert out.num_accepted.tolist() == [2] and out.is_bonus.tolist() == [False]


def test_all_accepted_when_p_equals_q_and_bonus_comes_from_last_position():
    q = torch.softmax(torch.randn(1, 3, VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    p = torch.cat([q, one_hot([[5]])], dim=1)  # [1, 4, vocab]; bonus position is one-hot on 5
    drafts = torch.tensor([[1, 0, 3]])
    for seed in range(20):
        out = verify_chain(drafts, torch.tensor([3]), q, p, [make_generator(seed)])
        assert out.emitted(0) == [1, 0, 3, 5] and bool(out.is_bonus[0])


def test_empty_draft_samples_one_token_from_first_position():
    p = one_hot([[4]])  # [1, 1, vocab]
    out = verify_chain(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), None, p, [None])
    assert out.output_tokens.tolist() == [[4]] and out.num_accepted.tolist() == [0]
    assert out.is_bonus.tolist() == [True]  # no draft was rejected: the token comes from p


def test_rows_with_fewer_drafts_take_bonus_at_their_own_end():
    # gamma_max 3; row 0 has 3 drafts, row 1 one draft, row 2 none. Padding holds -1.
    drafts = torch.tensor([[1, 2, 3], [1, -1, -1], [-1, -1, -1]])
    num_drafted = torch.tensor([3, 1, 0])
    p = torch.stack([one_hot([1, 2, 3, 0]), one_hot([1, 5, 5, 5]), one_hot([4, 5, 5, 5])])
    out = verify_chain(drafts, num_drafted, None, p, [None, None, None])
    assert out.output_tokens.tolist() == [[1, 2, 3, 0], [1, 5, -1, -1], [4, -1, -1, -1]]
    assert out.num_accepted.tolist() == [3, 1, 0] and out.is_bonus.tolist() == [True, True, True]


def test_end_of_sequence_draft_is_accepted_and_truncated_by_the_caller():
    eos = 5
    out = greedy_verify([2, eos, 3], [2, eos, 3, 1])
    assert out.emitted(0) == [2, eos, 3, 1]  # the verifier is token-agnostic


def test_deterministic_drafts_without_q():
    # q = None: each draft is one-hot. p gives the first draft probability 1 and the second 0.
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]]])
    for seed in range(20):
        out = verify_chain(torch.tensor([[1, 0]]), torch.tensor([2]), None, p, [make_generator(seed)])
        assert out.emitted(0) == [1, 2] and not bool(out.is_bonus[0])


def test_recovered_token_comes_from_the_residual():
    # Draft token 2 has p = 0: always rejected. max(0, p - q) = [0.5, 0, 0], so recovered is always 0,
    # while sampling from p itself (the broken variant) also gives 1.
    q = torch.tensor([[[0.0, 0.5, 0.5]]])
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    right, broken = set(), set()
    for seed in range(40):
        right.add(
            verify_chain(torch.tensor([[2]]), torch.tensor([1]), q, p, [make_generator(seed)]).emitted(0)[0]
        )
        with residual_skipped():
            out = verify_chain(torch.tensor([[2]]), torch.tensor([1]), q, p, [make_generator(seed)])
        broken.add(out.emitted(0)[0])
    assert right == {0}
    assert broken == {0, 1}


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    g = torch.Generator().manual_seed(3)
    q_sampled = torch.softmax(torch.randn(2, VOCAB, generator=g), dim=-1)  # [gamma, vocab]
    p_sampled = torch.softmax(torch.randn(3, VOCAB, generator=g), dim=-1)  # [gamma + 1, vocab]
    drafts = torch.tensor([[2, 4], [1, 3]])
    q = torch.stack([one_hot([2, 4]), q_sampled])  # row 0 greedy drafter, row 1 sampled drafter
    p = torch.stack([one_hot([2, 0, 1]), p_sampled])  # row 0 greedy target
    greedy_outputs, sampled_outputs = set(), set()
    for seed in range(60):
        out = verify_chain(
            drafts, torch.tensor([2, 2]), q, p, [make_generator(seed), make_generator(seed + 1)]
        )
        greedy_outputs.add(tuple(out.emitted(0)))
        sampled_outputs.add(tuple(out.emitted(1)))
    assert greedy_outputs == {(2, 0)}  # the generator never changes a greedy row
    assert len(sampled_outputs) > 3


def test_seeded_rows_are_reproducible_whatever_the_batch():
    g = torch.Generator().manual_seed(11)
    q = torch.softmax(torch.randn(4, 3, VOCAB, generator=g), dim=-1)
    p = torch.softmax(torch.randn(4, 4, VOCAB, generator=g), dim=-1)
    drafts = torch.randint(0, VOCAB, (4, 3), generator=g)
    num_drafted = torch.tensor([3, 2, 3, 1])
    first = verify_chain(drafts, num_drafted, q, p, [make_generator(s) for s in (1, 2, 3, 4)])
    again = verify_chain(drafts, num_drafted, q, p, [make_generator(s) for s in (1, 2, 3, 4)])
    assert torch.equal(first.output_tokens, again.output_tokens)
    # Row 1 alone, without the padding columns the larger batch needed, gives the same tokens.
    alone = verify_chain(drafts[1:2, :2], num_drafted[1:2], q[1:2, :2], p[1:2, :3], [make_generator(2)])
    assert alone.emitted(0) == first.emitted(1)
    # Different seeds give different outputs somewhere over a few tries.
    others = {
        tuple(verify_chain(drafts, num_drafted, q, p, [make_generator(s)] * 4).emitted(0)) for s in range(30)
    }
    assert len(others) > 1


def test_a_verified_batch_reaches_the_host_in_one_read(monkeypatch):
    """Greedy and sampled rows of different draft lengths: verification itself reads nothing back (the
    draft counts come from the host), and its outcome comes back in one read. Each read is a GPU
    synchronisation; .item(), .tolist(), .cpu() and .numpy() of any tensor are counted."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, 4, VOCAB, generator=gen), dim=-1)     # [batch, γmax+1, vocab]
    q = torch.softmax(torch.randn(3, 3, VOCAB, generator=gen), dim=-1)     # [batch, γmax, vocab]
    p[0] = one_hot([2, 4, 1, 5])                                            # a greedy row
    drafts = torch.tensor([[2, 4, 0], [1, 3, 5], [0, 0, 0]])
    drafted = [2, 3, 0]
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kw):
            reads.append(name)
            return original(self, *args, **kw)
        return counted

    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    out = verify_chain(drafts, torch.tensor(drafted), q, p, [make_generator(s) for s in range(3)],
                       [True, False, False], host_drafted=drafted)
    accepted, bonus, tokens = out.to_host()
    assert reads == ["tolist"]
    monkeypatch.undo()
    assert accepted == out.num_accepted.tolist() and bonus == out.is_bonus.tolist()
    assert tokens == out.output_tokens.tolist()
    assert accepted[0] == 2 and tokens[0][:3] == [2, 4, 1]      # the greedy row: both drafts, then p's argmax
