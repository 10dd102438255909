"""ReplayRecorder: the scheduler's observer that turns each finished request into a replay record.

It collects every step of a running request as the scheduler applies it (`on_step`: the draft, its
verify result) and, when the request is done (`on_request_done`), builds the record from the
request's prompt and its emitted output (proto/replay_codec.py) and hands it to the ReplayWriter,
which never blocks. Per running request it keeps the step outcomes only; nothing crosses a process.
`ObserverFanout` lets the metrics observer and the recorder both watch one scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specd.cluster.scheduler import SchedulerObserver, ServedStats
from specd.proto.replay_codec import RecordBuilder
from specd.workers.engine.types import Draft, FinishReason, VerifyResult


@dataclass
class _Steps:
    # (drafted ids, tree parents, accepted, bonus, version, emitted, drafts whose ids were not reported)
    steps: list[tuple[list[int], list[int] | None, int, bool, str, list[int], int]] = field(
        default_factory=list)


class ReplayRecorder(SchedulerObserver):
    def __init__(self, writer, target_checksum: str = "", skip_prefixes: tuple[str, ...] = ("warmup-",)):
        """writer: anything with submit(ReplayRecord) -> bool (cluster/replay_writer.py)."""
        self.writer = writer
        self.target_checksum = target_checksum
        self.skip_prefixes = skip_prefixes
        self._running: dict[str, _Steps] = {}
        # A step of a request cancelled while it ran is reported after the request is done: remember
        # the latest finished ids so that such a step does not open a new, never-closed entry.
        self._done: OrderedDict[str, None] = OrderedDict()

    def on_step(self, replica: int, draft: Draft, result: VerifyResult, depth: int) -> None:
        rid = result.request_id
        if rid.startswith(self.skip_prefixes) or rid in self._done:
            return
        parents = draft.parents[1:] if draft.parents else None
        # A chain's VerifyResult counts its drafts; where the backend reported fewer ids than that (vLLM:
        # the accepted prefix only), the record says how many it did not see.
        # (A last step cut short may not even show all its accepted ids: the record keeps those it has.)
        unseen = 0 if parents else max(0, result.num_drafted - len(draft.tokens))
        accepted = result.num_accepted if parents else min(result.num_accepted, len(draft.tokens))
        self._running.setdefault(rid, _Steps()).steps.append(
            (list(draft.tokens), parents, accepted, result.is_bonus, draft.drafter_version,
             list(result.new_tokens), unseen)
        )

    def on_request_done(self, seq, reason: str) -> None:
        """seq: specd.workers.engine.sequence.Sequence of the finished (or cancelled, or failed) request."""
        history = self._running.pop(seq.request_id, None)
        self._done[seq.request_id] = None
        if len(self._done) > 4096:
            self._done.popitem(last=False)
        if seq.request_id.startswith(self.skip_prefixes) or not seq.output:
            return
        if not getattr(seq.request, "replay", True):
            return      # the client asked for no record (GenerateRequest.skip_replay)
        record = build_record(seq, history.steps if history else [], self.target_checksum)
        self.writer.submit(record)

    def running(self) -> int:
        return len(self._running)


def build_record(seq, steps, target_checksum: str = ""):
    """A ReplayRecord of `seq` (its prompt, its emitted output) and its steps' outcomes, in order."""
    request = seq.request
    output = list(seq.output)
    domain = getattr(request, "domain", "") or ""
    b = RecordBuilder(request.request_id, request.prompt_token_ids, domain=domain,
                      temperature=float(request.sampling.temperature or 0.0), target_checksum=target_checksum)
    # The prefill emits one token (TargetWorker.start), then every step emits accepted + 1.
    first = min(1, len(output)) if steps else len(output)
    b.first_tokens(output[:first])
    pos = first
    for drafted, parents, accepted, bonus, version, new_tokens, unseen in steps:
        if pos >= len(output):
            break                      # a step applied after the request was cut or cancelled
        emitted = output[pos : pos + len(new_tokens)]
        b.step(drafted, accepted=accepted, bonus=bonus, emitted=emitted, drafter_version=version,
               parents=parents, unseen_drafted=unseen)
        pos += len(emitted)
    return b.finish()


class ObserverFanout(SchedulerObserver):
    """Calls every observer's hook in turn (metrics first, then the recorder)."""

    def __init__(self, observers: list[SchedulerObserver]):
        self.observers = observers

    def on_queue(self, waiting: int, running: int) -> None:
        for o in self.observers:
            o.on_queue(waiting, running)

    def on_first_token(self, seconds: float) -> None:
        for o in self.observers:
            o.on_first_token(seconds)

    def on_step(self, replica: int, draft: Draft, result: VerifyResult, depth: int) -> None:
        for o in self.observers:
            o.on_step(replica, draft, result, depth)

    def on_finish(self, reason: FinishReason, stats: ServedStats) -> None:
        for o in self.observers:
            o.on_finish(reason, stats)

    def on_request_done(self, seq, reason: str) -> None:
        for o in self.observers:
            o.on_request_done(seq, reason)
