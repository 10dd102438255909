"""Session fixtures shared by all tests: the real target model directory and a tiny random Llama.

The real-model fixture is deliberately not marked `slow`: the conversion runs once (~30 s) and is
cached on disk, and the tests that use it are kept few and short so that CI runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Two cores shared by everything on this machine; more threads only add contention.
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY_VOCAB = 128


def write_tiny_llama(path: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A random HF Llama (hidden 64, 4 heads / 2 KV heads, vocab 128) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        # A wider init than the default 0.02 gives peaked logits: greedy choices are not near-ties.
        initializer_range=0.3,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def make_tiny_llama():
    """write_tiny_llama(path, num_layers=2, seed=0) -> path, for tests that need a second model."""
    return write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def target_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (de-quantized on first use, then cached)."""
    from specd.workers.models.loader import ensure_target_model

    try:
        return ensure_target_model()
    except FileNotFoundError as e:  # package missing and nothing cached yet
        pytest.skip(str(e))
