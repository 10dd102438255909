"""decode=compiled on the CPU: the static path's layers through torch.compile (inductor's C++ backend)
give the tokens the eager path gives.

On CUDA the same compiled kernels are captured as one CUDA graph per bucket; that capture needs a GPU
(scripts/gpu_bench.sh measures it). Compiling takes tens of seconds per specialisation on this CPU, so
one module-scoped target and drafter serve every case.
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
from specd.workers.models.runner import ModelRunner

# inductor compiles C++ for minutes on a cold cache: not part of the quick loop
pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [11, 12]]


def _config(tiny_target_dir, tiny_drafter_dir, decode: str):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=4", "drafter.max_slots=4", "target.max_seq_len=128",
        f"target.decode={decode}", f"drafter.decode={decode}",
    ])


def _generate(target, drafter, spec):
    reqs = [NewRequest(f"r{i}", p, SamplingParams(), 24, spec) for i, p in enumerate(PROMPTS)]
    return [s.output for s in SpecEngine(target, drafter).generate(reqs, ignore_eos=True)]


@pytest.fixture(scope="module")
def compiled_workers(tiny_target_dir, tiny_drafter_dir):
    cfg = _config(tiny_target_dir, tiny_drafter_dir, "compiled")
    target = TargetWorker(cfg.target)
    return target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))


@pytest.mark.parametrize("fold", [False, True], ids=["cpu-attention", "cuda-attention"])
def test_compiled_runner_keeps_plain_weights_and_compiles_the_layers(tiny_target_dir, fold,
                                                                    monkeypatch) -> None:
    if fold:    # the attention CUDA compiles (query heads folded per KV head), here on the CPU
        from specd.workers.models import layers, static_decode

        monkeypatch.setattr(static_decode, "attention", layers.fold_gqa)
    runner = ModelRunner(tiny_target_dir, max_slots=2, max_seq_len=64, decode="compiled")
    assert runner.model.packed == "none"            # inductor cannot trace oneDNN's packed weights
    assert runner.static is not None and not runner.static.capture   # no CUDA graphs on a CPU
    assert runner.static._compiled is not None
    static = ModelRunner(tiny_target_dir, max_slots=2, max_seq_len=64, decode="static")
    outs = []
    for r in (static, runner):
        slots = [r.allocate() for _ in range(2)]
        r.prefill(slots, [[5, 6, 7], [8, 9]])
        outs.append(torch.cat([r.extend(slots, [[1, 2, 3], [4]]), r.extend(slots, [[6], [7]])], dim=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert runner.static._compiled is not None     # compiled, not fallen back to the plain layers


@pytest.mark.parametrize(
    "with_drafter,spec",
    [(False, SpecParams(enabled=False)), (True, SpecParams(gamma=4)),
     (True, SpecParams(gamma=3, tree_width=3))],
    ids=["target-only", "chain", "tree"],
)
def test_compiled_engine_is_token_identical_to_eager(compiled_workers, tiny_target_dir, tiny_drafter_dir,
                                                     with_drafter, spec) -> None:
    eager = TargetWorker(_config(tiny_target_dir, tiny_drafter_dir, "eager").target)
    expected = _generate(eager, None, SpecParams(enabled=False))
    target, drafter = compiled_workers
    outputs = _generate(target, drafter if with_drafter else None, spec)
    assert outputs == expected
    assert all(len(o) == 24 for o in outputs)


def test_a_failed_compile_falls_back_to_the_plain_layers(tiny_target_dir, caplog) -> None:
    """No C++ compiler or Triton on the host: the decoder warns and decodes uncompiled, same logits."""
    runner = ModelRunner(tiny_target_dir, max_slots=1, max_seq_len=64, decode="compiled")
    static = ModelRunner(tiny_target_dir, max_slots=1, max_seq_len=64, decode="static")

    def broken(*args):
        raise torch._dynamo.exc.TorchDynamoException("no compiler here")

    runner.static._compiled = broken
    outs = []
    for r in (runner, static):
        slot = r.allocate()
        r.prefill([slot], [[5, 6, 7]])
        outs.append(r.extend([slot], [[1, 2]]))
    assert runner.static._compiled is None
    assert "compiling the decode forward failed" in caplog.text
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
