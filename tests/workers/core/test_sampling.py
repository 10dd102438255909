import math

import pytest
import torch
from scipy.stats import chisquare, kstest

from specd.workers.core.sampling import (
    SamplingParams,
    exponential_noise,
    logits_to_probs,
    make_generator,
    params_to_tensors,
    sample,
    uniform_noise,
)


def process(logits, temperature=1.0, top_k=0, top_p=1.0):
    """logits [vocab] with one setting -> probs [vocab]."""
    settings = params_to_tensors([SamplingParams(temperature, top_k, top_p)], device="cpu")
    return logits_to_probs(torch.as_tensor(logits, dtype=torch.float64)[None, None], *settings)[0, 0]


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-0.1), "temperature must be >= 0"),
        (SamplingParams(temperature=float("nan")), "temperature must be >= 0"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k must be >= 0"),
        (SamplingParams(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (SamplingParams(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_validate_rejects_bad_settings(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_validate_accepts_edges_and_greedy_flag():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0).validate()
    SamplingParams(temperature=2.0, top_k=1, top_p=1e-6).validate()
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_make_generator_is_seeded_or_none():
    assert make_generator(None) is None
    a = torch.rand(3, generator=make_generator(7))
    b = torch.rand(3, generator=make_generator(7))
    assert torch.equal(a, b)


def test_params_to_tensors_types():
    t, k, p = params_to_tensors([SamplingParams(0.5, 3, 0.9), SamplingParams()], device="cpu")
    assert t.dtype == torch.float32 and k.dtype == torch.long and p.dtype == torch.float32
    assert t.tolist() == [0.5, 0.0] and k.tolist() == [3, 0] and p.tolist() == pytest.approx([0.9, 1.0])


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    assert torch.allclose(process(logits, temperature=0.5), torch.softmax(logits / 0.5, dim=-1))
    assert torch.allclose(process(logits, temperature=1.0), torch.softmax(logits, dim=-1))


def test_greedy_is_one_hot_on_argmax_first_of_ties():
    assert process([0.1, 3.0, -1.0, 3.0], temperature=0.0).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_keeps_k_largest_and_their_ties():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0], dtype=torch.float64)
    probs = process(logits, top_k=2)
    expected = torch.softmax(torch.tensor([4.0, 3.0], dtype=torch.float64), dim=-1)
    assert probs[[0, 3]].tolist() == [0.0, 0.0]
    assert torch.allclose(probs[[1, 2]], expected)
    tied = process([1.0, 3.0, 3.0, 0.0], top_k=1)
    assert tied.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0])
    assert torch.allclose(process(logits, top_k=10), process(logits))  # k >= vocab is off


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()
    assert process(logits, top_p=0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    # Mass before the third token is 0.8: it is dropped just below and kept just above.
    assert process(logits, top_p=0.79).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert process(logits, top_p=0.81).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert process(logits, top_p=1e-6).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(
        process(logits, top_p=1.0), torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    )


def test_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64).log()
    # top-k 3 renormalises to [4/9, 3/9, 2/9]; mass before the third is 7/9 < 0.8, so all three stay.
    assert process(logits, top_k=3, top_p=0.8).tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0])
    assert process(logits, top_k=3, top_p=0.7).tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])


def test_minus_inf_logits_get_exactly_zero():
    logits = [1.0, -math.inf, 0.0, -math.inf]
    for settings in [{}, {"top_k": 3}, {"top_p": 0.99}, {"temperature": 0.3, "top_k": 4, "top_p": 0.5}]:
        probs = process(logits, **settings)
        assert probs[1] == 0.0 and probs[3] == 0.0
        assert float(probs.sum()) == pytest.approx(1.0)


def test_rows_use_their_own_settings():
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 3)[:, None]  # [3, 1, vocab]
    settings = params_to_tensors(
        [SamplingParams(0.0), SamplingParams(1.0, top_k=1), SamplingParams(2.0)], device="cpu"
    )
    probs = logits_to_probs(logits, *settings)[:, 0]
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    assert probs[1].tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(probs[2], torch.softmax(torch.tensor([1.0, 0.5, 0.0]), dim=-1))


