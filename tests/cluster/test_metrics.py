"""SpecdMetrics turns scheduler hooks into Prometheus series."""

from __future__ import annotations

from prometheus_client import generate_latest

from specd.cluster.metrics import SpecdMetrics
from specd.cluster.scheduler import ServedStats
from specd.workers.core.stats import RequestStats
from specd.workers.engine.types import Draft, VerifyResult


def value(m: SpecdMetrics, name: str, labels: dict | None = None) -> float | None:
    return m.registry.get_sample_value(name, labels or {})


def test_steps_feed_acceptance_position_and_gamma_series() -> None:
    m = SpecdMetrics()
    m.on_step(0, Draft("a", [5, 6, 7], drafter_version="v1"), VerifyResult("a", 3, 2, [5, 6, 9], False), 3)
    m.on_step(0, Draft("b", [1], drafter_version="v1"), VerifyResult("b", 1, 1, [1, 4], True), 1)
    assert value(m, "specd_drafted_tokens_total", {"drafter_version": "v1"}) == 4
    assert value(m, "specd_accepted_tokens_total", {"drafter_version": "v1"}) == 3
    assert value(m, "specd_acceptance_rate") == 0.75
    assert value(m, "specd_tokens_per_step") == 2.5
    assert value(m, "specd_mean_accepted_length") == 2.5                 # both steps drafted: 1 + 3 / 2
    assert value(m, "specd_position_drafted_total", {"position": "0", "drafter_version": "v1"}) == 2
    assert value(m, "specd_position_accepted_total", {"position": "1", "drafter_version": "v1"}) == 1
    assert value(m, "specd_position_accepted_total", {"position": "2", "drafter_version": "v1"}) is None
    assert value(m, "specd_gamma_count") == 2 and value(m, "specd_gamma_sum") == 4
    assert value(m, "specd_drafter_version_info", {"replica": "0", "drafter_version": "v1"}) == 1
    m.on_step(0, Draft("c", [2], drafter_version="v2"), VerifyResult("c", 1, 0, [3], False), 1)
    assert value(m, "specd_drafter_version_info", {"replica": "0", "drafter_version": "v1"}) is None
    assert value(m, "specd_drafter_version_info", {"replica": "0", "drafter_version": "v2"}) == 1


def test_mean_accepted_length_counts_only_steps_that_drafted() -> None:
    m = SpecdMetrics()
    m.on_step(0, Draft("a", [5, 6, 7], drafter_version="v1"), VerifyResult("a", 3, 2, [5, 6, 9], False), 3)
    m.on_step(0, Draft("a", [], drafter_version=""), VerifyResult("a", 0, 0, [8], True), 0)
    assert value(m, "specd_tokens_per_step") == 2.0                       # (3 + 1) / 2
    assert value(m, "specd_mean_accepted_length") == 3.0                 # 1 + 2 / 1


def test_version_info_keeps_the_serving_version_through_steps_that_did_not_draft() -> None:
    m = SpecdMetrics()
    served = Draft("a", [5, 6], drafter_version="online-0002")
    m.on_step(0, served, VerifyResult("a", 2, 2, [5, 6, 1], True), 2)
    # the plan kept the next step from drafting: no draft tokens, no version
    m.on_step(0, Draft("a", [], drafter_version=""), VerifyResult("a", 0, 0, [7], False), 0)
    assert value(m, "specd_drafter_version_info", {"replica": "0", "drafter_version": "online-0002"}) == 1
    assert value(m, "specd_drafter_version_info", {"replica": "0", "drafter_version": "none"}) is None


def test_requests_queue_and_workers() -> None:
    m = SpecdMetrics()
    m.on_queue(waiting=3, running=2)
    m.on_first_token(0.2)
    m.on_finish("length", ServedStats(prompt_tokens=5, arrival=10.0, completion_tokens=8,
                                      spec=RequestStats(), first_token_at=10.2, finished_at=12.0))
    m.set_worker_stats([{"replica": 0, "target_busy_fraction": 0.9, "drafter_busy_fraction": 0.4,
                         "overlap_fraction": 0.3}])
    assert value(m, "specd_queue_depth") == 3 and value(m, "specd_running_requests") == 2
    assert value(m, "specd_generated_tokens_total") == 8
    assert value(m, "specd_requests_total", {"reason": "length"}) == 1
    assert value(m, "specd_request_latency_seconds_sum", {"reason": "length"}) == 2.0
    assert value(m, "specd_request_tokens_per_second_sum") == 4.0
    assert value(m, "specd_worker_busy_fraction", {"replica": "0", "worker": "drafter"}) == 0.4
    assert value(m, "specd_pipeline_overlap_fraction", {"replica": "0"}) == 0.3
    assert b"specd_time_to_first_token_seconds_bucket" in generate_latest(m.registry)
