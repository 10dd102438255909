"""`specd serve target.model_path=DIR` for a target of each family beyond Llama, as a user would point it at
their own checkpoint: the default configuration otherwise (a first start that builds the quick drafter
from this target, in the target's own cache; suffix + model drafting; replay and trainer on).

The checkpoints are tiny random ones written by transformers with SmolLM2's tokenizer beside them (its
49152-token vocabulary), so the server has a chat template and a tokenizer without a hub; every answer
must equal transformers' greedy decoding of the same checkpoint.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from specd.cluster.client import SpecdClient
from tests.e2e.in_process import serving
from tests.families import reference, write_family

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SERVED = ["llama3", "mistral", "qwen2", "qwen3", "gemma3"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
PROMPTS = [list(range(200, 230)), [1000 + 7 * i for i in range(12)]]   # longer than the 8-token windows


def _checkpoint(root, family: str, tokenizer_dir):
    path = write_family(root / family, family, vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None)[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def ray_for_serving():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-families", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("family", SERVED)
def test_a_family_target_serves_greedy_exact_with_its_own_quick_drafter(ray_for_serving, family,
                                                                        target_model_dir, tmp_path):
    from specd.configs import load_config

    model_dir = _checkpoint(tmp_path, family, target_model_dir)
    # its own cache: the quick drafter a first start builds for this target lands in tmp_path, not ~/.cache
    cfg = load_config([f"target.model_path={model_dir}", f"cache_dir={tmp_path / 'cache'}",
                       "server.port=0", "server.http_port=0", "server.metrics_port=0",
                       "target.max_slots=4", "drafter.max_slots=4",
                       "target.max_seq_len=256"])
    with serving(cfg) as handle:
        client = SpecdClient(handle.address, timeout=300)
        try:
            info = client.server_info()
            hf = reference(model_dir)
            drafted = 0
            for ids in PROMPTS:
                expected = _greedy(hf, ids, 24)
                # the default planner may judge drafting for a random target not worth it; a fixed γ drafts
                for policy in ("", "fixed"):
                    out = client.generate(token_ids=ids, max_new_tokens=24, ignore_eos=True, gamma=4,
                                          gamma_policy=policy)
                    assert out.token_ids == expected, f"{family}, {policy or 'default'} policy: tokens differ"
                    drafted += int(out.usage.get("drafted", 0))
            chat = client.generate(messages=[{"role": "user", "content": "Hello there"}], max_new_tokens=8)
            assert chat.finish_reason in ("length", "eos")
        finally:
            client.close()
    # the quick drafter was built for this target, in its own cache, and drafted
    own = f"{tmp_path / 'cache'}/targets/{model_dir.name}-"
    assert str(cfg.drafter.path).startswith(own), cfg.drafter.path
    assert drafted > 0, info
