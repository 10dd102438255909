"""Rows, ratios, table and files of `specd bench engine`, on tiny hand-written measurements."""

from __future__ import annotations

import json
import time

import pytest

from specd.bench.report import (
    add_ratios,
    make_row,
    merge_rounds,
    paired_interval,
    render_table,
    sort_rows,
    table_cells,
    write_json,
    write_plot,
)


def cell(workload="gsm8k", batch=1, temperature=0.0, generated=100, wall=10.0,
         per_request=(90.0, 110.0, 50.0), drafted=None, accepted=None, steps=None, emitted=None):
    return {
        "workload": workload, "batch": batch, "temperature": temperature, "num_prompts": len(per_request),
        "requested_tokens": generated, "generated_tokens": generated, "wall_s": wall,
        "request_ms_per_token": list(per_request), "drafted": drafted, "accepted": accepted,
        "steps": steps, "emitted": emitted, "outputs": [],
    }


def row(system, tps, speculative=False, **kw):
    c = cell(generated=int(tps * 10), wall=10.0, **kw)
    return make_row(system, c, 128, 1000.0, speculative_specd=speculative)


def test_make_row_derives_rates_from_counts():
    r = make_row("specd-chain", cell(drafted=40, accepted=30, steps=20, emitted=50), 128, 812.5, True, 3.0)
    assert r["tokens_per_s"] == pytest.approx(10.0)
    assert r["ms_per_token_p50"] == pytest.approx(90.0)       # median of 90, 110, 50
    assert r["acceptance_rate"] == pytest.approx(0.75)         # accepted / drafted
    assert r["tokens_per_step"] == pytest.approx(2.5)     # emitted / steps
    assert r["peak_rss_mb"] == 812.5 and r["load_s"] == 3.0


def test_paired_speedup_divides_by_the_interleaved_baseline():
    c = cell(drafted=40, accepted=30, steps=20, emitted=50)              # 100 tokens in 10 s
    assert make_row("specd-chain", c, 128, None, True)["speedup_vs_target_only_paired"] is None
    c.update(paired_base_wall_s=16.0, paired_base_tokens=100)           # the same tokens took 16 s
    r = make_row("specd-chain", c, 128, None, True)
    assert r["speedup_vs_target_only_paired"] == pytest.approx(1.6)
    assert "1.600x" in table_cells(r)
    assert r["paired_ci95"] is None                                       # no groups recorded


def test_paired_interval_from_groups():
    # every group 1.25x (base 10 s, system 8 s for the same 100 tokens): the interval is that point
    steady = [[10.0, 100, 8.0, 100]] * 6
    assert paired_interval(steady) == pytest.approx([1.25, 1.25])
    # groups at 0.95x and 1.05x alike: the interval holds 1.0 and stays inside [0.95, 1.05]
    mixed = [[10.0, 100, 10.0 / r, 100] for r in (0.95, 1.05) * 4]
    low, high = paired_interval(mixed)
    assert 0.95 <= low < 1.0 < high <= 1.05
    # three groups alike are wider than eight: a t interval, not a normal one
    few_low, few_high = paired_interval(mixed[:3])
    assert few_high - few_low > high - low
    assert paired_interval(steady[:2]) is None                            # too few groups
    c = cell(drafted=40, accepted=30, steps=20, emitted=50)
    c.update(paired_base_wall_s=80.0, paired_base_tokens=800, paired_groups=mixed)
    r = make_row("specd-chain", c, 128, None, True)
    assert r["paired_ci95"] == [low, high] and f"{low:.3f}-{high:.3f}" in table_cells(r)
    # rounds pool their groups
    other = make_row("specd-chain", {**c, "paired_groups": steady}, 128, None, True)
    merged = merge_rounds([r, other])
    assert len(merged["paired_groups"]) == 14 and merged["paired_ci95"] == paired_interval(mixed + steady)


