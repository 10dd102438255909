import json

import pytest

from specd.workers.core.stats import RequestStats


def three_steps() -> RequestStats:
    stats = RequestStats()
    stats.record_step(drafted=4, accepted=2, is_bonus=False, drafter_version="v1")  # 2 accepted + recovered
    stats.record_step(drafted=3, accepted=3, is_bonus=True, drafter_version="v2")   # 3 accepted + bonus
    stats.record_step(drafted=0, accepted=0, is_bonus=True)                         # no drafts: 1 bonus
    return stats


def test_record_step_counts() -> None:
    stats = three_steps()
    assert (stats.drafted, stats.accepted, stats.recovered, stats.bonus, stats.steps) == (7, 5, 1, 2, 3)
    assert stats.drafted_per_position == [2, 2, 2, 1]
    assert stats.accepted_per_position == [2, 2, 1]
    assert stats.gamma_history == [4, 3, 0]
    assert stats.drafter_versions == ["v1", "v2"]
    assert stats.emitted == 8  # accepted + one token per step


def test_rates() -> None:
    stats = three_steps()
    assert stats.acceptance_rate == pytest.approx(5 / 7)
    assert stats.tokens_per_step == pytest.approx(8 / 3)
    # MAL counts only the two steps that drafted: 1 + 5 / 2, not the 8 / 3 tokens per step
    assert stats.drafting_steps == 2 and stats.mean_accepted_length == pytest.approx(3.5)
    assert stats.acceptance_per_position() == pytest.approx([1.0, 1.0, 0.5, 0.0])
    empty = RequestStats()
    assert empty.acceptance_rate == 0.0 and empty.tokens_per_step == 0.0
    assert empty.mean_accepted_length == 0.0
    assert RequestStats.from_dict(stats.to_dict()).mean_accepted_length == pytest.approx(3.5)


def test_per_version_breakdown() -> None:
    stats = three_steps()
    v1, v2 = stats.by_version["v1"], stats.by_version["v2"]
    assert (v1.drafted, v1.accepted, v1.recovered, v1.bonus, v1.steps) == (4, 2, 1, 0, 1)
    assert v1.accepted_per_position == [1, 1] and v1.drafted_per_position == [1, 1, 1, 1]
    assert (v2.accepted, v2.bonus, v2.acceptance_rate) == (3, 1, 1.0)


def test_tree_step_counts_positions_by_depth() -> None:
    stats = RequestStats()
    stats.record_step(drafted=9, accepted=2, is_bonus=False, depth=3)
    stats.record_step(drafted=9, accepted=1, is_bonus=True, depth=3)  # path ended at a shallow leaf
    assert stats.drafted == 18
    assert stats.drafted_per_position == [2, 2, 2]
    assert stats.accepted_per_position == [2, 1]
    assert stats.gamma_history == [3, 3]


@pytest.mark.parametrize(
    "drafted, accepted, is_bonus, depth",
    [(2, 3, False, None), (3, 3, False, None), (3, 1, True, None), (4, 1, False, 5), (-1, 0, True, None)],
)
def test_inconsistent_steps_raise(drafted: int, accepted: int, is_bonus: bool, depth: int | None) -> None:
    with pytest.raises(ValueError):
        RequestStats().record_step(drafted, accepted, is_bonus, depth=depth)


def test_merge_pads_positions_and_keeps_inputs() -> None:
    a = three_steps()
    b = RequestStats()
    b.record_step(drafted=6, accepted=5, is_bonus=False, drafter_version="v3")
    b.record_step(drafted=2, accepted=0, is_bonus=False, drafter_version="v1")
    merged = a.merge(b)
    counts = (merged.drafted, merged.accepted, merged.recovered, merged.bonus, merged.steps)
    assert counts == (15, 10, 3, 2, 5)
    assert merged.drafted_per_position == [4, 4, 3, 2, 1, 1]
    assert merged.accepted_per_position == [3, 3, 2, 1, 1]
    assert merged.gamma_history == [4, 3, 0, 6, 2]
    assert merged.drafter_versions == ["v1", "v2", "v3"]
    assert merged.by_version["v1"].drafted == 6 and merged.by_version["v1"].steps == 2
    assert merged.by_version["v3"].accepted == 5
    assert a.drafted == 7 and a.by_version["v1"].drafted == 4  # inputs unchanged
    merged.by_version["v2"].record_step(1, 1, True)
    assert a.by_version["v2"].steps == 1  # merged copies, it does not alias


def test_to_dict_round_trip_is_plain_data() -> None:
    stats = three_steps()
    d = stats.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["acceptance_rate"] == pytest.approx(5 / 7)
    assert d["by_version"]["v1"]["recovered"] == 1
    assert RequestStats.from_dict(d) == stats
