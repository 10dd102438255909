"""The GPU decode path (static shapes over the preallocated cache) run eagerly on the CPU: same tokens.

The CUDA graph capture itself needs a GPU and is skipped here; everything it replays (padding to
buckets, the scratch slot, cache writes and masks computed on the device) runs in these tests.
"""

from __future__ import annotations

import pytest
import torch

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.device_settings import resolve_decode, resolve_dtype
from specd.workers.models.runner import ModelRunner
from specd.workers.models.static_decode import bucket

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [11, 12]]


def test_buckets_and_auto_settings() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(40, 32) == 32
    assert resolve_decode("auto", "cpu") == "eager" and resolve_decode("auto", "cuda") == "compiled"
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")


@pytest.mark.parametrize("fold", [False, True], ids=["cpu-attention", "cuda-attention"])
def test_static_runner_matches_eager_and_never_hands_out_the_scratch_slot(tiny_target_dir, fold,
                                                                          monkeypatch) -> None:
    if fold:    # the attention CUDA runs (query heads folded per KV head), here on the CPU
        from specd.workers.models import layers, static_decode

        monkeypatch.setattr(static_decode, "attention", layers.fold_gqa)
    eager = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=64)
    static = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=64, decode="static")
    assert static.cache.scratch == 3 and static.cache.k.shape[1] == 4
    outs = []
    for runner in (eager, static):
        slots = [runner.allocate() for _ in range(3)]
        assert runner.num_free == 0
        runner.prefill(slots, [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]])
        chain = runner.extend([slots[2], slots[0]], [[6, 7, 8], [3]])  # b=2, n=3: padded to 2 x 4
        chain = chain.clone()
        chain[1, 1:] = 0   # padding: garbage in general, zeros from the eager ragged forward
        tree = runner.extend_trees([slots[1]], [[1, 2, 3, 4]], [[-1, 0, 0, 1]])
        # rows in slots 0 and 1, in order: attention reads a view of the cache, no gather
        leading = runner.extend([slots[0], slots[1]], [[2], [3]])
        # a row reaching max_seq_len exactly: the bucket's padding must not write past it (positions
        # 6..60 hold zeros in both caches)
        runner.cache.lengths[slots[1]] = 61
        last = runner.extend([slots[1]], [[4, 5, 6]])
        outs.append((chain, tree, leading, last, runner.cache.lengths[:3].clone()))
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # one static bucket per (batch, tokens, attended length, outputs, leading rows): the tree and the last
    # chain share one
    assert set(static.static.graphs) == {(2, 4, 64, True, False, False, False),
                                         (1, 4, 64, True, False, False, False),
                                         (2, 1, 64, True, False, False, True)}
    # each bucket's first use is counted once, with the time it took (a capture on a GPU); eager has none
    assert static.first_uses()[0] == 3 and static.first_uses()[1] > 0
    assert eager.first_uses() == (0, 0.0)
    static.extend([slots[2], slots[0]], [[1, 2, 3], [4]])       # the first bucket again: no first use
    assert static.first_uses()[0] == 3


def test_a_new_compiled_bucket_compiles_both_leading_cases_and_still_matches_eager(tiny_target_dir) -> None:
    """decode=compiled: the first forward of a bucket runs the other leading-rows case too (so a server's
    warm-up compiles it, not its first use while serving); the discarded run leaves the cache as the real
    one does. Here the compiled function is the plain layers, recording which case each call took."""
    eager = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=64)
    static = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=64, decode="static")
    cases = []

    def compiled(*args):
        cases.append(args[-1])
        return static.static._layers(*args)

    static.static._compiled = compiled
    outs = []
    for runner in (eager, static):
        slots = [runner.allocate() for _ in range(3)]
        runner.prefill(slots, [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]])
        first = runner.extend([slots[0], slots[1]], [[2], [3]])        # leading: slots 0, 1
        cases_after_first = list(cases)
        again = runner.extend([slots[1], slots[0]], [[4], [6]])        # the same bucket, not leading
        later = runner.extend([slots[0], slots[1]], [[7], [8]])
        outs.append((first, again, later, runner.cache.lengths[:3].clone()))
    assert cases_after_first == [False, True]      # the other case first, then the real one
    # each new bucket runs both once (the non-leading one: leading first); a known bucket runs its own
    assert cases == [False, True, True, False, True]
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_inputs_are_padded_into_one_packed_buffer(tiny_target_dir) -> None:
    """One forward's inputs, b = 1 row of n = 3 tokens in a 2 x 4 bucket: the real ones where they belong,
    padded tokens at their own depth seeing only themselves, padding written to the scratch slot."""
    runner = ModelRunner(tiny_target_dir, max_slots=3, max_seq_len=64, decode="static")
    slot = runner.allocate()
    runner.prefill([slot], [[5, 6, 7, 8, 9]])
    runner.extend([slot, runner.allocate()], [[1, 2, 3], [4]])     # the (2, 4) bucket
    graph = next(g for key, g in runner.static.graphs.items() if key[:2] == (2, 4))
    scratch = runner.cache.scratch
    with torch.inference_mode():     # as the runner calls it
        runner.static._fill(graph, torch.tensor([[21, 22, 23]]), torch.tensor([[0, 1, 1]]),
                            torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool), [slot], [5],
                            None, None)
    inputs = {k: v.tolist() for k, v in graph.inputs.items() if k not in ("packed", "host")}
    assert inputs["ids"] == [[21, 22, 23, 0], [0, 0, 0, 0]]
    assert inputs["depth"] == [[0, 1, 1, 3], [0, 1, 2, 3]]
    assert inputs["tree"] == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]],
                              [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]]
    assert inputs["slots"] == [slot, scratch] and inputs["starts"] == [5, 0]
    assert inputs["write_slot"] == [[slot, slot, slot, scratch], [scratch] * 4]
    assert inputs["write_pos"] == [[5, 6, 7, 3], [0, 1, 2, 3]]
    assert graph.inputs["packed"].tolist() == graph.inputs["host"].tolist()   # copied in one piece


