"""Live tuning: the SpecdAdmin service and `specd admin set/get`.

`SetConfig` takes Hydra-style overrides of the live keys, builds the whole config again from the
running one plus the overrides and validates it exactly like start-up (configs.load_config), so a bad
value is refused with the same message and nothing changes. A valid change replaces the router's
Bounds (γ default and bounds, tree width, policy, speculation on/off) in one assignment: a request
takes its settings when it is admitted, so every step of it runs with one consistent set, and the
next admitted request runs with the new one. A drafter version pin goes to each DraftWorker, which
applies it between steps like any hot swap. ServerInfo's config and the specd_live_* gauges report
the result.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import sys
import threading
import typing

import grpc
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Quote, QuotedString
from hydra.errors import HydraException

from specd.cluster.redact import redact_config, redact_text
from specd.configs import ConfigError, SpecdConfig, flatten, load_config
from specd.proto.specd.v1 import serving_pb2, serving_pb2_grpc

log = logging.getLogger(__name__)

LIVE_KEYS = (
    "spec.enabled", "spec.gamma", "spec.gamma_min", "spec.gamma_max", "spec.tree_width",
    "spec.tree_width_max", "spec.policy", "drafter.version_pin",
)
# load_config uses Hydra's process-wide state: one composition at a time
_HYDRA_LOCK = threading.Lock()


def _string_keys(node: type = SpecdConfig, prefix: str = "") -> frozenset[str]:
    """Flattened keys whose schema type is str or str | None (free text, unlike enums and numbers)."""
    keys: set[str] = set()
    for name, hint in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(hint):
            keys |= _string_keys(hint, f"{prefix}{name}.")
        elif hint is str or set(typing.get_args(hint)) == {str, type(None)}:
            keys.add(f"{prefix}{name}")
    return frozenset(keys)


_STRING_KEYS = _string_keys()


def quote_string(value: str) -> str:
    """`value` as a quoted Hydra override value that composes back to exactly `value`: `=`, `,`, spaces
    and quotes are literal inside quotes, and a `${` is escaped so OmegaConf does not resolve it (each
    backslash right before it doubled, then one more, as OmegaConf's escape grammar reads them)."""
    escaped = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return QuotedString(text=escaped, quote=Quote.single).with_quotes()


def _as_override(key: str, text: str) -> str:
    """The running value of `key` (configs.flatten text) as an override that sets it back exactly."""
    if key in _STRING_KEYS and text != "null":
        return f"{key}={quote_string(text)}"
    # dict keys (custom Ray resources) need `++` to be set whole in a struct config
    return f"++{key}={text}" if key.endswith("resources") and text != "{}" else f"{key}={text}"


def _check_override(override: str) -> None:
    """Refuse what a client may not send: anything but key=value of a live key, and any interpolation
    or resolver (`${oc.env:...}` would read the server's environment into the config)."""
    if "=" not in override or override.startswith(("+", "~")):
        raise ConfigError(f"{override!r} is not allowed: give key=value of a live key")
    key = override.split("=", 1)[0]
    if key not in LIVE_KEYS:
        raise ConfigError(f"{key} cannot change on a running server (restart with it); live keys: "
                          + ", ".join(LIVE_KEYS))
    # checked on the raw text as well as the parsed value: `${` anywhere (quoted, escaped, in a list)
    # is refused, so nothing the client sends is ever resolved
    if "${" in override:
        raise ConfigError(f"{key}: interpolations and resolvers (${{...}}) are not allowed in live "
                          "overrides; give a literal value")
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as exc:
        raise ConfigError(f"{key}: not a valid override value ({' '.join(str(exc).split())})") from exc
    if parsed.is_sweep_override():
        raise ConfigError(f"{key}: sweeps (a,b / choice / range / glob) are not allowed; give one value")


def plan_update(current: dict[str, str], overrides: list[str]):
    """(validated new config, {key: new text}) for overrides of the running config `current`
    (configs.flatten form). Raises ConfigError for a bad value or a key that cannot change live."""
    if not overrides:
        raise ConfigError("no overrides given; live keys: " + ", ".join(LIVE_KEYS))
    for override in overrides:
        _check_override(override)
    base = [_as_override(k, v) for k, v in current.items()]
    with _HYDRA_LOCK:
        cfg = load_config(base + list(overrides))
    new = flatten(cfg)
    changed = {k: v for k, v in new.items() if current.get(k) != v}
    stray = sorted(set(changed) - set(LIVE_KEYS))
    if stray:   # a live key must not move anything else (defensive: the round trip is exact)
        raise ConfigError(f"the change would also move {', '.join(stray)}; refused")
    engine_wide = sorted(k for k in changed if k.startswith("spec.") and k != "spec.enabled")
    if cfg.target.backend == "vllm" and engine_wide:
        # vLLM's speculative config (num_speculative_tokens, the proposer's policy) is fixed at start
        raise ConfigError(f"{', '.join(engine_wide)} cannot change live on target.backend=vllm: the vLLM "
                          "engine's speculative config is set at start (restart with it)")
    return cfg, changed


def apply_bounds(bounds, cfg):
    """The router's Bounds with the live spec keys of cfg."""
    spec = cfg.spec
    return dataclasses.replace(
        bounds, spec_enabled=spec.enabled, gamma_default=spec.gamma, gamma_min=spec.gamma_min,
        gamma_max=spec.gamma_max, tree_width_default=spec.tree_width, tree_width_max=spec.tree_width_max,
        policy_default=str(spec.policy),
    )


class AdminServicer(serving_pb2_grpc.SpecdAdminServicer):
    """Shares the SpecdServicer's backend; changes apply to the next admitted request."""

    def __init__(self, specd_servicer):
        self.specd = specd_servicer
        self._lock = asyncio.Lock()

    async def SetConfig(self, request, context):
        backend = self.specd.backend
        if backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading its models")
        async with self._lock:
            try:
                cfg, changed = await asyncio.to_thread(plan_update, dict(backend.config),
                                                       list(request.overrides))
            except ConfigError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, redact_text(str(err)))
            if "spec.enabled" in changed and not backend.bounds.per_request_speculation:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "spec.enabled cannot change live here: this vLLM engine's proposer does "
                                    "not hear request settings (restart with it)")
            if "drafter.version_pin" in changed:
                pin = cfg.drafter.version_pin
                try:
                    await asyncio.gather(*[d.pin_version.remote(pin) for d in backend.drafters])
                except Exception as err:  # the actor's error text says why (no version store, ...)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        redact_text(f"drafter.version_pin={pin!r} is not allowed: {err}"))
            backend.bounds = apply_bounds(backend.bounds, cfg)
            backend.config = {**backend.config, **changed}
            if backend.metrics is not None:
                backend.metrics.set_live_config(backend.bounds, cfg.drafter.version_pin)
            log.info("live config changed: %s", redact_config(changed))
            return serving_pb2.SetConfigResponse(changed=redact_config(changed),
                                                 config=redact_config(backend.config))


