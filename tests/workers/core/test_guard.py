"""The speculation guard on hand-written step times: it keeps the faster mode and probes the other."""

from __future__ import annotations

import pytest

from specd.workers.core.guard import OFF, ON, SpeculationGuard, busy_seconds


def run(guard: SpeculationGuard, windows: int, seconds: dict[str, float], tokens: dict[str, int],
        batch: int = 8, clock: list[float] | None = None) -> list[str]:
    """Drive `windows` windows of steps; a step of mode m takes seconds[m] and emits tokens[m]. Returns
    the mode of each window run."""
    clock = clock if clock is not None else [0.0]
    modes = []
    for _ in range(windows):
        mode = ON if guard.allowed else OFF
        modes.append(mode)
        for _ in range(guard.warmup + guard.window_steps):
            start = clock[0]
            clock[0] += seconds[mode]
            guard.step(start, clock[0], tokens[mode], batch, speculated=mode == ON)
    return modes


def test_busy_seconds_is_the_union_of_steps_less_prefills() -> None:
    # two pipeline groups' steps overlap; a prefill in between is no decode time
    steps = [(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]
    assert busy_seconds(steps, []) == pytest.approx(2.5)
    assert busy_seconds(steps, [(1.2, 3.5)]) == pytest.approx(2.5 - 0.3 - 0.5)
    assert busy_seconds([(0.0, 1.0)], [(-1.0, 2.0)]) == 0.0


def test_speculation_that_loses_runs_only_as_a_probe() -> None:
    guard = SpeculationGuard(window_steps=4)
    # drafting steps emit 1.2x the tokens but take 1.4x the time: 0.86x plain decoding
    modes = run(guard, 40, {ON: 0.14, OFF: 0.10}, {ON: 96, OFF: 80})
    assert modes[:2] == [ON, OFF]                  # each mode measured once at this load
    later = modes[2:]
    assert later.count(ON) <= len(later) // 4 + 1   # the loser only as a probe
    assert ON in later                              # but probed: traffic or the drafter may change
    assert guard.throughput(3, OFF) == pytest.approx(800.0)
    assert guard.throughput(3, ON) == pytest.approx(96 / 0.14)


def test_speculation_that_pays_runs_and_plain_decoding_is_probed_rarely() -> None:
    guard = SpeculationGuard(window_steps=4)
    modes = run(guard, 70, {ON: 0.12, OFF: 0.10}, {ON: 160, OFF: 80})   # 1.67x
    assert modes[:2] == [ON, OFF]
    later = modes[2:]
    assert 1 <= later.count(OFF) <= len(later) // 32 + 1


def test_a_loss_within_the_margin_is_left_to_the_policy() -> None:
    # 3% slower with speculation: within what a window cannot tell from noise, speculation keeps running
    close = run(SpeculationGuard(window_steps=4), 30, {ON: 0.1, OFF: 0.1}, {ON: 97, OFF: 100})
    assert close[2:].count(ON) >= 2 * close[2:].count(OFF)
    # 8% slower: beyond the margin, plain decoding runs
    far = run(SpeculationGuard(window_steps=4), 30, {ON: 0.1, OFF: 0.1}, {ON: 92, OFF: 100})
    assert far[2:].count(OFF) > 3 * far[2:].count(ON)
    with pytest.raises(ValueError, match="margin"):
        SpeculationGuard(margin=1.0)


def test_probes_are_more_frequent_when_the_modes_are_close() -> None:
    close = run(SpeculationGuard(window_steps=2), 80, {ON: 0.1, OFF: 0.1}, {ON: 82, OFF: 80})
    far = run(SpeculationGuard(window_steps=2), 80, {ON: 0.1, OFF: 0.1}, {ON: 120, OFF: 80})
    assert close[2:].count(OFF) > far[2:].count(OFF) >= 1


def test_a_change_is_noticed_through_the_probes() -> None:
    guard, clock = SpeculationGuard(window_steps=4), [0.0]
    assert run(guard, 30, {ON: 0.14, OFF: 0.10}, {ON: 96, OFF: 80}, clock=clock)[-5:].count(OFF) >= 4
    # the drafter learned: speculation now pays 1.5x; within a few probes it runs again
    modes = run(guard, 60, {ON: 0.10, OFF: 0.10}, {ON: 120, OFF: 80}, clock=clock)
    assert modes[-10:].count(ON) >= 9


def test_each_load_is_judged_on_its_own_windows() -> None:
    guard, clock = SpeculationGuard(window_steps=4), [0.0]
    run(guard, 20, {ON: 0.14, OFF: 0.10}, {ON: 96, OFF: 80}, batch=16, clock=clock)   # loses at 16
    assert not guard.allowed or guard.throughput(4, ON) < guard.throughput(4, OFF)
    modes = run(guard, 4, {ON: 0.05, OFF: 0.05}, {ON: 2, OFF: 1}, batch=1, clock=clock)
    # batch 1 has no windows yet: measured afresh, on first, whatever batch 16 found
    assert ON in modes[:2] and guard.throughput(0, ON) == pytest.approx(40.0)


def test_steps_of_the_other_mode_and_empty_steps_do_not_count() -> None:
    guard = SpeculationGuard(window_steps=2, warmup=0)
    guard.step(0.0, 1.0, 5, 4, speculated=False)     # began before the window turned on: not this window's
    guard.step(0.0, 1.0, 5, 0, speculated=True)      # nobody ran
    assert guard.allowed and guard.windows == {ON: 0, OFF: 0}
    guard.step(1.0, 2.0, 8, 4, speculated=True)
    guard.step(2.0, 3.0, 8, 4, speculated=True)
    assert guard.windows == {ON: 1, OFF: 0} and not guard.allowed


def test_prefill_time_is_taken_out_of_the_window() -> None:
    guard = SpeculationGuard(window_steps=2, warmup=0)
    guard.step(0.0, 1.0, 10, 4, speculated=True)
    guard.prefill(1.0, 5.0)                           # a long prompt between the steps
    guard.step(0.5, 6.0, 10, 4, speculated=True)      # the other group waited for it
    assert guard.throughput(2, ON) == pytest.approx(20 / 2.0)


def test_a_windows_first_steps_are_not_timed() -> None:
    """After a switch the drafter catches up on what it missed: a cost of switching, not of the mode."""
    guard = SpeculationGuard(window_steps=2, warmup=1)
    guard.step(0.0, 5.0, 4, 4, speculated=True)      # the catch-up step: slow, not timed
    guard.step(5.0, 6.0, 4, 4, speculated=True)
    assert guard.allowed
    guard.step(6.0, 7.0, 4, 4, speculated=True)
    assert not guard.allowed and guard.throughput(2, ON) == pytest.approx(4.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window_steps"):
        SpeculationGuard(window_steps=0)
    with pytest.raises(ValueError, match="keep"):
        SpeculationGuard(keep=0)
    with pytest.raises(ValueError, match="warmup"):
        SpeculationGuard(warmup=-1)
