"""Workers and the in-process engine from a SpecdConfig: the one place they are built.

The demo and the benchmarks build through here; the server builds the same workers as Ray actors
(cluster/actors.py) with the same seeds (worker_seeds), so an in-process engine is replica 0 of a server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specd.configs.schema import SpecdConfig
    from specd.workers.engine.spec_engine import SpecEngine
    from specd.workers.engine.vllm_engine import VllmEngine


def worker_seeds(seed: int, replica: int = 0) -> tuple[int, int]:
    """(target, drafter) seeds of one replica: every worker of every replica draws its own random stream
    for unseeded requests."""
    return seed + 2 * replica, seed + 2 * replica + 1


def build_engine(
    cfg: SpecdConfig,
    speculative: bool = True,
    max_running: int | None = None,
    vllm_kwargs: dict[str, Any] | None = None,
) -> SpecEngine | VllmEngine:
    """The engine cfg describes: a TargetWorker and (if `speculative`) a DraftWorker in this process
    under a SpecEngine, or with target.backend=vllm a VllmEngine (specd's drafter as its proposer).
    `vllm_kwargs` go to vllm.LLM."""
    if cfg.target.backend == "vllm":
        from specd.workers.engine.vllm_engine import VllmEngine

        return VllmEngine(cfg, speculation="specd" if speculative else "none", max_running=max_running,
                          llm_kwargs=vllm_kwargs)
    from specd.workers.engine.draft_worker import DraftWorker
    from specd.workers.engine.spec_engine import SpecEngine
    from specd.workers.engine.target_worker import TargetWorker

    target_seed, drafter_seed = worker_seeds(cfg.seed)
    target = TargetWorker(cfg.target, seed=target_seed, cache_dir=cfg.cache_dir)
    drafter = None
    if speculative:
        drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir), seed=drafter_seed,
                              cache_dir=cfg.cache_dir)
    return SpecEngine(target, drafter, max_running=max_running,
                      guard_window_steps=cfg.spec.guard_window_steps if cfg.spec.guard_in_process else 0)
