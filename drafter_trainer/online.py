"""Online distillation (OSD): the serving drafter learns from the replay stream while specd serves.

One round of the loop (`OnlineTrainer.poll()`):
  1. read records through the consumer group (replay_source.py); move records that fail
     decode_record's checks (token ids outside the target's vocabulary, bad shapes) to the dead-letter
     stream; skip records of another target;
  2. feed each record's live steps (drafter version, drafted, accepted) to the LiveMonitor, and roll
     the serving version back to its parent when it fell behind it or collapsed (gate.py);
  3. label each record with the target's signal (online_data.py) and put it in the training buffer,
     or, every `holdout_every`-th record, in the gate's held-out set;
  4. every `update_every_records` new records (or `update_every_s` seconds): `steps_per_update`
     AdamW steps on random batches of the buffer with the configured divergence and position
     weights; then the gate scores the candidate against the serving version on the held-out
     records and publishes it when it is better by `gate_margin` (publish.py); then checkpoints the
     candidate and AdamW (checkpoint.py) and acknowledges the records the round trained on, now
     that what they taught is durable. Records that feed no update (skipped, empty, held out) are
     acknowledged in the round that read them, so the pending list stays bounded.
A restarted trainer resumes from its checkpoint when the store still serves the version it was trained
from, and reads its unacknowledged records again.
Plain Python: cluster/trainer_actor.py runs it as a Ray actor, `specd train` in a process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from specd.drafter_trainer.checkpoint import TrainerState, load_state, save_state
from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.gate import GateScore, LiveMonitor, passes, score
from specd.drafter_trainer.losses import dense_teacher, weighted_loss
from specd.drafter_trainer.online_data import (
    Example,
    Student,
    TargetTeacher,
    is_held_out,
    make_example,
    record_steps,
    trainer_dtype,
)
from specd.drafter_trainer.publish import TARGET_TENSORS, VersionStore, write_current_durably
from specd.drafter_trainer.replay_source import ReplaySource
from specd.proto.replay_codec import ReplayFormatError, decode_record
from specd.workers.drafters.versions import (
    VERSIONS_DIR,
    VersionError,
    held_out_acceptance,
    load_version,
    target_checksum,
    version_dir,
)

log = logging.getLogger(__name__)
# TrainerStats fields a checkpoint carries over a restart
_COUNTERS = ("records_seen", "records_skipped", "records_dead", "updates", "optimizer_steps", "publishes",
             "publish_failures", "rollbacks")


@dataclass
class TrainerStats:
    records_seen: int = 0
    records_skipped: int = 0
    records_dead: int = 0           # moved to the dead-letter stream (<stream>:dead)
    updates: int = 0
    optimizer_steps: int = 0
    last_loss: float = float("nan")
    losses: list[float] = field(default_factory=list)
    publishes: int = 0
    publish_failures: int = 0       # publishes that failed on the disk (nothing changed in the store)
    rollbacks: int = 0
    gate_candidate: dict = field(default_factory=dict)
    gate_serving: dict = field(default_factory=dict)
    serving_version: str = ""
    checkpoint_failures: int = 0
    resumed: bool = False           # this trainer continued from a checkpoint
    events: list[dict] = field(default_factory=list)   # publish / rollback / gate_rejected, newest last

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["losses"] = self.losses[-50:]
        d["events"] = self.events[-50:]
        return d


class OnlineTrainer:
    def __init__(self, cfg, source: ReplaySource, target_dir: str | Path, base_drafter_dir: str | Path,
                 store_root: str | Path, *, teacher: TargetTeacher | None = None, seed: int = 0,
                 store: VersionStore | None = None):
        """cfg: specd.configs.schema.TrainerConfig. base_drafter_dir: the drafter serving starts from (a full
        drafter directory); it becomes the store's first version when the store is empty (None: the store
        must have one). store: a VersionStore at store_root to publish through (default: a plain one)."""
        self.cfg = cfg
        self.source = source
        self.target_dir = Path(target_dir)
        self.store = store if store is not None else VersionStore(store_root, keep=cfg.keep_versions)
        self._known_versions: dict[str, bool] = {}     # recorded version -> published in the store
        self.target_checksum = target_checksum(self.target_dir)
        self.vocab_size = int(json.loads((self.target_dir / "config.json").read_text())["vocab_size"])
        self.dtype = trainer_dtype(str(cfg.dtype), str(cfg.device))
        self.teacher = teacher or TargetTeacher(self.target_dir, top_k=cfg.teacher_topk,
                                                device=str(cfg.device), dtype=self.dtype)
        self.stats = TrainerStats()
        self.monitor = LiveMonitor(cfg.rollback_window_steps, cfg.rollback_margin, cfg.collapse_steps,
                                   cfg.collapse_alpha)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        if self.store.current() is None:
            self._publish_base(base_drafter_dir)
        try:
            self.serving = self._load(self.store.current())
        except (ValueError, OSError) as exc:     # VersionError, a damaged config.json, a missing file
            self._recover_current(base_drafter_dir, exc)
            self.serving = self._load(self.store.current())
        self.candidate = self._load(self.store.current())
        self.stats.serving_version = self.store.current()
        self._serving_scores: dict[str, tuple[float, ...]] = {}   # the gate's, for the serving version
        self.optimizer = self._optimizer()
        self.buffer: deque[Example] = deque(maxlen=cfg.buffer_records)
        self.holdout: deque[Example] = deque(maxlen=cfg.holdout_records)
        self._unacked: dict[str, None] = {}    # in the buffer; acknowledged once their update is durable
        self._done: list[str] = []             # to acknowledge at the end of this round (fed no update)
        self.max_unacked = 4 * max(cfg.buffer_records, cfg.update_every_records)
        self._new = 0
        self._last_update = time.monotonic()
        self._resume()
        source.ensure_group()

    # ---- versions ------------------------------------------------------------------------------
    def _publish_base(self, base_drafter_dir: str | Path) -> None:
        state, config, meta = load_drafter(base_drafter_dir)
        self.store.publish(state, config, version=meta.get("version"), parent=None,
                           target_checksum=self.target_checksum, origin=str(base_drafter_dir),
                           held_out_acceptance=held_out_acceptance(meta))

    def _recover_current(self, base_drafter_dir: str | Path, exc: Exception) -> None:
        """CURRENT names a version that cannot be loaded: move it aside (versions/.broken-*, kept for
        inspection, never served) and serve the newest loadable version, else the base drafter again."""
        bad = self.store.current()
        log.error("trainer: serving version %s is unreadable (%s); moving it aside", bad, exc)
        aside = self.store.root / VERSIONS_DIR / f".broken-{bad}-{uuid.uuid4().hex[:6]}"
        with contextlib.suppress(OSError):
            version_dir(self.store.root, bad).rename(aside)
        for version in reversed(self.store.versions()):
            try:
                self._load(version)
            except (ValueError, OSError):
                continue
            write_current_durably(self.store.root, version)
            log.warning("trainer: serving %s instead", version)
            return
        if base_drafter_dir is None:
            raise VersionError(f"no loadable version in {self.store.root} and no base drafter on this node")
        self._publish_base(base_drafter_dir)

    def _load(self, version: str) -> Student:
        tensors, _ = load_version(version_dir(self.store.root, version), self.target_dir)
        config = _read_config(version_dir(self.store.root, version))
        return Student(config, tensors)

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        opt = torch.optim.AdamW(self.candidate.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        # Linear warm-up: Adam's first steps move every weight by about lr whatever its gradient, which
        # knocked a trained drafter's held-out acceptance down before it could learn
        # (docs/decisions/online-trainer-settings.md).
        warmup = max(1, cfg.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return opt

    @property
    def serving_version(self) -> str:
        return self.stats.serving_version

    # ---- the loop ------------------------------------------------------------------------------
    def poll(self, block_ms: int = 1000, count: int = 64) -> int:
        """One round: read, monitor, label, maybe update. Returns the number of records read.

        Should the round fail half-way (the caller retries, cluster/trainer_actor.py), the records it had
        not yet put into the buffer are read again from the pending list on the next round; those it had
        are skipped then."""
        entries = self.source.read(count=count, block_ms=block_ms)
        try:
            self._round([(i, d) for i, d in entries if i not in self._unacked])
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                self._ack_done()
            self.source.rewind()
            raise
        self._ack_done()
        return len(entries)

    def _ack_done(self) -> None:
        done, self._done = self._done, []
        self.source.ack(done)

    def _round(self, entries: list[tuple[str, bytes]]) -> None:
        records = [(entry_id, data, self._decode(entry_id, data)) for entry_id, data in entries]
        # Live acceptance first and the rollback check at once: labelling (a teacher forward per record)
        # must not delay rolling back a collapsed version.
        for _, _, record in records:
            if record is not None:
                self._observe_live(record)
        self._check_rollback()
        for entry_id, data, record in records:
            if record is not None:
                self._ingest(entry_id, data, record)
        due = self._new >= self.cfg.update_every_records or (
            self._new > 0 and time.monotonic() - self._last_update >= self.cfg.update_every_s
        )
        if due and self.buffer:
            self.update()

    def _observe_live(self, record) -> None:
        """Feed the monitor the steps drafted by the version the request started with. After a hot-swap a
        running request's drafter K/V still come from the old weights (workers/drafters/model.py load()),
        so its steps under the new version understate it: counting them rolled every new version back
        in `specd bench osd` (0.14-0.17 live against the parent's 0.20-0.22, four versions in a row)."""
        steps = record_steps(record)
        # Only the model drafter's versions are the store's: a combined drafter's other sources (suffix,
        # n-gram) record their own version on the steps they drafted, and those say nothing of the weights.
        first = next((v for _, drafted, _, v in steps if drafted > 0 and self._published(v)), None)
        for _, drafted, accepted, version in steps:
            if version == first:
                self.monitor.observe(version, drafted, accepted, record.domain)

    def _published(self, version: str) -> bool:
        known = self._known_versions.get(version)
        if known is None:
            known = self._known_versions[version] = version_dir(self.store.root, version).is_dir()
        return known

    def _decode(self, entry_id: str, data: bytes):
        try:
            record = decode_record(data, vocab_size=self.vocab_size)
        except ReplayFormatError as exc:
            self._dead_letter(entry_id, data, str(exc))
            return None
        if record.target_checksum and record.target_checksum != self.target_checksum:
            self.stats.records_skipped += 1
            self._done.append(entry_id)
            return None
        return record

    def _dead_letter(self, entry_id: str, data: bytes, reason: str) -> None:
        """A record the trainer cannot use: counted, moved to <stream>:dead with its reason, acknowledged."""
        log.warning("trainer: entry %s to %s: %s", entry_id, self.source.dead_stream, reason)
        self.source.dead_letter(entry_id, data, reason)
        self.stats.records_dead += 1

    def _ingest(self, entry_id: str, data: bytes, record) -> None:
        try:
            example = make_example(entry_id, record, self.teacher, positions=self.cfg.positions,
                                   accepted_weight=self.cfg.accepted_weight, need_hidden=self.serving.hidden,
                                   chain=self.cfg.gate_gamma, prompt_weight=self.cfg.prompt_weight)
        except (ValueError, IndexError) as exc:
            # decode_record's checks should leave nothing for labelling to trip over; should one slip
            # through, that record goes to the dead letters, not the trainer with it.
            self._dead_letter(entry_id, data, f"labelling failed: {type(exc).__name__}: {exc}")
            return
        self.stats.records_seen += 1
        if example is None:
            self._done.append(entry_id)        # nothing to learn from: acknowledged at once
            return
        if is_held_out(entry_id, self.cfg.holdout_every):
            # the gate's: it feeds no update, so nothing waits for it (a restart refills the held-out set)
            self.holdout.append(example)
            self._done.append(entry_id)
        else:
            self.buffer.append(example)
            self._unacked[entry_id] = None
            self._new += 1

    def train_steps(self, steps: int, examples: list[Example] | None = None) -> list[float]:
        """`steps` AdamW steps on random batches of `examples` (default: the buffer)."""
        pool = list(examples if examples is not None else self.buffer)
        losses = []
        self.candidate.train(True)
        params = self.candidate.parameters()
        # Mixed precision: the forward's matmuls in self.dtype, weights, gradients and AdamW state in
        # float32 (the drafter serves in bfloat16 anyway, drafter.dtype).
        autocast = torch.autocast(str(self.cfg.device), dtype=self.dtype, enabled=self.dtype != torch.float32)
        for _ in range(steps):
            batch = self.rng.sample(pool, min(self.cfg.batch_records, len(pool)))
            with autocast:
                logits = self.candidate.logits(batch, gen=self.gen)  # [Σ n, V_sub]
            p = torch.cat([dense_teacher(e.topk_logprobs, e.topk_ids, self.candidate.vocab_ids,
                                         self.candidate.vocab_size) for e in batch])
            w = torch.cat([e.weights for e in batch])
            loss = weighted_loss(logits.float(), p, w, self.cfg.divergence, self.cfg.jsd_beta)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            losses.append(float(loss.detach()))
        self.candidate.train(False)
        self.stats.optimizer_steps += steps
        self.stats.losses += losses
        if losses:
            self.stats.last_loss = losses[-1]
        return losses

    def update(self) -> str | None:
        """Train, gate, maybe publish, checkpoint; then acknowledge the records the round trained on,
        once what they taught is durable (published or checkpointed). Returns a published version."""
        fed = list(self._unacked)
        self.train_steps(self.cfg.steps_per_update)
        self.stats.updates += 1
        self._new = 0
        self._last_update = time.monotonic()
        published = self.gate_and_publish()
        if self.save_checkpoint() or published:
            self._ack(fed)
        elif len(self._unacked) > self.max_unacked:
            # Neither a publish nor a checkpoint for a long while (a full disk): acknowledge the oldest
            # rather than let the pending list grow without bound; what they taught may be lost.
            over = list(self._unacked)[: len(self._unacked) - self.max_unacked]
            log.warning("trainer: %d records acknowledged without durable state", len(over))
            self._ack(over)
        s = self.stats
        log.info("trainer: update %d: %d records seen, %d in the buffer, loss %.4f, gate candidate %s vs "
                 "serving %s: %s", s.updates, s.records_seen, len(self.buffer), s.last_loss,
                 s.gate_candidate.get("expected_acceptance"), s.gate_serving.get("expected_acceptance"),
                 f"published {published}" if published else "kept " + s.serving_version)
        return published

    def _ack(self, entry_ids: list[str]) -> None:
        self.source.ack(entry_ids)
        for entry_id in entry_ids:
            self._unacked.pop(entry_id, None)

    # ---- the trainer's own state ---------------------------------------------------------------
    def save_checkpoint(self) -> bool:
        """Checkpoint the candidate, AdamW and the counters (checkpoint.py); False when the disk
        refused (logged and counted: the previous checkpoint stays)."""
        counters = {k: getattr(self.stats, k) for k in _COUNTERS}
        state = TrainerState(candidate={k: v for k, v in self.candidate.state_dict().items()
                                        if k not in TARGET_TENSORS},
                             optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
                             serving_version=self.serving_version, counters=counters)
        try:
            save_state(self.store.root, state)
        except OSError as exc:
            self.stats.checkpoint_failures += 1
            log.error("trainer: checkpoint failed (records stay unacknowledged): %s", exc)
            return False
        return True

    def _resume(self) -> None:
        """Continue from the newest checkpoint if it was trained from the version serving now."""
        state = load_state(self.store.root)
        if state is None:
            return
        if state.serving_version != self.serving_version:
            log.warning("trainer: checkpoint trained from %s, the store serves %s: starting from %s",
                        state.serving_version, self.serving_version, self.serving_version)
            return
        self.candidate.load_state_dict({**self.candidate.state_dict(), **state.candidate})
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        for key, value in state.counters.items():
            if key in _COUNTERS:
                setattr(self.stats, key, value)
        self.stats.resumed = True
        log.info("trainer: resumed from its checkpoint (%d updates, %d optimizer steps)",
                 self.stats.updates, self.stats.optimizer_steps)

    def gate_and_publish(self) -> str | None:
        if not self.holdout:
            return None
        held = list(self.holdout)
        cand = score(self.candidate, held, self.cfg.gate_gamma)
        kept = {e.entry_id for e in held}
        self._serving_scores = {k: v for k, v in self._serving_scores.items() if k in kept}
        serv = score(self.serving, held, self.cfg.gate_gamma, cache=self._serving_scores)
        self.stats.gate_candidate, self.stats.gate_serving = cand.as_dict(), serv.as_dict()
        if not passes(cand, serv, self.cfg.gate_margin):
            self._event("gate_rejected", candidate=cand.as_dict(), serving=serv.as_dict())
            return None
        return self._publish(cand, serv)

    def _publish(self, cand: GateScore, serv: GateScore) -> str | None:
        parent = self.serving_version
        try:
            version = self.store.publish(
                self.candidate.state_dict(), self.candidate.config, version=None, parent=parent,
                target_checksum=self.target_checksum, records_seen=self.stats.records_seen,
                # what the planner seeds its acceptance counts with when this version starts drafting
                held_out_acceptance=round(cand.greedy_match, 4),
                gate={"candidate": cand.as_dict(), "serving": serv.as_dict(), "margin": self.cfg.gate_margin},
                train={"divergence": self.cfg.divergence, "positions": self.cfg.positions, "lr": self.cfg.lr,
                       "optimizer_steps": self.stats.optimizer_steps},
            )
        except OSError as exc:
            # A full or failing disk: the store is as it was (publish.py), CURRENT names the serving
            # version, and the candidate trains on; the next passing gate tries again.
            self.stats.publish_failures += 1
            self._event("publish_failed", parent=parent, error=f"{type(exc).__name__}: {exc}")
            log.error("trainer: publishing failed, %s keeps serving: %s", parent, exc)
            return None
        self.serving.load_state_dict(self.candidate.state_dict())
        self._serving_scores = {}
        self.stats.serving_version = version
        self.stats.publishes += 1
        self._event("publish", version=version, parent=parent, candidate=cand.as_dict(),
                    serving=serv.as_dict())
        log.info("trainer: published %s (parent %s): expected acceptance %.4f vs %.4f", version, parent,
                 cand.expected_acceptance, serv.expected_acceptance)
        return version

    def _check_rollback(self) -> None:
        version = self.serving_version
        parent = self.store.meta(version).get("parent_version")
        reason = self.monitor.should_roll_back(version, parent)
        if reason is None:
            return
        parent = self.store.roll_back(version)
        self.serving = self._load(parent)
        self._serving_scores = {}
        self.candidate = self._load(parent)
        self.optimizer = self._optimizer()
        self.stats.serving_version = parent
        self.stats.rollbacks += 1
        self._event("rollback", version=version, parent=parent, reason=reason)
        log.warning("trainer: rolled %s back to %s: %s", version, parent, reason)

    def _event(self, kind: str, **data) -> None:
        self.stats.events.append({"event": kind, "time": time.time(), "records_seen": self.stats.records_seen,
                                  **data})

    def run(self, stop=None, block_ms: int = 1000) -> None:
        """poll() until stop() is true (or forever)."""
        while stop is None or not stop():
            self.poll(block_ms=block_ms)


def _read_config(vdir: Path) -> dict:
    return json.loads((vdir / "config.json").read_text())
