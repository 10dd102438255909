"""Replay records -> training examples with the target's signal, and the drafter as a trainable student.

The target's signal is recomputed here with one teacher forward over prompt + output (see
proto/specd/v1/replay.proto for why), which also yields the target's hidden states a hidden-state
drafter reads. A record that already carries the target's top-k (the vLLM backend) skips the forward
unless hidden states are needed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.drafter_trainer.distill import DrafterLM
from specd.drafter_trainer.hidden_stage import HiddenDrafterLM, input_features
from specd.drafter_trainer.losses import position_weights
from specd.proto.replay_codec import tensor_to_torch
from specd.proto.specd.v1.replay_pb2 import ReplayRecord

FEATURE_PROJ = "model.feature_proj.weight"


@dataclass
class Example:
    """One served request, teacher-labelled. Label j is the target's distribution of the token at
    sequence index first_label + j + 1, predicted at index first_label + j. The first n_prompt_labels
    labels are prompt positions (trainer.prompt_weight > 0), the rest the output's."""

    entry_id: str
    token_ids: torch.Tensor  # [L] int64, prompt + output
    first_label: int  # len(prompt) - 1 - n_prompt_labels
    topk_logprobs: torch.Tensor  # [n, k] float32, n = len(output)
    topk_ids: torch.Tensor  # [n, k] int64
    weights: torch.Tensor  # [n] position weights (losses.position_weights)
    step_position: torch.Tensor  # [n] int64: index of the label within its step's drafts (0 = first)
    in_step: torch.Tensor  # [n] bool: the gate scores the label (see draft_positions)
    states: torch.Tensor | None = None  # [L, H] bfloat16 target final hidden states
    domain: str = ""
    versions: list[tuple[str, int, int]] = field(default_factory=list)  # (version, drafted, accepted)
    n_prompt_labels: int = 0

    @property
    def n_labels(self) -> int:
        return int(self.topk_ids.shape[0])


def record_steps(record: ReplayRecord) -> list[tuple[int, int, int, str]]:
    """(output_offset, drafted, accepted, drafter version) per step; a tree counts its accepted path."""
    names = list(record.drafter_versions)
    out = []
    for s in record.steps:
        if s.parents:
            drafted = min(int(s.accepted) + (0 if s.bonus else 1), len(s.drafted))
        else:
            drafted = len(s.drafted) + int(s.unseen_drafted)
        version = names[s.drafter_version] if names else ""
        out.append((int(s.output_offset), drafted, int(s.accepted), version))
    return out


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX). Without it oneDNN
    emulates bfloat16 and the trainer's matmuls get slower, not faster."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def trainer_dtype(name: str, device: str, cpuinfo: str | None = None) -> torch.dtype:
    """trainer.dtype: "auto" is bfloat16 on CUDA and on CPUs with native bfloat16, float32 elsewhere.

    The trainer's work is large matmuls (a teacher forward over whole records, a training step over
    8 of them), where bfloat16 pays on such a CPU, unlike the target's small decode steps (float32 there,
    workers/models/runner.py resolve_dtype)."""
    if name == "auto":
        if device == "cuda" or cpu_has_native_bf16(cpuinfo):
            return torch.bfloat16
        return torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        # float16 would need loss scaling, which the trainer does not do.
        raise ValueError(f"trainer.dtype {name!r} is not supported; choose from {sorted(dtypes)} or auto")
    return dtypes[name]


