"""What a worker loaded is frozen out of full collections; what comes after is collected as before."""

import gc
import weakref

from specd.workers.engine.gc_freeze import freeze_loaded_objects


class _Node:
    def __init__(self) -> None:
        self.me = self       # a reference cycle: only the collector frees it


def test_loaded_objects_are_frozen_and_later_cycles_still_collected() -> None:
    loaded = [_Node() for _ in range(100)]
    frozen = freeze_loaded_objects()
    try:
        # frozen objects other threads drop are still freed, so the count may fall a little after
        assert frozen >= 100 and 0 < gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in loaded)        # skipped by every collection
        later = _Node()
        assert id(later) in {id(o) for o in gc.get_objects()}
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None                                   # a cycle made after the freeze is freed
    finally:
        gc.unfreeze()