# ---- command line ------------------------------------------------------------------------------
def _cmd_admin(args: argparse.Namespace) -> int:
    from specd.cluster.client import SpecdClient
    from specd.cluster.client_cli import client_security, grpc_address

    if args.token_env == "SPECD_ADMIN_TOKEN" and (args.action == "get"
                                                  or not os.environ.get("SPECD_ADMIN_TOKEN")):
        # get reads ServerInfo (a user call); a server without admin tokens takes its bearer token
        args.token_env = "SPECD_TOKEN"
    try:
        with SpecdClient(grpc_address(args), timeout=args.timeout,
                         security=client_security(args)) as client:
            if args.action == "set":
                changed = client.set_config(args.overrides)
                for key, value in sorted(changed.items()):
                    print(f"{key}={value}")
                if not changed:
                    print("(nothing changed)", file=sys.stderr)
            else:
                config = client.server_info()["config"]
                wanted = args.overrides or LIVE_KEYS
                for key in wanted:
                    print(f"{key}={config.get(key, '<unknown key>')}")
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            print("the server has no admin service: off loopback it needs server.admin_token_file or "
                  "server.admin_token_env", file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers) -> None:
    """`specd admin set KEY=VALUE ...` and `specd admin get [KEY ...]` (called by cluster/cli.py)."""
    from specd.cluster.client_cli import add_client_options

    p = subparsers.add_parser("admin", help="change speculation settings of a running server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("set", "get"))
    p.add_argument("overrides", nargs="*", help="set: live keys, e.g. spec.gamma=5; get: keys to show")
    add_client_options(p)
    p.set_defaults(token_env="SPECD_ADMIN_TOKEN")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=_cmd_admin)
