"""`specd bench frontends`: the scripted server streams every token through both front ends, and the
client recovers each token's emission time from the text it reads."""

from __future__ import annotations

import json

import pytest

from specd.bench import frontends
from specd.bench.cli import run_alone


def test_clock_codec_round_trips_emission_times() -> None:
    codec = frontends.ClockCodec()
    assert codec.decode([12, 3_000_000]) == "0000000012;0003000000;"
    assert frontends._latencies_us(codec.decode([100, 250]), 400) == [300, 150]
    # the clock wraps at 2**31 µs; a token emitted just before the wrap is still a small latency
    assert frontends._latencies_us(codec.decode([frontends.WRAP - 5]), 10) == [15]


def test_bench_measures_every_token_of_both_front_ends(tmp_path) -> None:
    out = tmp_path / "frontends.json"
    assert run_alone("frontends", frontends, ["--clients", "1,3", "--tokens", "8", "--requests", "2",
                                              "--rounds", "1", "--interval-ms", "2", "--json", str(out),
                                              "--plot", str(tmp_path / "f.png")]) == 0
    data = json.loads(out.read_text())
    assert {(r["front_end"], r["clients"]) for r in data["rows"]} == {
        ("grpc", 1), ("http", 1), ("grpc", 3), ("http", 3)}
    for row in data["rows"]:
        assert row["tokens"] == row["clients"] * 2 * 8          # every token of every request was timed
        assert 0 < row["median_ms"] <= row["p90_ms"] < 1000
    summary = {s["clients"]: s for s in data["meta"]["summary"]}
    three = summary[3]
    added = three["http_median_ms"] - three["grpc_median_ms"]
    assert three["http_added_ms"] == pytest.approx(added, abs=2e-3)
    assert (tmp_path / "f.png").stat().st_size > 0
