"""The vllm target backend: the proposer against a simulated vLLM step loop, step alignment, and (slow,
needs the vllm extra) greedy identity with vLLM's own greedy output on GSM8K prompts."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.model import ModelDrafter
from specd.workers.drafters.ngram import NGramDrafter
from specd.workers.engine.vllm_engine import proposer_settings, vllm_missing
from specd.workers.engine.vllm_proposer import SpecdProposer, common_prefix
from specd.workers.engine.vllm_steps import align_steps, topk_lists

MAX_LEN = 256


def oracle(history: list[int]) -> int:
    """The simulated target's greedy token: periodic (period 12 here), so n-gram drafts get accepted."""
    return (history[-1] * 7 + history[-2] * 3) % 13


def vllm_config(gamma: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        speculative_config=SimpleNamespace(num_speculative_tokens=gamma),
    )


def make_proposer(tmp_path: Path, kind: str = "ngram", policy: str = "fixed", gamma: int = 4, **drafter):
    overrides = [f"drafter.kind={kind}", f"spec.policy={policy}", f"spec.gamma={gamma}", "spec.gamma_min=0"]
    overrides += [f"drafter.{k}={v}" for k, v in drafter.items()]
    cfg = load_config(overrides)
    settings = proposer_settings(cfg, tmp_path, max_running=4, swap_file=None)
    settings.max_idle_steps = 3
    return SpecdProposer(vllm_config(gamma), settings)


class FakeVllm:
    """vLLM's side of the custom_class contract: rows that move around, greedy one-hot verification of the
    previous step's drafts, sampled tokens appended to the rows before propose() is called."""

    def __init__(self, prompts: list[list[int]], max_new: int, seed: int = 0):
        self.histories = {i: list(p) for i, p in enumerate(prompts)}
        self.generated = dict.fromkeys(self.histories, 0)
        self.drafts: dict[int, list[int]] = {}
        self.max_new = max_new
        self.rng = random.Random(seed)
        self.steps = 0
        self.accepted = 0

    def step(self, proposer: SpecdProposer, mid_prefill: set[int] = frozenset()) -> dict[int, list[int]]:
        live = [r for r in self.histories if self.generated[r] < self.max_new]
        self.rng.shuffle(live)  # rows are not stable between steps
        sampled = []
        for r in live:
            if r in mid_prefill:
                sampled.append([])
                continue
            new = []
            for d in self.drafts.get(r, []):
                if d != oracle(self.histories[r] + new):
                    break
                new.append(d)
            self.accepted += len(new)
            new.append(oracle(self.histories[r] + new))
            new = new[: self.max_new - self.generated[r]]
            self.histories[r] += new
            self.generated[r] += len(new)
            sampled.append(new)
        counts = np.array([len(self.histories[r]) for r in live], dtype=np.int32)
        ids = np.zeros((max(len(live), 1), MAX_LEN), dtype=np.int32)
        for row, r in enumerate(live):
            ids[row, : counts[row]] = self.histories[r]
        out = proposer.propose(sampled, counts, ids) if live else []
        self.drafts = dict(zip(live, out, strict=True))
        self.steps += 1
        return self.drafts


PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [1, 2, 1, 2, 9, 9], [3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 11, 7, 8]]


def record_starts(proposer: SpecdProposer) -> list:
    """The drafter requests the proposer starts, in order (its DraftWorker.start, still called)."""
    started: list = []
    original = proposer.worker.start

    def recording(requests, first_tokens):
        started.extend(requests)
        original(requests, first_tokens)

    proposer.worker.start = recording
    return started


def test_proposer_continues_each_request_without_rebuilding(tmp_path):
    proposer = make_proposer(tmp_path, "ngram", min_ngram=1, max_ngram=3)
    fake = FakeVllm(PROMPTS, max_new=40)
    starts = record_starts(proposer)
    for _ in range(60):
        drafts = fake.step(proposer)
        # Each row's drafts equal what a fresh n-gram drafter proposes from the row's whole history:
        # the incremental state (fed only the new tokens each step) never drifted from the history.
        for r, draft in drafts.items():
            fresh = NGramDrafter(min_ngram=1, max_ngram=3)
            fresh.add_request("x", fake.histories[r])
            assert draft == fresh.lookup("x", min(4, MAX_LEN - len(fake.histories[r]) - 1))
    assert len(starts) == len(PROMPTS), "one drafter request per vLLM request (equal prompts included)"
    assert fake.accepted > 0