def test_graph_mode_needs_cuda(tiny_target_dir) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: capture is exercised by test_cuda_graphs_match_eager")
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(tiny_target_dir, max_slots=2, max_seq_len=64, decode="graph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graphs_match_eager(tiny_target_dir) -> None:
    eager = ModelRunner(tiny_target_dir, "cuda", max_slots=2, max_seq_len=128)
    graph = ModelRunner(tiny_target_dir, "cuda", max_slots=2, max_seq_len=128, decode="graph")
    outs = []
    for runner in (eager, graph):
        slots = [runner.allocate() for _ in range(2)]
        runner.prefill(slots, [[5, 6, 7], [8, 9]])
        steps = [runner.extend(slots, [[1, 2], [3]]) for _ in range(3)]  # capture, then replays
        outs.append(torch.stack(steps))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)


def _config(tiny_target_dir, tiny_drafter_dir, decode: str):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256",
        f"target.decode={decode}", f"drafter.decode={decode}", "drafter.hybrid_min_match=2",
    ])


@pytest.fixture(scope="module")
def static_workers(tiny_target_dir, tiny_drafter_dir):
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "static")
    target = TargetWorker(cfg.target)
    drafters = {}
    for kind in ("model", "hybrid"):
        cfg.drafter.kind = kind
        drafters[kind] = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    return target, drafters


@pytest.fixture(scope="module")
def target_only_outputs(tiny_target_dir, tiny_drafter_dir):
    """Greedy target-only decoding on the normal (eager) path: what every static run must reproduce."""
    target = TargetWorker(_config(tiny_target_dir, tiny_drafter_dir, "eager").target)
    return _generate(target, None, SpecParams(enabled=False))


def _generate(target, drafter, spec):
    reqs = [NewRequest(f"r{i}", p, SamplingParams(), 32, spec) for i, p in enumerate(PROMPTS)]
    return [s.output for s in SpecEngine(target, drafter).generate(reqs, ignore_eos=True)]


@pytest.mark.parametrize(
    "kind,spec",
    [
        (None, SpecParams(enabled=False)),
        ("model", SpecParams(gamma=4)),
        ("model", SpecParams(gamma=3, tree_width=3)),
        ("hybrid", SpecParams(gamma=5)),
    ],
    ids=["target-only", "chain", "tree", "hybrid"],
)
def test_static_engine_is_token_identical_to_eager(static_workers, target_only_outputs, kind, spec) -> None:
    target, drafters = static_workers
    outputs = _generate(target, drafters[kind] if kind else None, spec)
    assert outputs == target_only_outputs
    assert all(len(o) == 32 for o in outputs)


def test_static_drafter_drafts_what_eager_drafts_with_target_hidden_states(boot_hidden_drafter_dir) -> None:
    """The hidden-state drafter on the static (GPU) path gets its features in chains and trees alike: the
    same drafts as eager. Output exactness alone cannot catch a drafter that ignores its features there."""
    from specd.workers.drafters.model import ModelDrafter

    gen = torch.Generator().manual_seed(0)
    prompt = [1, 504, 3062, 288, 253, 1176, 314, 2428, 30, 198, 3117, 28, 216, 33, 28]
    hidden_size = ModelDrafter(boot_hidden_drafter_dir, max_slots=2, max_seq_len=128).hidden_size
    prompt_hidden = torch.randn(len(prompt) - 1, hidden_size, generator=gen)   # [len(prompt) - 1, H]
    step_hidden = torch.randn(1, hidden_size, generator=gen)                   # [1, H]
    drafts = []
    for decode in ("eager", "static"):
        drafter = ModelDrafter(boot_hidden_drafter_dir, max_slots=2, max_seq_len=128, pack="none",
                               decode=decode)
        assert drafter.uses_target_hidden
        drafter.add_request("r", prompt, seed=0, hidden=prompt_hidden)
        chain = drafter.propose(["r"], [3], [SamplingParams()]).tokens
        drafter.commit("r", 0, [prompt[-1]], hidden=step_hidden)
        tree = drafter.propose_tree(["r"], [3], [3], [SamplingParams()])
        drafts.append((chain, tree.tokens, tree.parents))
    assert drafts[0] == drafts[1]
    assert len(drafts[0][1][0]) == 3 * 3   # width 3 at the first level, each a chain of depth 3


def test_a_chain_the_decoder_cannot_take_is_left_to_the_caller(tiny_target_dir) -> None:
    """extend_chain answers None, and leaves the cache as it was, where chains cannot be run in one go
    (a failed capture turns them off) or the chain would run past max_seq_len: the drafter then drafts
    token by token."""
    runner = ModelRunner(tiny_target_dir, max_slots=2, max_seq_len=64, decode="static")
    slot = runner.allocate()
    runner.prefill([slot], [[5, 6, 7]])
    assert runner.extend_chain([slot], [[8]], 64) is None           # 3 + 1 + 63 > 64
    runner.static.chains = False
    assert runner.extend_chain([slot], [[8]], 3) is None
    assert runner.cache.lengths_of([slot]) == [3]
    runner.static.chains = True
    drafted = runner.extend_chain([slot], [[8, 9]], 3)
    assert len(drafted) == 1 and len(drafted[0]) == 3 and runner.cache.lengths_of([slot]) == [3 + 2 + 2]
