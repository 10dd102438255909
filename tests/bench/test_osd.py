"""`specd bench osd` pieces that need no server: the stream's order, swap events, the plot."""

from __future__ import annotations

import argparse

from specd.bench.osd import (
    DOMAINS,
    bootstrap_prompts,
    heldout_overrides,
    reference_drafter,
    stream_prompts,
    write_plot,
)
from specd.bench.osd_versions import published_events, serving_at_domain_end, swap_events


def test_stream_is_gsm8k_then_humaneval_from_the_train_split() -> None:
    prompts = stream_prompts(DOMAINS, 5, "train")
    assert [d for d, _ in prompts] == ["gsm8k"] * 5 + ["humaneval"] * 5
    eval_texts = {p.text for _, p in stream_prompts(DOMAINS, 5, "eval")}
    assert not eval_texts & {p.text for _, p in prompts}


def test_swap_events_mark_the_first_request_of_each_new_version() -> None:
    rows = [{"index": 0, "versions": ["a"]}, {"index": 1, "versions": ["a"]}, None,
            {"index": 3, "versions": ["a", "b"]}, {"index": 4, "versions": ["b"]},
            {"index": 5, "error": "x"}, {"index": 6, "versions": ["c"]}]
    assert swap_events(rows) == [{"index": 3, "version": "b"}, {"index": 6, "version": "c"}]


def test_plot_is_written(tmp_path) -> None:
    rows = [{"index": i, "alpha": i / 10, "drafted": i % 3, "versions": ["a"]} for i in range(10)]
    run = {"requests": rows,
           "swaps": [{"index": 4, "version": "b"}]}
    path = write_plot(tmp_path / "osd.png", {"on": run, "off": run}, 5, "t")
    assert path.stat().st_size > 1000
    one_domain = write_plot(tmp_path / "osd-one.png", {"on": run}, None, "t")   # no domain shift drawn
    assert one_domain.stat().st_size > 1000


def test_the_version_serving_when_each_domain_ended_is_its_last_requests_newest() -> None:
    rows = [{"index": 0, "domain": "gsm8k", "versions": ["a"]},
            {"index": 1, "domain": "gsm8k", "versions": ["a", "b"]},
            {"index": 2, "domain": "gsm8k", "error": "x"},
            {"index": 3, "domain": "humaneval", "versions": ["b"]}, None,
            {"index": 5, "domain": "humaneval", "versions": ["b", "c"]}]
    assert serving_at_domain_end(rows) == {"gsm8k": "b", "humaneval": "c"}


def _store(tmp_path, published: dict[str, float], current: str):
    import datetime as dt
    import json

    from specd.workers.drafters.versions import META_FILE, VERSIONS_DIR, write_current

    for version, t in published.items():
        vdir = tmp_path / VERSIONS_DIR / version
        vdir.mkdir(parents=True)
        created = dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")
        (vdir / META_FILE).write_text(json.dumps({"version": version, "created": created}))
    write_current(tmp_path, current)
    return tmp_path


def test_the_version_serving_at_a_domains_end_is_the_newest_published_before_it(tmp_path) -> None:
    # the model drafter stopped drafting HumanEval after request 3 (version "b"), but the trainer went on
    # publishing: "c" had served for a while when the segment ended; "d" came too late to serve
    rows = [{"index": 0, "domain": "gsm8k", "versions": ["a"], "done_at": 1000.0},
            {"index": 1, "domain": "gsm8k", "versions": ["a"], "done_at": 1010.0},
            {"index": 2, "domain": "humaneval", "versions": ["b"], "done_at": 1020.0},
            {"index": 3, "domain": "humaneval", "versions": [], "done_at": 1100.0}]
    store = _store(tmp_path, {"a": 900.0, "b": 1005.0, "c": 1050.0, "d": 1099.0}, current="d")
    assert serving_at_domain_end(rows, store, swap_delay_s=3.0) == {"gsm8k": "b", "humaneval": "c"}
    assert serving_at_domain_end(rows) == {"gsm8k": "a", "humaneval": "b"}      # no store: what drafted


