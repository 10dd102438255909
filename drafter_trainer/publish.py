"""Publishing online drafter versions: trained weights only, with metadata, written atomically and durably.

The layout and the reader live in workers/drafters/versions.py (DraftWorkers read it); this is the
writer. The embedding, taken from the target and frozen, is not written: the metadata references it
by the target's checksum and tensor name. The last `keep` versions stay on disk (and always the
serving one, its parent and the pinned one, drafter.version_pin), so rollbacks have somewhere to go.

Crash safety (drafter_trainer/durable.py): a version is written into a temporary directory, every file
and the directory fsynced, renamed into versions/ and versions/ fsynced; only then is CURRENT replaced
(temporary file, fsync, rename, fsync of the root). After a crash or power loss CURRENT names a complete
version. A failed publish (a full disk) raises OSError with CURRENT untouched and nothing left behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save

from specd.drafter_trainer.durable import rename_durably, sync_tree, write_text
from specd.workers.drafters.versions import (
    CURRENT_FILE,
    META_FILE,
    VERSIONS_DIR,
    WEIGHTS_FILE,
    VersionError,
    read_current,
    read_meta,
    read_pin,
    version_dir,
)

# Drafter tensors that are the target's own (frozen during training): drafter name -> target name.
TARGET_TENSORS = {"model.embed_tokens.weight": "model.embed_tokens.weight"}


class VersionStore:
    def __init__(self, root: str | Path, keep: int = 5):
        self.root = Path(root)
        self.keep = max(2, keep)
        (self.root / VERSIONS_DIR).mkdir(parents=True, exist_ok=True)

    def _seq(self, version: str) -> int:
        """A version's sequence number; 0 for a directory whose metadata is unreadable (pruned first)."""
        try:
            return int(self.meta(version).get("seq", 0))
        except VersionError:
            return 0

    def current(self) -> str | None:
        return read_current(self.root)

    def meta(self, version: str) -> dict:
        return read_meta(version_dir(self.root, version))

    def versions(self) -> list[str]:
        """Published versions, oldest first."""
        vdirs = [p for p in (self.root / VERSIONS_DIR).iterdir() if p.is_dir() and not p.name.startswith(".")]
        return [p.name for p in sorted(vdirs, key=lambda p: self._seq(p.name))]

    def publish(self, state_dict: dict[str, torch.Tensor], config: dict, *, version: str | None,
                parent: str | None, target_checksum: str, make_current: bool = True, **meta) -> str:
        """Write a version (trained tensors only) and, by default, point CURRENT at it; returns its name."""
        trained = {
            k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in TARGET_TENSORS
        }
        seq = 1 + max((self._seq(v) for v in self.versions()), default=0)
        tmp = self.root / VERSIONS_DIR / f".tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            weights = save(trained, metadata={"format": "pt"})
            digest = hashlib.sha256(weights).hexdigest()
            _write(tmp / WEIGHTS_FILE, weights)
            version = version or f"online-{seq:04d}-{digest[:8]}"
            _write(tmp / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
            full = {
                **meta, "version": version, "parent_version": parent, "seq": seq, "sha256": digest,
                "target_checksum": target_checksum, "target_tensors": TARGET_TENSORS,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
            _write(tmp / META_FILE, (json.dumps(full, indent=2) + "\n").encode())
            dest = version_dir(self.root, version)
            if dest.exists():
                raise FileExistsError(f"version {version} is already published")
            sync_tree(tmp)
            rename_durably(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if make_current:
            write_current_durably(self.root, version)
        self._prune()
        return version

    def roll_back(self, version: str) -> str:
        """Point CURRENT at `version`'s parent; returns the parent."""
        parent = self.meta(version).get("parent_version")
        if not parent or not version_dir(self.root, parent).is_dir():
            raise FileNotFoundError(f"{version} has no parent on disk to roll back to")
        write_current_durably(self.root, parent)
        return parent

    def protected(self) -> set[str]:
        """Versions never pruned: CURRENT, its parent, and the pinned one (drafter.version_pin)."""
        current = self.current()
        protect = {v for v in (current, read_pin(self.root)) if v}
        if current:
            with contextlib.suppress(VersionError):
                protect.add(self.meta(current).get("parent_version"))
        return protect

    def _prune(self) -> None:
        versions = self.versions()
        protect = self.protected()
        for old in versions[: max(0, len(versions) - self.keep)]:
            if old not in protect:
                shutil.rmtree(version_dir(self.root, old), ignore_errors=True)


def write_current_durably(root: str | Path, version: str) -> None:
    """Point CURRENT at `version`: atomic for readers, and on disk before this returns."""
    write_text(Path(root) / CURRENT_FILE, version + "\n")


def _write(path: Path, data: bytes) -> None:
    """A new file of a version being assembled (synced with its directory before the rename)."""
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o644)


__all__ = ["VersionStore", "TARGET_TENSORS", "CURRENT_FILE", "write_current_durably"]
