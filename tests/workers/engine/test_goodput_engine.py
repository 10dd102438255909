"""The goodput policy through the in-process engine on tiny models: exact output, profiled costs, stats."""

from __future__ import annotations

import time

import pytest

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.planner import SpeculationPlanner
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256",
        "spec.policy=goodput", "spec.goodput_profile_batch_sizes=[1,4,16]",
    ])


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


GREEDY = SamplingParams()


def _run(engine, spec, sampling=GREEDY, n=32):
    reqs = [NewRequest(f"r{i}", p, sampling, n, spec) for i, p in enumerate(PROMPTS)]
    return [s.output for s in engine.generate(reqs, ignore_eos=True)]


@pytest.mark.parametrize("kind,spec", [
    ("model", SpecParams(gamma=5, policy="goodput")),
    ("model", SpecParams(gamma=4, policy="goodput", tree_width=3)),
    ("ngram", SpecParams(gamma=4, policy="goodput")),
])
def test_greedy_output_equals_target_only(cfg, target, kind, spec):
    base = _run(SpecEngine(target), SpecParams(enabled=False))
    cfg.drafter.kind = kind
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    assert _run(engine, spec) == base
    assert target.free_slots() == cfg.target.max_slots


def test_cost_profile_is_measured_and_followed(cfg, target):
    cfg.drafter.kind = "model"
    cfg.spec.goodput_profile_budget_s = 1e6      # every size: a loaded machine's sweep is not the point here
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    costs = engine.step.planner.costs
    # The sweep ran on this target: batch sizes that fit its 6 slots, 1..1+gamma_max tokens per row.
    assert sorted(costs.verify_table) == [1, 4]
    rows = costs.verify_table.values()
    assert all(len(row) == 1 + cfg.spec.gamma_max and min(row) > 0 for row in rows)
    assert sorted(costs.draft_table) == [1, 4]
    _run(engine, SpecParams(gamma=5, policy="goodput"), SamplingParams(temperature=0.8, seed=3))
    stats = engine.step.planner.goodput_stats()
    assert stats["predicted"] > 0 and stats["measured"] > 0
    assert target.free_slots() == cfg.target.max_slots


def test_sampled_requests_finish_and_free_slots(cfg, target):
    """Seeded sampling stays exact in distribution, but γ follows measured step times, so the same seed
    may draw different tokens run to run (the draws depend on how many drafts each step verified)."""
    cfg.drafter.kind = "model"
    engine = SpecEngine(target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir), seed=1))
    outs = _run(engine, SpecParams(gamma=4, policy="goodput"), SamplingParams(temperature=0.9, seed=11))
    assert [len(o) for o in outs] == [32] * len(PROMPTS)
    assert target.free_slots() == cfg.target.max_slots


@pytest.mark.parametrize("host_seconds", [0.0, 0.2])
def test_host_work_of_drafting_steps_turns_drafting_off(cfg, target, monkeypatch, host_seconds):
    """A GPU step is short, and what a drafting step costs the host beyond its forwards can outweigh
    what it saves (H100, batch 8: 0.38x target-only). Simulated here: each drafting step sleeps
    host_seconds, far more than a tiny-model step. Suffix drafts of repeated prompts cost no drafter
    forward, so only the measured host cost can stop them."""
    cfg.drafter.kind = "suffix"
    cfg.drafter.suffix_with_model = False
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    spec = SpecParams(gamma=4, policy="goodput")
    base = _run(SpecEngine(target), SpecParams(enabled=False))
    assert _run(engine, spec) == base               # the global index now holds every output
    # forwards whose cost barely grows with drafted tokens (not this machine's start-up profile, which a
    # loaded machine skews): drafting pays, unless its host work is counted
    flat = {b: [0.003 + 0.0001 * n for n in range(1 + cfg.spec.gamma_max)] for b in (1, 4)}
    planner = engine.step.planner
    planner.set_cost_profile(flat, {1: 0.0, 4: 0.0})
    planner.costs.beta = 0.0        # and kept: measured forwards do not move it (HOST_BETA_UP still applies)
    propose = drafter.propose

    def slow_propose(items, **kw):
        drafts = propose(items, **kw)
        if any(d.tokens for d in drafts):
            time.sleep(host_seconds)
        return drafts

    monkeypatch.setattr(drafter, "propose", slow_propose)
    reqs = [NewRequest(f"again{i}", p, GREEDY, 32, spec) for i, p in enumerate(PROMPTS)]
    seqs = engine.generate(reqs, ignore_eos=True)
    assert [s.output for s in seqs] == base
    steps = sum(s.stats.steps for s in seqs)
    drafting = sum(1 for s in seqs for g in s.stats.gamma_history if g > 0)
    if host_seconds:
        # a few drafting steps measure it (two in a row), the rest do not draft
        assert max(planner.costs.host_draft.values()) > host_seconds / 4
        assert drafting <= steps // 3, (drafting, steps)
    else:
        # measured host work stays far below the slow case's injected 0.2 s (milliseconds here; a quarter
        # of it is margin for a loaded machine), so drafting keeps paying
        assert planner.costs.host_seconds(len(PROMPTS)) < 0.2 / 4
        assert drafting >= steps // 2, (drafting, steps)
    assert target.free_slots() == cfg.target.max_slots


