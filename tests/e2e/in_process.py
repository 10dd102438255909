"""`specd serve` in a thread of the test process (Ray initialised by the caller): its handle while the
block runs, then stopped, with bring-up failures raised in the test instead of a silent hang."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(cfg, bring_up_s: float = 900) -> Iterator:
    from specd.cluster.serve import serve

    ready, handles, errors = threading.Event(), [], []

    def run():
        try:
            serve(cfg, lambda h: (handles.append(h), ready.set()))
        except BaseException as exc:  # surface bring-up failures in the test, not a silent hang
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(bring_up_s), "server did not come up"
    assert not errors, errors
    try:
        yield handles[0]
    finally:
        handles[0].stop()
        thread.join(120)
    assert not thread.is_alive(), "server did not shut down"
