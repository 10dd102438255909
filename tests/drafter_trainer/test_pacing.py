"""The trainer's pacer: work at most a fraction of the wall time (a hand-driven clock, no real sleeping)."""

from __future__ import annotations

import pytest

from specd.drafter_trainer.pacing import Pacer


class _Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_work_of_two_seconds_at_a_quarter_idles_six() -> None:
    clock = _Clock()
    pacer = Pacer(0.25, sleep=clock.sleep, clock=clock)
    with pacer.work():
        clock.now += 2.0
    assert clock.slept == [pytest.approx(6.0)]
    assert pacer.busy_s == pytest.approx(2.0) and pacer.idled_s == pytest.approx(6.0)
    assert pacer.busy_s / clock.now == pytest.approx(0.25)


def test_a_whole_fraction_never_idles() -> None:
    clock = _Clock()
    pacer = Pacer(1.0, sleep=clock.sleep, clock=clock)
    for _ in range(3):
        with pacer.work():
            clock.now += 1.5
    assert clock.slept == [] and pacer.busy_s == pytest.approx(4.5)


def test_work_that_fails_is_paced_too() -> None:
    clock = _Clock()
    pacer = Pacer(0.5, sleep=clock.sleep, clock=clock)
    with pytest.raises(RuntimeError), pacer.work():
        clock.now += 1.0
        raise RuntimeError("a teacher forward failed")
    assert clock.slept == [pytest.approx(1.0)]


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused(fraction) -> None:
    with pytest.raises(ValueError, match="max_busy_fraction"):
        Pacer(fraction)