def test_pad_weight_from_a_ragged_forward() -> None:
    from specd.workers.engine.profile import _pad_weight

    row = [0.01 * n for n in range(1, 10)]                          # uniform rows: 10 ms per token per row
    assert _pad_weight(row, row[-1], 4, 9) == pytest.approx(1.0)     # costs the longest row's: padded
    assert _pad_weight(row, 0.01 * 3, 4, 9) == pytest.approx(0.0)    # costs the mean's (3 tokens): ragged
    assert _pad_weight(row, 0.01 * 6, 4, 9) == pytest.approx(0.5)
    noisy = [0.05, 0.04, 0.05, 0.05, 0.05, 0.06, 0.05, 0.07, 0.07]  # timing noise, repeated values
    assert 0.0 <= _pad_weight(noisy, 0.055, 4, 9) <= 1.0


def test_a_combined_drafter_is_profiled_through_its_model(cfg, target):
    """The suffix drafter drafts the profile's own repeated tokens from its index for free: timed as
    itself it priced its model's forwards and catch-ups at zero. The profile times the model drafter
    inside it; a lookup-only drafter stays free."""
    from specd.workers.engine.profile import profile_drafter

    cfg.drafter.kind = "suffix"
    cfg.drafter.suffix_with_model = True
    combined = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir)).drafter
    # what is timed is the model's forwards (counted: a slope of two timings can read 0 on a loaded machine)
    forwards = []
    extend = combined.model.runner.extend
    combined.model.runner.extend = lambda *a, **kw: forwards.append(len(a[0])) or extend(*a, **kw)
    try:
        measured = profile_drafter(combined, batch_sizes=(1, 4), max_seq_len=256)
    finally:
        combined.model.runner.extend = extend
    assert sorted(measured["draft"]) == [1, 4] and min(measured["draft"].values()) >= 0
    assert 1 in forwards and 4 in forwards                        # batches of 1 and 4 rows ran the model
    assert measured["catch_up"] >= 0
    assert not combined.requests and not combined.model.seqs      # the profile's requests are gone
    cfg.drafter.kind = "ngram"
    lookup = profile_drafter(DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir)).drafter,
                             batch_sizes=(1, 4), max_seq_len=256)
    assert lookup["catch_up"] == 0.0


class ClockRunner:
    """A runner whose forwards advance a fake clock: 10 ms + 2 ms per token, 5 ms more when rows differ
    in length, and a drift of 1 ms more per forward (the machine slowing down as it goes)."""

    def __init__(self) -> None:
        self.now, self.forwards, self.lengths, self.device = 0.0, 0, {}, "cpu"

    def extend(self, slots, inputs):
        counts = [len(x) for x in inputs]
        self.now += 0.010 + 0.002 * sum(counts) + (0.005 if min(counts) != max(counts) else 0.0)
        self.now += 0.001 * self.forwards
        self.forwards += 1

    def length(self, slot):
        return self.lengths.get(slot, 0)

    def rollback(self, slot, length):
        self.lengths[slot] = length


def test_ragged_cost_is_timed_in_pairs_beside_a_plain_forward(monkeypatch) -> None:
    from specd.workers.engine import profile

    runner = ClockRunner()
    monkeypatch.setattr(profile.time, "perf_counter", lambda: runner.now)
    plain = [1] * 4
    # one more token (2 ms) and going ragged (5 ms); the drift adds 1 ms to the later forward of a pair,
    # which ABBA order puts on each side alike, so the median is within a drift step of 7 ms
    extra = profile._paired_extra(runner, [0, 1, 2, 3], plain, [2, 1, 1, 1], pairs=6)
    assert extra == pytest.approx(0.007, abs=0.001)
    assert profile._paired_extra(runner, [0, 1, 2, 3], plain, plain, pairs=6) == pytest.approx(0.0, abs=0.001)