class TargetTeacher:
    """The target on the trainer's device: top-k log-probabilities (and hidden states) of whole records.

    dtype bfloat16 (trainer.dtype's default on a CPU with native bfloat16) labels as float32 does up to
    rounding, in less time (docs/decisions/trainer-precision.md)."""

    def __init__(self, target_dir: str | Path, top_k: int = 32, device: str = "cpu", max_seq_len: int = 4096,
                 chunk: int = 256, dtype: torch.dtype = torch.float32):
        from specd.workers.models.runner import ModelRunner

        self.runner = ModelRunner(target_dir, device=device, dtype=dtype, max_slots=1,
                                  max_seq_len=max_seq_len)
        self.top_k = top_k
        self.chunk = chunk
        self.max_seq_len = max_seq_len

    @torch.inference_mode()
    def label(self, token_ids: list[int], first_label: int, need_hidden: bool):
        """(topk_logprobs [n, k], topk_ids [n, k], states [L, H] or None) for positions first_label.."""
        slot = self.runner.allocate()
        lps, ids, states = [], [], []
        try:
            for begin in range(0, len(token_ids), self.chunk):
                chunk = token_ids[begin : begin + self.chunk]
                logits, hidden = self.runner.extend([slot], [chunk], return_hidden=True)
                lo = max(first_label - begin, 0)
                rows = logits[0, lo : len(chunk)]  # [m, V] predicting tokens begin+lo+1 ..
                if rows.shape[0]:
                    v, i = F.log_softmax(rows.float(), -1).topk(self.top_k, -1)
                    lps.append(v)
                    ids.append(i)
                if need_hidden:
                    states.append(hidden[0, : len(chunk)].to(torch.bfloat16))
        finally:
            self.runner.free(slot)
        n = len(token_ids) - 1 - first_label  # the last token predicts nothing we keep
        lp, ix = torch.cat(lps)[:n], torch.cat(ids)[:n]
        return lp, ix.long(), torch.cat(states) if need_hidden else None


def draft_positions(
    n: int, steps: list[tuple[int, int, int, str]], chain: int
) -> tuple[torch.Tensor, torch.Tensor]:  # [n] int64, [n] bool
    """(step_position, scored) of each output label, for the gate.

    A label verified by a step that drafted sits at its place in that step's drafts. Labels no drafted
    step covered (the policy drafted nothing there: γ = 0, a paused drafter) are split into chains of
    `chain`, as if drafted from their first label: without them the gate saw only the traffic where
    drafting already paid, and a domain where the drafter had stopped drafting could never show that
    a candidate improved on it (`specd bench osd`: HumanEval's records carried no drafted step and no
    candidate was published past its first 114 requests). The first output label (the prefill's
    token, which no drafter proposes) is not scored."""
    step_position = torch.zeros(n, dtype=torch.long)
    scored = torch.zeros(n, dtype=torch.bool)
    for offset, drafted, accepted, _ in steps:
        end = min(offset + accepted + 1, n)
        if drafted > 0 and offset < end:
            step_position[offset:end] = torch.arange(end - offset)
            scored[offset:end] = True
    run = 0
    for i in range(1, n):
        if scored[i]:
            run = 0
            continue
        step_position[i] = run % chain
        run += 1
    return step_position, scored | (torch.arange(n) > 0)


def make_example(entry_id: str, record: ReplayRecord, teacher: TargetTeacher | None, *, positions: str,
                 accepted_weight: float, need_hidden: bool, chain: int = 4,
                 prompt_weight: float = 0.0) -> Example | None:
    """None for a record with nothing to learn from (no output beyond the first token). chain: the
    gate's γ, the length of the chains labels no drafted step covered are scored in (draft_positions).
    prompt_weight > 0 also labels the prompt's positions (the same teacher forward scores them) with
    that weight; the gate never scores them."""
    prompt, output = list(record.prompt_token_ids), list(record.output_token_ids)
    if len(output) < 2 or not prompt:
        return None
    tokens = prompt + output
    first = len(prompt) - 1
    steps = record_steps(record)
    n = len(output)
    with_prompt = prompt_weight > 0 and teacher is not None
    if record.HasField("teacher") and not need_hidden and not with_prompt \
            and record.teacher.first_output_position == 0:
        lp = tensor_to_torch(record.teacher.logprobs).float()[:n]
        ix = tensor_to_torch(record.teacher.ids).long()[:n]
        states = None
    else:
        if teacher is None:
            raise ValueError("records without the target's top-k need a TargetTeacher")
        if len(tokens) > teacher.max_seq_len:
            return None
        lp, ix, states = teacher.label(tokens, 0 if with_prompt else first, need_hidden)
    n_prompt = first if with_prompt else 0
    n = min(n, lp.shape[0] - n_prompt)
    step_position, in_step = draft_positions(n, steps, chain)
    weights = position_weights(n, [(o, d, a) for o, d, a, _ in steps], positions, accepted_weight)[:n]
    if n_prompt:
        # Prompt labels read states as stale as undrafted output's would be (chains of `chain`).
        step_position = torch.cat([torch.arange(n_prompt) % chain, step_position])
        in_step = torch.cat([torch.zeros(n_prompt, dtype=torch.bool), in_step])
        weights = torch.cat([torch.full((n_prompt,), float(prompt_weight)), weights])
    return Example(
        entry_id=entry_id, token_ids=torch.tensor(tokens[: first + 1 + n]), first_label=first - n_prompt,
        topk_logprobs=lp[: n_prompt + n], topk_ids=ix[: n_prompt + n], weights=weights,
        step_position=step_position, in_step=in_step, states=states, domain=record.domain,
        versions=[(v, d, a) for _, d, a, v in steps], n_prompt_labels=n_prompt,
    )


