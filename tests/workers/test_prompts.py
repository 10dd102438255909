"""Shipped prompt data (workers/prompts.py): fixed disjoint splits, deterministic mixing, the chat turn."""

import pytest

from specd.workers import prompts as data
from specd.workers.models.chat import ChatCodec


@pytest.mark.parametrize("source, rows", [("gsm8k", 1319), ("humaneval", 164)])
def test_sources_load_completely_and_splits_cover_them(source, rows):
    prompts = data.load_source(source)
    assert len(prompts) == rows
    assert [p.index for p in prompts] == list(range(rows))
    assert all(p.text and p.reference for p in prompts)
    train, evaluation = data.split_indices(source, "train"), data.split_indices(source, "eval")
    assert set(train).isdisjoint(evaluation)
    assert set(train) | set(evaluation) == set(range(rows))


def test_split_sizes_are_the_documented_ones():
    sizes = {(s, split): len(data.load_split(s, split)) for s in data.SOURCES for split in data.SPLIT_NAMES}
    assert sizes == {("gsm8k", "train"): 1000, ("gsm8k", "eval"): 319, ("humaneval", "train"): 120,
                     ("humaneval", "eval"): 44}  # fmt: skip


def test_train_and_eval_prompts_are_disjoint_by_id_and_by_text():
    train, evaluation = data.load_prompts("train"), data.load_prompts("eval")
    assert len(train) == 1120 and len(evaluation) == 363
    assert {p.id for p in train}.isdisjoint(p.id for p in evaluation)
    assert {p.text for p in train}.isdisjoint(p.text for p in evaluation)


def test_load_prompts_is_deterministic_and_a_prefix_is_a_proportional_mix():
    first = data.load_prompts("train", limit=112)
    assert [p.id for p in first] == [p.id for p in data.load_prompts("train", limit=112)]
    assert [p.id for p in first] == [p.id for p in data.load_prompts("train")[:112]]
    counts = {s: sum(p.source == s for p in first) for s in data.SOURCES}
    assert counts == {"gsm8k": 100, "humaneval": 12}
    # Within a source the file order is kept.
    gsm = [p.index for p in first if p.source == "gsm8k"]
    assert gsm == sorted(gsm) and gsm[0] == 0


def test_eval_prompts_come_from_the_eval_ranges_only():
    for p in data.load_prompts("eval", sources=("humaneval",)):
        assert 120 <= p.index < 164
    assert data.load_prompts("eval", sources=("gsm8k",), limit=1)[0].index == 1000


def test_unknown_split_and_source_are_errors():
    with pytest.raises(ValueError):
        data.load_prompts("test")
    with pytest.raises(ValueError):
        data.load_source("mmlu")


def test_data_dir_can_be_overridden(tmp_path, monkeypatch):
    (tmp_path / "gsm8k_test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path))
    assert data.data_dir() == tmp_path
    assert [p.text for p in data.load_source("gsm8k")] == ["1+1?"]
    # files written for specd that such a directory lacks come from the repository's data/
    assert data.load_source("general") == data.load_source("general", data.REPO_DATA)
    assert len(data.load_source("general")) == 160


class TemplateTokenizer:
    """Stands in for a transformers tokenizer: a toy chat template and a character-level encoder."""

    def __init__(self):
        self.add_special_tokens_seen = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        body = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return body + "<assistant>"

    def __call__(self, text, add_special_tokens):
        self.add_special_tokens_seen.append(add_special_tokens)
        return {"input_ids": [ord(c) for c in text]}


def test_chat_template_wraps_gsm8k_verbatim_and_humaneval_with_an_instruction():
    tok = TemplateTokenizer()
    codec = ChatCodec(tok)
    question = data.load_split("gsm8k", "train")[0]
    assert codec.chat_text(data.chat_messages(question)) == f"<user>{question.text}</><assistant>"
    stub = data.load_split("humaneval", "train")[0]
    text = codec.chat_text(data.chat_messages(stub))
    assert "Complete the following Python function" in text and stub.text in text
    ids = data.encode_prompt(tok, question)
    assert ids == [ord(c) for c in f"<user>{question.text}</><assistant>"]
    assert tok.add_special_tokens_seen == [False]  # the template holds the special tokens already


def test_chat_prompts_are_eval_only_and_never_trained_on():
    from specd.workers.prompts import EVAL_ONLY_SOURCES, SOURCES, load_prompts, load_split

    chat = load_split("chat", "eval")
    assert len(chat) == 32 and all(p.source == "chat" and p.text.strip() for p in chat)
    assert load_split("chat", "train") == []
    assert "chat" in EVAL_ONLY_SOURCES and "chat" not in SOURCES    # no default mix trains on it
    assert all(p.source != "chat" for p in load_prompts("train"))


def test_general_prompts_are_the_quick_drafters_and_apart_from_the_benchmarks():
    from specd.drafter_trainer.bootstrap import BootstrapConfig
    from specd.workers.prompts import GENERAL_SOURCES, SOURCES, load_prompts, load_split

    train, held = load_split("general", "train"), load_split("general", "eval")
    assert (len(train), len(held)) == (144, 16) and all(p.text.strip() for p in train + held)
    chat = {p.text for p in load_split("chat", "eval")}
    assert not chat & {p.text for p in train + held}     # chat stays traffic no drafter saw
    assert len({p.text for p in train + held}) == 160
    # a fresh install's drafter learns general turns; the benchmark domains arrive as new traffic
    assert BootstrapConfig.quick().sources == GENERAL_SOURCES and BootstrapConfig().sources == SOURCES
    assert all(p.source == "general" for p in load_prompts("train", BootstrapConfig.quick().sources))


def test_openchat_stream_and_held_out_prompts_are_apart_from_every_other_chat_set():
    import re

    from specd.workers.prompts import SOURCES, STREAM_SOURCES, load_prompts, load_split

    stream, held = load_split("openchat", "train"), load_split("openchat", "eval")
    assert (len(stream), len(held)) == (200, 40) and all(p.text.strip() for p in stream + held)
    assert len({p.text for p in stream + held}) == 240
    # neither the quick drafter's turns nor the chat evaluation may share a prompt, even reworded
    function_words = {"a", "an", "the", "of", "to", "and", "in", "for", "is", "what", "how", "i", "my", "do",
                      "with", "write", "short", "about", "between", "difference", "differences", "explain"}

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z]+", text.lower())) - function_words

    others = [p.text for s in ("general", "chat") for part in ("train", "eval") for p in load_split(s, part)]
    for p in stream + held:
        overlap = max(len(words(p.text) & words(o)) / len(words(p.text) | words(o)) for o in others)
        assert overlap < 0.5, p.text
    assert "openchat" in STREAM_SOURCES and "openchat" not in SOURCES
    assert all(p.source != "openchat" for p in load_prompts("train"))
