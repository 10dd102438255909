"""Fixtures of the cluster tests; the fake workers themselves live in fake_workers.py."""

from __future__ import annotations

import pytest
from fake_workers import FakeDrafter, FakeTarget, Tracker


@pytest.fixture
def fake_pair():
    """A factory of (FakeTarget, FakeDrafter) sharing one Tracker."""

    def make(tracker: Tracker | None = None, max_slots: int = 8, delay: float = 0.0):
        target = FakeTarget(tracker, max_slots=max_slots, delay=delay)
        return target, FakeDrafter(target, delay=delay)

    return make
