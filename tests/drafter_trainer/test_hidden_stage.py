"""The second bootstrap stage: stale-state indexing, zero start, trainer/serving parity, training."""

import pytest
import torch
from tiny_configs import TARGET_CONFIG

from specd.drafter_trainer.distill import DrafterLM, TeacherSequence
from specd.drafter_trainer.drafter_format import make_drafter_config, save_drafter
from specd.drafter_trainer.hidden_stage import (
    HiddenDrafterLM,
    collate_features,
    fresh_greedy_match,
    input_features,
    simulate_chain,
    train_hidden_drafter,
)

HEAD_IDS = torch.arange(0, 40, 2)  # even tokens only


def _model(seed=0, staleness=4) -> HiddenDrafterLM:
    torch.manual_seed(seed)
    config = make_drafter_config(TARGET_CONFIG, num_layers=1, head_vocab=HEAD_IDS.numel())
    return HiddenDrafterLM(DrafterLM(config, HEAD_IDS), staleness)


def test_input_features_read_the_state_before_each_token_minus_its_staleness():
    states = torch.arange(5, dtype=torch.float32)[:, None] * 10  # state after token p = 10 p
    feats = input_features(states, torch.tensor([0, 0, 1, 0, 3]))
    # token p reads state p - 1 - s; before token 0 there is none (zeros)
    assert feats[:, 0].tolist() == [0.0, 0.0, 0.0, 20.0, 0.0]
    feats = input_features(states, torch.tensor([0, 0, 0, 2, 1]))
    assert feats[:, 0].tolist() == [0.0, 0.0, 10.0, 0.0, 20.0]


def test_zero_adapter_starts_from_the_token_drafter():
    model = _model()
    ids = torch.tensor([[3, 8, 1, 30, 12]])
    feats, stale = torch.randn(1, 5, 16), torch.tensor([[0, 1, 2, 3, 0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, feats, stale), model.base(ids))


def test_saved_drafter_serves_the_logits_it_was_trained_with(tmp_path):
    """The HF-based trainer and the plain-torch serving Llama agree, adapter included."""
    from specd.workers.models.llama import Llama

    model = _model(seed=1)
    with torch.no_grad():
        model.base.model.feature_proj.weight.normal_(0, 0.3)
        model.base.model.feature_staleness.normal_(0, 0.3)
    out = save_drafter(tmp_path / "d", model.state_dict(), model.config, {"target": "tiny"})
    loaded = Llama.from_pretrained(out)
    assert loaded.feature_staleness.shape == (4, 16)
    ids, feats = torch.tensor([[3, 8, 1, 30, 12, 7]]), torch.randn(1, 6, 16)
    stale = torch.tensor([[0, 0, 1, 2, 3, 5]])  # beyond the table: clamped to the last entry
    cache = loaded.make_cache(1, 16)
    got = loaded(ids, torch.arange(6)[None], [0], cache, full_vocab=False, features=feats, staleness=stale)
    with torch.no_grad():
        want = model.eval()(ids, feats, stale.clamp(max=3))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _copy_task(n_seqs=24, length=12, seed=0):
    """The next token is the current one + 2 (mod 40), always even: easy to learn from the states if
    the state says what came before. Teacher: one-hot top-1."""
    gen = torch.Generator().manual_seed(seed)
    seqs, states = [], []
    for _ in range(n_seqs):
        start = int(torch.randint(0, 20, (1,), generator=gen)) * 2
        tokens = (start + 2 * torch.arange(length)) % 40
        seqs.append(TeacherSequence(tokens, 0, torch.zeros(length - 1, 1), tokens[1:, None].clone()))
        # state after token p: a one-hot of token p + 2 spread over 16 dims (the target "knows")
        states.append(torch.nn.functional.one_hot(((tokens + 2) % 40) // 2 % 16, 16).float())
    return seqs, states


def test_collate_marks_labels_and_draws_staleness_in_range():
    seqs, states = _copy_task(n_seqs=3)
    batch = collate_features(seqs, states, 4, 0.5, torch.Generator().manual_seed(0))
    assert batch.label_mask.sum() == sum(s.n_labels for s in seqs) == batch.topk_ids.shape[0]
    assert int(batch.staleness.min()) >= 0 and int(batch.staleness.max()) <= 3
    assert (batch.staleness > 0).any() and (batch.staleness == 0).any()
    fresh = collate_features(seqs, states, 4, 0.5, None)
    assert (fresh.staleness == 0).all()


def test_training_learns_to_use_the_states():
    seqs, states = _copy_task()
    model = _model(seed=2)
    before = fresh_greedy_match(model, seqs, states)
    losses = train_hidden_drafter(model, seqs, states, steps=150, batch_size=4, lr=3e-3, progress=False)
    after = fresh_greedy_match(model, seqs, states)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    assert after > max(before, 0.8)
    chain = simulate_chain(model, seqs, states, gamma=3, stride=2)
    assert chain["steps"] > 0 and 0.0 <= chain["acceptance_rate"] <= 1.0
    assert chain["mean_accepted_length"] == pytest.approx(chain["mean_accepted"] + 1)