class Student:
    """The drafter being trained: a token drafter (DrafterLM) or a hidden-state one (HiddenDrafterLM).

    Its frozen part, the embedding taken from the target, is never trained."""

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor]):
        base = DrafterLM(config, state_dict["draft_vocab_ids"])
        self.hidden = FEATURE_PROJ in state_dict
        if self.hidden:
            staleness = int(state_dict["model.feature_staleness"].shape[0])
            self.module = HiddenDrafterLM(base, staleness)
            self.module.config = dict(config)
        else:
            self.module = base
        base.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
        base.freeze_embeddings()
        self.base = base
        self.config = dict(config)
        self.vocab_ids = base.draft_vocab_ids
        self.vocab_size = int(config["vocab_size"])

    def parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.base.state_dict().items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.base.load_state_dict(sd, strict=True)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def logits(self, examples: list[Example], gen: torch.Generator | None = None,
               fresh_fraction: float = 0.5) -> torch.Tensor:
        """Student logits at every label of `examples`, concatenated in order: [Σ n, V_sub].

        A hidden-state drafter reads, at the label's input, the state the serving drafter would read:
        with gen None the k-th draft of a step reads a state k steps stale (as in serving); with gen,
        a random mix of fresh and stale states (as the bootstrap trained it)."""
        t = max(int(e.token_ids.numel()) for e in examples)
        ids = torch.zeros(len(examples), t, dtype=torch.long)
        mask = torch.zeros(len(examples), t, dtype=torch.bool)
        feats = stale = None
        if self.hidden:
            hsize = self.base.model.config.hidden_size
            feats = torch.zeros(len(examples), t, hsize)
            stale = torch.zeros(len(examples), t, dtype=torch.long)
        for b, e in enumerate(examples):
            n_tok = int(e.token_ids.numel())
            ids[b, :n_tok] = e.token_ids
            mask[b, e.first_label : e.first_label + e.n_labels] = True
            if self.hidden:
                s = torch.zeros(n_tok, dtype=torch.long)
                if gen is None:
                    s[e.first_label : e.first_label + e.n_labels] = e.step_position
                else:
                    drawn = torch.randint(1, self.module.staleness, (n_tok,), generator=gen)
                    s = torch.where(torch.rand(n_tok, generator=gen) < fresh_fraction, 0, drawn)
                s = s.clamp(max=self.module.staleness - 1)
                stale[b, :n_tok] = s
                feats[b, :n_tok] = input_features(e.states.float(), s)
        h = self.module.hidden_states(ids, feats, stale) if self.hidden else self.base.hidden_states(ids)
        return self.base.lm_head(h[mask])


def is_held_out(entry_id: str, every: int) -> bool:
    """Every `every`-th record, chosen by a stable hash of its stream id, goes to the gate, never to
    training; stable across restarts, so a resumed trainer never trains on what it scored before."""
    return every > 0 and zlib.crc32(entry_id.encode()) % every == 0
