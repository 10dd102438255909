"""The weight-transfer backend of drafter versions (workers/engine/vllm_weights.py) is what vLLM's own
processes load: pyproject's general-plugin entry point names it, and vLLM's plugin loader registers it."""

from __future__ import annotations

import importlib.metadata

import pytest

from specd.workers.engine.vllm_engine import vllm_missing

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=f"needs the vllm extra ({vllm_missing()})")


def test_vllms_plugin_loader_registers_the_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    from specd.workers.engine.vllm_weights import BACKEND, SafetensorsFileEngine

    points = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("specd-drafter-weights") == "specd.workers.engine.vllm_weights:register"
    WeightTransferEngineFactory._registry.pop(BACKEND, None)
    # what load_general_plugins() runs in each vLLM process (it runs once per process: called directly)
    plugins = load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP)
    plugins["specd-drafter-weights"]()
    assert WeightTransferEngineFactory._registry[BACKEND]() is SafetensorsFileEngine


def test_update_info_names_the_file() -> None:
    from specd.workers.engine.vllm_weights import FileUpdateInfo, SafetensorsFileEngine

    engine = SafetensorsFileEngine.__new__(SafetensorsFileEngine)      # parse_* need no model
    assert engine.parse_update_info({"path": "/x.safetensors"}) == FileUpdateInfo(path="/x.safetensors")
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.parse_update_info({"tensors": []})