def test_rounds_merge_to_medians_and_keep_each_process():
    # one system's cell measured in three fresh processes (--rounds 3): 10, 13 and 12 tokens/s
    runs = []
    for tps, base in ((10.0, 10.0), (13.0, 12.5), (12.0, 12.0)):
        c = cell(generated=int(tps * 10), wall=10.0, drafted=40, accepted=20, steps=20, emitted=40)
        c.update(paired_base_wall_s=10.0, paired_base_tokens=int(base * 10))
        runs.append(make_row("specd-default", c, 128, 1000.0, True))
    merged = merge_rounds(runs)
    assert merged["tokens_per_s"] == pytest.approx(12.0)                     # median, not mean
    assert merged["tokens_per_s_rounds"] == pytest.approx([10.0, 13.0, 12.0])
    assert merged["tokens_per_s_spread"] == pytest.approx(3.0 / 12.0)         # (max - min) / median
    assert merged["paired_base_tokens_per_s"] == pytest.approx(12.0)
    assert merged["speedup_vs_target_only_paired"] == pytest.approx(1.0)      # median of 1.0, 1.04, 1.0
    assert merged["generated_tokens"] == 350 and merged["wall_s"] == pytest.approx(30.0)
    assert "25%" in table_cells(merged)
    single = merge_rounds(runs[:1])
    assert single["tokens_per_s_spread"] is None and single["tokens_per_s_rounds"] == [10.0]


def test_paired_base_over_the_target_only_process():
    # speculation off in the specd process ran 190 tok/s where the target-only process ran 200
    c = cell(generated=1800, wall=10.0, drafted=0, accepted=0, steps=100, emitted=100)
    c.update(paired_base_wall_s=10.0, paired_base_tokens=1900)
    rows = add_ratios([row("target-only", 200.0), make_row("specd-default", c, 128, None, True)])
    assert rows[1]["paired_base_vs_target_only"] == pytest.approx(0.95)
    assert rows[1]["speedup_vs_target_only"] == pytest.approx(0.9)
    assert rows[1]["speedup_vs_target_only_paired"] == pytest.approx(180 / 190)
    assert rows[0]["paired_base_vs_target_only"] is None


def test_make_row_without_speculation_has_null_acceptance():
    r = make_row("target-only", cell(), 128, None, False)
    assert r["acceptance_rate"] is None and r["tokens_per_step"] is None


def test_ratios_only_on_speculative_specd_rows_and_per_cell():
    rows = [
        row("target-only", 10.0),
        row("vllm", 20.0),
        row("transformers", 5.0),
        row("specd-chain", 25.0, speculative=True),
        row("specd-chain", 9.0, speculative=True, batch=8),     # a cell without baselines
        row("target-only", 30.0, batch=8),
    ]
    add_ratios(rows)
    chain_b1, chain_b8 = rows[3], rows[4]
    assert chain_b1["speedup_vs_target_only"] == pytest.approx(2.5)
    assert chain_b1["speedup_vs_vllm"] == pytest.approx(1.25)
    assert chain_b8["speedup_vs_target_only"] == pytest.approx(0.3)
    assert chain_b8["speedup_vs_vllm"] is None                  # vLLM did not run batch 8
    for r in rows[:3]:
        assert r["speedup_vs_target_only"] is None and r["speedup_vs_vllm"] is None


def test_greedy_agreement_counts_identical_outputs():
    rows = [row("target-only", 10.0), row("specd-ngram", 12.0, speculative=True),
            row("specd-ngram", 12.0, speculative=True, temperature=0.7)]
    key = ("gsm8k", 1, 0.0)
    outputs = {("target-only", key): [[1, 2], [3, 4]], ("specd-ngram", key): [[1, 2], [3, 5]]}
    add_ratios(rows, outputs)
    assert rows[1]["greedy_agreement_vs_target_only"] == pytest.approx(0.5)
    assert rows[2]["greedy_agreement_vs_target_only"] is None  # sampled rows are not compared


