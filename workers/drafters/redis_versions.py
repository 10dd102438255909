"""Published drafter versions carried by Redis, so that every DraftWorker reaches them with no shared disk.

A version is the same three files the on-disk store holds (workers/drafters/versions.py), stored as the
fields of one Redis hash; a CURRENT key names the version serving should use:

    <prefix>:CURRENT                  version name
    <prefix>:v:<version>              hash: meta (specd_drafter.json), config (config.json),
                                      chunks (count), w0 .. w<n-1> (model.safetensors, in order)
    <prefix>:seq                      sorted set: version -> its seq (the trainer prunes by it)

Writers (the router publishing the first-start drafter as version 0, the trainer publishing each gated
version) write the hash first and CURRENT last, so a reader that sees a CURRENT finds its hash complete.
Readers download a version into a store directory of their own (the same layout as the trainer's store)
and verify it there exactly as a version read from disk: sha256 of the weights, the serving target's
checksum, every tensor's shape. A Redis that is unreachable is an OSError to the reader: the serving
version stays and the next poll tries again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path

import redis
from safetensors.torch import save_file

from specd.workers.drafters.versions import (
    META_FILE,
    WEIGHTS_FILE,
    VersionError,
    load_version,
    read_current,
    sha256_file,
    version_dir,
    write_pin,
)

CONFIG_FILE = "config.json"
CHUNK_BYTES = 32 << 20      # Redis caps one value at 512 MB; smaller chunks keep replies short


class SourceUnavailable(OSError):
    """The version source (Redis) cannot be reached now; the version itself may be fine."""


def redis_client(spec: dict, socket_timeout: float | None = 5.0) -> redis.Redis:
    """spec: {"url", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"} (plain values, so it
    travels in a Ray call); the password may instead sit in the environment variable spec["password_env"]
    of the process that reads it (each Kubernetes pod has its own copy of the Secret)."""
    password = spec.get("password") or os.environ.get(spec.get("password_env") or "", "") or None
    extra = {}
    if str(spec["url"]).startswith("rediss://"):
        extra = {k: spec.get(k) for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")}
    return redis.Redis.from_url(spec["url"], password=password, socket_timeout=socket_timeout,
                                socket_connect_timeout=socket_timeout, **extra)


def _key(prefix: str, *parts: str) -> str:
    return ":".join((prefix, *parts))


def push_version(client: redis.Redis, prefix: str, vdir: str | Path, make_current: bool = True) -> str:
    """Copy the on-disk version `vdir` into Redis (its bytes unchanged, so its sha256 still holds)."""
    vdir = Path(vdir)
    meta_text = (vdir / META_FILE).read_text()
    meta = json.loads(meta_text)
    version = str(meta["version"])
    data = (vdir / WEIGHTS_FILE).read_bytes()
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    fields: dict[str, bytes | str | int] = {"meta": meta_text, "config": (vdir / CONFIG_FILE).read_text(),
                                            "chunks": len(chunks)}
    fields.update({f"w{i}": c for i, c in enumerate(chunks)})
    pipe = client.pipeline(transaction=True)
    pipe.delete(_key(prefix, "v", version))
    pipe.hset(_key(prefix, "v", version), mapping=fields)
    pipe.zadd(_key(prefix, "seq"), {version: float(meta.get("seq", 0))})
    if make_current:
        pipe.set(_key(prefix, "CURRENT"), version)
    pipe.execute()
    return version


def set_current(client: redis.Redis, prefix: str, version: str) -> None:
    if not client.exists(_key(prefix, "v", version)):
        raise VersionError(f"version {version} is not in Redis")
    client.set(_key(prefix, "CURRENT"), version)


def redis_current(client: redis.Redis, prefix: str) -> str | None:
    value = client.get(_key(prefix, "CURRENT"))
    return value.decode() if value else None


def prune(client: redis.Redis, prefix: str, keep: int, protect: set[str]) -> list[str]:
    """Delete all but the newest `keep` versions (never one in `protect`, nor the pinned one); returns the
    deleted ones."""
    pinned = client.get(_key(prefix, "pin"))
    protect = protect | ({pinned.decode()} if pinned else set())
    names = [v.decode() for v in client.zrange(_key(prefix, "seq"), 0, -1)]
    gone = [v for v in names[: max(0, len(names) - keep)] if v not in protect]
    if gone:
        pipe = client.pipeline(transaction=True)
        for v in gone:
            pipe.delete(_key(prefix, "v", v))
            pipe.zrem(_key(prefix, "seq"), v)
        pipe.execute()
    return gone


def fetch_version(client: redis.Redis, prefix: str, version: str, store_root: str | Path) -> Path:
    """Download `version` into <store_root>/versions/<version> (atomically; kept when already there)."""
    dest = version_dir(store_root, version)
    if (dest / META_FILE).is_file():
        return dest
    fields = client.hgetall(_key(prefix, "v", version))
    if not fields:
        raise VersionError(f"version {version} is not in Redis")
    try:
        n = int(fields[b"chunks"])
        data = b"".join(fields[f"w{i}".encode()] for i in range(n))
        meta, config = fields[b"meta"], fields[b"config"]
    except (KeyError, ValueError) as exc:
        raise VersionError(f"version {version}: incomplete in Redis ({exc})") from exc

    def write(tmp: Path) -> None:
        (tmp / WEIGHTS_FILE).write_bytes(data)
        (tmp / META_FILE).write_bytes(meta)
        (tmp / CONFIG_FILE).write_bytes(config)

    _write_once(dest, write)
    return dest


class DirVersionSource:
    """Versions in a store directory on this machine (the trainer's own, or a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def current(self) -> str | None:
        return read_current(self.root)

    def version_dir(self, version: str) -> Path:
        return version_dir(self.root, version)

    def pin(self, version: str | None) -> None:
        """Record drafter.version_pin in the store (never pruned); VersionError for an unpublished one."""
        write_pin(self.root, version)

    def __str__(self) -> str:
        return str(self.root)


class RedisVersionSource:
    """Versions in Redis, downloaded on first use into `cache_root` (this process's own store dir)."""

    def __init__(self, spec: dict, prefix: str, cache_root: str | Path):
        self.spec, self.prefix, self.cache_root = spec, prefix, Path(cache_root)
        self._client: redis.Redis | None = None

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis_client(self.spec, socket_timeout=30.0)
        return self._client

    def current(self) -> str | None:
        try:
            return redis_current(self.client, self.prefix)
        except redis.RedisError as exc:
            raise SourceUnavailable(f"Redis unavailable: {exc}") from exc

    def version_dir(self, version: str) -> Path:
        try:
            return fetch_version(self.client, self.prefix, version, self.cache_root)
        except redis.RedisError as exc:
            raise SourceUnavailable(f"Redis unavailable: {exc}") from exc

    def pin(self, version: str | None) -> None:
        """Record drafter.version_pin in Redis, where the trainer's pruning spares it; VersionError for a
        version Redis does not hold."""
        try:
            if version is None:
                self.client.delete(_key(self.prefix, "pin"))
                return
            self.version_dir(version)
            self.client.set(_key(self.prefix, "pin"), version)
        except redis.RedisError as exc:
            raise SourceUnavailable(f"Redis unavailable: {exc}") from exc

    def __str__(self) -> str:
        return f"redis {self.spec.get('url')} {self.prefix}"


def version_source(where: str | Path | dict, cache_root: str | Path | None = None):
    """A source from what the router hands a DraftWorker: a directory, or {"redis": spec, "prefix": ...}."""
    if isinstance(where, dict):
        if cache_root is None:
            raise ValueError("a Redis version source needs a local cache directory")
        return RedisVersionSource(where["redis"], where["prefix"], cache_root)
    return DirVersionSource(where)


def materialize_drafter(vdir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    """A full drafter directory (the target's tensors included, as a bootstrapped drafter has them) made
    from a verified published version, for a DraftWorker to start from; kept when already there."""
    out_dir = Path(out_dir)
    if (out_dir / META_FILE).is_file():
        return out_dir
    tensors, meta = load_version(vdir, target_dir)

    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt"})
        shutil.copyfile(Path(vdir) / CONFIG_FILE, tmp / CONFIG_FILE)
        # the full file's own hash, so that a reader checking a drafter directory finds it consistent
        (tmp / META_FILE).write_text(json.dumps({**meta, "sha256": sha256_file(tmp / WEIGHTS_FILE),
                                                 "published_sha256": meta.get("sha256")}, indent=2))

    _write_once(out_dir, write)
    return out_dir


def _write_once(dest: Path, write) -> None:
    """Fill a fresh sibling directory with write(tmp), then rename it to dest in one step, so a reader
    sees all of dest or none. Several processes may fill the same dest at once (each replica's
    DraftWorker on a node shares the cache): the first rename wins, and the others, having written the
    same bytes, drop theirs. Linux refuses a rename onto a non-empty directory with ENOTEMPTY, not EEXIST."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        os.rename(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not (dest / META_FILE).is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["CHUNK_BYTES", "DirVersionSource", "RedisVersionSource", "SourceUnavailable", "fetch_version",
           "materialize_drafter", "prune", "push_version", "redis_client", "redis_current",
           "set_current", "version_source"]
