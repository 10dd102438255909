"""VllmScheduler against a scripted stand-in of the VllmTarget actor (no vLLM): events reach the request's
handle, a request's end carries its statistics and per-step records to the observer, an abort finishes at
once and reaches the actor, admission bounds hold. tests/e2e/test_vllm_serve.py runs the real thing."""

from __future__ import annotations

import asyncio

import pytest

from specd.cluster.requests import FinishEvent, QueueFull, SchedulerObserver, TokensEvent
from specd.cluster.vllm_actor import FinishOut, TokensOut
from specd.cluster.vllm_scheduler import VllmScheduler, vllm_limits
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.core.stats import RequestStats
from specd.workers.engine.types import Draft, FinishReason, NewRequest, SpecParams, VerifyResult


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        result = self.fn(*args)
        if asyncio.iscoroutine(result):
            return asyncio.ensure_future(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class ScriptedActor:
    """Each submitted request emits [1, 2] then [3] and ends LENGTH with one drafted step (2 drafted,
    1 accepted), unless aborted first."""

    def __init__(self):
        self.events: list = []
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.submit = _Method(self._submit)
        self.abort = _Method(self.aborted.extend)
        self.poll = _Method(self._poll)
        self.stats = _Method(lambda: {"busy_s": 0.0, "running": 0, "vllm_unfinished": 0,
                                      "drafter_version": "v1"})
        self.close = _Method(lambda: None)

    def _submit(self, requests, ignore_eos):
        for r in requests:
            self.submitted.append(r.request_id)

    def script(self, rid: str) -> None:
        stats = RequestStats()
        stats.record_step(2, 1, False, drafter_version="v1")
        record = VerifyResult(rid, 2, 1, [3], False)
        self.events += [TokensOut(rid, [1, 2]), TokensOut(rid, [3]),
                        FinishOut(rid, "length", stats, [(Draft(rid, [3, 9], drafter_version="v1"), record)],
                                  "v1")]

    async def _poll(self, timeout_s):
        await asyncio.sleep(0.01)
        events, self.events = self.events, []
        return events


class Recorder(SchedulerObserver):
    def __init__(self):
        self.steps, self.finishes, self.records = [], [], []

    def on_step(self, replica, draft, result, depth):
        self.steps.append((replica, draft.drafter_version, result.num_drafted, result.num_accepted, depth))

    def on_finish(self, reason, stats):
        self.finishes.append(reason)

    def on_request_done(self, seq, reason):   # what the replay recorder writes: the steps seen by then
        self.records.append((seq.request_id, reason, len(self.steps)))


def request(rid: str, max_new: int = 3) -> NewRequest:
    return NewRequest(rid, [5, 6, 7], SamplingParams(), max_new, SpecParams(gamma=2))


async def collect(handle) -> tuple[list[int], FinishEvent]:
    tokens = []
    async for event in handle:
        if isinstance(event, TokensEvent):
            tokens += event.tokens
        else:
            return tokens, event
    raise AssertionError("no FinishEvent")


def test_streams_tokens_and_ends_with_stats_and_records():
    async def run():
        actor, observer = ScriptedActor(), Recorder()
        s = VllmScheduler([actor], capacity=[2], max_queue=1, max_running=2, observer=observer)
        await s.start()
        handle = s.submit(request("a"))
        actor.script("a")
        tokens, fin = await collect(handle)
        await s.stop()
        return actor, observer, tokens, fin

    actor, observer, tokens, fin = asyncio.run(run())
    assert actor.submitted == ["a"] and tokens == [1, 2, 3]
    assert fin.reason == FinishReason.LENGTH and fin.stats.completion_tokens == 3
    assert (fin.stats.spec.drafted, fin.stats.spec.accepted) == (2, 1)
    assert observer.steps == [(0, "v1", 2, 1, 2)] and observer.finishes == [FinishReason.LENGTH]


def test_abort_finishes_at_once_reaches_vllm_and_drops_late_tokens():
    async def run():
        actor, observer = ScriptedActor(), Recorder()
        s = VllmScheduler([actor], capacity=[2], max_queue=1, max_running=2, observer=observer)
        await s.start()
        handle = s.submit(request("a", max_new=100))
        s.abort("a")
        actor.script("a")                  # what vLLM had emitted before the abort reached it
        tokens, fin = await collect(handle)
        await asyncio.sleep(0.05)
        running = s.running()
        await s.stop()
        return actor, tokens, fin, running

    actor, tokens, fin, running = asyncio.run(run())
    assert actor.aborted == ["a"] and tokens == [] and running == 0
    assert fin.reason == FinishReason.CANCELLED


def test_an_aborted_requests_record_waits_for_the_steps_its_actor_held():
    """A stop string, cancel or deadline ends the stream at once; the replay record follows when the
    actor's FinishOut brings the request's steps, so the trainer sees requests cut short too."""
    async def run():
        actor, observer = ScriptedActor(), Recorder()
        s = VllmScheduler([actor], capacity=[2], max_queue=1, max_running=2, observer=observer)
        await s.start()
        handle = s.submit(request("a", max_new=100))
        actor.events.append(TokensOut("a", [1, 2]))
        while not s.tokens_generated:
            await asyncio.sleep(0.01)
        s.abort("a", FinishReason.STOP)
        _, fin = await collect(handle)
        before = list(observer.records)
        stats = RequestStats()
        stats.record_step(2, 1, False, drafter_version="v1")
        step = (Draft("a", [1, 9], drafter_version="v1"), VerifyResult("a", 2, 1, [1, 2], False))
        actor.events.append(FinishOut("a", "cancelled", stats, [step], "v1"))
        while not observer.records:
            await asyncio.sleep(0.01)
        await s.stop()
        return fin, before, observer

    fin, before, observer = asyncio.run(run())
    assert fin.reason == FinishReason.STOP and before == []
    assert observer.records == [("a", FinishReason.STOP, 1)] and observer.steps == [(0, "v1", 2, 1, 2)]


def test_admission_bounds_and_queue():
    async def run():
        s = VllmScheduler([ScriptedActor()], capacity=[1], max_queue=1, max_running=1)
        s.submit(request("a"))
        s.submit(request("b"))             # waits
        assert (s.running(), s.waiting()) == (1, 1) and not s.can_admit()
        with pytest.raises(QueueFull):
            s.submit(request("c"))
        await s.stop()

    asyncio.run(run())


def test_limits_are_named_with_their_reasons():
    limits = vllm_limits(load_config(["spec=tree"]))
    assert any("token trees" in x for x in limits) and any("one-hot" in x for x in limits)
    native = vllm_limits(load_config(["target.vllm_speculation=vllm-draft-model"]))
    assert any("draft_model proposer drafts spec.gamma" in x and "refused" in x for x in native)
    assert not any("draft_model" in x for x in limits)
