"""Top-k forward KL, batching and the distillation loop on tiny hand-written cases."""

import math

import pytest
import torch
from tiny_configs import TARGET_CONFIG

from specd.drafter_trainer.distill import (
    DrafterLM,
    TeacherSequence,
    collate,
    distill_step,
    evaluate,
    greedy_matches,
    make_optimizer,
    topk_forward_kl,
    train_drafter,
)

# The shared tiny target, cut to a 2-layer drafter config with its own (untied) head and 32 tokens.
TINY = {
    **{k: v for k, v in TARGET_CONFIG.items() if k not in ("architectures", "quantization_config")},
    "vocab_size": 32,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}


def log(x):
    return torch.log(torch.tensor(x, dtype=torch.float32))


def test_kl_is_zero_when_drafter_equals_teacher_on_reduced_head():
    # Head rows hold target ids [7, 3, 9]; the teacher's top-3 lists them in another order.
    draft_vocab_ids = torch.tensor([7, 3, 9])
    teacher_ids = torch.tensor([[9, 7, 3]])
    teacher_lp = log([[0.6, 0.3, 0.1]])
    student_logits = log([[0.3, 0.1, 0.6]])  # same distribution, in head-row order
    loss = topk_forward_kl(student_logits, teacher_lp, teacher_ids, draft_vocab_ids)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_kl_is_zero_on_full_vocab_when_mass_sits_on_top_k():
    teacher_ids = torch.tensor([[4, 1]])
    teacher_lp = log([[0.75, 0.25]])
    student_logits = torch.full((1, 6), -1e4)
    student_logits[0, 4], student_logits[0, 1] = math.log(0.75), math.log(0.25)
    assert topk_forward_kl(student_logits, teacher_lp, teacher_ids).item() == pytest.approx(0.0, abs=1e-6)


def test_kl_matches_hand_computed_value():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3).
    teacher_ids = torch.tensor([[0, 1]])
    teacher_lp = log([[0.5, 0.5]])
    student_logits = log([[0.25, 0.75]])
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    loss = topk_forward_kl(student_logits, teacher_lp, teacher_ids)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_teacher_top_k_is_renormalised_and_mass_outside_top_k_is_penalised():
    # Teacher top-2 holds only 0.8 of its mass; renormalised it is (3/4, 1/4).
    teacher_ids = torch.tensor([[0, 1]])
    teacher_lp = log([[0.6, 0.2]])
    exact = log([[0.75, 0.25, 1e-12]])
    leaky = log([[0.6, 0.2, 0.2]])  # 0.2 on a token outside the teacher's top-k
    assert topk_forward_kl(exact, teacher_lp, teacher_ids).item() == pytest.approx(0.0, abs=1e-5)
    assert topk_forward_kl(leaky, teacher_lp, teacher_ids).item() == pytest.approx(-math.log(0.8), rel=1e-4)


def test_ids_outside_the_head_are_dropped_and_empty_rows_skipped():
    draft_vocab_ids = torch.tensor([2, 5])
    # Row 0: id 8 is not in the head; the rest renormalises to (2/3, 1/3) over ids (5, 2).
    # Row 1: nothing representable: carries no signal and must not turn the mean into nan.
    teacher_ids = torch.tensor([[5, 8, 2], [8, 9, 10]])
    teacher_lp = log([[0.4, 0.4, 0.2], [0.5, 0.3, 0.2]])
    student_logits = torch.stack([log([1 / 3, 2 / 3]), log([0.5, 0.5])])
    loss = topk_forward_kl(student_logits, teacher_lp, teacher_ids, draft_vocab_ids)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_kl_with_no_representable_row_is_zero_and_differentiable():
    student_logits = torch.zeros(1, 2, requires_grad=True)
    loss = topk_forward_kl(student_logits, log([[0.9]]), torch.tensor([[7]]), torch.tensor([0, 1]))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(student_logits.grad, torch.zeros(1, 2))


def test_kl_is_positive_and_gradient_descends_toward_the_teacher():
    torch.manual_seed(0)
    teacher_ids = torch.tensor([[3, 0, 1], [2, 3, 0]])
    teacher_lp = log([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1]])
    student_logits = torch.randn(2, 4, requires_grad=True)
    loss = topk_forward_kl(student_logits, teacher_lp, teacher_ids)
    loss.backward()
    assert loss.item() > 0
    grad = student_logits.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        stepped = student_logits - 0.5 * grad
    assert topk_forward_kl(stepped, teacher_lp, teacher_ids).item() < loss.item()


