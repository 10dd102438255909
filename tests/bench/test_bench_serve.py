"""The pure figures of `specd bench serve` (the load run itself is exercised by hand and in e2e)."""

from __future__ import annotations

import pytest

from specd.bench.serve import (
    derived_figures,
    merge_rounds,
    percentiles,
    request_lengths,
    round_figures,
    summarize,
    worker_delta,
)


def test_percentiles_are_nearest_rank() -> None:
    assert percentiles([3.0, 1.0, 2.0, 4.0]) == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert percentiles([float(i) for i in range(1, 101)], (1, 50, 100)) == {"p1": 1.0, "p50": 50.0,
                                                                               "p100": 100.0}


def test_summarize_counts_tokens_latencies_and_acceptance() -> None:
    timings = [
        {"tokens": 11, "ttft_s": 1.0, "total_s": 2.0,
         "usage": {"drafted": 8, "accepted": 6, "recovered": 1, "bonus": 1, "steps": 2,
                   "drafter_versions": ["v1"]}},
        {"tokens": 1, "ttft_s": 0.5, "total_s": 0.5, "usage": None},
    ]
    s = summarize(timings, wall_s=4.0)
    assert s["tokens"] == 12 and s["tokens_per_s"] == 3.0
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)          # (2.0 - 1.0) / 10, one-token requests skipped
    assert s["acceptance_rate"] == 0.75 and s["tokens_per_step"] == 4.0
    assert s["drafter_versions"] == ["v1"] and s["ttft_s"]["p90"] == 1.0


def test_worker_delta_and_derived_figures() -> None:
    before = {"workers": [{"replica": 0, "target_busy_s": 1.0, "drafter_busy_s": 1.0, "active_s": 2.0}]}
    after = {"workers": [{"replica": 0, "target_busy_s": 9.0, "drafter_busy_s": 5.0, "active_s": 12.0}]}
    (w,) = worker_delta(before, after)
    assert w["target_busy_fraction"] == 0.8 and w["drafter_busy_fraction"] == 0.4
    assert w["overlap_fraction"] == pytest.approx(0.2)      # 8 + 4 busy seconds in 10 s: 2 s at once
    results = {"specd": {"tokens_per_s": 12.0, "workers": [w]}, "target-only": {"tokens_per_s": 8.0},
               "specd-unpipelined": {"tokens_per_s": 10.0}, "in-process": {"tokens_per_s": 11.0}}
    f = derived_figures(results)
    assert f["speedup_specd_vs_target_only"] == 1.5 and f["pipeline_gain"] == pytest.approx(0.2)
    assert f["router_ray_overhead"] == pytest.approx(1 / 11)
    assert f["pipeline_overlap_fraction"] == w["overlap_fraction"]


def test_fixed_lengths_are_all_max_new_tokens() -> None:
    assert request_lengths(3, 64) == [64, 64, 64]


def test_mixed_lengths_are_seeded_spread_around_max_new_tokens() -> None:
    lengths = request_lengths(400, 64, "mixed")
    assert lengths == request_lengths(400, 64, "mixed")          # every phase sends the same
    assert lengths != request_lengths(400, 64, "mixed", seed=1)
    assert min(lengths) >= 32 and max(lengths) <= 96
    assert len(set(lengths)) > 40                                  # spread, so clients fall out of step
    assert abs(sum(lengths) / len(lengths) - 64) < 3


def test_unknown_length_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fixed or mixed"):
        request_lengths(2, 64, "long")


def _round(tps: float, tpot: float) -> dict:
    timings = [{"tokens": 11, "ttft_s": 0.5, "total_s": 0.5 + 10 * tpot, "usage": None}] * 2
    out = summarize(timings, 22 / tps)
    return {**out, "workers": [{"replica": 0}], "pipeline_groups": 2, "_timings": timings}


def test_rounds_merge_all_timings_and_pair_round_by_round() -> None:
    specd = merge_rounds([_round(10.0, 0.2), _round(30.0, 0.1)])
    base = merge_rounds([_round(20.0, 0.25), _round(20.0, 0.25)])
    assert specd["tokens_per_s"] == pytest.approx(44 / (22 / 10 + 22 / 30))   # all tokens over all wall
    assert [r["tokens_per_s"] for r in specd["rounds"]] == pytest.approx([10.0, 30.0])
    assert specd["tpot_s"]["p50"] == pytest.approx(0.1)                     # over every request
    figures = round_figures({"specd": specd, "target-only": base})
    assert figures["speedup_rounds"] == pytest.approx([0.5, 1.5])
    assert figures["speedup_median"] == pytest.approx(1.0)
    assert figures["tpot_p50_ratio_rounds"] == pytest.approx([0.8, 0.4])
    assert round_figures({"specd": _round(1.0, 0.1), "target-only": _round(1.0, 0.1)}) == {}


def test_the_ready_line_gives_the_grpc_address_with_or_without_metrics() -> None:
    from specd.bench.serve import ServerProcess

    def address(line: str) -> str:
        return ServerProcess.READY.search(line).group(1)

    assert address("specd serving SmolLM2-135M-Instruct on 127.0.0.1:40841") == "127.0.0.1:40841"
    # the metrics note names another address after " on ": the gRPC one is the first
    assert address("specd serving SmolLM2-135M-Instruct on 127.0.0.1:45347, metrics on "
                   "http://127.0.0.1:9464/metrics") == "127.0.0.1:45347"
