"""The chat codec: one template rendering for the router, the benchmarks and the trainer."""

from __future__ import annotations

from specd.workers.models.chat import ChatCodec


class Tok:
    """A toy transformers tokenizer: one id per call (the text length), 99 standing for BOS."""

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [99] * add_special_tokens + [len(text)]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def decode(self, ids, skip_special_tokens):
        assert skip_special_tokens
        return ",".join(map(str, ids))


def test_chat_is_rendered_without_a_second_bos_and_text_with_one():
    codec = ChatCodec(Tok())
    messages = [{"role": "user", "content": "hey"}]
    assert codec.chat_text(messages) == "<s><user>hey"
    assert codec.render_chat(messages) == [len("<s><user>hey")]
    assert codec.encode("hey") == [99, 3]
    assert codec.decode([1, 2]) == "1,2"
