"""ModelRunner on a tiny random Llama (batched prefill/extend, trees, rollback, hot swap), and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specd.workers.core.kv_cache import CacheFullError
from specd.workers.models.runner import ModelRunner

ATOL = 1e-4


@pytest.fixture
def runner(tiny_llama_dir):
    return ModelRunner(tiny_llama_dir, max_slots=4, max_seq_len=64)


def _single(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of `tokens` in a fresh slot of a runner (freed afterwards)."""
    slot = runner.allocate()
    try:
        return runner.extend([slot], [tokens])[0]
    finally:
        runner.free(slot)


def test_slots_and_lengths(runner):
    assert runner.vocab_size == 128 and runner.vocab_ids is None
    slots = [runner.allocate() for _ in range(4)]
    with pytest.raises(CacheFullError):
        runner.allocate()
    runner.prefill([slots[2]], [[1, 2, 3]])
    assert runner.length(slots[2]) == 3
    runner.free(slots[2])
    assert runner.num_free == 1
    assert runner.length(runner.allocate()) == 0


def test_batched_prefill_equals_single_prefill_and_chunking_changes_nothing(tiny_llama_dir, runner):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1], [100, 101, 102]]
    slots = [runner.allocate() for _ in prompts]
    batched = runner.prefill(slots, prompts)  # [3, vocab]
    assert [runner.length(s) for s in slots] == [7, 1, 3]
    chunked = ModelRunner(tiny_llama_dir, max_slots=4, max_seq_len=64, prefill_chunk=2)
    cslots = [chunked.allocate() for _ in prompts]
    by_chunks = chunked.prefill(cslots, prompts)
    assert [chunked.length(s) for s in cslots] == [7, 1, 3]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(batched[i], _single(runner, p)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(by_chunks[i], batched[i], atol=ATOL, rtol=0)


def test_extend_variable_counts_per_row(runner):
    prompts = [[3, 4, 5], [9, 9]]
    slots = [runner.allocate() for _ in prompts]
    runner.prefill(slots, prompts)
    new = [[20, 21, 22], [30]]
    logits = runner.extend(slots, new)  # [2, 3, vocab]
    assert logits.shape == (2, 3, 128)
    assert [runner.length(s) for s in slots] == [6, 3]
    for i in range(2):
        ref = _single(runner, prompts[i] + new[i])[-len(new[i]) :]
        torch.testing.assert_close(logits[i, : len(new[i])], ref, atol=ATOL, rtol=0)
    # The padded row wrote junk past its length; the next step must not see it.
    nxt = runner.extend(slots, [[40], [41]])
    torch.testing.assert_close(nxt[1, 0], _single(runner, [9, 9, 30, 41])[-1], atol=ATOL, rtol=0)


def test_rows_in_any_slot_order_read_the_cache_as_one_view_and_change_nothing(tiny_llama_dir, monkeypatch):
    from specd.workers.models import layers

    runner = ModelRunner(tiny_llama_dir, max_slots=5, max_seq_len=64)   # slot 4 stays free for _single
    slots = [runner.allocate() for _ in range(4)]
    assert slots == [0, 1, 2, 3]                        # the lowest free slot first
    runner.free(2), runner.free(0)
    assert [runner.allocate(), runner.allocate()] == [0, 2]
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    shuffled = [2, 0, 3, 1]                             # rows in request order, slots in no order
    runs = []   # cache views per layer of each whole-batch plan (ragged row groups plan their rows again)
    make = layers.BatchPlan.make.__func__
    monkeypatch.setattr(layers.BatchPlan, "make", classmethod(
        lambda cls, slots, *a, **k: (plan := make(cls, slots, *a, **k),
                                     len(slots) == 4 and runs.append(len(plan.runs)))[0]))
    first, hidden = runner.prefill(shuffled, [prompts[s] for s in shuffled], return_hidden=True)
    logits = runner.extend(shuffled, [[20, 21], [22], [23, 24], [25]])          # [4, 2, vocab]
    trees = runner.extend_trees(shuffled, [[30, 31, 32], [33], [34, 35], [36]],
                                [[-1, 0, 0], [-1], [-1, 0], [-1]])              # [4, 3, vocab]
    assert runs and set(runs) == {1}                    # every forward saw slots 0-3 as one run
    monkeypatch.undo()
    for row, s in enumerate(shuffled):
        prompt = prompts[s]
        torch.testing.assert_close(first[row], _single(runner, prompt)[-1], atol=ATOL, rtol=0)
        assert hidden[row].shape[0] == len(prompt)
        new = [[20, 21], [22], [23, 24], [25]][row]
        ref = _single(runner, prompt + new)[-len(new):]
        torch.testing.assert_close(logits[row, : len(new)], ref, atol=ATOL, rtol=0)
    # slot 2's tree (row 0): root 30 after prompt + [20, 21]; children 31, 32
    for node in (1, 2):
        ref = _single(runner, prompts[2] + [20, 21, 30, [31, 32][node - 1]])[-1]
        torch.testing.assert_close(trees[0, node], ref, atol=ATOL, rtol=0)


def test_rollback_after_rejected_drafts(runner):
    slot = runner.allocate()
    runner.prefill([slot], [[1, 2, 3, 4]])
    runner.extend([slot], [[50, 51, 52, 53]])  # last token + 3 drafts; accept one
    runner.rollback(slot, 6)
    logits = runner.extend([slot], [[77]])
    torch.testing.assert_close(logits[0, 0], _single(runner, [1, 2, 3, 4, 50, 51, 77])[-1], atol=ATOL, rtol=0)


def test_extend_tree_then_keep_path(runner):
    slot = runner.allocate()
    prefix = [10, 11, 12]
    runner.prefill([slot], [prefix])
    # root 60; children 61, 62; 61 -> 63, 64 (siblings); 62 -> 65
    tokens, parents = [60, 61, 62, 63, 64, 65], [-1, 0, 0, 1, 1, 2]
    logits = runner.extend_tree(slot, tokens, parents)  # [6, vocab]
    assert logits.shape == (6, 128) and runner.length(slot) == 9
    for path in ([0, 1, 3], [0, 1, 4], [0, 2, 5]):
        ref = _single(runner, prefix + [tokens[i] for i in path])[3:]
        torch.testing.assert_close(logits[path], ref, atol=ATOL, rtol=0)
    runner.keep_tree_path(slot, 3, [0, 1, 4])
    assert runner.length(slot) == 6
    nxt = runner.extend([slot], [[99]])
    torch.testing.assert_close(nxt[0, 0], _single(runner, prefix + [60, 61, 64, 99])[-1], atol=ATOL, rtol=0)


def test_batched_trees_match_single_trees(runner):
    slots = [runner.allocate(), runner.allocate()]
    runner.prefill(slots, [[1, 2], [3, 4, 5, 6]])
    trees = [([7, 8, 9], [-1, 0, 0]), ([10, 11], [-1, 0])]
    batched = runner.extend_trees(slots, [t for t, _ in trees], [p for _, p in trees])  # [2, 3, vocab]
    for slot, (tokens, parents), row in zip(slots, trees, batched, strict=True):
        runner.rollback(slot, runner.length(slot) - len(tokens))
        single = runner.extend_tree(slot, tokens, parents)
        torch.testing.assert_close(row[: len(tokens)], single, atol=ATOL, rtol=0)


def test_bad_tree_is_refused(runner):
    slot = runner.allocate()
    runner.prefill([slot], [[1]])
    with pytest.raises(ValueError, match="parent"):
        runner.extend_tree(slot, [1, 2, 3], [-1, 2, 0])


def test_hot_swap_from_dir_and_state_dict(tiny_llama_dir, make_tiny_llama, tmp_path, runner):
    other = make_tiny_llama(tmp_path / "other", seed=3)
    expected = _single(ModelRunner(other, max_slots=1, max_seq_len=16), [4, 5, 6])
    before = _single(runner, [4, 5, 6])
    assert not torch.allclose(before, expected)
    runner.load_weights(other)
    torch.testing.assert_close(_single(runner, [4, 5, 6]), expected)
    runner.load_weights(load_file(str(tiny_llama_dir / "model.safetensors")))
    torch.testing.assert_close(_single(runner, [4, 5, 6]), before)


def test_real_smollm2_greedy_decode_matches_transformers(target_model_dir):
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(target_model_dir, max_slots=2, max_seq_len=128)
    assert runner.vocab_size == 49152
    prompts = [[1, 504, 3458, 282, 4195, 314], [1, 1780, 314, 253]]
    slots = [runner.allocate() for _ in prompts]
    last = runner.prefill(slots, prompts)  # batched, different lengths
    out = [[], []]
    for _ in range(6):  # batched one-token decode steps
        nxt = last.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            out[i].append(t)
        last = runner.extend(slots, [[t] for t in nxt])[:, 0]
    hf = AutoModelForCausalLM.from_pretrained(target_model_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, out, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p + o])).logits[0]  # teacher-forced: greedy agrees iff argmax == o
        assert ref[len(p) - 1 : -1].argmax(-1).tolist() == o


