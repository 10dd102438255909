"""The prompts a drafter learns from: the train split only, held-out prompts apart, templated once."""

from specd.drafter_trainer import data
from specd.workers import prompts


def test_train_prompts_are_the_train_split_in_the_shared_mix():
    train = data.train_prompts(limit=112)
    assert [p.id for p in train] == [p.id for p in prompts.load_prompts("train", limit=112)]
    for p in train:
        assert p.index in prompts.split_indices(p.source, "train")


def test_heldout_prompts_are_never_trained_on():
    held = data.heldout_prompts(("gsm8k", "humaneval"))
    assert {p.id for p in held}.isdisjoint(p.id for p in data.train_prompts())
    assert data.heldout_prompts(("gsm8k",), limit=1)[0].index == 1000


def test_split_table_is_recorded_per_source():
    assert data.split_table(("humaneval",)) == {"humaneval": {"train": (0, 120), "eval": (120, 164)}}


def test_encode_prompts_uses_the_shared_chat_turn():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "|".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens):
            assert not add_special_tokens
            return {"input_ids": [len(text)]}

    question = data.train_prompts(("gsm8k",), limit=1)[0]
    assert data.encode_prompts(Tok(), [question]) == [[len(question.text)]]