def test_estimates_start_from_the_drafters_held_out_acceptance(cfg, tiny_drafter_dir, tmp_path):
    """A drafter whose training record says its greedy choice matched 12% of held-out tokens seeds the
    planner's per-position counts and the suffix drafter's per-request model estimate with 0.12, not a
    flat 0.6; an operator's spec.goodput_prior wins; a record without the figure falls back to 0.6, and
    so do versions swapped in without one (online versions)."""
    import json
    import shutil

    from specd.workers.core.gamma import ACCEPTANCE_PRIOR as DEFAULT_PRIOR
    from specd.workers.drafters.versions import META_FILE

    drafter_dir = tmp_path / "drafter"
    shutil.copytree(tiny_drafter_dir, drafter_dir)
    meta = drafter_dir / META_FILE
    record = json.loads(meta.read_text()) if meta.exists() else {"version": "tiny"}
    record["train"] = {"eval_after": {"greedy_match": 0.12}}
    meta.write_text(json.dumps(record))

    def worker(*overrides):
        c = load_config([f"target.model_path={cfg.target.model_path}", f"drafter.path={drafter_dir}",
                         "drafter.max_slots=2", "drafter.kind=suffix", *overrides])
        return DraftWorker(c.drafter, c.spec, str(cfg.target.model_path))

    def planner(w):
        info = w.planning_info()
        return SpeculationPlanner(info["spec"], held_out_acceptance=info["held_out_acceptance"])

    seeded = worker()
    assert planner(seeded).positions[True].alpha()[0] == pytest.approx(0.12)
    assert seeded.drafter.model_prior == pytest.approx(0.12)
    assert planner(worker("spec.goodput_prior=0.5")).positions[False].alpha()[0] == pytest.approx(0.5)
    online = tmp_path / "online"
    shutil.copytree(drafter_dir, online)
    (online / META_FILE).write_text(json.dumps({"version": "online-1"}))
    seeded.drafter.weights_drafter.load(online)
    assert seeded.drafter.model_prior == DEFAULT_PRIOR
    assert planner(seeded).positions[True].alpha()[0] == DEFAULT_PRIOR
    record["train"] = {}
    meta.write_text(json.dumps(record))
    assert planner(worker()).positions[True].alpha()[0] == DEFAULT_PRIOR


class _CountingRunner:
    """A runner stand-in whose forwards take `per_row` seconds a row (time advances by a fake clock)."""

    def __init__(self, per_row: float, clock: list[float], slots: int = 16):
        self.per_row, self.clock, self.num_free, self.max_seq_len = per_row, clock, slots, 256
        self.rows_seen: set[int] = set()
        self._lengths: dict[int, int] = {}
        self._next = 0

    def allocate(self) -> int:
        self._next += 1
        self._lengths[self._next] = 0
        return self._next

    def free(self, slot: int) -> None:
        self._lengths.pop(slot, None)

    def prefill(self, slots, prompts) -> None:
        self.clock[0] += self.per_row * len(slots)

    def extend(self, slots, tokens) -> None:
        self.rows_seen.add(len(slots))
        self.clock[0] += self.per_row * len(slots)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        self._lengths[slot] = length


def test_the_sweep_keeps_to_its_budget(monkeypatch) -> None:
    """A batch size whose estimated sweep would pass the budget is not swept, nor any larger one; the
    smallest always is, and with no budget every size that fits is."""
    from specd.workers.engine import profile

    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    runner = _CountingRunner(per_row=0.5, clock=clock)
    out = profile.profile_verify(runner, batch_sizes=[1, 4, 16], max_tokens=5, budget_s=60.0)
    # batch 1: 1 + 4 × 3 + 13 = 26 forwards × 0.5 s = 13 s; batch 4's estimate 1 + 12 + 13 + 26 = 52
    # forwards × 2 s: past 60 s
    assert list(out["verify"]) == [1] and out["skipped"] == [4, 16] and runner.rows_seen == {1}
    clock[0] = 0.0
    out = profile.profile_verify(_CountingRunner(per_row=0.01, clock=clock), batch_sizes=[1, 4, 16],
                                 max_tokens=5, budget_s=60.0)
    assert list(out["verify"]) == [1, 4, 16] and out["skipped"] == []
    out = profile.profile_verify(_CountingRunner(per_row=0.5, clock=clock), batch_sizes=[1, 4, 16],
                                 max_tokens=5)
    assert list(out["verify"]) == [1, 4, 16]