def test_published_events_mark_when_each_trained_version_served(tmp_path) -> None:
    import json

    from specd.workers.drafters.versions import META_FILE, VERSIONS_DIR

    rows = [{"index": i, "domain": "gsm8k", "versions": [], "done_at": 1000.0 + 10 * i} for i in range(6)]
    store = _store(tmp_path, {"boot": 900.0, "v2": 1012.0, "v3": 1200.0}, current="v2")
    for v, parent, seen in (("boot", None, 0), ("v2", "boot", 1), ("v3", "v2", 5)):
        meta = tmp_path / VERSIONS_DIR / v / META_FILE
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "parent_version": parent,
                                    "records_seen": seen}))
    # v2 published at 1012 (+1 s for whole seconds, +3 s delay): first served by the request done at 1020;
    # 2 requests had finished when it was published, of which the trainer had read 1
    assert published_events(rows, store, swap_delay_s=3.0) == [
        {"index": 2, "version": "v2", "records_seen": 1, "requests_done": 2}]


def test_after_a_rollback_the_version_serving_is_what_drafted_last(tmp_path) -> None:
    rows = [{"index": 0, "domain": "gsm8k", "versions": ["a"], "done_at": 1000.0}]
    store = _store(tmp_path, {"a": 900.0, "b": 950.0}, current="a")             # b was rolled back
    assert serving_at_domain_end(rows, store, swap_delay_s=3.0) == {"gsm8k": "a"}


def test_the_quick_drafter_saw_none_of_the_stream() -> None:
    seen = bootstrap_prompts(from_offline=False)
    assert 0 < len(seen) < 100 and {s for s, _ in seen} == {"general"}
    assert not any((p.source, p.index) in seen for _, p in stream_prompts(DOMAINS, 400, "train", seen))


def test_the_stream_puts_prompts_the_starting_drafter_was_trained_on_last() -> None:
    seen = frozenset({("gsm8k", 0), ("gsm8k", 5), ("humaneval", 1), ("humaneval", 7)})
    prompts = stream_prompts(DOMAINS, 400, "train", seen)
    gsm8k = [p for d, p in prompts if d == "gsm8k"]
    assert not any((p.source, p.index) in seen for p in gsm8k)      # 1,000 train rows: room to spare
    assert gsm8k[0].index == 1
    humaneval = [(p.source, p.index) in seen for d, p in prompts if d == "humaneval"]
    first_seen = humaneval.index(True)                              # 120 rows: the stream cycles
    assert first_seen == 118 and humaneval[118:120] == [True, True] and not any(humaneval[:first_seen])


def test_the_reference_is_the_offline_drafter_when_built_and_not_the_start(tmp_path) -> None:
    args = argparse.Namespace(reference=None)
    offline = tmp_path / "drafters" / "boot-hidden"
    quick = tmp_path / "drafters" / "boot-quick-hidden"
    assert reference_drafter(args, str(quick), str(tmp_path)) is None          # not built
    offline.mkdir(parents=True)
    (offline / "config.json").write_text("{}")
    assert reference_drafter(args, str(quick), str(tmp_path)) == str(offline)
    assert reference_drafter(args, str(offline), str(tmp_path)) is None        # started from it
    assert reference_drafter(argparse.Namespace(reference="none"), str(quick), str(tmp_path)) is None
    assert reference_drafter(argparse.Namespace(reference="/x"), str(quick), str(tmp_path)) == "/x"


def test_the_heldout_evaluation_runs_without_the_speculation_guard() -> None:
    from specd.configs import load_config

    cfg = load_config(heldout_overrides(["spec.guard_window_steps=16", "spec.policy=fixed"]))
    assert cfg.spec.guard_window_steps == 0
    assert load_config(["spec.guard_window_steps=16"]).spec.guard_window_steps == 16
