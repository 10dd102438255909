"""New drafter weights into a running vLLM engine through vLLM's own draft-weight update calls.

vLLM 0.32 updates a served model's weights in three calls on every worker (`start_draft_weight_update`,
`update_weights`, `finish_weight_update`), carried by a weight-transfer engine of the backend named in
`weight_transfer_config`. Its built-in backends move CUDA tensors (IPC handles, NCCL broadcasts from a
trainer process in the same collective); a specd version arrives instead as a safetensors file that
the router's process has verified (hot_swap.py). This backend, "specd-safetensors", reads that file on
each worker and loads it into the draft model with vLLM's layerwise reload, as the IPC backend does:
the checkpoint-format tensors go through the model's own `load_weights` (tensor-parallel sharding,
fused qkv and gate/up projections, CPU weight repacking) between two engine steps.

Registered in vLLM's weight-transfer factory by `register()`, which vLLM runs in every one of its
processes as a general plugin (pyproject.toml's `vllm.general_plugins` entry point), so engines whose
workers are separate processes (tensor parallelism) find it too; VllmEngine calls it as well, for an
engine built in a process where plugins already loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "specd-safetensors"

log = logging.getLogger(__name__)


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: no process group, no handles."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str                                  # a safetensors file every worker can read


class SafetensorsFileEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
        self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        return None


def register() -> None:
    """Add the backend to vLLM's factory (idempotent: every vLLM process calls it once as a plugin)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SafetensorsFileEngine)


def update_draft_weights(llm_engine, path: str) -> None:
    """The three official calls on every worker of a running engine: the draft model then holds the
    weights in `path` (a file from native_export.write_update_file).

    The scheduler is paused around them ("keep": running requests stay, no step runs), as vLLM's RL
    recipes pause generation for a weight update: where the engine core is its own process it steps on
    its own, and a step between two of the calls would run the draft model with its weights half
    replaced (on meta tensors, mid-reload). In this process (VllmTarget's layout) steps run only when
    asked, so the pause changes nothing there."""
    core = llm_engine.engine_core
    _call(core, "pause_scheduler", "keep", False)
    try:
        llm_engine.collective_rpc("start_draft_weight_update")
        llm_engine.collective_rpc("update_weights", kwargs={"update_info": {"path": path}})
        llm_engine.collective_rpc("finish_weight_update")
    finally:
        _call(core, "resume_scheduler")


def _call(core, method: str, *args):
    """An engine-core utility, whether the core runs in its own process (a client with call_utility)
    or in this one (the client holds it as engine_core)."""
    if hasattr(core, "call_utility"):
        return core.call_utility(method, *args)
    return getattr(core.engine_core, method)(*args)
