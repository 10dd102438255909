"""Host reads per verify step (issue 54): on a GPU each `.item()`, `.tolist()`, `.cpu()` or `.numpy()` of a
device tensor is a synchronisation. The target worker's verify of a whole batch reads once for
target-only decoding and chains, greedy and sampled.

Run on the CPU with the GPU's read policy (`host_reads_are_cheap` false: no early exits, no per-node
reads; argmax on the tensor, not through numpy), through the static decode path the GPU runs, tiny
models. Everything is a CPU tensor here, so reads of tensors that are host-side by design are left out
by where they happen (HOST_SIDE) or what they are (the sampling settings, and the hidden states a
drafter reads, copied to the host without a wait before the outcome's read: `_states_to_host`). A
sampled tree's shape is planned from host-side parents that this cannot tell from device tensors: the
tree walk's own reads are counted in tests/workers/core/test_verify_tree.py."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from specd.configs import load_config
from specd.workers.core import sampling, verify_chain, verify_tree
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine import target_worker
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import Draft, NewRequest, SpecParams

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40]]
READS = ("item", "tolist", "cpu", "numpy")
# Files whose reads are of host-side tensors by design, never a GPU synchronisation: the cache's committed
# lengths (KVCache.lengths lives on the CPU) and the static decoder's pinned staging buffer.
HOST_SIDE = {"kv_cache.py", "runner.py", "static_decode.py"}
TORCH = str(Path(torch.__file__).parent)


def _workers(target_dir, drafter_dir):
    cfg = load_config([
        f"target.model_path={target_dir}", f"drafter.path={drafter_dir}",
        "target.max_slots=4", "drafter.max_slots=4", "target.max_seq_len=256",
        "target.decode=static", "drafter.decode=static",
    ])
    target = TargetWorker(cfg.target)
    return target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))


@pytest.fixture(scope="module", params=["drafter", "hidden-drafter"])
def workers(request, tiny_target_dir, tiny_drafter_dir, tiny_llama_dir, tiny_hidden_llama_dir):
    """A drafter of its own, or one that reads the target's hidden states (the default's kind): every
    verify then also returns the states of the batch's new tokens."""
    if request.param == "drafter":
        return _workers(tiny_target_dir, tiny_drafter_dir)
    target, drafter = _workers(tiny_llama_dir, tiny_hidden_llama_dir)
    assert drafter.uses_target_hidden()
    return target, drafter


@pytest.fixture
def reads_per_verify(workers, monkeypatch):
    """The reads of each TargetWorker.verify call, as the GPU would make them."""
    for module in (sampling, verify_tree, target_worker):
        monkeypatch.setattr(module, "host_reads_are_cheap", lambda device: False)
    # the GPU's argmax stays on the device (the CPU's goes through numpy)
    for module in (sampling, verify_chain, verify_tree, target_worker):
        if hasattr(module, "greedy_argmax"):
            monkeypatch.setattr(module, "greedy_argmax", lambda logits: logits.argmax(dim=-1))
    # sampling settings are host tensors by design (params_to_tensors): reading them syncs nothing
    settings: list[torch.Tensor] = []
    to_tensors = target_worker.params_to_tensors

    def host_settings(params):
        made = to_tensors(params)
        settings.extend(made)
        return made

    monkeypatch.setattr(target_worker, "params_to_tensors", host_settings)
    # the hidden states' copy is queued without a wait; what reads it on the host reads host memory
    host_states: set[int] = set()
    to_host = target_worker._states_to_host

    def queued_states(*args):
        states = to_host(*args)
        if states is not None:
            host_states.add(states.untyped_storage().data_ptr())
        return states

    monkeypatch.setattr(target_worker, "_states_to_host", queued_states)
    target, _ = workers
    per_call: list[list[str]] = []
    inside = threading.local()      # the drafter computes in a thread of its own meanwhile: not counted

    def counting(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kw):
            # A torch function mode left active (torch.set_default_device installs one) sends the read
            # back through this wrapper: one read, counted once.
            if getattr(inside, "reading", False):
                return original(self, *args, **kw)
            if (getattr(inside, "verify", False) and not any(self is t for t in settings)
                    and self.untyped_storage().data_ptr() not in host_states):
                frame = sys._getframe(1)
                while frame.f_code.co_filename.startswith(TORCH):     # np.asarray(t) -> t.__array__()
                    frame = frame.f_back
                where = Path(frame.f_code.co_filename).name
                if where not in HOST_SIDE:
                    per_call[-1].append(f"{name} in {where}:{frame.f_lineno}")
            inside.reading = True
            try:
                return original(self, *args, **kw)
            finally:
                inside.reading = False
        return counted

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    verify = target.verify

    def verify_counted(*args, **kw):
        per_call.append([])
        inside.verify = True
        try:
            return verify(*args, **kw)
        finally:
            inside.verify = False

    monkeypatch.setattr(target, "verify", verify_counted)
    return per_call


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("spec", [SpecParams(enabled=False), SpecParams(gamma=3)],
                         ids=["target-only", "chain"])
def test_a_verify_step_reads_its_outcome_once(workers, reads_per_verify, spec, temperature):
    target, drafter = workers
    params = SamplingParams(temperature=temperature)
    reqs = [NewRequest(f"r{i}", p, params, 12, spec) for i, p in enumerate(PROMPTS)]
    seqs = SpecEngine(target, drafter if spec.enabled else None).generate(reqs, ignore_eos=True)
    assert all(len(s.output) == 12 for s in seqs)
    assert len(reads_per_verify) >= 3
    assert all(len(r) == 1 for r in reads_per_verify), reads_per_verify


def test_a_greedy_tree_verify_step_reads_its_outcome_once(workers, reads_per_verify):
    target, drafter = workers
    spec = SpecParams(gamma=3, tree_width=3)
    reqs = [NewRequest(f"r{i}", p, SamplingParams(), 12, spec) for i, p in enumerate(PROMPTS)]
    seqs = SpecEngine(target, drafter).generate(reqs, ignore_eos=True)
    assert all(len(s.output) == 12 for s in seqs)
    assert len(reads_per_verify) >= 2
    assert all(len(r) == 1 for r in reads_per_verify), reads_per_verify


def test_hidden_states_are_copied_without_a_wait(monkeypatch):
    """The states' copy must not synchronise: it is queued (non_blocking) before the outcome's read, which
    is then the step's one synchronisation on a GPU."""
    calls = []
    to = torch.Tensor.to

    def recording(self, *args, **kw):
        calls.append((args, kw))
        return to(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", recording)
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)     # [b, n_max, H]
    drafts = [Draft("a", [4, 4]), Draft("b", [])]
    states = target_worker._states_to_host(hidden, [0, 1], drafts)
    assert torch.equal(states, hidden[:, :3])
    # a subset of rows: up to the longest of their own drafts
    assert torch.equal(target_worker._states_to_host(hidden, [1], drafts), hidden[[1], :1])
    assert target_worker._states_to_host(None, [0], drafts) is None
    assert calls and all(kw.get("non_blocking") is True and args == ("cpu",) for args, kw in calls)
