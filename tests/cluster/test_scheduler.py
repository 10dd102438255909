"""The scheduler over fake workers: lossless plumbing, pipelining, continuous batching, cancellation,
admission control and worker failures. No timing assertions: overlaps are proven by the fakes' wait."""

from __future__ import annotations

import asyncio

import pytest
from fake_workers import EOS, Tracker, target_only

from specd.cluster.scheduler import (
    FinishEvent,
    QueueFull,
    Scheduler,
    TokensEvent,
)
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.types import FinishReason, NewRequest, SpecParams


def request(rid: str, prompt: list[int], n: int, spec: bool = True, gamma: int = 4,
            stop=(EOS,)) -> NewRequest:
    return NewRequest(rid, prompt, SamplingParams(), n, SpecParams(gamma=gamma, enabled=spec), stop)


def scheduler(pairs, groups: int = 2, max_queue: int = 8, max_running: int = 16, capacity: int = 8):
    return Scheduler(pairs, capacity=capacity, max_queue=max_queue, max_running=max_running,
                     pipeline_groups=groups, eos_token_ids=[EOS])


async def until(condition, what: str) -> None:
    """Yield to the loop until condition() holds; the bound only guards against a hang."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def test_output_equals_target_only_with_and_without_speculation(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        sched = scheduler([(target, drafter)])
        await sched.start()
        prompts = [[1, 2, 3], [10], [40, 41], [5, 6, 7, 8]]
        spec = [sched.generate(request(f"s{i}", p, 17)) for i, p in enumerate(prompts)]
        plain = [sched.generate(request(f"t{i}", p, 17, spec=False)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*spec, *plain)
        await sched.stop()
        return target, drafter, results

    target, drafter, results = asyncio.run(main())
    prompts = [[1, 2, 3], [10], [40, 41], [5, 6, 7, 8]]
    for i, (tokens, fin) in enumerate(results):
        assert tokens == target_only(prompts[i % 4], 17)
        assert fin.reason == FinishReason.LENGTH and fin.stats.completion_tokens == 17
    spec_stats = [fin.stats.spec for _, fin in results[:4]]
    assert sum(s.drafted for s in spec_stats) > sum(s.accepted for s in spec_stats) > 0
    assert sum(s.recovered for s in spec_stats) > 0 and sum(s.bonus for s in spec_stats) > 0
    assert all(fin.stats.spec.drafted == 0 for _, fin in results[4:])  # target-only: gamma 0
    assert all(fin.stats.spec.drafter_versions == ["v1"] for _, fin in results[:4])
    # γ never overshoots max_new_tokens: a step emits at most gamma + 1 tokens
    assert max(drafter.gammas) == 4 and min(drafter.gammas) == 0
    assert target.running == {} and drafter.running == {}


def test_target_hidden_states_reach_a_drafter_that_reads_them(fake_pair) -> None:
    """start and verify return hidden rows only for such a drafter, and each reaches it with its tokens."""
    from fake_workers import FakeDrafter, FakeTarget

    async def main():
        target = FakeTarget()
        drafter = FakeDrafter(target, hidden=True)
        sched = scheduler([(target, drafter)])
        await sched.start()
        prompts = [[1, 2, 3], [10], [40, 41]]
        reqs = [sched.generate(request(f"h{i}", p, 13)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*reqs)
        await sched.stop()
        return drafter, prompts, results

    drafter, prompts, results = asyncio.run(main())
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == target_only(prompt, 13)
    # every prompt row and every verified token's row (the last step's commit is never sent)
    assert drafter.hidden_rows >= sum(len(p) for p in prompts)
    assert sum(fin.stats.spec.accepted for _, fin in results) > 0


def test_two_groups_draft_one_while_verifying_the_other(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair(Tracker(wait_for_overlap=2.0))
        sched = scheduler([(target, drafter)], groups=2)
        await sched.start()
        outs = await asyncio.gather(*[sched.generate(request(f"r{i}", [i + 1], 12)) for i in range(4)])
        stats = await sched.worker_stats()
        await sched.stop()
        return target, outs, stats

    target, outs, stats = asyncio.run(main())
    assert [t for t, _ in outs] == [target_only([i + 1], 12) for i in range(4)]
    assert target.tracker.overlapped_verifies > 0
    assert target.tracker.max_concurrent == 2
    # every verify carries one group: two requests, never all four
    verifies = [ids for w, m, ids in target.tracker.log if m == "verify"]
    assert max(len(ids) for ids in verifies) == 2
    assert stats[0]["steps"] > 0 and stats[0]["active_s"] > 0


def test_one_group_is_unpipelined(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        sched = scheduler([(target, drafter)], groups=1)
        await sched.start()
        outs = await asyncio.gather(*[sched.generate(request(f"r{i}", [i + 1], 9)) for i in range(3)])
        await sched.stop()
        return target, outs

    target, outs = asyncio.run(main())
    assert [t for t, _ in outs] == [target_only([i + 1], 9) for i in range(3)]
    assert target.tracker.max_concurrent == 1
    assert target.tracker.overlapped_verifies == 0


def test_requests_join_and_leave_between_steps(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        sched = scheduler([(target, drafter)], groups=1)
        await sched.start()
        target.verify_gate.clear()              # the first verify of "long" waits: "long" stays running
        long = asyncio.create_task(sched.generate(request("long", [1], 40, gamma=1)))
        await until(lambda: any("long" in ids for _, m, ids in target.tracker.log if m == "verify"), "a step")
        short_task = asyncio.create_task(sched.generate(request("short", [50], 3, gamma=1)))
        await until(lambda: sched.running() == 2, "short admitted; it starts at the next step boundary")
        target.verify_gate.set()
        short = await short_task
        long_out = await long
        await sched.stop()
        return target, short, long_out

    target, short, long_out = asyncio.run(main())
    assert short[0] == target_only([50], 3) and long_out[0] == target_only([1], 40)
    log = [(m, ids) for _, m, ids in target.tracker.log if m in ("start", "verify")]
    start_short = log.index(("start", ("short",)))
    # "short" joined while "long" was running, was verified in the same batch, then left
    assert any(m == "verify" and "long" in ids for m, ids in log[:start_short])
    assert ("verify", ("long", "short")) in log[start_short:]
    last_short = max(i for i, (m, ids) in enumerate(log) if "short" in ids)
    assert any(ids == ("long",) for m, ids in log[last_short + 1:])


def test_eos_ends_a_request_and_max_new_tokens_is_exact(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        sched = scheduler([(target, drafter)])
        await sched.start()
        eos = await sched.generate(request("eos", [90], 30))
        exact = [await sched.generate(request(f"n{n}", [3], n)) for n in (1, 2, 5, 6)]
        # the router sends no stop ids with ignore_eos; the scheduler then ignores its own EOS list too
        ignored = await sched.generate(request("ign", [97], 5, stop=()), ignore_eos=True)
        await sched.stop()
        return eos, exact, ignored

    eos, exact, ignored = asyncio.run(main())
    assert eos[0] == list(range(91, 100)) and eos[1].reason == FinishReason.EOS
    for (tokens, fin), n in zip(exact, (1, 2, 5, 6), strict=True):
        assert tokens == target_only([3], n) and fin.reason == FinishReason.LENGTH
    assert ignored[0] == [98, 99, 0, 1, 2]


def test_cancel_frees_slots_on_both_workers(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair(delay=0.002)
        sched = scheduler([(target, drafter)], capacity=1, max_queue=4)
        await sched.start()
        running = sched.submit(request("run", [1], 60, gamma=1))
        queued = sched.submit(request("queued", [2], 60))
        first = await running.__anext__()
        assert isinstance(first, TokensEvent)
        assert sched.waiting() == 1
        sched.abort("queued")
        assert (await queued.__anext__()).reason == FinishReason.CANCELLED
        sched.abort("run")
        events = [e async for e in running]
        await until(lambda: not target.running and not drafter.running, "slots freed")
        after = await sched.generate(request("after", [7], 4))
        await sched.stop()
        return target, events, after, sched

    target, events, after, sched = asyncio.run(main())
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == FinishReason.CANCELLED
    assert "run" in target.released
    assert not any("queued" in ids for _, _, ids in target.tracker.log)   # never started
    assert after[0] == target_only([7], 4)
    assert sched.running() == 0


def test_admission_control_rejects_beyond_the_queue(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        target.gate.clear()                     # hold the first prefill so every slot stays taken
        sched = scheduler([(target, drafter)], capacity=1, max_running=1, max_queue=1)
        await sched.start()
        a = asyncio.create_task(sched.generate(request("a", [1], 3)))
        b = asyncio.create_task(sched.generate(request("b", [2], 3)))
        await until(lambda: sched.waiting() == 1 and sched.running() == 1, "one running, one queued")
        with pytest.raises(QueueFull, match="max_queue=1"):
            sched.submit(request("c", [3], 3))
        target.gate.set()
        outs = await asyncio.gather(a, b)
        late = await sched.generate(request("c", [3], 3))
        await sched.stop()
        return outs, late

    outs, late = asyncio.run(main())
    assert [t for t, _ in outs] == [target_only([1], 3), target_only([2], 3)]
    assert late[0] == target_only([3], 3)


def test_a_failing_worker_fails_its_requests_not_the_scheduler(fake_pair) -> None:
    async def main():
        target, drafter = fake_pair()
        target.fail_on_verify.add("bad")
        sched = scheduler([(target, drafter)], groups=1)
        await sched.start()
        bad = await sched.generate(request("bad", [1], 10))
        good = await sched.generate(request("good", [4], 10))
        await sched.stop()
        return target, bad, good

    target, bad, good = asyncio.run(main())
    assert bad[1].reason == FinishReason.ERROR and "fake failure" in bad[1].error
    assert "bad" in target.released
    assert good[0] == target_only([4], 10) and good[1].reason == FinishReason.LENGTH


def test_requests_spread_over_replicas(fake_pair) -> None:
    async def main():
        pairs = [fake_pair(), fake_pair()]
        sched = scheduler(pairs, groups=2)
        await sched.start()
        outs = await asyncio.gather(*[sched.generate(request(f"r{i}", [i + 1], 6)) for i in range(4)])
        await sched.stop()
        return pairs, outs

    pairs, outs = asyncio.run(main())
    assert [t for t, _ in outs] == [target_only([i + 1], 6) for i in range(4)]
    assert sorted(fin.stats.replica for _, fin in outs) == [0, 0, 1, 1]
    for target, _ in pairs:
        assert sum(1 for _, m, _ in target.tracker.log if m == "start") >= 1


def test_requests_that_finish_while_the_drafter_is_down_are_released_when_it_is_back(fake_pair,
                                                                                       monkeypatch) -> None:
    """A drafter call that raises (its process lives on: serving found a ValueError inside a propose) puts the
    running requests on target-only decoding. Those that finish before the drafter answers again still hold
    its KV slots; it is told to release them once it is back, or the slots leaked until its cache was full."""
    from specd.workers.engine import step as step_module

    monkeypatch.setattr(step_module, "DRAFTER_RETRY_S", 0.0)

    async def main():
        target, drafter = fake_pair()
        real_propose, calls = drafter.propose, []

        def propose_failing_once(items):
            calls.append(len(items))
            if len(calls) == 3:
                raise ValueError("fake failure inside the drafter")
            return real_propose(items)

        drafter.propose = propose_failing_once
        drafter.max_slots = lambda: 8           # what the step asks a failed drafter: are you back?
        sched = scheduler([(target, drafter)], groups=1)
        await sched.start()
        first = await asyncio.gather(*[sched.generate(request(f"r{i}", [i + 1], 12)) for i in range(3)])
        for i in range(20):         # the first request after the outage asks whether the drafter is back
            after = await sched.generate(request(f"after{i}", [20], 12))
            if after[1].stats.spec.drafted > 0:
                break
        await sched.stop()
        return drafter, first, after

    drafter, first, after = asyncio.run(main())
    assert [t for t, _ in first] == [target_only([i + 1], 12) for i in range(3)]
    assert after[0] == target_only([20], 12) and after[1].stats.spec.drafted > 0   # the drafter is back
    assert drafter.running == {}          # every request it started was released, those of the outage too
