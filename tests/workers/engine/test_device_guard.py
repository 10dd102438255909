"""Every tensor the engine creates names its device, checked on the CPU where CI runs.

On a GPU a tensor made without `device=` lands on the CPU and crashes the first op that mixes it
with the model's tensors (the verify path did exactly that on an H100). Here there is one device, so
the mix cannot fail by itself: instead the engine runs under a guard that makes the default device
`meta` (so a tensor without a device holds no data and fails on use) and raises at once, naming the
call site, when code in workers/ calls a factory function without a device. Models are built before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

WORKERS = str(Path(__file__).resolve().parents[3] / "workers")
# Functions that make a new tensor from nothing (or from Python data): each must be told its device.
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace,
}
PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


class ImplicitDeviceError(RuntimeError):
    pass


class RequireDevice(TorchFunctionMode):
    """Raise when code under workers/ calls a factory function without `device=`.

    torch.as_tensor / torch.tensor of an existing tensor keep its device, so only Python data counts.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            copies = func in (torch.tensor, torch.as_tensor)
            from_tensor = copies and args and isinstance(args[0], torch.Tensor)
            caller = sys._getframe(1)
            if not from_tensor and caller.f_code.co_filename.startswith(WORKERS):
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                raise ImplicitDeviceError(f"torch.{func.__name__} without device= at {where}")
        return func(*args, **kwargs)


@pytest.fixture()
def device_guard():
    """The engine under the guard: default device meta, factory calls in workers/ need a device."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        with RequireDevice():
            yield
    finally:
        torch.set_default_device(previous)


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256", "drafter.hybrid_min_match=2",
    ])


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


@pytest.fixture(scope="module")
def drafters(cfg, target):
    made = {}
    for kind in ("model", "hybrid", "ngram"):
        cfg.drafter.kind = kind
        made[kind] = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    return made


def _generate(target, drafter, spec, sampling, n=24):
    reqs = [NewRequest(f"r{i}", p, sampling, n, spec) for i, p in enumerate(PROMPTS)]
    return [s.output for s in SpecEngine(target, drafter).generate(reqs, ignore_eos=True)]


CASES = [
    ("target-only", SpecParams(enabled=False)),
    ("model", SpecParams(gamma=4)),
    ("model", SpecParams(gamma=3, tree_width=3)),
    ("hybrid", SpecParams(gamma=4)),
    ("ngram", SpecParams(gamma=4)),
]


@pytest.mark.parametrize("kind,spec", CASES, ids=["target-only", "chain", "tree", "hybrid", "ngram"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)],
    ids=["greedy", "sampled"],
)
def test_engine_creates_every_tensor_on_an_explicit_device(
    target, drafters, kind, spec, sampling, device_guard
):
    drafter = None if kind == "target-only" else drafters[kind]
    outputs = _generate(target, drafter, spec, sampling)
    assert all(len(o) == 24 for o in outputs)
    assert target.free_slots() == target.cfg.max_slots


def test_guard_catches_a_tensor_without_device(device_guard):
    """The guard itself: a factory call from workers/ code without a device raises, naming the line."""
    from specd.workers.core import tree

    with pytest.raises(ImplicitDeviceError, match="torch.zeros without device="):
        code = compile("torch.zeros(3)", tree.__file__, "eval")
        eval(code, {"torch": torch})  # noqa: S307 - a one-line factory call attributed to workers/
