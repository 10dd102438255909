"""Config groups, enums and start-up validation: every key round-trips through override text, bad
values fail naming the key, the value and what is allowed, groups and --config-dir/--config-name
compose, and the enums agree with the registries they name."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest

from specd.configs import ConfigError, flatten, load_config
from specd.configs.groups import GROUPS
from specd.configs.schema import DrafterKind, GammaPolicyName


def test_defaults_equal_the_default_group_options() -> None:
    # a yaml that lists only specd_schema gets what configs/config.yaml picks
    picked = load_config(["model=smollm2", "drafter=suffix", "spec=goodput", "server=local", "cluster=local"])
    assert asdict(picked) == asdict(load_config())


@pytest.mark.parametrize("groups", [
    [],
    ["drafter=ngram", "spec=tree", "cluster=ray", "server=public"],
    ["drafter=token", "spec=adaptive", "cluster=ray-shared-gpu", "model=hf", "target.model_path=/m"],
])
def test_every_key_round_trips_through_its_override_text(groups) -> None:
    cfg = load_config(groups)
    flat = flatten(cfg)
    again = load_config([f"{k}={v}" if not k.endswith("resources") or v == "{}" else f"++{k}={v}"
                         for k, v in flat.items()])
    assert flatten(again) == flat


def mutate(key: str, text: str) -> str:
    """Another valid-looking value for a key, from its override text."""
    if text in ("true", "false"):
        return "false" if text == "true" else "true"
    if text == "null":
        return "/tmp/x" if "file" in key or "path" in key or "dir" in key or "url" in key else "7"
    try:
        return str(int(text) + 1)
    except ValueError:
        pass
    try:
        return repr(float(text) / 2 if float(text) else 0.5)
    except ValueError:
        return text + "x"


@pytest.mark.slow     # every key of the schema through hydra: about 45 s on 2 cores
def test_each_key_takes_a_new_value_or_names_itself_in_the_error() -> None:
    flat = flatten(load_config())
    changed = 0
    for key, text in flat.items():
        if key.endswith("resources") or key in ("server.tls_cert_file", "server.tls_key_file",
                                                "server.tls_client_ca_file", "replay.redis_url"):
            continue   # paired keys and dicts: covered by the round trip and the bad-value cases
        value = mutate(key, text)
        try:
            cfg = load_config([f"{key}={value}"])
        except ConfigError as err:
            assert key in str(err), (key, value, str(err))
            continue
        assert flatten(cfg)[key] != text, key
        changed += 1
    assert changed > len(flat) * 0.7


@pytest.mark.parametrize("override, key, allowed", [
    ("spec.policy=bogus", "spec.policy='bogus'", "fixed, egag, confidence, adaptive"),
    ("drafter.kind=gpt", "drafter.kind='gpt'", "model, ngram, hybrid"),
    ("target.backend=tgi", "target.backend='tgi'", "torch, vllm"),
    ("target.dtype=int4", "target.dtype='int4'", "float32, bfloat16, float16"),
    ("target.device=tpu", "target.device='tpu'", "cpu, cuda"),
    ("server.port=abc", "server.port='abc'", "Integer"),
    ("server.port=70000", "server.port=70000", "between 0 and 65535"),
    ("target.replicas=0", "target.replicas=0", ">= 1"),
    ("spec.gamma=9", "spec.gamma=9", "spec.gamma_max=8"),
    ("spec.tree_width=5", "spec.tree_width=5", "spec.tree_width_max=4"),
    ("server.pipeline_groups=3", "server.pipeline_groups=3", "between 1 and 2"),
    ("spec.gama=3", "unknown key spec.gama", "gamma, gamma_min"),
    ("drafter=bogus", "drafter/bogus", "hidden"),
    ("server.tls_cert_file=/a.pem", "server.tls_cert_file='/a.pem'", "set together"),
    ("spec.lossy=true", "spec.lossy=True", "exact"),
    ("drafter.suffix_max_depth=300", "drafter.suffix_max_depth=300", "between 2 and 255"),
    ("spec.goodput_prior=1.5", "spec.goodput_prior=1.5", "between 0 and 1"),
])
def test_invalid_values_name_the_key_the_value_and_what_is_allowed(override, key, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert key in str(err.value) and allowed in str(err.value)


def test_model_hf_needs_a_path(monkeypatch) -> None:
    monkeypatch.delenv("SPECD_MODEL_PATH", raising=False)
    with pytest.raises(ConfigError, match="target.model_path"):
        load_config(["model=hf"])
    monkeypatch.setenv("SPECD_MODEL_PATH", "/models/x")
    assert load_config(["model=hf"]).target.model_path == "/models/x"


def test_groups_set_their_section_and_overrides_win() -> None:
    cfg = load_config(["drafter=ngram", "spec=tree", "spec.tree_width=3", "cluster=ray"])
    assert cfg.drafter.kind == DrafterKind.ngram and cfg.drafter.kind == "ngram"
    assert cfg.spec.tree_width == 3 and cfg.spec.gamma == 4
    assert cfg.ray.address == "auto" and cfg.target.num_gpus == 1 and cfg.drafter.num_gpus == 1
    assert load_config(["spec=off"]).spec.enabled is False
    assert load_config(["drafter=suffix"]).drafter.kind == "suffix"
    # cluster comes after model in the defaults: the preset's placement stays with model=hf
    cfg = load_config(["cluster=ray", "model=hf", "target.model_path=/m"])
    assert cfg.target.num_gpus == 1 and cfg.target.model_path == "/m"
    assert set(GROUPS) == {"model", "drafter", "spec", "server", "replay", "trainer", "cluster"}
    cfg = load_config(["replay=off", "trainer=rejections"])
    assert cfg.replay.enabled is False and cfg.trainer.positions == "rejected" and cfg.trainer.enabled
    assert load_config(["trainer=off"]).trainer.enabled is False
    with pytest.raises(ConfigError, match="replay.redis_url"):
        load_config(["replay=external"])


def test_config_dir_and_name_with_a_yaml_of_ones_own(tmp_path) -> None:
    (tmp_path / "prod.yaml").write_text(
        "defaults:\n  - specd_schema\n  - drafter: ngram\n  - spec: tree\n  - _self_\n"
        "name: prod\nspec:\n  gamma: 2\nserver:\n  max_queue: 9\n")
    cfg = load_config(["spec.tree_width=2"], config_name="prod", config_dir=str(tmp_path))
    assert (cfg.name, cfg.drafter.kind, cfg.spec.gamma, cfg.spec.tree_width, cfg.server.max_queue) == \
        ("prod", "ngram", 2, 2, 9)
    (tmp_path / "broken.yaml").write_text(
        "defaults:\n  - specd_schema\n  - _self_\nname: b\nspec:\n  policy: no\n")
    with pytest.raises(ConfigError, match="spec.policy"):
        load_config([], config_name="broken", config_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="not a directory"):
        load_config([], config_dir=str(tmp_path / "missing"))


def test_specd_serve_arguments_reach_the_config(tmp_path, capsys) -> None:
    from specd.cluster.serve import _cmd_serve, add_config_options, config_from_args

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("# from a ConfigMap\nspec=tree\nspec.gamma=5\n\n")
    args = parser.parse_args(["--overrides-file", str(overrides), "drafter=ngram", "spec.tree_width=2"])
    cfg = config_from_args(args)
    assert (cfg.spec.gamma, cfg.spec.tree_width, cfg.drafter.kind) == (5, 2, "ngram")
    # an invalid value stops `specd serve` before anything loads, with the key in the message
    assert _cmd_serve(parser.parse_args(["spec.policy=bogus"])) == 2
    assert "spec.policy='bogus'" in capsys.readouterr().err


def test_enums_agree_with_the_registries() -> None:
    import importlib
    import pkgutil

    import specd.workers.drafters
    from specd.workers.core.gamma import GAMMA_POLICIES
    from specd.workers.drafters.registry import DRAFTERS

    assert set(GammaPolicyName) == set(GAMMA_POLICIES)
    for module in pkgutil.iter_modules(specd.workers.drafters.__path__):
        importlib.import_module(f"specd.workers.drafters.{module.name}")
    assert set(DrafterKind) == set(DRAFTERS)
