"""Hydra config tree for specd (schema.py: every key; groups.py: the presets; validate.py: checks)."""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specd.configs.groups import register
from specd.configs.schema import SpecdConfig
from specd.configs.validate import ConfigError, check, from_hydra

__all__ = ["ConfigError", "flatten", "load_config", "override_value", "SpecdConfig"]


def load_config(
    overrides: list[str] | None = None, config_name: str = "config", config_dir: str | None = None
) -> SpecdConfig:
    """Compose a config with command-line style overrides and validate it (raises ConfigError).

    config_name: a yaml in configs/ (the embedded `config`) or, with config_dir, in that directory;
    such a yaml lists `specd_schema` (and any groups) in its defaults, like configs/config.yaml.
    """
    register()
    try:
        if config_dir is None:
            with initialize_config_module(config_module="specd.configs", version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=list(overrides or []))
        else:
            directory = Path(config_dir).expanduser().resolve()
            if not directory.is_dir():
                raise ConfigError(f"--config-dir {config_dir!r} is not a directory")
            with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=list(overrides or []))
        validated = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise from_hydra(exc) from exc
    if not isinstance(validated, SpecdConfig):
        raise ConfigError(f"config {config_name!r} does not build on specd_schema (add it to its defaults)")
    if validated.drafter.max_seq_len is None:
        validated.drafter.max_seq_len = validated.target.max_seq_len
    if validated.drafter.device is None:        # a GPU target drafts on a GPU unless told otherwise
        validated.drafter.device = validated.target.device
    check(validated)
    return validated


def override_value(value: Any) -> str:
    """A value as Hydra override text, so `key=<text>` gives the value back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def flatten(cfg: Any, prefix: str = "") -> dict[str, str]:
    """Every leaf key of a config ("spec.gamma") with its value as override text."""
    out: dict[str, str] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            out.update(flatten(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = override_value(value)
    return out
