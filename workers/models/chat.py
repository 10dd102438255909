"""Text and chat messages to token ids and back, over a transformers tokenizer with a chat template.

The one place a chat is rendered: the router (client messages), the benchmarks and the demo (their
prompts) and the drafter trainer (its training prompts) all encode through ChatCodec, so a prompt
becomes the same token ids wherever it comes from.
"""

from __future__ import annotations

from typing import Any


class ChatCodec:
    """The router's TextCodec (cluster/validation.py) over a transformers tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """Plain text as the model's tokenizer sees it, with its special tokens (e.g. BOS)."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        """The templated conversation, ending with the assistant header (generation starts after it)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # Render to text first: the tokenized return type of apply_chat_template differs across versions.
        # The template already holds the special tokens: a second BOS would change what the target sees.
        return list(self.tokenizer(self.chat_text(messages), add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
