"""The link between VllmEngine and its in-process proposer: the start-up sweep of vLLM's verify costs
(throwaway drafts, timed steps, the verify table the planner starts from). No vLLM engine is started."""

from __future__ import annotations

import numpy as np
import pytest

from specd.workers.engine.vllm_link import PrefixHasher, ProposerLink, prefix_key, verify_table
from tests.workers.engine.test_vllm_backend import MAX_LEN, make_proposer


def test_verify_table_takes_medians_and_fills_between_measured_counts():
    samples = [(4, 1, 0.040), (4, 1, 0.050), (4, 1, 0.041), (4, 2, 0.060), (4, 4, 0.090),
               (16, 1, 0.070), (16, 3, 0.110),
               (8, 2, 0.5)]                       # no one-token measurement: left out
    table = verify_table(samples, max_tokens=5)
    assert sorted(table) == [4, 16]
    assert table[4] == pytest.approx([0.041, 0.060, 0.075, 0.090, 0.105])   # 3 between, 5 past the end
    assert table[16] == pytest.approx([0.070, 0.090, 0.110, 0.130, 0.150])


def test_link_files_drafts_once_and_forgets_the_oldest():
    link = ProposerLink(capacity=2)
    keys = [prefix_key(np.array([i, i + 1], dtype=np.int32)) for i in range(3)]
    for i, key in enumerate(keys):
        link.put(key, [i], f"v{i}")
    assert len(link) == 2 and link.pop(keys[0]) is None
    assert link.pop(keys[2]) == ([2], "v2") and link.pop(keys[2]) is None


def test_a_prefix_fed_in_pieces_has_the_key_of_the_whole():
    """The proposer and the engine key a growing history step by step; the key must be the one a
    prefix_key of the whole history gives (the link's other side may compute it either way)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=300, dtype=np.int64)
    hasher = PrefixHasher(tokens[:10].tolist())
    for start, end in ((10, 11), (11, 40), (40, 40), (40, 300)):
        hasher.update(tokens[start:end])
        assert hasher.key() == prefix_key(tokens[:end].astype(np.int32)) == prefix_key(tokens[:end].tolist())
    assert hasher.key() == hasher.key()               # reading a key does not feed it
    assert prefix_key([1, 2]) != prefix_key([1, 2, 0]) != prefix_key([2, 1])
    row = np.zeros((2, 8), dtype=np.int32)
    row[1, :3] = [7, 8, 9]                            # a slice of a row of vLLM's token_ids_cpu
    assert prefix_key(row[1, :3]) == prefix_key([7, 8, 9])


def _call(proposer, histories: list[list[int]], sampled: list[list[int]]):
    counts = np.array([len(h) for h in histories], dtype=np.int32)
    ids = np.zeros((len(histories), MAX_LEN), dtype=np.int32)
    for row, h in enumerate(histories):
        ids[row, : len(h)] = h
    return proposer.propose(sampled, counts, ids)


def test_the_sweep_drafts_throwaway_tokens_and_times_the_steps(tmp_path):
    proposer = make_proposer(tmp_path, "ngram")
    proposer.link.force_gamma = 3
    histories = [[5, 6, 7, 8], [9, 10, 11]]
    out = _call(proposer, histories, [[8], [11]])
    assert out == [[8, 8, 8], [11, 11, 11]]
    assert proposer.link.samples == []                 # nothing verified yet
    out = _call(proposer, [h + [1] for h in histories], [[1], [1]])
    (rows, tokens, seconds), = proposer.link.samples
    assert (rows, tokens) == (2, 4) and seconds > 0    # the step that verified 1 + 3 tokens per row
    # a row mid-prefill: that step is not one of the same rows, so it is not timed
    _call(proposer, [histories[0] + [1, 2], [4, 4]], [[2], []])
    assert len(proposer.link.samples) == 1
    assert proposer.worker.requests == {}, "the drafter never sees the sweep's requests"


def test_the_sweep_table_becomes_the_planner_cost_profile(tmp_path):
    proposer = make_proposer(tmp_path, "ngram")
    table = {1: [0.02, 0.025, 0.03], 4: [0.04, 0.06, 0.08]}
    proposer.link.profile = {"verify": table}
    _call(proposer, [[3, 4, 5, 3, 4, 5, 3, 4]], [[4]])
    costs = proposer.planner.costs
    assert proposer.link.profile is None
    assert costs.batches == [1, 4] and costs.verify_table[4] == table[4] and costs.pad_weight == 0.0


@pytest.mark.slow
def test_a_vllm_engine_sweeps_its_verify_steps_before_serving(monkeypatch):
    """With the engine core in this process (as in the serving actor) and the goodput plan, VllmEngine times
    vLLM's steps at each batch size and draft count, the proposer takes the table, and greedy output is
    vLLM's own."""
    from specd.configs import load_config
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.engine.types import NewRequest
    from specd.workers.engine.vllm_engine import VllmEngine, vllm_missing

    if vllm_missing() is not None:
        pytest.skip(vllm_missing())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    base = ["target.max_slots=4", "target.max_seq_len=256", "drafter=ngram", "spec.gamma=4",
            "spec.goodput_profile_batch_sizes=[1,4]"]
    prompts = [[1, 504, 3937, 28, 2], [1, 11126, 314, 253, 2], [1, 3937, 3937, 28, 504, 2]]

    def run(cfg, speculation):
        engine = VllmEngine(cfg, speculation=speculation)
        try:
            reqs = [NewRequest(f"r{i}", p, SamplingParams(), 24) for i, p in enumerate(prompts)]
            seqs = engine.generate(reqs, ignore_eos=True)
            return engine, [s.output for s in seqs]
        finally:
            engine.close()

    engine, outputs = run(load_config(base), "specd")
    shapes = {(b, n) for b, n, _ in engine.link.samples}
    assert {(1, 1), (1, 5), (4, 1), (4, 5)} <= shapes, shapes
    assert engine.link.profile is None, "the proposer did not take the table"
    assert engine.profile_s > 0
    _, reference = run(load_config(base), "none")
    assert outputs == reference
