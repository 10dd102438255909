"""A drafter directory on disk: weights, config, metadata, tokenizer; written atomically.

Layout (what the plain-torch Llama loader in workers/models expects):

    config.json          the target's HF config (its family: llama, mistral, qwen2, qwen3) with the
                         drafter's num_hidden_layers and the TARGET's vocab_size
    model.safetensors    HF tensor names of that family; lm_head.weight has only V_sub rows and
                         draft_vocab_ids [V_sub] int64 names the target token id of each row
    specd_drafter.json   {"version", "sha256", "parent_version", "target", "created", "train": {...}}
    tokenizer files      copied from the target, so the directory is self-contained

The reduced-vocabulary head gives q exactly 0 outside draft_vocab_ids: a drafter can never propose
such a token, and verification stays exact because p/q is only ever evaluated on drafted tokens.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specd.workers.drafters.versions import META_FILE, WEIGHTS_FILE, sha256_file
from specd.workers.models.config import FAMILIES

CONFIG_FILE = "config.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
DRAFT_VOCAB_KEY = "draft_vocab_ids"

# Target config keys that make no sense for a drafter cut from it.
_DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class DrafterFormatError(ValueError):
    """The directory or the tensors do not form a valid drafter."""


def make_drafter_config(target_config: Mapping[str, Any], num_layers: int, head_vocab: int) -> dict[str, Any]:
    """The drafter's config dict: the target's family and shapes with fewer layers and an untied head.

    A drafter cut from a Qwen3 target is a Qwen3 (its q/k norms and all), so the layers it copies mean
    what they meant in the target. vocab_size stays the target's full vocabulary (the embedding is the
    target's); the head size is recorded separately because no HF config has a field for a reduced head.
    """
    config = {k: v for k, v in dict(target_config).items() if k not in _DROP_CONFIG_KEYS}
    config.setdefault("model_type", "llama")
    family = config["model_type"]
    if family not in FAMILIES:
        raise DrafterFormatError(f"no drafter for model_type {family!r} (supported: {FAMILIES})")
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False, specd_draft_vocab_size=head_vocab)
    return config


def _config_dict(config: Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def check_drafter_tensors(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """Raise DrafterFormatError unless the tensors match the layout described in the module docstring."""
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", DRAFT_VOCAB_KEY):
        if key not in state_dict:
            raise DrafterFormatError(f"missing tensor {key}")
    if config.get("model_type") not in FAMILIES:
        raise DrafterFormatError(f"model_type must be one of {FAMILIES}, got {config.get('model_type')!r}")
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    embed, head, ids = (
        state_dict["model.embed_tokens.weight"],
        state_dict["lm_head.weight"],
        state_dict[DRAFT_VOCAB_KEY],
    )
    if tuple(embed.shape) != (vocab, hidden):
        raise DrafterFormatError(
            f"embed_tokens {tuple(embed.shape)} != (vocab_size, hidden) {(vocab, hidden)}"
        )
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise DrafterFormatError(f"{DRAFT_VOCAB_KEY} must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}")
    if tuple(head.shape) != (ids.numel(), hidden):
        raise DrafterFormatError(f"lm_head {tuple(head.shape)} != (len(draft_vocab_ids), hidden)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise DrafterFormatError(f"{DRAFT_VOCAB_KEY} outside [0, {vocab})")
    if torch.unique(ids).numel() != ids.numel():
        raise DrafterFormatError(f"{DRAFT_VOCAB_KEY} has duplicates")
    num_layers = int(config["num_hidden_layers"])
    for i in range(num_layers):
        if f"model.layers.{i}.self_attn.q_proj.weight" not in state_dict:
            raise DrafterFormatError(f"config has {num_layers} layers but layer {i} is missing")
    if f"model.layers.{num_layers}.self_attn.q_proj.weight" in state_dict:
        raise DrafterFormatError(f"tensors hold more than the config's {num_layers} layers")


def save_drafter(
    out_dir: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    meta: Mapping[str, Any],
    tokenizer_dir: str | Path | None = None,
    version_prefix: str = "drafter",
) -> Path:
    """Write a drafter directory atomically and return its path.

    Everything is written into a temporary sibling directory first, then renamed into place, so a
    reader (a DraftWorker hot-swapping) sees either the old drafter or the complete new one, never a
    half-written file. The metadata gets `sha256` of model.safetensors, and `version`
    (<version_prefix>-<first 8 hex of sha256>) and `created` unless the caller set them.
    """
    out_dir = Path(out_dir)
    config = _config_dict(config)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    check_drafter_tensors(tensors, config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_FILE, 0o644)  # safetensors writes 0600; DraftWorkers may run as other users
        digest = sha256_file(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        full_meta = {
            "format_version": FORMAT_VERSION,
            "version": f"{version_prefix}-{digest[:8]}",
            "parent_version": None,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            **dict(meta),
            "sha256": digest,
        }
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2) + "\n")
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    # rename() cannot replace a non-empty directory, so an existing drafter is first renamed aside;
    # the window in which out_dir is missing is two renames long and readers retry on a missing dir.
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_drafter_meta(drafter_dir: str | Path) -> dict[str, Any]:
    path = Path(drafter_dir) / META_FILE
    if not path.is_file():
        raise DrafterFormatError(f"{drafter_dir} is not a drafter directory (no {META_FILE})")
    return json.loads(path.read_text())


def load_drafter_config(drafter_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(drafter_dir) / CONFIG_FILE).read_text())


def verify_checksum(drafter_dir: str | Path) -> bool:
    """True when model.safetensors still hashes to the sha256 recorded in the metadata."""
    meta = load_drafter_meta(drafter_dir)
    weights = Path(drafter_dir) / WEIGHTS_FILE
    return weights.is_file() and sha256_file(weights) == meta.get("sha256")


def load_drafter(
    drafter_dir: str | Path, verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(state_dict, config, meta) of a drafter directory; raises DrafterFormatError when invalid."""
    if verify and not verify_checksum(drafter_dir):
        raise DrafterFormatError(f"{drafter_dir}: {WEIGHTS_FILE} does not match the recorded sha256")
    meta = load_drafter_meta(drafter_dir)
    config = load_drafter_config(drafter_dir)
    state_dict = load_file(str(Path(drafter_dir) / WEIGHTS_FILE))
    check_drafter_tensors(state_dict, config)
    return state_dict, config, meta


def read_draft_vocab_ids(drafter_dir: str | Path) -> torch.Tensor:
    """draft_vocab_ids alone, without reading the rest of the weights."""
    with safe_open(str(Path(drafter_dir) / WEIGHTS_FILE), framework="pt") as f:
        return f.get_tensor(DRAFT_VOCAB_KEY)
