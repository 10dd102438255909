"""Keep the memory a CPU forward frees, so the next forward reuses it instead of faulting it in again.

glibc's malloc returns large freed blocks to the kernel: blocks above its mmap threshold are unmapped
on free, and the top of the heap is trimmed beyond its trim threshold. Every decode step allocates
and frees the same few-MB activations (the logits of a batch of 16 alone are 3 MB), so a process can
fault megabytes of fresh zeroed pages every step. Whether it does depends on the process's history:
glibc raises the mmap threshold when it frees a larger mmapped block, so two processes that served
the same traffic after a different start-up (a cost profile, a drafter) decode at different speeds
(docs/decisions/slot-order-and-freed-memory.md).

`keep_freed_memory` fixes both thresholds at run time (mallopt), which also turns off glibc's dynamic
adjustment: blocks under 32 MiB come from the heap and stay with the process. Memory is not lost, it
is kept for reuse, so the resident size stays near the process's peak rather than dropping between
steps. Without glibc (another libc or OS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2); blocks above it are still mapped.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

_applied = False


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # gnu_get_libc_version exists in glibc only: mallopt's parameters above are glibc's
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory(enabled: bool = True) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); True when they are set."""
    global _applied
    if not enabled:
        return False
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        log.info("not glibc: malloc thresholds left as they are")
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        log.warning("mallopt refused the malloc thresholds: freed activations go back to the kernel")
        return False
    _applied = True
    return True
