"""Fake workers with the TargetWorker / DraftWorker API, for scheduler and router tests.

The fake target's "model" is deterministic: the token after t is (t + 1) % VOCAB, so the target-only
output of any prompt is known. The fake drafter proposes that rule but is wrong at every position whose
index is 4 mod 5, so steps see both rejections (recovered tokens) and full acceptance (bonus tokens).
The drafter checks the commit fields it receives against the target's committed sequence: a scheduler
that loses or reorders a verify result fails loudly. A shared Tracker records which calls overlapped.
"""

from __future__ import annotations

import threading
import time

import torch

from specd.configs.schema import SpecConfig
from specd.workers.engine.types import Draft, DraftItem, NewRequest, VerifyResult

VOCAB = 100
EOS = 99


def next_token(t: int) -> int:
    return (t + 1) % VOCAB


def target_only(prompt: list[int], n: int, eos: int | None = EOS) -> list[int]:
    """What greedy target-only decoding emits: n tokens, or up to and including the first EOS."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
        if last == eos:
            break
    return out


class Tracker:
    """Which worker calls ran at the same time, and the call log in start order."""

    def __init__(self, wait_for_overlap: float = 0.0):
        self.lock = threading.Condition()
        self.in_flight: dict[str, int] = {"target": 0, "drafter": 0}
        self.max_concurrent = 0
        self.overlapped_verifies = 0
        self.log: list[tuple[str, str, tuple[str, ...]]] = []   # (worker, method, request ids)
        self.proposes_started = 0
        # >0: a verify waits up to this long for a propose to start, proving the pipeline (no timing asserts)
        self.wait_for_overlap = wait_for_overlap

    def enter(self, worker: str, method: str, ids: list[str]) -> None:
        with self.lock:
            self.in_flight[worker] += 1
            self.max_concurrent = max(self.max_concurrent, sum(self.in_flight.values()))
            self.log.append((worker, method, tuple(ids)))
            if method == "propose":
                self.proposes_started += 1
                self.lock.notify_all()

    def leave(self, worker: str) -> None:
        with self.lock:
            self.in_flight[worker] -= 1

    def wait_for_propose(self) -> None:
        with self.lock:
            seen = self.proposes_started
            if self.in_flight["drafter"]:
                self.overlapped_verifies += 1
                return
            if self.wait_for_overlap and self.lock.wait_for(
                lambda: self.proposes_started > seen, timeout=self.wait_for_overlap
            ):
                self.overlapped_verifies += 1


class FakeTarget:
    def __init__(self, tracker: Tracker | None = None, max_slots: int = 8, delay: float = 0.0):
        self.tracker = tracker or Tracker()
        self.max_slots = max_slots
        self.delay = delay
        self.running: dict[str, list[int]] = {}
        self.gate = threading.Event()     # start() blocks until set (admission tests hold it)
        self.gate.set()
        self.verify_gate = threading.Event()   # verify() blocks until set (join tests hold it)
        self.verify_gate.set()
        self.fail_on_verify: set[str] = set()
        self.released: list[str] = []
        self.before_verify: dict[str, list[int]] = {}   # each request's sequence before its last verify
        self._busy = 0.0

    def info(self) -> dict:
        return {"model": "fake", "model_dir": "/nonexistent", "vocab_size": VOCAB, "eos_token_ids": [EOS],
                "max_seq_len": 64, "max_slots": self.max_slots}

    def _work(self) -> None:
        t0 = time.perf_counter()
        if self.delay:
            time.sleep(self.delay)
        self._busy += time.perf_counter() - t0

    @staticmethod
    def hidden_of(tokens: list[int]) -> torch.Tensor:
        """Fake hidden states: the row that predicted a token holds that token, so a drafter can check
        it got the rows of exactly the tokens it is handed: [len(tokens), 1]."""
        return torch.tensor(tokens, dtype=torch.float32)[:, None]

    def start(self, requests: list[NewRequest], return_hidden: bool = False):
        out = self._start(requests)
        if return_hidden:
            pairs = zip(requests, out, strict=True)
            return out, [self.hidden_of([*r.prompt_token_ids[1:], *f]) for r, f in pairs]
        return out

    def _start(self, requests: list[NewRequest]) -> list[list[int]]:
        self.tracker.enter("target", "start", [r.request_id for r in requests])
        try:
            self.gate.wait(timeout=30)
            if len(self.running) + len(requests) > self.max_slots:
                raise RuntimeError(f"no free KV slots: {len(requests)} asked, {len(self.running)} used")
            self._work()
            out = []
            for r in requests:
                assert r.request_id not in self.running, r.request_id
                first = next_token(r.prompt_token_ids[-1])
                self.running[r.request_id] = [*r.prompt_token_ids, first]
                out.append([first])
            return out
        finally:
            self.tracker.leave("target")

    def verify(self, drafts: list[Draft], return_hidden: bool = False) -> list[VerifyResult]:
        results = self._verify(drafts)
        for res in results if return_hidden else []:
            res.hidden = self.hidden_of(res.new_tokens)
        return results

    def _verify(self, drafts: list[Draft]) -> list[VerifyResult]:
        self.tracker.enter("target", "verify", [d.request_id for d in drafts])
        try:
            self.verify_gate.wait(timeout=30)
            self.tracker.wait_for_propose()
            self._work()
            results = []
            for d in drafts:
                if d.request_id in self.fail_on_verify:
                    raise ValueError(f"fake failure for {d.request_id}")
                seq = self.running[d.request_id]
                self.before_verify[d.request_id] = list(seq)
                accepted, expect = 0, next_token(seq[-1])
                for tok in d.tokens:
                    if tok != expect:
                        break
                    accepted += 1
                    expect = next_token(expect)
                new = [*d.tokens[:accepted], expect]
                seq += new
                results.append(VerifyResult(d.request_id, len(d.tokens), accepted, new,
                                            is_bonus=accepted == len(d.tokens)))
            return results
        finally:
            self.tracker.leave("target")

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.released.append(rid)

    def busy_seconds(self) -> float:
        return self._busy


class FakeDrafter:
    def __init__(
        self, target: FakeTarget | None, delay: float = 0.0, version: str = "v1", hidden: bool = False
    ):
        self.target = target            # None (e.g. in another process): skip the cross-check
        self.hidden = hidden            # reads target hidden states: checks it gets the right rows
        self.hidden_rows = 0
        self.tracker = target.tracker if target is not None else Tracker()
        self.delay = delay
        self.version_id = version
        self.running: dict[str, list[int]] = {}
        self.last_draft: dict[str, list[int]] = {}
        self.gammas: list[int] = []
        self._busy = 0.0

    def start(self, requests: list[NewRequest], first_tokens: list[list[int]], prompt_hidden=None) -> None:
        assert (prompt_hidden is not None) == self.hidden
        for i, (r, first) in enumerate(zip(requests, first_tokens, strict=True)):
            if self.hidden:
                want = FakeTarget.hidden_of([*r.prompt_token_ids[1:], *first])
                assert torch.equal(prompt_hidden[i], want)
                self.hidden_rows += len(want)
            self.running[r.request_id] = [*r.prompt_token_ids, *first]
            self.last_draft[r.request_id] = []

    def propose(self, items: list[DraftItem]) -> list[Draft]:
        self.tracker.enter("drafter", "propose", [i.request_id for i in items])
        try:
            t0 = time.perf_counter()
            if self.delay:
                time.sleep(self.delay)
            drafts = []
            for item in items:
                seq, last = self.running[item.request_id], self.last_draft[item.request_id]
                # the commit must be the previous verify result of this very request
                assert item.commit_new_tokens[: item.commit_accepted] == last[: item.commit_accepted]
                if self.hidden and item.commit_new_tokens:
                    assert torch.equal(item.commit_hidden, FakeTarget.hidden_of(item.commit_new_tokens))
                    self.hidden_rows += len(item.commit_new_tokens)
                else:
                    assert item.commit_hidden is None
                seq += item.commit_new_tokens
                if self.target is not None:
                    # a plan of γ 0 is proposed beside its step's verify (step.py), which may have appended
                    # the step's tokens already; a plan that drafts is proposed before it
                    now = self.target.running[item.request_id]
                    before = self.target.before_verify.get(item.request_id) if item.gamma == 0 else None
                    assert seq in (now, before), "drafter and target disagree"
                tokens, t = [], seq[-1]
                for _ in range(item.gamma):
                    t = next_token(t)
                    tokens.append(t if (len(seq) + len(tokens)) % 5 != 4 else (t + 2) % VOCAB)
                self.last_draft[item.request_id] = tokens
                self.gammas.append(item.gamma)
                drafts.append(Draft(item.request_id, tokens, drafter_version=self.version_id))
            self._busy += time.perf_counter() - t0
            return drafts
        finally:
            self.tracker.leave("drafter")

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)
            self.last_draft.pop(rid, None)

    def uses_target_hidden(self) -> bool:
        return self.hidden

    def planning_info(self) -> dict:
        # the fixed policy by default: no goodput cost model, so nothing to profile
        return {"spec": SpecConfig(policy="fixed"), "max_seq_len": None, "held_out_acceptance": None}

    def version(self) -> str:
        return self.version_id

    def busy_seconds(self) -> float:
        return self._busy


class RayFakeTarget(FakeTarget):
    """Constructed like TargetWorker(cfg, seed, cache_dir) by specd.cluster.actors.create_cluster."""

    def __init__(self, *_args):
        super().__init__(max_slots=4)


class RayFakeDrafter(FakeDrafter):
    """Constructed like DraftWorker(...); in another process it cannot see the target, so no cross-check."""

    def __init__(self, *_args):
        super().__init__(None)

    def max_slots(self) -> int:
        return 4


class RaySlowFakeDrafter(RayFakeDrafter):
    """50 ms per propose: a request lasts long enough to kill its drafter mid-stream."""

    def __init__(self, *_args):
        super().__init__()
        self.delay = 0.05


class RaySlowFakeTarget(RayFakeTarget):
    """0.3 s per start and verify: a call is still running when the test kills the actor."""

    def __init__(self, *_args):
        super().__init__()
        self.delay = 0.3


class FakeTrainer:
    """Stands in for TrainerActor where only its identity matters: the settings digest it was started
    with, and which router started it (passed as the endpoint)."""

    def __init__(self, cfg, endpoint):
        from specd.cluster.trainer_actor import trainer_settings

        self._settings = trainer_settings(cfg)
        self.started_by = endpoint

    def settings(self) -> str:
        return self._settings

    def stats(self) -> dict:
        return {"started_by": self.started_by}

    def stop(self) -> None:
        pass
