"""Keep the garbage collector's full collections short: what a worker loaded at start-up is frozen.

A full collection walks every object the collector tracks. A worker process holds hundreds of thousands of
them once torch and transformers are imported and a model is loaded, so a full collection is a stall of
the decode loop that lands in one step's latency (docs/decisions/gc-freeze.md). `gc.freeze()`, Python's
remedy for a heap that lives as long as the process, moves every object tracked at that moment to a
permanent generation that collections skip. Objects frozen and freed later are still freed by reference
counting; only a reference cycle among them would wait for the process to end, and what start-up built
lives that long anyway. At exit they are unfrozen, so shutdown frees them as it would have (extension
modules that count their objects at exit, triton's nanobind bindings, otherwise report them as leaked).
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_loaded_objects() -> int:
    """Collect once, then freeze every object still tracked; returns how many are frozen in all."""
    global _registered
    gc.collect()
    gc.freeze()
    if not _registered:
        atexit.register(gc.unfreeze)
        _registered = True
    return gc.get_freeze_count()
