"""Validation of a composed config, before anything loads: every failure names the key, the value
given and what is allowed. Types and closed choices (enums) are checked by OmegaConf while Hydra
composes; this module turns those errors into the same one-line form and checks ranges and the
relations between keys that a type cannot express."""

from __future__ import annotations

import ipaddress
from typing import Any

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from specd.configs.schema import TARGET_MODELS


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the value and what is allowed."""


def _bad(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not allowed: {allowed}")


# key: (lowest allowed, highest allowed); None = unbounded on that side
RANGES: dict[str, tuple[float | None, float | None]] = {
    "target.num_gpus": (0, None), "target.num_cpus": (0, None), "target.replicas": (1, None),
    "target.max_slots": (1, None), "target.max_seq_len": (2, None), "target.num_threads": (1, None),
    "drafter.num_gpus": (0, None), "drafter.num_cpus": (0, None), "drafter.max_slots": (1, None),
    "drafter.max_seq_len": (1, None), "drafter.min_ngram": (1, None), "drafter.max_ngram": (1, None),
    "drafter.hybrid_min_match": (1, None),
    # the suffix index packs a tail's depth into 8 bits (workers/drafters/suffix_index.py)
    "drafter.suffix_max_depth": (2, 255), "drafter.suffix_max_nodes": (1, None),
    "spec.goodput_prior": (0, 1),
    "spec.gamma": (0, None), "spec.gamma_min": (0, None), "spec.gamma_max": (0, 64),
    "spec.tree_width": (1, None), "spec.tree_width_max": (1, 16),
    "spec.egag_threshold": (0, None), "spec.egag_beta": (0, None), "spec.confidence_threshold": (0, 1),
    "sampling.max_new_tokens_default": (1, None), "sampling.max_new_tokens_cap": (1, None),
    "sampling.temperature_max": (0, None),
    "target.tensor_parallel_size": (1, None), "target.gpu_memory_utilization": (0.01, 1),
    "server.port": (0, 65535), "server.health_port": (0, 65535), "server.metrics_port": (0, 65535),
    "server.http_port": (0, 65535),
    "server.max_queue": (1, None), "server.max_running": (1, None), "server.pipeline_groups": (1, 2),
    "server.max_message_bytes": (1024, 2**31 - 1), "server.shutdown_grace_s": (0, None),
    "server.health_probe_s": (0, None), "server.max_prompt_chars": (1, None),
    "replay.maxlen": (1, None), "replay.queue_size": (1, None),
    "trainer.num_gpus": (0, None), "trainer.num_cpus": (0, None), "trainer.lr": (0, None),
    "trainer.batch_records": (1, None), "trainer.keep_versions": (1, None),
}


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return None          # a section another branch has not landed yet
        node = getattr(node, part)
    return node


def check(cfg: Any) -> None:
    """Range and relation checks on a composed SpecdConfig (raises ConfigError)."""
    for key, (lo, hi) in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = (f"between {lo} and {hi}" if lo is not None and hi is not None
                      else f">= {lo}" if lo is not None else f"<= {hi}")
            raise _bad(key, value, f"must be {bounds}")
    spec = cfg.spec
    if spec.lossy:
        raise _bad("spec.lossy", True, "specd has no lossy verification mode; every mode is exact")
    if spec.gamma_min > spec.gamma_max:
        raise _bad("spec.gamma_min", spec.gamma_min, f"must be <= spec.gamma_max={spec.gamma_max}")
    if not spec.gamma_min <= spec.gamma <= spec.gamma_max:
        raise _bad("spec.gamma", spec.gamma,
                   f"must lie in [spec.gamma_min={spec.gamma_min}, spec.gamma_max={spec.gamma_max}]")
    if spec.tree_width > spec.tree_width_max:
        raise _bad("spec.tree_width", spec.tree_width,
                   f"must be <= spec.tree_width_max={spec.tree_width_max}")
    if cfg.drafter.max_seq_len is not None and cfg.drafter.max_seq_len < cfg.target.max_seq_len:
        # a shorter drafter could not hold the requests the target admits
        raise _bad("drafter.max_seq_len", cfg.drafter.max_seq_len,
                   f"must be >= target.max_seq_len={cfg.target.max_seq_len} (unset = the target's)")
    if cfg.drafter.min_ngram > cfg.drafter.max_ngram:
        raise _bad("drafter.min_ngram", cfg.drafter.min_ngram,
                   f"must be <= drafter.max_ngram={cfg.drafter.max_ngram}")
    sampling = cfg.sampling
    if sampling.max_new_tokens_default > sampling.max_new_tokens_cap:
        raise _bad("sampling.max_new_tokens_default", sampling.max_new_tokens_default,
                   f"must be <= sampling.max_new_tokens_cap={sampling.max_new_tokens_cap}")
    target = cfg.target
    if target.model is not None and target.model not in TARGET_MODELS:
        raise _bad("target.model", target.model,
                   f"one of {', '.join(TARGET_MODELS)} (`specd models` lists them)")
    if target.model is not None and target.model_path is not None:
        raise _bad("target.model", target.model,
                   f"target.model and target.model_path={target.model_path!r} are both set; set one")
    if cfg.target.tensor_parallel_size > 1 and cfg.target.backend != "vllm":
        raise _bad("target.tensor_parallel_size", cfg.target.tensor_parallel_size,
                   "needs target.backend=vllm (the torch backend runs a target on one device)")
    server = cfg.server
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        raise _bad("server.tls_cert_file", server.tls_cert_file,
                   "server.tls_cert_file and server.tls_key_file must be set together")
    if server.tls_client_ca_file and not server.tls_cert_file:
        raise _bad("server.tls_client_ca_file", server.tls_client_ca_file,
                   "mutual TLS needs server.tls_cert_file and server.tls_key_file")
    if server.tls_min_version not in ("1.2", "1.3"):
        raise _bad("server.tls_min_version", server.tls_min_version, "one of '1.2', '1.3'")
    if server.health_port and server.health_port == server.port:
        raise _bad("server.health_port", server.health_port, "must differ from server.port")
    taken = {"server.port": server.port, "server.health_port": server.health_port,
             "server.metrics_port": server.metrics_port}
    for key, port in taken.items():
        if server.http_port and server.http_port == port:
            raise _bad("server.http_port", server.http_port, f"must differ from {key}")
    if open_bind_refused(server.host, bool(server.auth_token_file or server.auth_token_env),
                         server.insecure):
        raise _bad("server.host", server.host, OPEN_BIND_HELP)


OPEN_BIND_HELP = ("a non-loopback address needs a bearer token: set server.auth_token_file or "
                  "server.auth_token_env (and TLS: server.tls_cert_file, server.tls_key_file), or "
                  "server.insecure=true to serve it open on purpose")


def open_bind_refused(host: str, has_tokens: bool, insecure: bool) -> bool:
    """A bind anyone on the network could use without a token, and not asked for on purpose."""
    return not is_loopback_host(host) and not has_tokens and not insecure


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine reaches (localhost, 127.0.0.0/8, ::1)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:       # a host name: it may resolve to anything, so not loopback
        return False


def from_hydra(exc: Exception) -> ConfigError:
    """A Hydra/OmegaConf composition error as one line naming the key, the value and what is allowed."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        msg = str(getattr(cause, "msg", cause)).splitlines()[0]
        override = str(exc).splitlines()[0].removeprefix("Error merging override ")
        name, eq, given = override.partition("=")
        value = given if eq and name.lstrip("+~") == key else None
        if isinstance(cause, ConfigKeyError | ConfigAttributeError):
            section = key.rpartition(".")[0]
            known = _known_keys(section)
            return ConfigError(f"unknown key {key}" + (f"={value!r}" if value is not None else "")
                               + (f"; {section or 'the config'} has: {', '.join(known)}" if known else ""))
        if value is not None:
            return ConfigError(f"{key}={value!r} is not allowed: {msg}")
        return ConfigError(f"{key}: {msg}")
    text = str(exc).split("Config search path")[0]
    return ConfigError(" ".join(text.split()))


def _known_keys(section: str) -> list[str]:
    from dataclasses import fields, is_dataclass

    from specd.configs.schema import SpecdConfig

    node: Any = SpecdConfig
    for part in filter(None, section.split(".")):
        match = [f for f in fields(node) if f.name == part]
        if not match or not is_dataclass(match[0].default_factory):   # type: ignore[arg-type]
            return []
        node = match[0].default_factory
    return [f.name for f in fields(node)]
