"""Writing files so that a crash or power loss leaves the old state or the new one, never half of one.

rename() is atomic, but without fsync the renamed file's data may not be on disk yet (after a power loss
the new name can point at an empty or truncated file), and the rename itself lives in the directory,
which needs its own fsync. So: write a temporary file in the same directory, fsync it, rename it over
the destination, fsync the directory. A directory of files is made the same way: each file fsynced, the
directory fsynced, renamed into place, the parent fsynced.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (its entries: names created, renamed or removed in it)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` durably: a reader sees the old or the new content, before and after a
    crash. On failure (a full disk) the old file is untouched and no temporary file is left."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text(path: str | Path, text: str, mode: int = 0o644) -> None:
    write_bytes(path, text.encode(), mode)


def sync_tree(directory: str | Path) -> None:
    """fsync every file in `directory` (not recursive) and then the directory itself."""
    directory = Path(directory)
    for p in directory.iterdir():
        if p.is_file():
            fsync_path(p)
    fsync_path(directory)


def rename_durably(src: str | Path, dst: str | Path) -> None:
    """rename src (a synced file or directory) to dst and fsync the directories of both names."""
    src, dst = Path(src), Path(dst)
    os.rename(src, dst)
    fsync_path(dst.parent)
    if src.parent != dst.parent:
        fsync_path(src.parent)
