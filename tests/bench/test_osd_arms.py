"""bench/osd_arms.py: the three-arm comparison's bookkeeping, on hand-written rows (the real run is
`specd bench osd --arms ...`, minutes per arm on the real model)."""

from __future__ import annotations

import pytest

from specd.bench.osd_arms import ARMS, heldout_halves, summary, write_plot


def _result(arm: str, before: float, after: float, tokens_per_s: float) -> dict:
    rows = [{"index": i, "domain": "openchat", "tokens": 8, "drafted": 4, "accepted": i % 3,
             "alpha": (i % 3) / 4, "tokens_per_step": 1.0 + (i % 3) / 2, "versions": ["v0"]}
            for i in range(6)]
    phase = {"speedup": None, "alpha": 0.25, "tokens_per_step": 1.5, "failed_requests": 0}
    return {"arm": arm, "domain": "openchat", "before": {**phase, "speedup": before},
            "after": {**phase, "speedup": after},
            "stream": {"requests": rows, "tokens_per_s": tokens_per_s, "failed_requests": 0},
            "published": [{"index": 3, "version": "v1"}], "failed_requests": 1}


def test_arms_differ_only_in_drafter_and_trainer() -> None:
    assert set(ARMS) == {"suffix-frozen", "default-online", "model-online", "offline-frozen"}
    assert ARMS["offline-frozen"] == ARMS["suffix-frozen"]     # only the drafter it starts from differs
    assert "trainer.enabled=false" in ARMS["suffix-frozen"]
    assert set(ARMS["default-online"]) - set(ARMS["suffix-frozen"]) == {"trainer.enabled=true"}
    assert "drafter.kind=model" in ARMS["model-online"]


def test_heldout_halves_are_disjoint_and_from_the_eval_split() -> None:
    before, after = heldout_halves("openchat", 20)
    assert len(before) == len(after) == 20
    assert {p.index for p in before}.isdisjoint({p.index for p in after})
    assert min(p.index for p in before) >= 200          # openchat's eval rows are [200, 240)
    with pytest.raises(SystemExit, match="fewer than"):
        heldout_halves("openchat", 21)


def test_summary_compares_the_online_default_with_the_frozen_one() -> None:
    table = summary([_result("suffix-frozen", 1.05, 1.40, 20.0), _result("default-online", 1.04, 1.61, 19.0)])
    arms = table["openchat"]
    assert arms["suffix-frozen"]["speedup_after"] == 1.40
    assert arms["default-online"]["stream_alpha"] == round(6 / 24, 4)   # accepted 0+1+2+0+1+2 of 24
    assert arms["default-online"]["versions_published"] == 1
    assert arms["b_over_a"] == {"heldout_speed_after": round(1.61 / 1.40, 4),
                                "stream_throughput": round(19.0 / 20.0, 4)}
    assert "offline_over_a" not in arms


def test_summary_compares_the_offline_ceiling_with_the_frozen_one() -> None:
    table = summary([_result("suffix-frozen", 1.05, 1.40, 20.0), _result("offline-frozen", 1.1, 1.54, 19.0)])
    assert table["openchat"]["offline_over_a"] == {"heldout_speed_after": round(1.54 / 1.40, 4)}
    assert "b_over_a" not in table["openchat"]


def test_plot_is_written(tmp_path) -> None:
    path = write_plot(tmp_path / "arms.png", [_result(a, 1.0, 1.2, 10.0) for a in ARMS])
    assert path.stat().st_size > 10_000
