"""`specd bench first-start` reads the phases of this version's console and of an older version's log
alike (bench/first_start.py)."""

from __future__ import annotations

from specd.bench.first_start import PHASES, mark_phases

NOW = [
    "specd: log file /c/logs/serve.log (--verbose shows it here) (1 s)",
    "specd: gRPC on 127.0.0.1:4001 (NOT_SERVING while loading) (1 s)",
    "specd: model: de-quantizing SmolLM2-135M-Instruct into the cache, once (2 s)",
    "specd: model SmolLM2-135M-Instruct ready (30 s)",
    "specd: drafter suffix with model drafter seed-hidden-1 (held-out greedy match 4.3%) (40 s)",
    "specd: workers up: SmolLM2-135M-Instruct on 1 replica(s) (55 s)",
    "specd: warm (70 s)",
    "specd serving SmolLM2-135M-Instruct on 127.0.0.1:4001",
]
BEFORE = [  # 7d6bbeb's console
    "2026-12-01 20:59:06,358 INFO specd.cluster.serve: gRPC on 127.0.0.1:50061 (NOT_SERVING while loading)",
    "I1201 20:59:07.322670    6610 fork_posix.cc:71] Other threads are currently calling into gRPC",
    "2026-12-01 20:59:56,970 WARNING specd.cluster.first_start: no bootstrapped drafter in the cache: "
    "building the quick one",
    "2026-12-01 21:05:11,815 INFO specd.cluster.first_start: quick drafter built in 315 s",
    "2026-12-01 21:06:06,773 INFO specd.cluster.serve: workers up after 420.4 s: SmolLM2 on 1 replica(s)",
    "2026-12-01 21:07:16,326 INFO specd.cluster.serve: warm after 490.0 s",
    "specd serving SmolLM2-135M-Instruct on 127.0.0.1:50061, OpenAI-compatible HTTP on http://x/v1",
]


def _ends(lines: list[str]) -> dict[str, float]:
    ended: dict[str, float] = {}
    for at, line in enumerate(lines):
        mark_phases(ended, float(at), line)
    return ended


def test_every_phase_ends_once_in_order_in_both_consoles() -> None:
    now, before = _ends(NOW), _ends(BEFORE)
    assert list(now) == list(PHASES) == list(before)
    assert now == {"ports": 1.0, "model": 3.0, "drafter": 4.0, "workers": 5.0, "warm": 6.0, "serving": 7.0}
    assert before == {"ports": 0.0, "model": 2.0, "drafter": 3.0, "workers": 4.0, "warm": 5.0, "serving": 6.0}