def test_settings_moved_to_the_device_in_one_copy_process_as_on_the_host(monkeypatch):
    """The GPU branch (settings and flags packed into one copy) gives what the CPU branch gives."""
    from specd.workers.core import sampling

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2, 50, generator=g)   # [batch, n, vocab]
    params = [SamplingParams(0.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
              SamplingParams(0.9, top_k=7, top_p=0.6)]
    on_host = logits_to_probs(logits, *params_to_tensors(params))
    monkeypatch.setattr(sampling, "host_reads_are_cheap", lambda device: False)
    assert torch.equal(logits_to_probs(logits, *params_to_tensors(params)), on_host)
    greedy = [SamplingParams(0.0)] * 2
    assert torch.equal(logits_to_probs(logits[:2], *params_to_tensors(greedy)),
                       on_host[:1].new_zeros(2, 2, 50).scatter(-1, logits[:2].argmax(-1, keepdim=True), 1.0))


def test_sample_one_hot_and_zero_probability():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    for seed in range(50):
        tokens = sample(probs, [make_generator(seed), None])
        assert tokens[0] == 1 and tokens[1] != 1


def test_sample_frequencies_match_probs():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    tokens = sample(probs.expand(20_000, -1), [None] * 20_000)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[4] == 0
    expected = probs[:4].double() / probs[:4].double().sum() * counts.sum()
    assert chisquare(counts[:4].numpy(), expected.numpy()).pvalue > 1e-3


def test_exponential_noise_is_exp1_for_seeded_and_shared_rows():
    torch.manual_seed(0)
    noise = exponential_noise([make_generator(7), None], 50_000)
    for row in noise.double():
        assert row.min() > 0
        assert kstest(row.numpy(), "expon").pvalue > 1e-3
    assert kstest(noise[0].numpy(), noise[1].numpy()).pvalue > 1e-3
    assert torch.equal(noise[0], exponential_noise([make_generator(7)], 50_000)[0])   # seeded: reproducible


def test_seeded_row_does_not_depend_on_its_batch():
    probs = torch.softmax(torch.randn(1, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    alone = sample(probs, [make_generator(5)])
    in_batch = sample(torch.cat([probs.flip(-1), probs, probs]), [None, make_generator(5), make_generator(6)])
    assert int(alone[0]) == int(in_batch[1])
    # The number of uniforms a seeded row takes is its own count, not the batch width.
    narrow = uniform_noise([make_generator(3)], [2], 2)
    wide = uniform_noise([make_generator(3), None], [2, 5], 5)
    assert torch.equal(narrow[0], wide[0, :2]) and wide[0, 2:].eq(0).all()


def test_greedy_rows_draw_no_randomness_and_keep_their_token():
    one_hot = torch.zeros(3, 40).scatter(-1, torch.tensor([[7], [0], [39]]), 1.0)
    seeded = make_generator(11)
    before = seeded.get_state().clone()
    torch.manual_seed(4)
    default_before = torch.get_rng_state().clone()
    tokens = sample(one_hot, [seeded, None, make_generator(2)], greedy=[True, True, True])
    assert tokens.tolist() == [7, 0, 39]
    assert torch.equal(seeded.get_state(), before)                 # its own generator untouched
    assert torch.equal(torch.get_rng_state(), default_before)      # and the shared one too
    # A sampled row beside greedy ones draws exactly what it draws alone.
    probs = torch.softmax(torch.randn(1, 40, generator=torch.Generator().manual_seed(3)), dim=-1)
    alone = sample(probs, [make_generator(9)])
    beside = sample(torch.cat([one_hot[:1], probs]), [make_generator(1), make_generator(9)],
                    greedy=[True, False])
    assert int(alone[0]) == int(beside[1]) and int(beside[0]) == 7
    assert uniform_noise([make_generator(3)], [4], 4, greedy=[True]).eq(0).all()


def test_settings_that_are_off_keep_tiny_probabilities():
    # The mass before the tail rounds to exactly 1.0; "top_p = 1 is off" must still keep the tail.
    probs = process([0.0, -40.0, -40.0], top_p=1.0, top_k=0)
    assert probs[1] > 0 and probs[2] > 0
    assert torch.equal(probs, torch.softmax(torch.tensor([0.0, -40.0, -40.0], dtype=torch.float64), dim=-1))


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-12])
def test_tiny_positive_temperature_gives_the_limit_distribution_not_nan(temperature):
    # float32, as the workers compute: logits / 1e-38 overflow to ±inf and inf - inf is NaN.
    logits = torch.tensor([[[30.0, -2.0, 15.0, 30.0, -50.0]]])
    settings = params_to_tensors([SamplingParams(temperature)], device="cpu")
    probs = logits_to_probs(logits, *settings)[0, 0]
    # The T -> 0 limit: uniform over the tied maxima, exactly zero elsewhere.
    assert torch.equal(probs, torch.tensor([0.5, 0.0, 0.0, 0.5, 0.0]))
    with_top = params_to_tensors([SamplingParams(temperature, top_k=2, top_p=0.9)], device="cpu")
    assert torch.isfinite(logits_to_probs(logits, *with_top)).all()


def test_make_generator_takes_any_64_bit_seed():
    for seed in (2**64 - 1, 2**64 + 5, -1):
        a = torch.rand(2, generator=make_generator(seed))
        assert torch.equal(a, torch.rand(2, generator=make_generator(seed % 2**64)))


def test_greedy_argmax_equals_torch_argmax_ties_nan_and_views_included():
    from specd.workers.core.sampling import greedy_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 97, generator=g)
    x[0, 1, 10] = x[0, 1, 40] = x[0, 1].max() + 1           # a tie: the first index wins in both
    x[1, 2, 7] = float("nan")                               # a NaN counts as the maximum in both
    x[2, 3] = float("-inf")                                 # a row of -inf: index 0
    cases = [x, x[:, 1:4], x.double(), x[0, 0], x[:1, :1].expand(4, 6, 97), x.half(), x.bfloat16()]
    for t in cases:
        got = greedy_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1)), t.shape


