"""Publishing online drafter versions: trained weights only, with metadata, written atomically.

The layout and the reader live in workers/drafters/versions.py (DraftWorkers read it); this is the
writer. The embedding, taken from the target and frozen, is not written: the metadata references it
by the target's checksum and tensor name. The last `keep` versions stay on disk (and always the
serving one and its parent), so rollbacks have somewhere to go.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from specd.workers.drafters.versions import (
    CURRENT_FILE,
    META_FILE,
    VERSIONS_DIR,
    WEIGHTS_FILE,
    read_current,
    read_meta,
    sha256_file,
    version_dir,
    write_current,
)

# Drafter tensors that are the target's own (frozen during training): drafter name -> target name.
TARGET_TENSORS = {"model.embed_tokens.weight": "model.embed_tokens.weight"}


class VersionStore:
    def __init__(self, root: str | Path, keep: int = 5):
        self.root = Path(root)
        self.keep = max(2, keep)
        (self.root / VERSIONS_DIR).mkdir(parents=True, exist_ok=True)

    def current(self) -> str | None:
        return read_current(self.root)

    def meta(self, version: str) -> dict:
        return read_meta(version_dir(self.root, version))

    def versions(self) -> list[str]:
        """Published versions, oldest first."""
        vdirs = [p for p in (self.root / VERSIONS_DIR).iterdir() if p.is_dir() and not p.name.startswith(".")]
        return [p.name for p in sorted(vdirs, key=lambda p: read_meta(p).get("seq", 0))]

    def publish(self, state_dict: dict[str, torch.Tensor], config: dict, *, version: str | None,
                parent: str | None, target_checksum: str, make_current: bool = True, **meta) -> str:
        """Write a version (trained tensors only) and, by default, point CURRENT at it; returns its name."""
        trained = {
            k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in TARGET_TENSORS
        }
        seq = 1 + max((self.meta(v).get("seq", 0) for v in self.versions()), default=0)
        tmp = self.root / VERSIONS_DIR / f".tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_file(trained, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            os.chmod(tmp / WEIGHTS_FILE, 0o644)
            digest = sha256_file(tmp / WEIGHTS_FILE)
            version = version or f"online-{seq:04d}-{digest[:8]}"
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            full = {
                **meta, "version": version, "parent_version": parent, "seq": seq, "sha256": digest,
                "target_checksum": target_checksum, "target_tensors": TARGET_TENSORS,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
            (tmp / META_FILE).write_text(json.dumps(full, indent=2) + "\n")
            dest = version_dir(self.root, version)
            if dest.exists():
                raise FileExistsError(f"version {version} is already published")
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if make_current:
            write_current(self.root, version)
        self._prune()
        return version

    def roll_back(self, version: str) -> str:
        """Point CURRENT at `version`'s parent; returns the parent."""
        parent = self.meta(version).get("parent_version")
        if not parent or not version_dir(self.root, parent).is_dir():
            raise FileNotFoundError(f"{version} has no parent on disk to roll back to")
        write_current(self.root, parent)
        return parent

    def _prune(self) -> None:
        versions = self.versions()
        current = self.current()
        protect = {current}
        if current:
            protect.add(self.meta(current).get("parent_version"))
        for old in versions[: max(0, len(versions) - self.keep)]:
            if old not in protect:
                shutil.rmtree(version_dir(self.root, old), ignore_errors=True)


__all__ = ["VersionStore", "TARGET_TENSORS", "CURRENT_FILE"]
