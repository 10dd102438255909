"""Speculation guard: decode throughput measured with speculation allowed and without, so it never loses.

The goodput controller (goodput.py) drafts where its cost model says drafting pays. What the model does
not see it cannot price: on a CPU host the router's drafter actor and the router itself share the
target's cores, so every proposal slows the verify running beside it (docs/decisions/speculation-guard.md).
The guard closes the loop on the outcome instead of a prediction:

- decode steps run in windows of `window_steps` steps; in an "on" window speculation is allowed (the
  controller decides per request), in an "off" window nobody drafts (plain decoding, the drafter is not
  asked: SpecStep's skip path, which keeps the drafter's state exact);
- each window's throughput is its tokens over the time its steps were running, less the time prefills
  ran (new requests' prompts are work of neither mode, and how many arrive depends on how fast the
  others finish): tokens per busy second;
- a window's first `warmup` steps run in its mode but are not timed: after a switch the drafter first
  takes in what it missed while off (a catch-up prefill per request), a cost of switching, not of
  either mode, which timed would make speculation look worse the more often the guard probes it;
- windows are kept per load (the log2 bucket of the mean requests per step: batch 1 and batch 16 are
  different trades); speculation runs unless its recent windows (median of the last `keep`) did worse
  than plain decoding's by more than `margin`, and the other mode is probed every few windows, the more
  rarely the larger the gap, so probing costs at most about PROBE_COST of throughput and a change (a
  drafter that learned, other traffic) is noticed. The margin leaves the few percent a window cannot
  tell from noise to the γ policy (without it the engine grid's batch 4-8 cells, where the goodput
  policy gained a few percent, lost them to the guard: 9 of 12 cells lower) and catches what a policy
  gets wrong by more.

Output is exact in both modes: the guard only turns drafting off. Plain python: no torch, ray, grpc or
redis; the caller passes the times (time.perf_counter), so tests drive it with hand-written ones.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

ON, OFF = "on", "off"
PROBE_COST = 0.015       # about this share of throughput may go to probing the worse mode
MIN_PROBE_INTERVAL = 4   # windows between probes, at most this often ...
MAX_PROBE_INTERVAL = 32  # ... and at least this often


def _covered(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def busy_seconds(steps: list[tuple[float, float]], excluded: list[tuple[float, float]]) -> float:
    """Seconds during which some step ran and no excluded interval (a prefill) did."""
    total = 0.0
    cut = _covered(excluded)
    for start, end in _covered(steps):
        total += end - start
        for a, b in cut:
            total -= max(0.0, min(end, b) - max(start, a))
    return max(total, 0.0)


@dataclass
class _Window:
    mode: str
    steps: list[tuple[float, float]] = field(default_factory=list)
    prefills: list[tuple[float, float]] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    started: int = 0     # steps of this window's mode seen, timed or not


class SpeculationGuard:
    """Chooses, window by window, whether speculation may run; see the module docstring."""

    def __init__(self, window_steps: int = 32, keep: int = 3, warmup: int = 2, margin: float = 0.05) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.margin = margin
        self.window_steps = window_steps
        self.keep = keep
        self.warmup = warmup
        self.window = _Window(ON)
        self.history: dict[tuple[int, str], deque[float]] = {}   # (load bucket, mode) -> tokens/s
        self._since_probe = 0
        self._bucket: int | None = None      # the load of the last closed window
        self.windows = {ON: 0, OFF: 0}      # closed windows per mode (metrics)

    @property
    def allowed(self) -> bool:
        """May the next step speculate?"""
        return self.window.mode == ON

    def prefill(self, start: float, end: float) -> None:
        """A prefill (a step's start of new requests) ran from start to end: not a decode step's time."""
        self.window.prefills.append((start, end))

    def step(self, start: float, end: float, tokens: int, requests: int, speculated: bool) -> None:
        """A decode step over `requests` requests ran from start to end and emitted `tokens`. speculated:
        the step's mode was this window's (a step that began before the window switched is not counted)."""
        if requests <= 0 or speculated != self.allowed:
            return
        w = self.window
        w.started += 1
        if w.started <= self.warmup:
            return
        w.steps.append((start, end))
        w.tokens += tokens
        w.requests += requests
        if len(w.steps) >= self.window_steps:
            self._close()

    def throughput(self, bucket: int, mode: str) -> float | None:
        """Median tokens per busy second of the last windows of this load and mode (None: none yet)."""
        seen = self.history.get((bucket, mode))
        return statistics.median(seen) if seen else None

    def stats(self) -> dict:
        """For metrics: whether speculation may run now, windows closed per mode, and the last closed
        window's load with each mode's tokens per busy second there (0: not measured)."""
        measured = {m: (self.throughput(self._bucket, m) if self._bucket is not None else None) or 0.0
                    for m in (ON, OFF)}
        return {"guard_allowed": self.allowed, "guard_windows_on": self.windows[ON],
                "guard_windows_off": self.windows[OFF],
                "guard_on_tokens_per_s": measured[ON], "guard_off_tokens_per_s": measured[OFF]}

    def _close(self) -> None:
        w = self.window
        bucket = self._bucket = round(math.log2(w.requests / len(w.steps)))
        seconds = busy_seconds(w.steps, w.prefills)
        if seconds > 0:
            self.history.setdefault((bucket, w.mode), deque(maxlen=self.keep)).append(w.tokens / seconds)
            self.windows[w.mode] += 1
        self.window = _Window(self._next_mode(bucket))

    def _next_mode(self, bucket: int) -> str:
        on, off = self.throughput(bucket, ON), self.throughput(bucket, OFF)
        if on is None:
            return ON
        if off is None:
            return OFF
        best, other = (ON, OFF) if on >= off * (1.0 - self.margin) else (OFF, ON)
        gap = abs(on - off) / max(on, off)
        interval = min(max(round(gap / PROBE_COST), MIN_PROBE_INTERVAL), MAX_PROBE_INTERVAL)
        self._since_probe += 1
        if self._since_probe >= interval:
            self._since_probe = 0
            return other
        return best
