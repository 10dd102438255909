"""Hot-swapping a DraftWorker's drafter to new published versions, between steps.

A background thread watches the version store's CURRENT pointer (workers/drafters/versions.py): a
directory, or Redis (workers/drafters/redis_versions.py), whose versions it downloads into a store
directory of its own process first.
When it names a version other than the serving one, the thread reads it, verifies it (sha256 of the
weights, the serving target's checksum, every tensor's name and shape against the running drafter)
and parks the tensors. The DraftWorker takes them at the start of its next call (`take()`), so a
step is drafted by one version from its first token to its last; nothing about verification changes,
so output stays exact. A version that fails verification is rejected with one log line, remembered
(it is not retried), and the serving version stays.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from specd.workers.drafters.redis_versions import SourceUnavailable, version_source
from specd.workers.drafters.versions import VersionError, load_version

log = logging.getLogger(__name__)


class DrafterSwapper:
    def __init__(self, root: str | Path | dict, target_dir: str | Path, fits: Callable[[dict], None],
                 serving_version: str, poll_s: float = 2.0, cache_root: str | Path | None = None):
        """fits(tensors): raises VersionError unless a version's tensors can load into the running drafter
        (versions.check_fits against its Llama; vllm_native.py against the served checkpoint).
        root: a store directory, or a Redis source (redis_versions.version_source) downloading into
        cache_root."""
        self.source = version_source(root, cache_root)
        self.target_dir = Path(target_dir)
        self.fits = fits
        self.serving = serving_version
        self.poll_s = poll_s
        self.rejected: dict[str, str] = {}       # version -> reason
        self.pin: str | None = None              # serve this version, not CURRENT (drafter.version_pin)
        self.swaps = 0
        self._ready: tuple[str, dict[str, torch.Tensor], dict] | None = None   # version, tensors, meta
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-drafter-swap", daemon=True)

    def start(self) -> DrafterSwapper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.poll_s)

    def check(self) -> str | None:
        """Look at CURRENT once; returns the version made ready, if any (the thread calls this)."""
        try:
            wanted = self.pin or self.source.current()
        except OSError:
            return None
        with self._lock:
            parked = self._ready[0] if self._ready else None
        if not wanted or wanted in (self.serving, parked) or wanted in self.rejected:
            return None
        try:
            tensors, meta = load_version(self.source.version_dir(wanted), self.target_dir)
            self.fits(tensors)
        except SourceUnavailable:      # Redis away while downloading: not the version's fault, next poll
            return None
        except (VersionError, OSError, ValueError, KeyError) as exc:
            self.rejected[wanted] = str(exc)
            log.warning("drafter version %s rejected, %s stays: %s", wanted, self.serving, exc)
            return None
        with self._lock:
            # Pinned elsewhere while this one loaded (the poll thread and a pin race): a stale load must not
            # overwrite the pinned version's. It did in `specd bench osd`, whose held-out evaluation pins
            # each domain's version while the thread's first check loads CURRENT: "after" read the last
            # version's figures.
            if wanted != (self.pin or wanted):
                return None
            self._ready = (wanted, tensors, meta)
        return wanted

    def take(self) -> tuple[str, dict[str, torch.Tensor], dict] | None:
        """The verified version waiting to be applied, if any (the worker calls this between steps); none
        when a pin names another version."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None and self.pin and ready[0] != self.pin:
            return None
        return ready

    def applied(self, version: str) -> None:
        self.serving = version
        self.swaps += 1
