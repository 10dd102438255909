"""Published online drafter versions on disk, and how a DraftWorker reads and checks one.

Layout of a version store (written by drafter_trainer/publish.py, atomically):

    <root>/CURRENT                    the version serving should use (one line)
    <root>/PINNED                     the version drafter.version_pin serves, if any (never pruned)
    <root>/versions/<version>/
        model.safetensors             the trained weights only; the embedding is the target's
        config.json                   the drafter's config
        specd_drafter.json            {"version", "parent_version", "sha256", "target_checksum",
                                       "target_tensors": {drafter name: target name}, "gate", ...}

Tensors taken from the target are referenced by the target's checksum and read from the target's
own files at load time, never copied. A version whose weights do not hash to the recorded sha256,
whose target checksum is not the serving target's, or whose tensors do not fit the running drafter
is rejected with VersionError, before any weight of the running drafter is touched.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

CURRENT_FILE = "CURRENT"
PIN_FILE = "PINNED"
VERSIONS_DIR = "versions"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specd_drafter.json"


class VersionError(ValueError):
    """A published version that must not be served (corrupt, for another target, wrong shapes)."""


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _checksum_cached(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in files:
        h.update(sha256_file(path).encode())
    return h.hexdigest()


def target_checksum(target_dir: str | Path) -> str:
    """sha256 over the sha256 of each of the target's safetensors files (cached per size and mtime)."""
    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        raise VersionError(f"{target_dir}: no safetensors files")
    return _checksum_cached(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def read_current(root: str | Path) -> str | None:
    path = Path(root) / CURRENT_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def write_current(root: str | Path, version: str) -> None:
    """Point CURRENT at `version` atomically (a reader sees the old or the new line, never half)."""
    root = Path(root)
    tmp = root / f".{CURRENT_FILE}.tmp-{os.getpid()}"
    tmp.write_text(version + "\n")
    os.replace(tmp, root / CURRENT_FILE)


def read_pin(root: str | Path) -> str | None:
    """The pinned version (drafter.version_pin) recorded in the store, if any."""
    try:
        return (Path(root) / PIN_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def check_version_exists(root: str | Path, version: str) -> None:
    """Raise VersionError unless `version` is a published version of the store at `root` (what pinning
    one requires; drafter.version_pin's validation can call this)."""
    vdir = version_dir(root, version)
    if not (vdir / META_FILE).is_file():
        raise VersionError(f"version {version!r} is not published in {root}")


def write_pin(root: str | Path, version: str | None) -> None:
    """Record the pinned version in the store (None: unpin), so that the trainer never prunes it; raises
    VersionError for a version that is not published. Written durably (fsync, rename, fsync)."""
    root = Path(root)
    path = root / PIN_FILE
    if version is None:
        path.unlink(missing_ok=True)
        return
    check_version_exists(root, version)
    tmp = root / f".{PIN_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    # The trainer prunes without a lock: had it removed the version between the check and the write,
    # the pin must not stand.
    if not version_dir(root, version).is_dir():
        path.unlink(missing_ok=True)
        raise VersionError(f"version {version!r} was pruned while being pinned")


def version_dir(root: str | Path, version: str) -> Path:
    if not version or "/" in version or version.startswith("."):
        raise VersionError(f"bad version name {version!r}")
    return Path(root) / VERSIONS_DIR / version


def read_meta(vdir: str | Path) -> dict:
    try:
        return json.loads((Path(vdir) / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise VersionError(f"{vdir}: unreadable {META_FILE}: {exc}") from exc


def parent_held_out_acceptance(meta: dict) -> float | None:
    """The greedy match of the version this one replaced, scored by the same gate on the same held-out
    records (an online version's `gate.serving`); None for a version no gate judged. Beside the version's
    own figure it says how much better the gate found it, on a like basis."""
    match = meta.get("gate", {}).get("serving", {}).get("greedy_match")
    return float(match) if isinstance(match, int | float) and 0.0 < match <= 1.0 else None


def held_out_acceptance(meta: dict) -> float | None:
    """The share of target tokens the drafter's greedy choice matched on data it was not trained on, about
    what its first drafts get accepted: the version's own `held_out_acceptance` (an online version: its
    gate's score on held-out replayed traffic; the trainer copies a base drafter's), else the bootstrap's
    train.eval_after.greedy_match; None where the record has neither (a drafter from elsewhere). The
    planner seeds its acceptance counts with it: a flat prior instead had a swapped-in version draft far
    more than it earned (docs/decisions/version-acceptance-prior.md)."""
    match = meta.get("held_out_acceptance")
    if match is None:
        match = meta.get("train", {}).get("eval_after", {}).get("greedy_match")
    return float(match) if isinstance(match, int | float) and 0.0 <= match <= 1.0 else None


def load_version(vdir: str | Path, target_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(full HF-named tensors, meta) of a published version, verified; raises VersionError."""
    vdir = Path(vdir)
    meta = read_meta(vdir)
    weights = vdir / WEIGHTS_FILE
    if not weights.is_file() or sha256_file(weights) != meta.get("sha256"):
        raise VersionError(f"{vdir.name}: {WEIGHTS_FILE} does not match the recorded sha256")
    want = target_checksum(target_dir)
    if meta.get("target_checksum") != want:
        raise VersionError(f"{vdir.name}: trained for target {str(meta.get('target_checksum'))[:12]}, "
                           f"serving target is {want[:12]}")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise VersionError(f"{vdir.name}: unreadable weights: {exc}") from exc
    refs: dict[str, str] = meta.get("target_tensors", {})
    for name, target_name in refs.items():
        tensors[name] = _target_tensor(target_dir, target_name)
    return tensors, meta


def _target_tensor(target_dir: str | Path, name: str) -> torch.Tensor:
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                return f.get_tensor(name)
    raise VersionError(f"target has no tensor {name!r}")


def check_fits(model, tensors: dict[str, torch.Tensor]) -> None:
    """Raise VersionError unless `tensors` cover exactly the running Llama's parameters with their
    shapes, so that loading them cannot fail half-way (model: specd.workers.models.llama.Llama)."""
    expected = model._expected_hf_names()
    missing = expected - set(tensors)
    if missing:
        raise VersionError(f"missing tensors: {sorted(missing)[:3]}")
    for name, t in tensors.items():
        target = model._hf_targets(name)
        if target is None:
            if name != "lm_head.weight":
                raise VersionError(f"unexpected tensor {name!r}")
            continue
        param, rows, _ = target
        shape = param.shape if rows is None else param[rows].shape
        if tuple(shape) != tuple(t.shape):
            raise VersionError(f"{name}: shape {tuple(t.shape)} != serving drafter's {tuple(shape)}")
