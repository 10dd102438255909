"""Hydra config tree for specd (see schema.py for every key)."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from configs.schema import SpecdConfig, register


def load_config(overrides: list[str] | None = None) -> SpecdConfig:
    """Compose configs/config.yaml with command-line style overrides, validated against the schema."""
    register()
    with initialize_config_module(config_module="configs", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    validated = OmegaConf.to_object(cfg)
    assert isinstance(validated, SpecdConfig)
    drafter = validated.drafter
    if drafter.max_seq_len is None:
        drafter.max_seq_len = validated.target.max_seq_len
    if drafter.max_seq_len < validated.target.max_seq_len:
        # A shorter drafter could not hold the requests the target admits.
        raise ValueError(
            f"drafter.max_seq_len={drafter.max_seq_len} must be >= target.max_seq_len="
            f"{validated.target.max_seq_len} (unset = the target's)"
        )
    if validated.spec.lossy:
        raise ValueError("spec.lossy=true: specd has no lossy verification mode; every mode is exact")
    if not validated.spec.gamma_min <= validated.spec.gamma <= validated.spec.gamma_max:
        raise ValueError(
            f"spec.gamma={validated.spec.gamma} must lie in [spec.gamma_min={validated.spec.gamma_min}, "
            f"spec.gamma_max={validated.spec.gamma_max}]"
        )
    return validated
