"""Free forwards for `specd bench overhead`: a step with everything but the model's arithmetic.

The stand-in target and drafter are the real TargetWorker and DraftWorker on small model directories
(one layer, the real vocabulary and hidden width, so logits, hidden states and KV bookkeeping have the
real shapes) whose ModelRunner forward is replaced by one that returns fixed logits and hidden states at
once. Everything around the forward runs as served: planning, drafting bookkeeping, suffix lookups,
verification, KV rollback, Sequence.apply, streaming.

The fixed logits of the target and of the drafter peak at the same token (TOKEN), so greedy drafts are
always accepted: a speculative step does the most bookkeeping it can (every draft accepted, a bonus
token, the longest commits). With `UnpredictableTargetWorker` the target's peak moves to a new token at
every forward instead (a sequence that does not repeat within a run), so no draft is accepted and no
suffix lookup matches: the regime of traffic nobody trained for, where the planner learns to draft
nothing and a speculative step's cost over a plain one is what speculating costs when it buys nothing.
The workers are subclasses so that Ray can build them as actors (cluster/actors.create_cluster takes the
classes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.target_worker import TargetWorker

VOCAB = 49152          # SmolLM2's vocabulary and hidden width: the tensors a step moves have real sizes
HIDDEN = 576
HEADS, KV_HEADS = 9, 3
DRAFT_HEAD = 4096      # the default drafter's reduced head (its most frequent target tokens)
TOKEN = 5              # what both stand-ins predict (not EOS = 1)
EOS = 1


def _llama_tensors(seed: int) -> dict[str, torch.Tensor]:
    """One Llama layer with HF names; values never matter (the forward is replaced), shapes do."""
    g = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (64, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (64, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, 64),
    }
    return {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}


def _config(max_seq_len: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": max_seq_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "eos_token_id": EOS, "bos_token_id": 0, "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def write_stand_ins(root: Path, max_seq_len: int) -> tuple[Path, Path]:
    """(target dir, drafter dir): the drafter reads the target's hidden states, with a reduced head."""
    target, drafter = root / "target", root / "drafter"
    if (drafter / "specd_drafter.json").exists():
        return target, drafter
    for path in (target, drafter):
        path.mkdir(parents=True, exist_ok=True)
    save_file(_llama_tensors(0), str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(_config(max_seq_len)))
    tensors = _llama_tensors(1)
    ids = torch.arange(DRAFT_HEAD, dtype=torch.int64)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][ids].clone()
    tensors["draft_vocab_ids"] = ids
    tensors["model.feature_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
    tensors["model.feature_staleness"] = torch.zeros(4, HIDDEN)
    save_file(tensors, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text(json.dumps({**_config(max_seq_len), "tie_word_embeddings": False}))
    (drafter / "specd_drafter.json").write_text(json.dumps({"version": "free-1"}))
    return target, drafter


class FreeForward:
    """ModelRunner._forward's interface, answering at once: logits peaked at TOKEN, zero hidden states.

    The logits are views of one buffer filled with that row once, grown as needed: each row contiguous in
    memory, as a real forward's are (a broadcast view of one row, which the bench used before, made the
    target's argmax over the vocabulary 3.5x slower than on real logits: docs/decisions/cpu-argmax.md).
    The hidden states are a broadcast view of one zero row. The bench runs greedy requests, whose path
    never writes into logits; a caller that did would change what later calls return, which the
    bench's tokens per step would show (every draft is accepted only while the logits peak at TOKEN)."""

    def __init__(self, model, moving: bool = False) -> None:
        """moving: the peak moves to a new token at every call (UnpredictableTargetWorker; a model with
        the full vocabulary as its head, as a target has)."""
        if moving and model.draft_vocab_ids is not None:
            raise ValueError("a moving peak needs a model whose head is the full vocabulary")
        self.model = model
        self.calls = 0
        self.moving = moving
        self._peak = TOKEN
        self._rows: dict[bool, torch.Tensor] = {}
        self._logits: dict[bool, torch.Tensor] = {}     # [rows, positions, width] copies of _row
        dtype, device = model.embed_tokens.dtype, model.embed_tokens.device
        self._hidden = torch.zeros(model.cfg.hidden_size, dtype=dtype, device=device)

    def _row(self, full_vocab: bool) -> torch.Tensor:
        row = self._rows.get(full_vocab)
        if row is None:
            model = self.model
            reduced = model.draft_vocab_ids is not None
            width = model.head_size if reduced and not full_vocab else model.cfg.vocab_size
            fill = float("-inf") if reduced and full_vocab else -10.0
            row = torch.full((width,), fill, dtype=model.embed_tokens.dtype, device=model.embed_tokens.device)
            if reduced:
                row[model.draft_vocab_ids if full_vocab else slice(None)] = -10.0
                column = TOKEN if full_vocab else int((model.draft_vocab_ids == TOKEN).nonzero()[0, 0])
            else:
                column = self._peak     # TOKEN, or a moving peak's current token
            row[column] = 10.0
            self._rows[full_vocab] = row
        return row

    def advance(self) -> None:
        """Count a forward; a moving peak goes to this call's token in every cached row and buffer (two
        writes per row: the old peak's column down, the new one's up)."""
        self.calls += 1
        if not self.moving:
            return
        peak = moving_token(self.calls)
        for cached in (*self._rows.values(), *self._logits.values()):
            cached[..., self._peak] = -10.0
            cached[..., peak] = 10.0
        self._peak = peak

    def __call__(self, input_ids, positions, slots, cache, attn_mask=None, logit_index=None, full_vocab=True,
                 features=None, staleness=None, return_hidden=False, counts=None):
        self.advance()
        b, n = input_ids.shape
        m = n if logit_index is None else logit_index.shape[1]
        logits = self._logits.get(full_vocab)
        if logits is None or logits.shape[0] < b or logits.shape[1] < m:
            rows = max(b, 0 if logits is None else logits.shape[0])
            positions = max(m, 0 if logits is None else logits.shape[1])
            logits = self._row(full_vocab).expand(rows, positions, -1).contiguous()
            self._logits[full_vocab] = logits
        logits = logits[:b, :m]
        if return_hidden:
            return logits, self._hidden.expand(b, n, -1)
        return logits


def moving_token(call: int) -> int:
    """The moving peak of the call'th forward: steps through 40,000 tokens of the vocabulary in an order
    that repeats no token within 40,000 calls (7919 is prime to 40,000), never EOS or TOKEN."""
    return 6 + (call * 7919) % 40000


def free_runner(runner, moving: bool = False) -> FreeForward:
    """Replace a ModelRunner's forward by a FreeForward. With decode=static (the GPU path's logic, run
    eagerly) the static decoder's padded forward answers at once too, so its bucketing, input staging and
    output copies are what is measured."""
    if runner.static is not None and runner.static.capture:
        raise ValueError("free forwards cannot be captured as CUDA graphs: run with decode=eager or static")
    forward = runner._forward = FreeForward(runner.model, moving=moving)
    if runner.static is not None:
        def run(bufs, kv_len, full_vocab, return_hidden, leading):   # [bb, nb, vocab] (and [bb, nb, hidden])
            forward.advance()
            bb, nb = bufs["ids"].shape
            logits = forward._row(full_vocab).expand(bb, nb, -1)
            return (logits, forward._hidden.expand(bb, nb, -1)) if return_hidden else (logits,)
        def run_chain(bufs, kv_len, steps, leading):   # [bb, steps] target ids: the stand-ins' pick
            forward.advance()
            bb = bufs["ids"].shape[0]
            return (torch.full((bb, steps), TOKEN, dtype=torch.long, device=bufs["ids"].device),)
        runner.static._run = run
        runner.static._run_chain = run_chain
    return forward


class FreeTargetWorker(TargetWorker):
    moving = False

    def __init__(self, cfg, seed: int = 0, cache_dir: str | None = None):
        super().__init__(cfg, seed=seed, cache_dir=cache_dir)
        free_runner(self.runner, moving=self.moving)


class UnpredictableTargetWorker(FreeTargetWorker):
    """Free forwards whose peak moves at every call: no draft and no lookup is ever accepted."""

    moving = True


class FreeDraftWorker(DraftWorker):
    def __init__(self, cfg, spec, target_model_dir: str, seed: int = 0, cache_dir: str | None = None):
        super().__init__(cfg, spec, target_model_dir, seed=seed, cache_dir=cache_dir)
        weights = self.drafter.weights_drafter
        if weights is not None:
            free_runner(weights.runner)
