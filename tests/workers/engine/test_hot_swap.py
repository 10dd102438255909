"""Hot-swapping published drafter versions in a DraftWorker: a good version is applied between steps;
a corrupt one, one for another target, or one that does not fit the running drafter is rejected with
one log line, and the serving version stays."""

from __future__ import annotations

import logging

import pytest
import torch

from specd.configs import load_config
from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.publish import VersionStore
from specd.workers.core.gamma import ACCEPTANCE_PRIOR as DEFAULT_PRIOR
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.versions import VersionError, read_pin, target_checksum
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.planner import SpeculationPlanner
from specd.workers.engine.types import DraftItem, NewRequest
from tests.drafter_trainer.online_helpers import make_tiny_drafter


@pytest.fixture(scope="module")
def drafters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    token = make_tiny_drafter(tiny_llama_dir, root / "token")
    return token, make_tiny_drafter(tiny_llama_dir, root / "hidden", hidden=True)


def _worker(tiny_llama_dir, drafter_dir) -> DraftWorker:
    cfg = load_config([f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter_dir}",
                       "drafter.max_slots=4", "drafter.dtype=float32", "drafter.pack=none"])
    return DraftWorker(cfg.drafter, cfg.spec, str(tiny_llama_dir))


def _planner(worker: DraftWorker) -> SpeculationPlanner:
    info = worker.planning_info()
    return SpeculationPlanner(info["spec"], held_out_acceptance=info["held_out_acceptance"])


def _one_step(worker: DraftWorker, planner: SpeculationPlanner, rid: str) -> None:
    """One propose for a fresh request; the planner reads what the drafter reported beside the draft."""
    worker.start([NewRequest(rid, [1, 2, 3], SamplingParams(), 8)], [[4]])
    planner.observe_drafts(worker.propose([DraftItem(rid, 2)]))
    worker.release([rid])


def _publish(store: VersionStore, drafter_dir, tiny_llama_dir, scale: float = 0.1, **kw) -> str:
    state, config, _ = load_drafter(drafter_dir)
    state = {k: (v + torch.randn_like(v) * scale if v.is_floating_point() else v) for k, v in state.items()}
    kw.setdefault("target_checksum", target_checksum(tiny_llama_dir))
    return store.publish(state, config, version=None, parent=None, **kw)


def test_good_version_applied_between_steps_bad_ones_rejected(tmp_path, tiny_llama_dir, drafters, caplog):
    token_dir, hidden_dir = drafters
    worker = _worker(tiny_llama_dir, token_dir)
    store = VersionStore(tmp_path / "store")
    start = worker.watch_versions(str(store.root), str(tiny_llama_dir), poll_s=3600)  # checks by hand
    swapper = worker._swapper
    swapper.stop()               # no background checks racing the ones below (it checked an empty store)
    head_before = worker.drafter.weights_drafter.runner.model.lm_head.weight.clone()

    planner = _planner(worker)
    planner.positions[True].observe(3, 0)         # the old version's drafts were all rejected ...
    low = planner.positions[True].alpha()[0]
    _one_step(worker, planner, "before")
    assert planner.positions[True].alpha()[0] == low                # no swap: the counts stay
    good = _publish(store, token_dir, tiny_llama_dir)
    assert swapper.check() == good
    assert worker.swap_stats()["version"] == start                 # parked, not applied until the next step
    worker.propose([])
    assert worker.swap_stats()["version"] == good and worker.swap_stats()["swaps"] == 1
    assert not torch.equal(worker.drafter.weights_drafter.runner.model.lm_head.weight, head_before)
    # ... the planner hears of the swap with the next drafts, and measures the new version's acceptance
    # afresh from the prior, not seeded with the old one's (no held-out figure here: the default prior)
    _one_step(worker, planner, "after")
    assert planner.positions[True].alpha()[0] == DEFAULT_PRIOR > low
    assert worker.drafter.held_out_acceptance is None

    # A version whose record carries its held-out acceptance (the trainer's gate score) is expected to
    # draft at that rate: the flat prior had a weak swapped-in version draft far more than it earned.
    scored = _publish(store, token_dir, tiny_llama_dir, held_out_acceptance=0.17,
                      gate={"candidate": {"greedy_match": 0.17}, "serving": {"greedy_match": 0.12}})
    assert swapper.check() == scored
    _one_step(worker, planner, "scored")
    assert worker.swap_stats()["version"] == scored
    # (and the gate's score of the version it replaced, on the same records: the planner's served ratio)
    assert worker.drafter.held_out_acceptance == 0.17 and worker.drafter.held_out_parent == 0.12
    assert planner.positions[True].alpha()[0] == pytest.approx(0.17)
    good = scored

    caplog.set_level(logging.WARNING, logger="specd.workers.engine.hot_swap")
    corrupt = _publish(store, token_dir, tiny_llama_dir)
    weights = store.root / "versions" / corrupt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    other_target = _publish(store, token_dir, tiny_llama_dir, target_checksum="0" * 64)
    misfit = _publish(store, hidden_dir, tiny_llama_dir)    # a hidden-state drafter's tensors
    for bad, why in ((corrupt, "sha256"), (other_target, "target"), (misfit, "unexpected tensor")):
        store_current(store, bad)
        assert swapper.check() is None and swapper.check() is None   # rejected once, not retried
        assert why in swapper.rejected[bad]
        worker.propose([])
        assert worker.swap_stats()["version"] == good
    lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 3


