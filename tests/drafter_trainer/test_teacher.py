"""The bootstrap teachers: specd's engine against transformers generate(), and the chunk cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from specd.drafter_trainer.distill import TeacherSequence
from specd.drafter_trainer.teacher import engine_generate_teacher, hf_generate_teacher, run_teacher_cached
from specd.workers.models.runner import ModelRunner

PROMPTS = [[5, 9, 17, 3], [40, 2], [7, 7, 7, 7, 7, 7, 11], [100, 64, 8]]
EOS = [1]


def _runner(model_dir, slots: int) -> ModelRunner:
    return ModelRunner(model_dir, max_slots=slots, max_seq_len=64)


def test_engine_teacher_greedy_matches_transformers_generate(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    want = hf_generate_teacher(hf, PROMPTS, 0.0, 12, 5, batch_size=4, eos_ids=EOS, pad_id=0, progress=False)
    got = engine_generate_teacher(_runner(tiny_llama_dir, 2), PROMPTS, 0.0, 12, 5, EOS, seed=0)
    assert len(got) == len(want) == len(PROMPTS)
    for g, w, prompt in zip(got, want, PROMPTS, strict=True):
        assert g.token_ids.tolist() == w.token_ids.tolist()
        assert g.first_label == w.first_label == len(prompt) - 1
        assert g.n_labels == len(g.token_ids) - len(prompt)  # one label per generated token
        assert torch.equal(g.topk_ids[:, 0], g.token_ids[len(prompt) :])  # greedy: the top-1 is emitted
        torch.testing.assert_close(g.topk_logprobs, w.topk_logprobs, atol=1e-4, rtol=1e-4)


def test_engine_teacher_sampling_is_seeded_and_independent_of_batching(tiny_llama_dir):
    one = engine_generate_teacher(_runner(tiny_llama_dir, 1), PROMPTS, 0.7, 10, 3, EOS, seed=3)
    four = engine_generate_teacher(_runner(tiny_llama_dir, 4), PROMPTS, 0.7, 10, 3, EOS, seed=3)
    other = engine_generate_teacher(_runner(tiny_llama_dir, 4), PROMPTS, 0.7, 10, 3, EOS, seed=4)
    assert [s.token_ids.tolist() for s in one] == [s.token_ids.tolist() for s in four]
    assert [s.token_ids.tolist() for s in one] != [s.token_ids.tolist() for s in other]
    for s in one:  # the labels stay the unprocessed distribution: log-probabilities, descending
        assert torch.all(s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:])
        assert torch.all(s.topk_logprobs.exp().sum(-1) <= 1.0 + 1e-5)


def test_engine_teacher_stops_at_eos_and_frees_its_slots(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, 2)
    first = engine_generate_teacher(runner, PROMPTS, 0.0, 12, 3, EOS, seed=0)
    eos_token = int(first[0].token_ids[len(PROMPTS[0])])  # make the first generated token the EOS
    stopped = engine_generate_teacher(runner, PROMPTS[:1], 0.0, 12, 3, [eos_token], seed=0)
    assert stopped[0].token_ids.tolist() == PROMPTS[0] + [eos_token]
    assert runner.num_free == 2


def test_run_teacher_cached_reuses_chunks(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    calls: list[list[list[int]]] = []

    def fake_teacher(prompts, temperature, seed):
        calls.append(list(prompts))
        return [
            TeacherSequence(
                torch.tensor(p + [seed]), len(p) - 1, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long)
            )
            for p in prompts
        ]

    cfg = SimpleNamespace(
        gen_batch_size=2,
        seed=10,
        max_new_tokens=1,
        top_k_logprobs=2,
        teacher="fake",
        reuse_teacher_data=True,
        progress=False,
    )
    seqs, cached = run_teacher_cached(cfg, tiny_llama_dir, "t", PROMPTS[:2], 0.0, fake_teacher)
    assert cached == 0 and len(calls) == 1
    seqs2, cached2 = run_teacher_cached(cfg, tiny_llama_dir, "t", PROMPTS, 0.0, fake_teacher)
    assert cached2 == 1 and calls[-1] == PROMPTS[2:]  # only the new chunk is generated
    assert [s.token_ids.tolist() for s in seqs2[:2]] == [s.token_ids.tolist() for s in seqs]
    assert seqs2[2].token_ids.tolist() == PROMPTS[2] + [11]  # chunk c is seeded with seed + c


def test_unknown_teacher_is_refused():
    from specd.drafter_trainer.bootstrap import BootstrapConfig

    with pytest.raises(ValueError, match="unknown teacher 'nope'"):
        BootstrapConfig(teacher="nope")
