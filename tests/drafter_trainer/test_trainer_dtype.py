"""trainer.dtype: which precision "auto" picks, and mixed-precision training that still learns with the
weights and optimizer state in float32."""

from __future__ import annotations

import shutil

import pytest
import torch

from specd.cluster.redis_server import ManagedRedis
from specd.configs.schema import TrainerConfig
from specd.drafter_trainer.online import OnlineTrainer
from specd.drafter_trainer.online_data import TargetTeacher, cpu_has_native_bf16, make_example, trainer_dtype
from specd.drafter_trainer.replay_source import ReplaySource
from tests.drafter_trainer.online_helpers import greedy_continuations, make_record, make_tiny_drafter

AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_auto_is_bfloat16_on_cuda_and_on_cpus_with_native_bfloat16_only() -> None:
    assert cpu_has_native_bf16(AVX512_BF16)
    assert cpu_has_native_bf16("flags\t\t: avx2 amx_bf16 amx_tile\n")
    assert not cpu_has_native_bf16(AVX2_ONLY)
    assert not cpu_has_native_bf16("")
    assert trainer_dtype("auto", "cpu", AVX512_BF16) is torch.bfloat16
    assert trainer_dtype("auto", "cpu", AVX2_ONLY) is torch.float32
    assert trainer_dtype("auto", "cuda", AVX2_ONLY) is torch.bfloat16
    assert trainer_dtype("float32", "cpu", AVX512_BF16) is torch.float32
    assert trainer_dtype("bfloat16", "cpu", AVX2_ONLY) is torch.bfloat16
    for unsupported in ("float16", "int8"):   # float16 would need loss scaling
        with pytest.raises(ValueError, match="trainer.dtype"):
            trainer_dtype(unsupported, "cpu")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_drafter_learns_in_either_precision_with_float32_weights(tmp_path, tiny_llama_dir, dtype):
    cfg = TrainerConfig(divergence="forward_kl", lr=3e-3, warmup_steps=1, batch_records=4, dtype=dtype)
    teacher = TargetTeacher(tiny_llama_dir, top_k=8, max_seq_len=128, dtype=trainer_dtype(dtype, "cpu"))
    base = make_tiny_drafter(tiny_llama_dir, tmp_path / "base", hidden=True)
    with ManagedRedis() as server:
        source = ReplaySource(server.endpoint.client(), "s", cfg.group, cfg.consumer)
        trainer = OnlineTrainer(cfg, source, tiny_llama_dir, base, tmp_path / "store", teacher=teacher)
    assert trainer.dtype is trainer_dtype(dtype, "cpu")
    version = trainer.serving_version
    examples = [make_example(f"{i}-0", make_record(i, p, o, version), teacher, positions="all",
                             accepted_weight=0.2, need_hidden=True)
                for i, (p, o) in enumerate(greedy_continuations(tiny_llama_dir, 8))]
    assert all(e.states.dtype is torch.bfloat16 for e in examples)   # stored compactly either way
    losses = trainer.train_steps(40, examples)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert all(p.dtype is torch.float32 for p in trainer.candidate.parameters())
    assert all(s.dtype is torch.float32 for state in trainer.optimizer.state.values()
               for s in state.values() if torch.is_tensor(s) and s.is_floating_point())