def test_greedy_matches_maps_head_rows_to_target_ids():
    draft_vocab_ids = torch.tensor([10, 20, 30])
    student_logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])  # argmax rows 1, 0 -> ids 20, 10
    teacher_ids = torch.tensor([[20, 10], [30, 10]])
    assert greedy_matches(student_logits, teacher_ids, draft_vocab_ids).tolist() == [True, False]


def _sequence(tokens, first_label, k=2):
    n = len(tokens) - first_label
    return TeacherSequence(
        token_ids=torch.tensor(tokens),
        first_label=first_label,
        topk_logprobs=torch.log(torch.full((n, k), 1.0 / k)),
        topk_ids=torch.arange(n * k).view(n, k) % 32,
    )


def test_collate_right_pads_and_flattens_labels_in_order():
    a, b = _sequence([1, 2, 3, 4, 5], first_label=2), _sequence([6, 7, 8], first_label=1)
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert batch.label_mask.tolist() == [[False, False, True, True, True], [False, True, True, False, False]]
    assert torch.equal(batch.topk_ids, torch.cat([a.topk_ids, b.topk_ids]))
    assert batch.topk_logprobs.shape == (5, 2)


def test_collate_rejects_labels_past_the_end():
    bad = _sequence([1, 2, 3], first_label=1)
    bad.first_label = 2  # 2 labels starting at position 2 would need 4 tokens
    with pytest.raises(ValueError):
        collate([bad])


def _teacher_data(n_seq=12, length=10, k=4, seed=0):
    """Sequences from a fixed random bigram teacher, so there is something learnable."""
    table_gen = torch.Generator().manual_seed(1234)  # the same teacher for every call
    # [prev token, next token] log-probabilities
    table = torch.log_softmax(torch.randn(32, 32, generator=table_gen) * 3, dim=-1)
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(n_seq):
        tokens = [int(torch.randint(32, (1,), generator=g))]
        for _ in range(length - 1):
            tokens.append(int(torch.multinomial(table[tokens[-1]].exp(), 1, generator=g)))
        lp, ids = table[torch.tensor(tokens[:-1])].topk(k, dim=-1)
        sequences.append(TeacherSequence(torch.tensor(tokens), 0, lp, ids))
    return sequences


def _tiny_drafter(seed=0, head=None):
    torch.manual_seed(seed)
    ids = torch.arange(32) if head is None else head
    model = DrafterLM(TINY, ids)
    model.freeze_embeddings()
    return model


def test_drafter_state_dict_uses_drafter_directory_names():
    names = set(_tiny_drafter().state_dict())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "draft_vocab_ids"} <= names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert not any("rotary" in n for n in names)


def test_distill_step_updates_layers_but_not_the_frozen_embedding():
    model = _tiny_drafter()
    embed = model.model.embed_tokens.weight.clone()
    head = model.lm_head.weight.clone()
    optimizer = make_optimizer(model, lr=1e-2)
    stats = distill_step(model, optimizer, collate(_teacher_data()[:3]))
    assert stats.labelled == 27 and 0 <= stats.matched <= 27 and stats.loss > 0
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert not torch.equal(model.lm_head.weight, head)


def test_training_lowers_held_out_loss_and_is_deterministic():
    train, held_out = _teacher_data(seed=1), _teacher_data(n_seq=4, seed=2)
    model = _tiny_drafter()
    before = evaluate(model, held_out)
    settings = dict(steps=60, batch_size=4, lr=1e-2, warmup_steps=2, progress=False)
    history = train_drafter(model, train, **settings)
    after = evaluate(model, held_out)
    assert after.loss < before.loss
    assert after.greedy_match >= before.greedy_match
    assert after.head_coverage == 1.0 and after.labelled == 36

    again = _tiny_drafter()
    history_again = train_drafter(again, train, **settings)
    assert [s.loss for s in history] == [s.loss for s in history_again]


def test_evaluate_counts_head_coverage_of_the_target_argmax():
    sequences = _teacher_data(n_seq=2)
    half_head = torch.arange(0, 32, 2)
    model = _tiny_drafter(head=half_head)
    stats = evaluate(model, sequences)
    argmax = torch.cat([s.topk_ids[:, 0] for s in sequences])
    assert stats.head_coverage == pytest.approx(float(torch.isin(argmax, half_head).float().mean()))
    assert stats.greedy_match <= stats.head_coverage
