"""Benchmark prompts: the eval split only, never a prompt a drafter trains on."""

from specd.bench import datasets
from specd.drafter_trainer.data import train_prompts


class Tok:
    """A toy tokenizer: the chat template is the user's text, one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return messages[0]["content"]

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}


def test_workload_prompts_are_eval_rows_disjoint_from_training():
    trained = {p.text for p in train_prompts()}
    for workload, first in (("gsm8k", 1000), ("humaneval", 120)):
        rows = datasets.workload_prompts(workload, 3, Tok())
        assert [i for i, _ in rows] == [first, first + 1, first + 2]
        assert all("".join(map(chr, ids)) not in trained for _, ids in rows)


def test_mixed_prompts_give_messages_and_the_same_prompts_as_ids():
    messages, ids = datasets.mixed_prompts(["gsm8k", "humaneval"], 10, Tok())
    assert len(messages) == len(ids) == 10
    assert [[ord(c) for c in m[0]["content"]] for m in messages] == ids
    assert any("Complete the following Python function" in m[0]["content"] for m in messages)
