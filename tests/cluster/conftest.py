"""Fixtures of the cluster tests; the fake workers themselves live in fake_workers.py."""

from __future__ import annotations

import fake_workers
import pytest
from fake_workers import FakeDrafter, FakeTarget, Tracker


@pytest.fixture
def fake_pair():
    """A factory of (FakeTarget, FakeDrafter) sharing one Tracker."""

    def make(tracker: Tracker | None = None, max_slots: int = 8, delay: float = 0.0):
        target = FakeTarget(tracker, max_slots=max_slots, delay=delay)
        return target, FakeDrafter(target, delay=delay)

    return make


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for tests that place the fake workers as real actors."""
    ray = pytest.importorskip("ray")
    # The fakes live in the tests folder, which Ray's worker processes cannot import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(fake_workers)
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test-fakes", log_to_driver=False)
    yield ray
    ray.shutdown()
