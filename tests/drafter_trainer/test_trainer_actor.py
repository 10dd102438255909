"""The real TrainerActor as a Ray actor against a real redis-server: hostile records go to the
dead-letter stream and training goes on; a persistent failure ends the actor's process, Ray restarts
it, and the restarted trainer trains on."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from specd.cluster.redis_server import ManagedRedis
from specd.drafter_trainer.replay_source import ENTRY_FIELD, REASON_FIELD, RECORD_FIELD
from specd.proto.replay_codec import encode_record
from tests.drafter_trainer.online_helpers import greedy_continuations, make_record, make_tiny_drafter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    # the actor's process must import this tree, not an installed copy
    ray.init(num_cpus=2, include_dashboard=False, namespace="specd-test-trainer", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def redis_server():
    with ManagedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def continuations(tiny_llama_dir):
    return greedy_continuations(tiny_llama_dir, 16, new_tokens=12)


def _config(tmp_path: Path, tiny_llama_dir: Path, stream: str, *extra: str):
    from specd.configs import load_config

    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    return load_config([
        f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter}", f"trainer.out_dir={tmp_path}/store",
        "target.max_seq_len=128", "trainer.teacher_topk=8", "trainer.holdout_every=4",
        "trainer.steps_per_update=2", "trainer.batch_records=2", "trainer.update_every_records=4",
        "trainer.update_every_s=1", "trainer.dtype=float32", "trainer.nice=0", "trainer.sched_idle=false",
        "trainer.num_cpus=1", f"replay.stream={stream}", *extra,
    ])


def _wait(cond, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _stats(ray, actor) -> dict | None:
    try:
        return ray.get(actor.stats.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None          # restarting


def _hostile_records(good: bytes) -> list[bytes]:
    from specd.proto.specd.v1.replay_pb2 import ReplayRecord

    out = [b"\xff\xfe not protobuf"]
    rec = ReplayRecord.FromString(good)
    rec.output_token_ids.append(-5)                 # negative id: an index error in the teacher before
    out.append(rec.SerializeToString())
    rec = ReplayRecord.FromString(good)
    rec.prompt_token_ids.append(1 << 20)            # beyond the vocabulary (128)
    out.append(rec.SerializeToString())
    rec = ReplayRecord.FromString(good)
    rec.teacher.first_output_position = 0
    rec.teacher.ids.dtype, rec.teacher.logprobs.dtype = "int32", "float32"
    rec.teacher.ids.shape[:] = [1 << 32, 1 << 32]   # the element count wraps to 0 in 64 bits
    rec.teacher.logprobs.shape[:] = [1 << 32, 1 << 32]
    out.append(rec.SerializeToString())
    return out


def test_hostile_records_go_to_the_dead_letters_and_training_goes_on(tmp_path, tiny_llama_dir, ray_local,
                                                                     redis_server, continuations) -> None:
    from specd.cluster.trainer_actor import start_trainer_actor

    ray, stream = ray_local, "s-hostile"
    cfg = _config(tmp_path, tiny_llama_dir, stream)
    client = redis_server.endpoint.client()
    good = [encode_record(make_record(i, p, o, "tiny-t")) for i, (p, o) in enumerate(continuations)]
    hostile = _hostile_records(good[0])
    for data in hostile:                    # first in the stream: read before any good record
        client.xadd(stream, {RECORD_FIELD: data})
    for data in good[:8]:
        client.xadd(stream, {RECORD_FIELD: data})
    actor = start_trainer_actor(cfg, redis_server.endpoint)
    try:
        s = _wait(lambda: (st := _stats(ray, actor)) and st["records_seen"] >= 8 and st["updates"] >= 1
                  and st, "an update on the good records")
        assert s["records_dead"] == len(hostile) and s["failures"] == 0 and s["alive"]
        dead = client.xrange(stream + ":dead")
        assert [f[RECORD_FIELD] for _, f in dead] == hostile
        reasons = [f[REASON_FIELD].decode() for _, f in dead]
        assert "not a replay record" in reasons[0] and "-5" in reasons[1]
        assert "outside the vocabulary" in reasons[2] and "dimension" in reasons[3]
        for data in good[8:]:               # and it goes on with what comes after
            client.xadd(stream, {RECORD_FIELD: data})
        s = _wait(lambda: (st := _stats(ray, actor)) and st["records_seen"] >= 16 and st, "the later records")
        assert s["records_dead"] == len(hostile) and not s["restarted"]
        pending = client.xpending_range(stream, cfg.trainer.group, "-", "+", 100)
        # dead letters are acknowledged: never read again
        assert not {e["message_id"] for e in pending} & {f[ENTRY_FIELD] for _, f in dead}
    finally:
        ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor)


def test_a_persistent_failure_restarts_the_actor_and_it_trains_on(tmp_path, tiny_llama_dir, ray_local,
                                                                 redis_server, continuations) -> None:
    from specd.cluster.trainer_actor import start_trainer_actor
    from specd.workers.drafters.versions import META_FILE, read_current, version_dir

    ray, stream = ray_local, "s-persistent"
    cfg = _config(tmp_path, tiny_llama_dir, stream, "trainer.max_restarts=2")
    actor = start_trainer_actor(cfg, redis_server.endpoint)
    try:
        first = _wait(lambda: _stats(ray, actor), "the trainer to start")
        assert not first["restarted"]
        store = Path(first["store"])
        broken = read_current(store)
        (version_dir(store, broken) / META_FILE).write_text("{not json")   # every poll fails from now on
        after = _wait(lambda: (st := _stats(ray, actor)) and st["pid"] != first["pid"] and st,
                      "Ray to restart the actor")
        assert after["restarted"] and after["failures"] == 0 and after["alive"]
        assert read_current(store) == after["serving_version"]
        assert any(p.name.startswith(f".broken-{broken}") for p in (store / "versions").iterdir())
        client = redis_server.endpoint.client()
        for i, (p, o) in enumerate(continuations[:8]):
            client.xadd(stream, {RECORD_FIELD: encode_record(make_record(i, p, o, "tiny-t"))})
        _wait(lambda: (st := _stats(ray, actor)) and st["updates"] >= 1, "an update after the restart")
    finally:
        ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor)
