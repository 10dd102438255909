"""DrafterPause: when the in-process engine leaves a drafter that drafted nothing alone (planner.py)."""

from __future__ import annotations

from specd.workers.engine.planner import PAUSE_MAX_STEPS, PAUSE_MIN_BATCH, PAUSE_STEPS, DrafterPause


def _run(pause: DrafterPause, steps: int, batch: int = 16, drafts: bool = False) -> list[bool]:
    """`steps` steps of `batch` speculating requests; True where the drafter was asked."""
    asked = []
    for _ in range(steps):
        if pause.skip(batch):
            asked.append(False)
        else:
            pause.asked(batch, drafts, colocated=True)
            asked.append(True)
    return asked


def test_the_pause_doubles_up_to_its_cap_while_nothing_drafts() -> None:
    pause = DrafterPause()
    asked = _run(pause, 200)
    gaps, last = [], 0
    for i, a in enumerate(asked[1:], 1):
        if a:
            gaps.append(i - last - 1)
            last = i
    assert gaps[:4] == [PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS, 8 * PAUSE_STEPS]
    assert max(gaps) == PAUSE_MAX_STEPS and gaps[-1] == PAUSE_MAX_STEPS
    assert pause.paused_steps == asked.count(False)


def test_a_draft_ends_the_backoff() -> None:
    pause = DrafterPause()
    _run(pause, 60)
    assert pause.next == PAUSE_MAX_STEPS
    while pause.skip(16):
        pass
    pause.asked(16, drafted=True, colocated=True)
    assert pause.remaining == 0 and pause.next == PAUSE_STEPS
    assert _run(pause, 3, drafts=True) == [True, True, True]


def test_a_smaller_batch_asks_the_drafter_again_at_once() -> None:
    pause = DrafterPause()
    _run(pause, 40)
    assert pause.remaining > 0
    assert pause.skip(16) is True                        # same load: still paused
    assert pause.skip(15) is False                       # a request finished: ask now
    assert pause.remaining == 0
    pause.asked(15, drafted=False, colocated=True)        # still nothing: the backoff goes on
    assert pause.remaining == PAUSE_MAX_STEPS


def test_small_batches_and_drafters_of_their_own_never_pause() -> None:
    pause = DrafterPause()
    assert _run(pause, 20, batch=PAUSE_MIN_BATCH - 1) == [True] * 20
    pause.asked(16, drafted=False, colocated=False)      # the router's actor works while the target verifies
    assert pause.remaining == 0
