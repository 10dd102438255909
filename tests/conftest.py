"""Session fixtures shared by all tests: the real target model directory, the bootstrapped drafters
and a tiny random Llama; and the suite's plugin (tests/ci_required.py): tests using the real model
or Ray are marked `slow`, and in CI (CI set) a skipped `ci_required` test fails.

The drafter fixtures build what is missing from the cache (~/.cache/specd) once, so a test that
needs a drafter runs on a fresh machine whatever ran before it (tests/e2e runs before tests/workers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ci_required import (  # noqa: F401 (pytest hooks: found by name in this conftest)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionstart,
)

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
def tiny_hidden_llama_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a random target-state adapter (hidden 64): a drafter that reads the target's
    hidden states."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specd.workers.models.llama import FEATURE_PROJ, FEATURE_STALENESS

    dst = tmp_path_factory.mktemp("tiny_hidden") / "drafter"
    shutil.copytree(tiny_llama_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    tensors[FEATURE_PROJ] = torch.randn(64, 64, generator=gen) * 0.3
    tensors[FEATURE_STALENESS] = torch.randn(4, 64, generator=gen) * 0.3
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "specd_drafter.json").write_text(json.dumps({"version": "tiny-hidden"}))
    return dst


@pytest.fixture(scope="session")
def target_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (de-quantized on first use, then cached)."""
    from specd.workers.models.loader import ensure_target_model

    try:
        return ensure_target_model()
    except FileNotFoundError as e:  # package missing and nothing cached yet
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def real_target_dir() -> Path:
    """The converted SmolLM2-135M-Instruct (de-quantized once, then cached on disk)."""
    from specd.workers.models.loader import ensure_target_model

    return ensure_target_model()


@pytest.fixture(scope="session")
def boot_drafter_dir(real_target_dir) -> Path:
    """The bootstrapped default drafter if it exists; else a quick one made once for the tests."""
    from specd.drafter_trainer.bootstrap import bootstrap_drafter, cache_root
    from specd.workers.drafters.model import default_drafter_dir

    if (default_drafter_dir() / "specd_drafter.json").exists():
        return default_drafter_dir()
    quick = cache_root() / "drafters" / "boot-quick-tests"
    if (quick / "specd_drafter.json").exists():
        return quick
    return bootstrap_drafter(_quick_tests_config(real_target_dir, quick))


def _quick_tests_config(target_dir, out_dir):
    """The quick preset on the benchmark domains (SOURCES), not its general chat turns: the engine tests
    draft GSM8K and HumanEval prompts and need a drafter that accepts some of them."""
    from specd.drafter_trainer.bootstrap import BootstrapConfig
    from specd.workers.prompts import SOURCES

    return BootstrapConfig.quick(target_dir=str(target_dir), out_dir=str(out_dir), sources=SOURCES)


@pytest.fixture(scope="session")
def boot_hidden_drafter_dir(real_target_dir, boot_drafter_dir) -> Path:
    """The bootstrapped drafter that reads target hidden states (the default); else a quick one."""
    from specd.drafter_trainer.bootstrap import BootstrapConfig
    from specd.drafter_trainer.hidden_stage import bootstrap_hidden_drafter
    from specd.workers.drafters.model import default_drafter_dir

    if (default_drafter_dir(target_hidden=True) / "specd_drafter.json").exists():
        return default_drafter_dir(target_hidden=True)
    cfg = _quick_tests_config(real_target_dir, boot_drafter_dir)
    if (cfg.resolved_hidden_out_dir() / "specd_drafter.json").exists():
        return cfg.resolved_hidden_out_dir()
    if boot_drafter_dir == default_drafter_dir():
        cfg = BootstrapConfig(target_dir=str(real_target_dir))  # the full preset's cached teacher data
    return bootstrap_hidden_drafter(cfg, boot_drafter_dir)
