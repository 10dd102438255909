"""`specd bench soak` pieces that need no server: process labels, RSS growth, TPOT windows, the plot."""

from __future__ import annotations

import os

from specd.bench.soak import growth, process_label, sample_rss, windows, write_plot


def test_processes_of_the_server_tree_get_stable_labels() -> None:
    assert process_label(["ray::TargetWorker.verify"], "ray::TargetWorker.verify") == "ray::TargetWorker"
    assert process_label(["python", "-m", "specd.cluster.serve", "x=1"], "python") == "router"
    assert process_label(["/usr/bin/redis-server", "127.0.0.1:1234"], "redis-server") == "redis-server"
    assert process_label(["/bin/sh"], "sh") == "other"


def test_rss_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    samples = [{"t": 0, "rss_mib": {"router": 100.0}}, {"t": 60, "rss_mib": {"router": 300.0, "redis": 10.0}},
               {"t": 120, "rss_mib": {"router": 320.0, "redis": 12.0}},
               {"t": 180, "rss_mib": {"router": 310.0, "redis": 11.0}}]
    g = growth(samples, warmup_s=60)
    assert g["router"] == {"at_warmup_end": 300.0, "max_after": 320.0, "growth": 20.0}
    assert g["total"]["growth"] == 22.0 and g["redis"]["growth"] == 2.0
    assert growth(samples, warmup_s=999) == {}


def test_tpot_windows_group_requests_by_completion_time() -> None:
    reqs = [{"end": 5, "tpot_s": 0.010}, {"end": 50, "tpot_s": 0.030}, {"end": 70, "tpot_s": 0.020},
            {"end": 80, "tpot_s": None}]
    w = windows(reqs, 60)
    assert [x["requests"] for x in w] == [2, 1]
    assert w[0]["tpot_p50_ms"] == 20.0 and w[0]["tpot_p99_ms"] == 30.0 and w[1]["t"] == 90.0


def test_rss_of_a_live_tree_and_the_plot(tmp_path) -> None:
    rss = sample_rss(os.getpid())
    assert sum(rss.values()) > 10            # this test process itself, in MiB
    samples = [{"t": t, "rss_mib": {"router": 100.0 + t}} for t in range(0, 300, 30)]
    tpot = windows([{"end": t, "tpot_s": 0.02} for t in range(0, 300, 7)], 60)
    assert write_plot(tmp_path / "soak.png", samples, tpot, 60, "t").stat().st_size > 1000