def test_proposer_skips_rows_mid_prefill_and_evicts_finished_requests(tmp_path):
    proposer = make_proposer(tmp_path, "ngram")
    fake = FakeVllm(PROMPTS[:2], max_new=6)
    drafts = fake.step(proposer, mid_prefill={1})
    assert drafts[1] == [] and len(proposer.worker.requests) == 1
    while any(g < fake.max_new for g in fake.generated.values()):
        fake.step(proposer)
    assert len(proposer.worker.requests) == 2
    for _ in range(proposer.settings.max_idle_steps + 1):
        proposer.propose([], np.zeros(0, dtype=np.int32), np.zeros((0, MAX_LEN), dtype=np.int32))
    assert proposer.worker.requests == {}, "requests no row continued are released"


def test_proposer_rebuilds_after_divergent_history(tmp_path):
    proposer = make_proposer(tmp_path, "ngram")
    fake = FakeVllm(PROMPTS[:1], max_new=30)
    fake.step(proposer)
    fake.step(proposer)
    # A history the proposer never saw (e.g. a preempted request recomputed under another prefix).
    fake.histories[0] = [9, 8, 7, 9, 8, 7, 9, 8]
    drafts = fake.step(proposer)
    fresh = NGramDrafter()
    fresh.add_request("x", fake.histories[0])
    assert drafts[0] == fresh.lookup("x", 4)
    assert len(proposer.worker.requests) == 2  # the stale one waits for eviction


@pytest.mark.parametrize("policy", ["fixed", "egag", "adaptive"])
def test_proposer_gamma_policies_with_model_drafter(tmp_path, tiny_target_dir, tiny_drafter_dir, policy):
    # float32, so the incremental drafter and a fresh one fed the whole history round alike
    proposer = make_proposer(
        tmp_path, "model", policy=policy, gamma=6, path=tiny_drafter_dir, dtype="float32"
    )
    fake = FakeVllm(PROMPTS, max_new=30, seed=1)
    lengths = []
    for _ in range(12):
        drafts = fake.step(proposer)
        lengths += [len(d) for d in drafts.values()]
        assert all(len(d) <= 6 for d in drafts.values())
    assert max(lengths) > 0
    if policy == "fixed":
        assert set(lengths) == {6}
        # The tracked drafter (KV cache rolled back and fed the new tokens each step) drafts what a fresh
        # one drafts from the whole history.
        fresh = ModelDrafter(tiny_drafter_dir, max_slots=1, pack=proposer.worker.drafter.runner.model.packed)
        for r, draft in drafts.items():
            fresh.add_request("x", fake.histories[r])
            assert fresh.propose(["x"], [6], [SamplingParams()]).tokens[0] == draft
            fresh.remove_request("x")


def test_proposer_hot_swaps_drafter_weights(tmp_path, tiny_drafter_dir):
    proposer = make_proposer(tmp_path, "model", path=tiny_drafter_dir)
    proposer.settings.swap_file = str(tmp_path / "swap.json")
    fake = FakeVllm(PROMPTS[:2], max_new=20)
    fake.step(proposer)
    assert proposer.worker.version() == "tiny-1"
    new_dir = tmp_path / "tiny-2"
    shutil.copytree(tiny_drafter_dir, new_dir)
    (new_dir / "specd_drafter.json").write_text(json.dumps({"version": "tiny-2"}))
    (tmp_path / "swap.json").write_text(json.dumps({"path": str(new_dir)}))
    fake.step(proposer)
    assert proposer.worker.version() == "tiny-2"


