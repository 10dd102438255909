"""What a GPU deployment of `target.backend=vllm` asks of Ray and vLLM (no GPU needed to check it): whole
GPUs reserved per replica, tensor parallelism and the memory share reaching the engine, the drafter on
the target's device unless set, and what the torch backend refuses."""

from __future__ import annotations

import re

import pytest

from specd.cluster.vllm_serve import actor_options
from specd.configs import ConfigError, load_config
from specd.workers.engine.vllm_engine import engine_gpu_kwargs


def cfg(*overrides: str):
    return load_config(["target.backend=vllm", *overrides])


def test_a_cpu_replica_reserves_no_gpu() -> None:
    opts = actor_options(cfg())
    assert opts["num_gpus"] == 0 and opts["num_cpus"] == 1.0


def test_a_cuda_replica_reserves_whole_gpus_for_its_tensor_parallel_shards() -> None:
    assert actor_options(cfg("target.device=cuda"))["num_gpus"] == 1.0
    assert actor_options(cfg("target.device=cuda", "target.tensor_parallel_size=4"))["num_gpus"] == 4.0
    pinned = actor_options(cfg("target.device=cuda", "target.num_gpus=2", "+target.resources.specd_target=1"))
    assert pinned["num_gpus"] == 2.0 and pinned["resources"] == {"specd_target": 1.0}
    with pytest.raises(ValueError, match="fewer than target.tensor_parallel_size=2"):
        actor_options(cfg("target.device=cuda", "target.num_gpus=1", "target.tensor_parallel_size=2"))


def test_engine_arguments_carry_the_memory_share_and_tensor_parallelism() -> None:
    one = engine_gpu_kwargs(cfg("target.device=cuda", "target.gpu_memory_utilization=0.5"))
    assert one == {"gpu_memory_utilization": 0.5, "tensor_parallel_size": 1}
    two = engine_gpu_kwargs(cfg("target.device=cuda", "target.tensor_parallel_size=2"))
    # the engine's workers are processes of the actor, on its GPUs, with its environment
    assert two["tensor_parallel_size"] == 2 and two["distributed_executor_backend"] == "mp"


def test_the_drafter_follows_the_target_device_unless_set() -> None:
    assert cfg("target.device=cuda").drafter.device == "cuda"
    assert cfg("target.device=cuda", "drafter.device=cpu").drafter.device == "cpu"
    assert load_config([]).drafter.device == "cpu"


@pytest.mark.parametrize(("overrides", "message"), [
    (["target.tensor_parallel_size=2"],
     "target.tensor_parallel_size=2 is not allowed: needs target.backend=vllm"),
    (["target.backend=vllm", "target.gpu_memory_utilization=0"], "target.gpu_memory_utilization=0"),
    (["target.backend=vllm", "target.gpu_memory_utilization=1.5"], "target.gpu_memory_utilization=1.5"),
    (["target.backend=vllm", "target.tensor_parallel_size=0"], "target.tensor_parallel_size=0"),
])
def test_bad_sizes_are_refused_by_name(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(overrides)


def test_a_vllm_router_refuses_what_its_engine_cannot_do_per_request() -> None:
    from specd.cluster.validation import Bounds, InvalidRequest, validate_request
    from specd.cluster.vllm_serve import vllm_bounds
    from specd.proto.specd.v1 import serving_pb2

    class Codec:
        def encode(self, text):
            return [1, 2, 3]

    config = cfg("spec.gamma=3", "spec.gamma_max=8", "spec.tree_width_max=4")
    base = Bounds.from_config(config, {"vocab_size": 100, "max_seq_len": 64})

    def request(**spec):
        return serving_pb2.GenerateRequest(text="x", speculation=serving_pb2.SpeculationOptions(**spec))

    hears = vllm_bounds(base, config, {"per_request_speculation": True})
    assert (hears.tree_width_max, hears.gamma_max, hears.policies) == (1, 3, ("goodput",))
    assert validate_request(request(enabled=False), hears, Codec()).spec.enabled is False
    assert validate_request(request(gamma=1), hears, Codec()).spec.gamma == 1
    for spec, message in ((dict(tree_width=2), "tree_width must be in [1, 1]"),
                          (dict(gamma=5), "gamma must be in [0, 3]"),
                          (dict(gamma_policy="egag"), "gamma_policy 'egag' is not one of ['goodput']")):
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            validate_request(request(**spec), hears, Codec())
    deaf = vllm_bounds(base, config, {"per_request_speculation": False})
    with pytest.raises(InvalidRequest, match="speculation.enabled cannot be set per request"):
        validate_request(request(enabled=False), deaf, Codec())
    assert validate_request(request(), deaf, Codec()).spec.enabled is True
