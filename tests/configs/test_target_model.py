"""target.model: a named target, refused at start when unknown (listing the known) or set beside
target.model_path; its names mirror the registry in workers/models/targets.py."""

from __future__ import annotations

import pytest

from specd.configs import ConfigError, load_config
from specd.configs.schema import TARGET_MODELS


def test_the_names_agree_with_the_registry():
    from specd.workers.models.targets import DEFAULT_TARGET, NAMED_TARGETS

    assert tuple(NAMED_TARGETS) == TARGET_MODELS and TARGET_MODELS[0] == DEFAULT_TARGET


def test_the_default_names_no_target_and_each_name_composes():
    assert load_config().target.model is None            # None: the default, SmolLM2 (or model_path's)
    for name in TARGET_MODELS:
        assert load_config([f"target.model={name}"]).target.model == name


def test_an_unknown_name_is_refused_listing_the_known():
    with pytest.raises(ConfigError) as info:
        load_config(["target.model=llama-70b"])
    message = str(info.value)
    assert message.startswith("target.model='llama-70b' is not allowed")
    assert all(name in message for name in TARGET_MODELS) and "\n" not in message


def test_model_and_model_path_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="target.model and target.model_path=.* are both set"):
        load_config(["target.model=qwen2.5-coder-0.5b-instruct", f"target.model_path={tmp_path}"])
    assert load_config([f"target.model_path={tmp_path}"]).target.model_path == str(tmp_path)
