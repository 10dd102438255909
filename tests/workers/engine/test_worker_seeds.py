"""Worker seeds: unseeded requests draw from a stream seeded by their worker, so replicas differ and a
worker started again with the same seed draws the same stream (torch's global generator is not used)."""

from __future__ import annotations

import torch

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.model import ModelDrafter
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

UNSEEDED = SamplingParams(temperature=1.0)


def _target_stream(cfg, seed: int) -> list[int]:
    target = TargetWorker(cfg.target, seed=seed)
    torch.manual_seed(0)  # the global generator in the same state for every worker: only its seed differs
    reqs = [NewRequest(f"u{i}", [3, 4, 5], UNSEEDED, 12, SpecParams(enabled=False)) for i in range(2)]
    return [t for s in SpecEngine(target).generate(reqs, ignore_eos=True) for t in s.output]


def test_target_worker_seed_drives_unseeded_requests(tiny_target_dir):
    cfg = load_config([f"target.model_path={tiny_target_dir}", "target.max_slots=2", "target.max_seq_len=64"])
    first, again, other = _target_stream(cfg, 1), _target_stream(cfg, 1), _target_stream(cfg, 2)
    assert first == again
    assert first != other


def _drafter_stream(path, seed: int) -> list[int]:
    drafter = ModelDrafter(path, max_slots=2, max_seq_len=64, seed=seed, pack="none")
    torch.manual_seed(0)
    drafter.add_request("u", [3, 4, 5])
    return drafter.propose(["u"], [16], [SamplingParams(temperature=4.0)]).tokens[0]


def test_drafter_seed_drives_unseeded_requests(tiny_drafter_dir):
    first, again = _drafter_stream(tiny_drafter_dir, 1), _drafter_stream(tiny_drafter_dir, 1)
    assert first == again
    assert first != _drafter_stream(tiny_drafter_dir, 2)
