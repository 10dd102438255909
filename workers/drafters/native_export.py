"""The model drafter as a plain Hugging Face Llama checkpoint, for proposers that are not specd's own.

vLLM's `draft_model` speculative method loads a draft model as an ordinary causal LM over the target's
vocabulary. specd's model drafter is one (a small Llama on the target's tokenizer) except for its head:
often reduced to the target ids in `draft_vocab_ids` [V_sub], with `lm_head.weight` [V_sub, hidden]. The
export scatters those rows into a full [V, hidden] head and drops the id list; every other tensor keeps
its name and shape.

Invariant of the export: on every target id the drafter's head scores, the exported model's logit is
the drafter's. Ids outside its vocabulary score 0 instead of the drafter's -inf (vLLM's Llama head has no
bias to carry -inf), so a draft differs only where every in-vocabulary logit is negative; on open-chat
text that was 0 of 648 positions for the quick drafter (docs/decisions/vllm-native-drafter.md). Output
stays exact either way: the target verifies every draft.

A hidden-state drafter (`model.feature_proj`) reads the target's hidden states, which vLLM's draft_model
proposer does not hand over: exporting one is refused rather than served without its inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specd.workers.models.llama import DRAFT_VOCAB_IDS

HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
HIDDEN_ONLY = ("model.feature_proj.weight", "model.feature_staleness")
SPECD_CONFIG_KEYS = ("specd_draft_vocab_size",)
WEIGHTS_FILE = "model.safetensors"


def full_vocab_tensors(tensors: dict[str, torch.Tensor],
                       vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A drafter's HF-named tensors with its reduced head scattered into a full-vocabulary one.

    vocab_size: the target's vocabulary (default: the embedding's rows). Raises ValueError for a
    hidden-state drafter or a head that does not fit the vocabulary."""
    hidden = [name for name in HIDDEN_ONLY if name in tensors]
    if hidden:
        raise ValueError(f"a hidden-state drafter ({hidden[0]}) needs the target's hidden states, which "
                         "vLLM's draft_model proposer does not pass: serve a token-only drafter "
                         "(drafter.target_hidden=false)")
    out = {name: t for name, t in tensors.items() if name != DRAFT_VOCAB_IDS}
    if HEAD not in out and EMBED in out:
        out[HEAD] = out[EMBED]                        # a tied head, written out for the reader
    vocab = vocab_size or int(out[EMBED].shape[0])
    ids = tensors.get(DRAFT_VOCAB_IDS)
    head = out[HEAD]                                  # [V_sub or V, hidden]
    if ids is None:
        if head.shape[0] != vocab:
            raise ValueError(f"head of {head.shape[0]} rows without {DRAFT_VOCAB_IDS}, vocabulary {vocab}")
        return out
    ids = ids.long()                                  # [V_sub]
    if ids.numel() != head.shape[0] or int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"{DRAFT_VOCAB_IDS} ({ids.numel()} ids) does not index a vocabulary of {vocab} "
                         f"for a head of {head.shape[0]} rows")
    full = torch.zeros(vocab, head.shape[1], dtype=head.dtype)   # [V, hidden]
    full[ids] = head
    out[HEAD] = full
    return out


def export_native_dir(src: str | Path, out: str | Path) -> Path:
    """Write drafter directory `src` to `out` as a plain Llama checkpoint a draft_model proposer loads;
    returns `out`."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    for key in SPECD_CONFIG_KEYS:
        config.pop(key, None)
    config["tie_word_embeddings"] = False           # the head is its own tensor after the scatter
    write_update_file(load_file(str(src / WEIGHTS_FILE)), out / WEIGHTS_FILE, int(config["vocab_size"]))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def write_update_file(tensors: dict[str, torch.Tensor], path: str | Path, vocab_size: int) -> Path:
    """Tensors of the drafter (or of a published version of it) in the exported checkpoint's form, as one
    safetensors file: the export's weights, and what the vLLM weight-transfer engine of vllm_weights.py
    loads into the running draft model."""
    native = full_vocab_tensors(tensors, vocab_size)
    save_file({k: v.contiguous() for k, v in native.items()}, str(path))
    return Path(path)


def check_same_shapes(reference: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """Raise VersionError unless `tensors` have exactly the reference's names and shapes (the serving
    drafter's, read from its file), so an update cannot fail half-way inside the engine."""
    from specd.workers.drafters.versions import VersionError

    names = set(tensors)
    if names != set(reference):
        missing, extra = sorted(set(reference) - names), sorted(names - set(reference))
        raise VersionError(f"tensor names differ from the serving drafter's: missing {missing[:3]}, "
                           f"unexpected {extra[:3]}")
    for name, t in tensors.items():
        if tuple(t.shape) != reference[name]:
            raise VersionError(f"{name}: shape {tuple(t.shape)} != serving drafter's {reference[name]}")


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a safetensors file, read from its header."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