def test_proposer_files_its_drafts_for_the_records(tmp_path, tiny_drafter_dir):
    """Each row's drafts are filed under the key of the history they follow, with the drafting version;
    the engine's read-back takes them when vLLM's counts agree and falls back to the accepted prefix."""
    from specd.workers.engine.vllm_engine import VllmEngine
    from specd.workers.engine.vllm_link import PrefixHasher, prefix_key

    proposer = make_proposer(tmp_path, "model", policy="fixed", path=tiny_drafter_dir)
    fake = FakeVllm(PROMPTS[:2], max_new=20)
    drafts = fake.step(proposer)
    assert proposer.link.serving_version == "tiny-1"
    keys = {r: prefix_key(np.array(fake.histories[r], dtype=np.int32)) for r in drafts}
    engine = SimpleNamespace(link=proposer.link)
    history = PrefixHasher(fake.histories[0])
    d0 = drafts[0]
    # vLLM kept the first two drafts and emitted a recovered token: the filed ids come back, once
    got = VllmEngine._filed_draft(engine, "a", history, len(d0), 2, [*d0[:2], 99], "read-at")
    assert got.tokens == d0 and got.drafter_version == "tiny-1"
    assert proposer.link.pop(keys[0]) is None
    # counts that disagree with what was filed (or nothing filed): the accepted prefix, the version that
    # drafted when the step was read
    d1 = drafts[1]
    history1 = PrefixHasher(fake.histories[1])
    got = VllmEngine._filed_draft(engine, "b", history1, len(d1) + 1, 1, [d1[0], 5], "read-at")
    assert got.tokens == [d1[0]] and got.drafter_version == "read-at"
    got = VllmEngine._filed_draft(engine, "c", PrefixHasher([1, 2]), 3, 0, [5], "read-at")
    assert got.tokens == [] and got.drafter_version == "read-at"


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0


def test_align_steps_recovers_drafted_and_draftless_steps():
    # prefill token, then: 3 drafted 2 accepted (3 tokens), no draft (1), 4 drafted 0 accepted (1),
    # 4 drafted 4 accepted but cut to 2 by max_tokens.
    deltas = [[5], [1, 2, 3], [4], [6], [7, 8]]
    entries = [(3, 2), (4, 0), (4, 4)]
    steps = align_steps(deltas, entries)
    assert len(steps) == 4
    assert sorted(steps) == sorted([(3, 2), (0, 0), (4, 0), (4, 4)])
    assert steps[0] == (3, 2) and steps[-1] == (4, 4)
    assert align_steps([[5], [1], [2]], []) == [(0, 0), (0, 0)]


def test_topk_lists_sorts_and_cuts():
    lp = SimpleNamespace
    ids, values = topk_lists([{7: lp(logprob=-2.0), 3: lp(logprob=-0.1), 9: lp(logprob=-5.0)}], 2)
    assert ids == [[3, 7]] and values == [[-0.1, -2.0]]
    assert topk_lists([{1: lp(logprob=0.0)}], 0) == (None, None)


# ---- the real engine (slow: vLLM starts in ~40 s, one engine at a time) ---------------------------------

VLLM_MISSING = vllm_missing()
GSM8K = Path(__file__).resolve().parents[3] / "data" / "gsm8k_test.jsonl"


def gsm8k_prompts(n: int) -> list[list[int]]:
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    tokenizer = load_tokenizer(ensure_target_model())
    prompts = []
    with GSM8K.open() as f:
        for line in f:
            chat = [{"role": "user", "content": json.loads(line)["question"]}]
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
            if len(prompts) == n:
                break
    return prompts


def run_vllm(cfg, mode: str, prompts: list[list[int]], n: int, sampled: int = 0):
    """Greedy outputs (and replay records) of every prompt; then, on the same engine, `sampled` prompts at
    T = 0.8 (seeded) to show sampled requests run through the same drafts."""
    from specd.workers.engine.types import NewRequest
    from specd.workers.engine.vllm_engine import VllmEngine

    engine = VllmEngine(cfg, speculation=mode, teacher_topk=4 if mode == "specd" else 0)
    try:
        records = []
        reqs = [NewRequest(f"g{i}", p, SamplingParams(), n) for i, p in enumerate(prompts)]
        seqs = engine.generate(reqs, ignore_eos=True, on_record=lambda _s, d, r: records.append((d, r)))
        hot = SamplingParams(temperature=0.8, seed=7)
        warm = engine.generate([NewRequest(f"t{i}", p, hot, n) for i, p in enumerate(prompts[:sampled])],
                               ignore_eos=True)
    finally:
        engine.close()
    return seqs, records, warm


