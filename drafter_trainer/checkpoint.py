"""The online trainer's own state on disk, so that a restart resumes training instead of starting over.

    <store root>/trainer-state/LATEST        the newest complete checkpoint's directory name
    <store root>/trainer-state/ckpt-<n>/
        candidate.safetensors                 the candidate's trained tensors (the embedding is the target's)
        optimizer.safetensors                 AdamW's per-parameter tensors, keys "<param index>.<name>"
        trainer.json                          param groups, the lr scheduler, the counters, the serving
                                              version the candidate was trained from, sha256 of both files

Only safetensors and JSON: nothing here is unpickled. Written like a published version
(drafter_trainer/durable.py): a temporary directory, every file fsynced, renamed into place, then LATEST
replaced durably and older checkpoints removed; a crash leaves the previous checkpoint whole. A
checkpoint whose files do not match their recorded sha256 is ignored (the trainer starts from the
serving version). The directory is the trainer's private state: it is not part of the version store
DraftWorkers read, and on a cluster it belongs on the trainer's own disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from specd.drafter_trainer.durable import rename_durably, sync_tree, write_text

log = logging.getLogger(__name__)
STATE_DIR = "trainer-state"
LATEST_FILE = "LATEST"
FORMAT = 1


@dataclass
class TrainerState:
    candidate: dict[str, torch.Tensor]
    optimizer: dict                 # torch.optim state_dict() form
    scheduler: dict
    serving_version: str
    counters: dict


def save_state(root: str | Path, state: TrainerState) -> Path:
    """Write `state` as the newest checkpoint under root/trainer-state; raises OSError (a full disk) with
    the previous checkpoint intact."""
    base = Path(root) / STATE_DIR
    base.mkdir(parents=True, exist_ok=True)
    latest = read_latest(base)
    seq = int(latest.split("-")[1]) + 1 if latest else 1
    tmp = base / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        opt_tensors, opt_rest = _split_optimizer(state.optimizer)
        files = {"candidate.safetensors": save({k: v.detach().cpu().contiguous()
                                                for k, v in state.candidate.items()}),
                 "optimizer.safetensors": save(opt_tensors)}
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        meta = {"format": FORMAT, "serving_version": state.serving_version, "optimizer": opt_rest,
                "scheduler": state.scheduler, "counters": state.counters,
                "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1) + "\n")
        sync_tree(tmp)
        name = f"ckpt-{seq:06d}"
        rename_durably(tmp, base / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text(base / LATEST_FILE, name + "\n")
    for old in base.iterdir():
        if old.is_dir() and old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return base / name


def load_state(root: str | Path) -> TrainerState | None:
    """The newest checkpoint, or None when there is none or it is damaged (logged)."""
    base = Path(root) / STATE_DIR
    name = read_latest(base)
    if name is None:
        return None
    ckpt = base / name
    try:
        meta = json.loads((ckpt / "trainer.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint format {meta.get('format')}, this code reads {FORMAT}")
        blobs = {}
        for file, digest in meta["sha256"].items():
            blobs[file] = (ckpt / file).read_bytes()
            if hashlib.sha256(blobs[file]).hexdigest() != digest:
                raise ValueError(f"{file} does not match its sha256")
        candidate = load(blobs["candidate.safetensors"])
        optimizer = _join_optimizer(load(blobs["optimizer.safetensors"]), meta["optimizer"])
    except (OSError, ValueError, KeyError) as exc:
        log.error("trainer checkpoint %s unusable, starting from the serving version: %s", ckpt, exc)
        return None
    return TrainerState(candidate, optimizer, meta["scheduler"], meta["serving_version"], meta["counters"])


def read_latest(base: Path) -> str | None:
    try:
        name = (base / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return name if name.startswith("ckpt-") else None


def _split_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors "<index>.<name>", the JSON rest) of an optimizer's state_dict()."""
    tensors, scalars = {}, {}
    for index, entries in sd["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *rest.get("scalars", {}).items()]:
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}