def store_current(store: VersionStore, version: str) -> None:
    from specd.workers.drafters.versions import write_current

    write_current(store.root, version)


def test_a_pinned_version_wins_over_current_until_unpinned(tmp_path, tiny_llama_dir, drafters):
    token_dir, _ = drafters
    worker = _worker(tiny_llama_dir, token_dir)
    with pytest.raises(ValueError, match="no version store"):
        worker.pin_version("v1")            # not following a store yet: nothing to pin
    store = VersionStore(tmp_path / "store")
    worker.watch_versions(str(store.root), str(tiny_llama_dir), poll_s=3600)   # checks by hand
    swapper = worker._swapper
    swapper.stop()               # no background checks racing the ones below (it checked an empty store)
    first = _publish(store, token_dir, tiny_llama_dir)
    second = _publish(store, token_dir, tiny_llama_dir)
    store_current(store, second)
    worker.pin_version(first)               # drafter.version_pin (specd admin set): first, not CURRENT
    with pytest.raises(VersionError, match="not published"):
        worker.pin_version("online-9999-00000000")      # refused: the pin stays where it was
    assert swapper.pin == first and read_pin(store.root) == first
    assert swapper.check() == first
    worker.propose([])                      # applied between steps like any swap
    assert worker.swap_stats()["version"] == first and swapper.check() is None
    worker.pin_version(None)                # unpinned: CURRENT again
    assert swapper.check() == second
    worker.propose([])
    assert worker.swap_stats()["version"] == second


def test_a_version_loaded_while_another_was_pinned_is_not_applied(tmp_path, tiny_llama_dir, drafters,
                                                                  monkeypatch):
    """The poll thread loads CURRENT while the caller pins another version (bench osd's held-out
    evaluation): the stale load must neither overwrite the pinned one nor be applied."""
    import specd.workers.engine.hot_swap as hot_swap

    token_dir, _ = drafters
    worker = _worker(tiny_llama_dir, token_dir)
    store = VersionStore(tmp_path / "store")
    worker.watch_versions(str(store.root), str(tiny_llama_dir), poll_s=3600)
    swapper = worker._swapper
    swapper.stop()
    first = _publish(store, token_dir, tiny_llama_dir)
    second = _publish(store, token_dir, tiny_llama_dir)
    store_current(store, second)
    load = hot_swap.load_version

    def pinned_meanwhile(vdir, target_dir):
        worker.pin_version(first)           # the other thread pins while this load of CURRENT runs
        return load(vdir, target_dir)

    monkeypatch.setattr(hot_swap, "load_version", pinned_meanwhile)
    assert swapper.check() is None and swapper.take() is None     # the stale load is dropped, not parked
    monkeypatch.setattr(hot_swap, "load_version", load)
    assert swapper.check() == first
    worker.propose([])
    assert worker.swap_stats()["version"] == first

    worker.pin_version(None)
    assert swapper.check() == second        # parked ...
    worker.pin_version(first)               # ... then pinned away before the step: not applied
    worker.propose([])
    assert worker.swap_stats()["version"] == first
