"""Replay records from serving: the scheduler with real (tiny) workers records every finished request
exactly (its prompt, output, steps), and with the real Redis stopped and restarted while requests
stream, every request still finishes, drops are counted, and writing resumes."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from prometheus_client import CollectorRegistry

from specd.cluster.redis_server import ManagedRedis
from specd.cluster.replay import ObserverFanout, ReplayRecorder
from specd.cluster.replay_writer import RECORD_FIELD, ReplayWriter
from specd.cluster.scheduler import FinishEvent, Scheduler, SchedulerObserver, TokensEvent
from specd.configs import load_config
from specd.proto.replay_codec import decode_record
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from tests.drafter_trainer.online_helpers import make_tiny_drafter

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 30, 31], [40, 41], [3, 4, 5, 6, 3, 4]]


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory):
    drafter_dir = make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("d") / "drafter")
    cfg = load_config([f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter_dir}",
                       "target.max_slots=8", "drafter.max_slots=8", "target.max_seq_len=256"])
    return TargetWorker(cfg.target), DraftWorker(cfg.drafter, cfg.spec, str(tiny_llama_dir))


class ListWriter:
    def __init__(self):
        self.records = []

    def submit(self, record) -> bool:
        self.records.append(record)
        return True


async def _run(sched: Scheduler, tag: str, n_tokens: int, gamma: int = 3, tree: int = 1,
               replay=lambda i: True) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        spec = SpecParams(gamma=gamma, tree_width=tree)
        tokens: list[int] = []
        new = NewRequest(f"{tag}-{i}", prompt, SamplingParams(), n_tokens, spec, domain=f"d{i % 2}",
                         replay=replay(i))
        async for ev in sched.submit(new, ignore_eos=True):
            if isinstance(ev, TokensEvent):
                tokens += ev.tokens
            else:
                assert isinstance(ev, FinishEvent) and ev.reason == "length", ev
        return tokens

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])


def _scheduler(workers, observer: SchedulerObserver) -> Scheduler:
    target, drafter = workers
    return Scheduler([(target, drafter)], capacity=8, max_queue=16, max_running=8, pipeline_groups=2,
                     observer=observer)


@pytest.mark.parametrize("tree", [1, 3])
def test_every_finished_request_becomes_an_exact_record(workers, tree):
    writer = ListWriter()
    recorder = ReplayRecorder(writer, target_checksum="abc")

    async def main():
        sched = _scheduler(workers, ObserverFanout([SchedulerObserver(), recorder]))
        await sched.start()
        try:
            return await _run(sched, f"t{tree}", 23, tree=tree)
        finally:
            await sched.stop()

    outputs = asyncio.run(main())
    assert recorder.running() == 0
    by_id = {r.request_id: r for r in writer.records}
    assert len(by_id) == len(PROMPTS)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        rec = by_id[f"t{tree}-{i}"]
        assert list(rec.prompt_token_ids) == prompt and list(rec.output_token_ids) == out
        assert rec.target_checksum == "abc" and rec.steps and rec.domain == f"d{i % 2}"
        offsets = [s.output_offset for s in rec.steps]
        assert offsets[0] == 1 and offsets == sorted(offsets)
        for s, nxt in zip(rec.steps, [*offsets[1:], len(out)], strict=True):
            assert nxt - s.output_offset <= s.accepted + 1    # a step emits accepted + 1 (the last one cut)
            assert s.accepted <= len(s.drafted)
            if tree > 1 and s.drafted:
                assert len(s.parents) == len(s.drafted)


def test_a_request_that_asks_for_no_record_leaves_none(workers):
    """GenerateRequest.skip_replay (NewRequest.replay False): served like any other, never recorded, and
    the recorder forgets its steps."""
    writer = ListWriter()
    recorder = ReplayRecorder(writer)

    async def main():
        sched = _scheduler(workers, recorder)
        await sched.start()
        try:
            return await _run(sched, "skip", 12, replay=lambda i: i % 2 == 0)
        finally:
            await sched.stop()

    outputs = asyncio.run(main())
    assert all(len(out) == 12 for out in outputs)
    assert sorted(r.request_id for r in writer.records) == ["skip-0", "skip-2"]
    assert recorder.running() == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_stopped_and_restarted_while_serving_fails_nothing(workers):
    registry = CollectorRegistry()
    server = ManagedRedis().start()
    writer = ReplayWriter(server.endpoint, "s", maxlen=1000, queue_size=4, socket_timeout_s=0.3,
                          retry_s=0.2, registry=registry).start()
    recorder = ReplayRecorder(writer)

    async def main():
        sched = _scheduler(workers, ObserverFanout([SchedulerObserver(), recorder]))
        await sched.start()
        try:
            first = await _run(sched, "up", 12)
            await asyncio.to_thread(_wait, lambda: writer.written == len(PROMPTS))
            server.stop()
            down = [await _run(sched, f"down{k}", 12) for k in range(4)]
            await asyncio.to_thread(_wait, lambda: writer.dropped > 0)
            server.start()
            # the writer finds Redis again within retry_s and writes what waited in its queue; requests that
            # finish before that are dropped like the others (the queue holds 4), so wait for the writes
            written = writer.written
            await _run(sched, "probe", 12)
            await asyncio.to_thread(_wait, lambda: writer.written > written)
            back = [await _run(sched, f"back{k}", 12) for k in range(3)]
            return first, down, back
        finally:
            await sched.stop()

    try:
        first, down, back = asyncio.run(main())
        assert all(len(t) == 12 for t in first)
        assert all(len(t) == 12 for wave in down + back for t in wave)
        def last_id() -> str:
            newest = server.endpoint.client().xrevrange("s", count=1)
            return decode_record(newest[0][1][RECORD_FIELD]).request_id if newest else ""

        # records queued while Redis was away may land first; the last requests' records follow them
        assert _wait(lambda: last_id().startswith("back")), last_id()
        dropped = sum(registry.get_sample_value("specd_replay_records_dropped_total", {"reason": r}) or 0
                      for r in ("queue_full", "redis_error"))
        assert dropped == writer.dropped > 0
    finally:
        writer.stop()
        server.stop()


def _wait(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_step_that_reported_counts_only_records_its_unseen_drafts():
    """The vLLM backend knows a step's accepted ids and how many it drafted: the record keeps the ids it
    has, counts the rest as unseen, and the trainer reads the step's whole draft length."""
    from types import SimpleNamespace

    from specd.drafter_trainer.online_data import record_steps
    from specd.proto.replay_codec import encode_record
    from specd.workers.engine.types import Draft, VerifyResult

    writer = ListWriter()
    recorder = ReplayRecorder(writer)
    request = NewRequest("r", [5, 6, 7], SamplingParams(), 8, SpecParams())
    recorder.on_step(0, Draft("r", [11, 12], drafter_version="v2"),
                     VerifyResult("r", 4, 2, [11, 12, 13], False), 4)
    recorder.on_step(0, Draft("r", [14, 15, 16], drafter_version="v2"),
                     VerifyResult("r", 3, 3, [14, 15, 16, 17], True), 3)
    # a last step cut by max_new_tokens: one of its two accepted ids was emitted
    recorder.on_step(0, Draft("r", [18]), VerifyResult("r", 3, 2, [18], False), 3)
    recorder.on_request_done(SimpleNamespace(request_id="r", request=request,
                                             output=[10, 11, 12, 13, 14, 15, 16, 17, 18]), "length")
    record = decode_record(encode_record(writer.records[0]))
    assert [(list(s.drafted), s.unseen_drafted, s.accepted) for s in record.steps] == [
        ([11, 12], 2, 2), ([14, 15, 16], 0, 3), ([18], 2, 1)]
    assert [(offset, drafted, accepted) for offset, drafted, accepted, _ in record_steps(record)] == [
        (1, 4, 2), (4, 3, 3), (8, 3, 1)]
