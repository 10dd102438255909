"""keep_freed_memory: a loop that allocates and frees a step's worth of blocks stops faulting pages in.

Page faults are counted (ru_minflt), not timed, in fresh interpreters: glibc's thresholds depend on what
the process allocated before, so the test's own process would not tell.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specd.workers.engine import host_memory

STEPS = textwrap.dedent("""
    import resource, sys, torch
    from specd.workers.engine import host_memory
    if sys.argv[1] == "keep":
        assert host_memory.keep_freed_memory() and host_memory.keep_freed_memory()   # once; again: no-op
    else:
        # glibc's documented starting thresholds (128 KiB), held fixed: its dynamic adjustment would make
        # the count depend on where the heap's blocks happen to lie
        libc = host_memory._glibc()
        libc.mallopt(host_memory.M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(host_memory.M_TRIM_THRESHOLD, 128 * 1024)
    def step():
        live = [torch.ones(512 * 1024) for _ in range(32)]   # 32 activations of 2 MiB, written
        del live
    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's malloc only")
def test_kept_memory_is_reused_instead_of_faulted_in_again():
    touched = 20 * 32 * 512  # pages of 4 KiB written by the 20 timed steps
    kept, plain = faults("keep"), faults("plain")
    assert kept < 0.01 * touched
    # with glibc's starting thresholds every freed block goes back and is faulted in again
    assert plain > 0.5 * touched


def test_disabled_changes_nothing():
    assert host_memory.keep_freed_memory(False) is False