def test_greedy_top_is_topk_best_first_with_argmax_first():
    from specd.workers.core.sampling import greedy_argmax, greedy_top

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 97, generator=g)
    x[0, 10] = x[0, 40] = x[0].max() + 1                     # a tie at the top
    for t in (x, x[1:3], x.bfloat16(), x.half(), x.double()):    # x[1:3]: few rows, torch.topk's path
        for k in (1, 2, 3, 5):
            got = greedy_top(t, k)
            assert got.shape == (t.shape[0], k) and got.dtype == torch.int64
            # the same values, best first, as torch.topk, each index once
            assert torch.equal(t.gather(-1, got), torch.topk(t, k).values)
            assert all(len(set(row)) == k for row in got.tolist())
            if k == 1:
                assert torch.equal(got[:, 0], greedy_argmax(t))
    assert set(greedy_top(x, 3)[0, :2].tolist()) == {10, 40}
    short = torch.full((4, 8), float("-inf"))
    short[:, 3] = 1.0                                       # fewer than k finite logits: torch.topk's
    assert torch.equal(greedy_top(short, 2), torch.topk(short, 2).indices)


def test_pick_rows_is_advanced_indexing():
    from specd.workers.core.sampling import pick_rows

    x = torch.randn(4, 5, 33, generator=torch.Generator().manual_seed(2))
    rows, cols = [0, 0, 3, 2], [4, 1, 1, 0]
    for t in (x, x.bfloat16(), x.half(), x.double(), x[:, 1:4], x.int()):
        cut = [c % t.shape[1] for c in cols]
        got = pick_rows(t, rows, cut)
        assert got.dtype == t.dtype and torch.equal(got, t[rows, cut])
