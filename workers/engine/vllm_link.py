"""What a VllmEngine and the SpecdProposer inside its vLLM engine share, where both run in one process.

vLLM builds the proposer itself, from its own config, so neither holds the other. Where the engine core
runs in the engine's process (the serving actor sets VLLM_ENABLE_V1_MULTIPROCESSING=0), the two meet in a
`ProposerLink` registered under the path of the proposer's settings file (one per engine):

- drafts: the proposer files each row's drafts and their drafter version under the key of the history
  they were drafted after (prefix_key); the engine reads them back when the request finishes, for its
  replay records and per-version metrics (vLLM itself reports per-step counts only);
- serving_version and swap_stats: which weights draft now, and the hot swaps the proposer applied;
- per-request speculation: the engine files each request's settings (on or off, its γ cap) under the key
  of its prompt (`expect`); the proposer claims them when the request's row first appears (`claim`), so
  a request sent with speculation off drafts nothing and a γ cap holds, though vLLM's speculative config
  is engine-wide;
- the start-up cost sweep: the engine sets `force_gamma`, the proposer then returns that many throwaway
  drafts per row and records how long vLLM took to verify them (`samples`); the engine turns the samples
  into a verify table (`verify_table`) and hands it back through `profile` for the planner's cost model.

Where the proposer runs in vLLM's own engine process, nothing is registered on the engine's side of the
link: the engine falls back to vLLM's counts and its configured version, and no sweep runs.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


def prefix_key(tokens) -> bytes:
    """A collision-safe key of a token prefix (int32 bytes, like vLLM's token_ids_cpu rows)."""
    return PrefixHasher(tokens).key()


class PrefixHasher:
    """prefix_key of a prefix that grows, fed as it grows: a key costs the new tokens, not the whole
    prefix again (blake2b hashes a stream, so feeding a prefix in pieces gives the key of the whole)."""

    def __init__(self, tokens=()):
        self._hash = hashlib.blake2b(digest_size=16)
        self.update(tokens)

    def update(self, tokens) -> None:
        # a contiguous int32 row (vLLM's token_ids_cpu) is hashed in place, without a copy
        self._hash.update(memoryview(np.ascontiguousarray(tokens, dtype=np.int32)))

    def key(self) -> bytes:
        return self._hash.copy().digest()


class ProposerLink:
    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity                            # filed drafts kept, oldest first out
        self.serving_version: str | None = None             # the weights the proposer drafts with now
        self.swap_stats: Callable[[], dict] | None = None   # the proposer's DraftWorker.swap_stats
        self.force_gamma: int | None = None                 # sweep: throwaway drafts per row
        self.samples: list[tuple[int, int, float]] = []     # sweep: (rows, tokens per row, seconds)
        self.profile: dict | None = None                    # the verify table for the proposer to take
        self._entries: OrderedDict[bytes, tuple[list[int], str]] = OrderedDict()
        # prompt key -> settings of the requests with that prompt not yet seen by the proposer, in order
        self._specs: OrderedDict[bytes, list[tuple[bool, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def in_process(self) -> bool:
        """The proposer of this link lives in this process (it registered its swap statistics)."""
        return self.swap_stats is not None

    def put(self, key: bytes, tokens: list[int], version: str) -> None:
        with self._lock:
            self._entries[key] = (tokens, version)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def pop(self, key: bytes) -> tuple[list[int], str] | None:
        with self._lock:
            return self._entries.pop(key, None)

    def expect(self, prompt_key: bytes, enabled: bool, gamma: int) -> None:
        """A request with this prompt comes: draft for it (enabled) at most `gamma` tokens a step."""
        with self._lock:
            self._specs.setdefault(prompt_key, []).append((enabled, gamma))
            self._specs.move_to_end(prompt_key)
            while len(self._specs) > self.capacity:       # requests aborted before their first step
                self._specs.popitem(last=False)

    def claim(self, prompt_key: bytes) -> tuple[bool, int] | None:
        """The settings of the oldest unseen request with this prompt (None: none filed, engine defaults)."""
        with self._lock:
            queue = self._specs.get(prompt_key)
            if not queue:
                return None
            spec = queue.pop(0)
            if not queue:
                del self._specs[prompt_key]
            return spec

    def __len__(self) -> int:
        return len(self._entries)


_LINKS: dict[str, ProposerLink] = {}


def proposer_link(settings_path: str) -> ProposerLink:
    """The process's link of the engine whose proposer reads `settings_path`."""
    return _LINKS.setdefault(str(settings_path), ProposerLink())


def drop_proposer_link(settings_path: str) -> None:
    _LINKS.pop(str(settings_path), None)


def verify_table(samples: list[tuple[int, int, float]], max_tokens: int) -> dict[int, list[float]]:
    """A CostProfile verify table from sweep samples: per batch size, the median seconds of each measured
    tokens-per-row count, the counts between two measured ones linearly interpolated, 1..max_tokens.
    A batch size without a one-token measurement and one more is left out."""
    by_shape: dict[tuple[int, int], list[float]] = {}
    for b, n, seconds in samples:
        by_shape.setdefault((b, n), []).append(seconds)
    table = {}
    for b in sorted({b for b, _ in by_shape}):
        ns = sorted(n for bb, n in by_shape if bb == b)
        if ns[0] != 1 or len(ns) < 2:
            continue
        ys = [statistics.median(by_shape[(b, n)]) for n in ns]
        table[b] = [float(np.interp(n, ns, ys)) if n <= ns[-1]
                    else ys[-1] + (ys[-1] - ys[-2]) / (ns[-1] - ns[-2]) * (n - ns[-1])
                    for n in range(1, max_tokens + 1)]
    return table
