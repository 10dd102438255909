"""Hot-swap under concurrent streaming load through the scheduler, with real (tiny) workers: versions
published while requests stream are applied between steps, no request fails, and greedy output is
token-identical to target-only decoding before, during and after the swaps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specd.cluster.scheduler import FinishEvent, Scheduler, TokensEvent
from specd.configs import load_config
from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.publish import VersionStore
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.versions import target_checksum
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from tests.drafter_trainer.online_helpers import make_tiny_drafter

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 30, 31], [40, 41], [3, 4, 5, 6, 3, 4], [90, 12], [100, 101, 102]]
N_TOKENS = 40


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory):
    drafter_dir = make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("d") / "drafter")
    cfg = load_config([f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter_dir}",
                       "target.max_slots=8", "drafter.max_slots=8", "target.max_seq_len=256"])
    return TargetWorker(cfg.target), DraftWorker(cfg.drafter, cfg.spec, str(tiny_llama_dir)), drafter_dir


async def _wave(sched: Scheduler, tag: str, spec: bool) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        req = NewRequest(f"{tag}-{i}", prompt, SamplingParams(), N_TOKENS, SpecParams(gamma=3, enabled=spec))
        tokens: list[int] = []
        async for event in sched.submit(req, ignore_eos=True):
            if isinstance(event, TokensEvent):
                tokens += event.tokens
            else:
                assert isinstance(event, FinishEvent) and event.reason == "length", event
        return tokens

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])


def test_hot_swap_under_streaming_load_keeps_output_exact(tmp_path, tiny_llama_dir, workers):
    target, drafter, drafter_dir = workers
    store = VersionStore(tmp_path / "store", keep=3)
    drafter.watch_versions(str(store.root), str(tiny_llama_dir), poll_s=0.02)
    state, config, _ = load_drafter(drafter_dir)
    checksum = target_checksum(tiny_llama_dir)

    def publish(seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        noisy = {k: v + torch.randn(v.shape, generator=g) * 0.05 if v.is_floating_point() else v
                 for k, v in state.items()}
        return store.publish(noisy, config, version=None, parent=None, target_checksum=checksum)

    async def main():
        sched = Scheduler([(target, drafter)], capacity=8, max_queue=16, max_running=8, pipeline_groups=2)
        await sched.start()
        try:
            reference = await _wave(sched, "target-only", spec=False)
            before = await _wave(sched, "before", spec=True)
            assert drafter.swap_stats()["swaps"] == 0

            published: list[str] = []

            async def publisher():
                for seed in range(4):
                    published.append(await asyncio.to_thread(publish, seed))
                    await asyncio.sleep(0.15)

            during, _ = await asyncio.gather(_wave(sched, "during", spec=True), publisher())
            swaps_during = drafter.swap_stats()["swaps"]
            after = await _wave(sched, "after", spec=True)
            return reference, before, during, after, swaps_during, published
        finally:
            await sched.stop()

    reference, before, during, after, swaps_during, published = asyncio.run(main())
    assert before == reference
    assert during == reference
    assert after == reference
    assert swaps_during >= 1
    assert drafter.swap_stats()["version"] == published[-1]
    assert all(len(t) == N_TOKENS for t in reference)