def test_tree_nodes_read_their_roots_state_stale_by_depth(tiny_hidden_llama_dir):
    """root_features: every node of a tree reads its row's one state, staleness its depth; the same
    logits as that state given per node. A tree shape seen before (its layout is cached) too."""
    runner = ModelRunner(tiny_hidden_llama_dir, max_slots=2, max_seq_len=64)
    slots = [runner.allocate(), runner.allocate()]
    gen = torch.Generator().manual_seed(4)
    runner.prefill(slots, [[1, 2], [3, 4, 5]], features=[torch.randn(2, 64, generator=gen),
                                                          torch.randn(3, 64, generator=gen)])
    trees = [([7, 8, 9, 10], [-1, 0, 0, 1]), ([11, 12], [-1, 0])]
    roots = torch.randn(2, 64, generator=gen)
    starts = runner.lengths(slots)
    outs = []
    for _ in range(2):
        outs.append(runner.extend_trees(slots, [t for t, _ in trees], [p for _, p in trees],
                                        root_features=roots))
        runner.rollback_many(slots, starts)
    per_node = runner.extend_trees(slots, [t for t, _ in trees], [p for _, p in trees],
                                   features=[roots[0].expand(4, -1), roots[1].expand(2, -1)],
                                   staleness=[[0, 1, 1, 2], [0, 1]])
    for out in outs:
        for row, (tokens, _) in enumerate(trees):
            n = len(tokens)
            torch.testing.assert_close(out[row, :n], per_node[row, :n], atol=ATOL, rtol=0)
    runner.rollback_many(slots, starts)
    with pytest.raises(ValueError, match="parent"):
        runner.extend_trees(slots, [[1, 2, 3], [4, 5]], [[-1, 2, 0], [-1, 0]])
    with pytest.raises(ValueError, match="parent"):     # refused again: a refusal is not cached
        runner.extend_trees(slots, [[1, 2, 3], [4, 5]], [[-1, 2, 0], [-1, 0]])
