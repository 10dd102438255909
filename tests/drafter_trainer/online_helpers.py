"""Tiny target + drafter directories and replay records for the online-training tests.

The tiny target is tests/conftest.py's random Llama; the drafter is cut from it the way the
bootstrap cuts one from the real target (its embedding, one layer, a reduced head) and saved in the
drafter directory format. Records hold the target's own greedy continuations, so the teacher signal
is learnable."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specd.drafter_trainer.distill import DrafterLM
from specd.drafter_trainer.drafter_format import make_drafter_config, save_drafter
from specd.drafter_trainer.hidden_stage import HiddenDrafterLM
from specd.proto.replay_codec import RecordBuilder


def make_tiny_drafter(target_dir: Path, out_dir: Path, hidden: bool = False, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target = load_file(str(target_dir / "model.safetensors"))
    vocab = int(target_cfg["vocab_size"])
    head_ids = torch.arange(vocab, dtype=torch.int64)[: vocab * 3 // 4]
    config = make_drafter_config(target_cfg, num_layers=1, head_vocab=head_ids.numel())
    base = DrafterLM(config, head_ids)
    with torch.no_grad():
        base.model.embed_tokens.weight.copy_(target["model.embed_tokens.weight"])
        base.lm_head.weight.copy_(target["model.embed_tokens.weight"][head_ids])
    model = HiddenDrafterLM(base, staleness=4) if hidden else base
    meta = {"version": f"tiny-{'h' if hidden else 't'}"}
    return save_drafter(out_dir, model.state_dict(), model.config, meta,
                        version_prefix="tiny")


def greedy_continuations(target_dir: Path, n: int, prompt_len: int = 6, new_tokens: int = 24, seed: int = 0):
    """[(prompt, output)] of the tiny target's greedy decoding from random prompts."""
    from specd.workers.models.runner import ModelRunner

    runner = ModelRunner(target_dir, max_slots=1, max_seq_len=128)
    vocab = runner.vocab_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        slot = runner.allocate()
        logits = runner.prefill([slot], [prompt])
        toks = [int(logits[0].argmax())]
        for _ in range(new_tokens - 1):
            toks.append(int(runner.extend([slot], [[toks[-1]]])[0, -1].argmax()))
        runner.free(slot)
        out.append((prompt, toks))
    return out


def make_record(i: int, prompt: list[int], output: list[int], version: str, accepted: int = 1,
                gamma: int = 3, checksum: str = "", domain: str = "test"):
    """A record whose steps each draft γ tokens and accept `accepted` of them."""
    b = RecordBuilder(f"req-{i}", prompt, domain=domain, target_checksum=checksum)
    b.first_tokens(output[:1])
    pos = 1
    while pos < len(output):
        emit = output[pos : pos + accepted + 1]
        drafted = output[pos : pos + accepted] + [0] * (gamma - accepted)
        b.step(drafted[:gamma], accepted=min(accepted, len(emit)), bonus=False, emitted=emit,
               drafter_version=version)
        pos += len(emit)
    return b.finish()