def test_sort_groups_cells_then_system_order():
    rows = [row("vllm", 1.0, batch=8), row("target-only", 1.0), row("vllm", 1.0),
            row("target-only", 1.0, batch=8)]
    out = sort_rows(rows, ["target-only", "vllm"])
    assert [(r["batch"], r["system"]) for r in out] == [(1, "target-only"), (1, "vllm"), (8, "target-only"),
                                                        (8, "vllm")]


def test_table_cells_show_dashes_for_missing_values():
    rows = add_ratios([row("target-only", 10.0), row("specd-chain", 15.0, speculative=True)])
    base, spec = table_cells(rows[0]), table_cells(rows[1])
    assert base[0] == "target-only" and base[-2] == "-" and base[6] == "-"
    assert spec[-5] == "1.50x" and spec[-4] == spec[-3] == "-"  # vs target-only; no paired run
    assert spec[-1] == "-"                          # one process each: no spread
    assert render_table(rows).row_count == 2


def test_json_and_plot_files(tmp_path):
    rows = add_ratios([row("target-only", 10.0), row("specd-chain", 15.0, speculative=True),
                       row("target-only", 30.0, batch=8)])
    path = write_json(tmp_path / "out" / "bench.json", rows, {"quick": True})
    data = json.loads(path.read_text())
    assert data["meta"] == {"quick": True}
    assert [r["system"] for r in data["rows"]] == ["target-only", "specd-chain", "target-only"]
    png = write_plot(tmp_path / "bench.png", rows, ["target-only", "specd-chain"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_busy_warning_counts_other_processes_not_the_bench_itself() -> None:
    from specd.bench.child import finish_cell, new_cell_result
    from specd.bench.report import OTHER_CPUS_BUSY, busy_warnings

    cell = new_cell_result({"workload": "w", "batch": 1, "temperature": 0.0, "prompts": [[1]]})
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:      # this process's own work is not "other processes"
        sum(range(1000))
    cell = finish_cell(cell)
    assert "_cpu_start" not in cell and cell["other_cpus"] >= 0.0
    # the bench's own two threads lift the load average past 2 CPUs on an idle machine: not busy
    assert busy_warnings([{"other_cpus": 0.05, "loadavg_1m_max": 2.2}]) == []
    assert "0.90 CPUs" in busy_warnings([{"other_cpus": 0.9, "loadavg_1m_max": 2.2}])[0]
    assert OTHER_CPUS_BUSY < 0.9
    assert "may have been busy" in busy_warnings([{"loadavg_1m_max": 3.5}])[0]


def test_first_uses_of_decode_buckets_come_off_a_second_rate_beside_the_first():
    """tokens_per_s keeps every second of the timed run; tokens_per_s_less_first_uses takes the buckets'
    first uses (captures on a GPU) off the wall time, and its speed-up divides by target-only's alike."""
    base = make_row("target-only", {**cell(generated=1000, wall=4.0), "first_use_s": 0.0}, 128, None, False)
    spec = make_row("specd-default", {**cell(generated=1000, wall=5.0), "first_use_buckets": 4,
                                      "first_use_s": 1.0}, 128, None, True)
    eager = make_row("specd-chain", cell(generated=1000, wall=5.0), 128, None, True)
    add_ratios([base, spec, eager])
    assert spec["tokens_per_s"] == pytest.approx(200.0)
    assert spec["tokens_per_s_less_first_uses"] == pytest.approx(250.0)
    assert spec["speedup_vs_target_only"] == pytest.approx(0.8)
    assert spec["speedup_vs_target_only_less_first_uses"] == pytest.approx(1.0)
    # no count (an engine without a static decoder's): no second rate, no second ratio
    assert eager["tokens_per_s_less_first_uses"] is None
    assert eager["speedup_vs_target_only_less_first_uses"] is None