@pytest.mark.slow
@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"needs the vllm extra ({VLLM_MISSING})")
def test_vllm_backend_greedy_equals_vllm_greedy_on_gsm8k(monkeypatch, boot_drafter_dir):
    """boot_drafter_dir (tests/conftest.py): the token-only model drafter, built when the cache has
    none, so both drafter kinds run on a fresh machine too."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts, n = gsm8k_prompts(8), 96
    # a fixed γ: whether the goodput default drafts sampled rows after the greedy ones is its own choice
    base = ["target.max_slots=20", "target.max_seq_len=512", "spec.gamma=4", "spec.policy=fixed"]
    reference, _, _ = run_vllm(load_config(base), "none", prompts, n)
    assert all(len(s.output) == n for s in reference)
    for kind in ("ngram", "model"):
        cfg = load_config([*base, f"drafter.kind={kind}", f"drafter.path={boot_drafter_dir}"])
        seqs, records, hot = run_vllm(cfg, "specd", prompts, n, sampled=4)
        assert [s.output for s in seqs] == [s.output for s in reference], f"{kind} drafter changed the output"
        drafted = sum(s.stats.drafted for s in seqs)
        assert drafted > 0, f"the {kind} drafter proposed nothing"
        for s in seqs + hot:
            # Every token after the prefill's comes from a step (the last step may be cut by max_tokens).
            assert len(s.output) == n
            assert s.stats.steps <= n - 1 <= s.stats.emitted
        assert sum(s.stats.drafted for s in hot) > 0
        # Replay records: one per step, with the target's top-4 logprobs for every emitted token.
        assert len(records) == sum(s.stats.steps for s in seqs)
        results = [r for _, r in records]
        assert all(len(r.teacher_topk_ids) == len(r.new_tokens) for r in results)
        # each step's draft: the filed ids (in-process proposer) or the accepted prefix, never more
        for d, r in records:
            k = r.num_accepted
            assert len(d.tokens) <= r.num_drafted and d.tokens[:k] == r.new_tokens[:k]
        top1 = [ids[0] for r in results for ids in r.teacher_topk_ids]
        emitted = [t for r in results for t in r.new_tokens]
        assert np.mean(np.array(top1) == np.array(emitted)) > 0.99  # greedy: the target's top-1 (ties aside)


def test_per_request_speculation_off_and_gamma_caps_are_honoured(tmp_path):
    from specd.workers.engine.vllm_link import prefix_key

    proposer = make_proposer(tmp_path, "ngram", min_ngram=1, max_ngram=3)
    off, capped, free = PROMPTS[0], PROMPTS[1], PROMPTS[3]
    # what VllmEngine.submit files for each request before vLLM schedules it
    proposer.link.expect(prefix_key(np.array(off)), False, 4)
    proposer.link.expect(prefix_key(np.array(capped)), True, 1)
    fake = FakeVllm([off, capped, free], max_new=40)
    started = record_starts(proposer)
    drafted = {0: 0, 1: 0, 2: 0}
    longest = {0: 0, 1: 0, 2: 0}
    for _ in range(40):
        for r, draft in fake.step(proposer).items():
            drafted[r] += len(draft)
            longest[r] = max(longest[r], len(draft))
    assert drafted[0] == 0, "a request with speculation off drafts nothing, on every step"
    assert 0 < longest[1] <= 1 and longest[2] > 1
    # the request with speculation off never took a drafter slot (its row was known on every step)
    assert sorted(r.prompt_token_ids for r in started) == sorted([capped, free])
    assert fake.histories[0][len(off):] == target_row(off, len(fake.histories[0]) - len(off))


def target_row(prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(oracle(out))
    return out[len(prompt):]
