"""Live tuning over real gRPC with fake workers: SpecdAdmin.SetConfig needs the admin token, validates
like start-up (nothing changes on a bad value), and the next requests run with the new γ, tree width
and policy; ServerInfo, the live gauges and `specd admin set/get` report it."""

from __future__ import annotations

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget
from prometheus_client import CollectorRegistry
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.admin import LIVE_KEYS, plan_update
from specd.cluster.auth import ServerSecurity
from specd.cluster.client import Security, SpecdClient
from specd.cluster.metrics import SpecdMetrics
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.configs import ConfigError, flatten, load_config
from specd.configs.schema import ServerConfig

TOKEN, ADMIN = "user-token", "admin-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    (tmp / "token").write_text(TOKEN)
    (tmp / "admin").write_text(ADMIN)
    lt = LoopThread()
    target = FakeTarget(max_slots=2, delay=0.001)
    drafter = FakeDrafter(target, delay=0.001)
    cfg = load_config([f"spec.gamma={BOUNDS.gamma_default}", f"spec.gamma_max={BOUNDS.gamma_max}",
                       f"spec.tree_width_max={BOUNDS.tree_width_max}"])
    metrics = SpecdMetrics(CollectorRegistry())
    security = ServerSecurity.from_config(ServerConfig(auth_token_file=str(tmp / "token"),
                                                       admin_token_file=str(tmp / "admin")))

    async def up():
        sched = Scheduler([(target, drafter)], capacity=2, max_queue=4, max_running=2, pipeline_groups=1,
                          eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0, security=security)
        await srv.start()
        backend = Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 1, 4, metrics, flatten(cfg))
        metrics.set_live_config(backend.bounds, None)
        await srv.attach(backend)
        return sched, srv, backend

    sched, srv, backend = lt.run(up())
    yield {"address": srv.address, "backend": backend, "metrics": metrics, "tmp": tmp}
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def client(server, token: str | None) -> SpecdClient:
    return SpecdClient(server["address"], timeout=30, security=Security(token=token))


def depth(c: SpecdClient, **kw) -> int:
    """Deepest draft position of one request: how far γ let the drafter go."""
    out = c.generate(text="hi", max_new_tokens=12, ignore_eos=True, **kw)
    return len(out.usage["drafted_per_position"])


def test_admin_needs_the_admin_token(server) -> None:
    for token in (None, TOKEN, "wrong"):
        with client(server, token) as c, pytest.raises(grpc.RpcError) as err:
            c.set_config(["spec.gamma=2"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client(server, ADMIN) as c, pytest.raises(grpc.RpcError) as err:
        c.generate(text="hi")           # the admin token is not a user token
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_next_requests_use_the_new_gamma_tree_and_policy(server) -> None:
    with client(server, TOKEN) as user, client(server, ADMIN) as admin:
        assert depth(user) == BOUNDS.gamma_default
        assert admin.set_config(["spec.gamma=2"]) == {"spec.gamma": "2"}
        assert depth(user) == 2
        assert admin.set_config(["spec.gamma=5", "spec.gamma_max=5", "spec.tree_width=2",
                                 "spec.policy=egag"]) == {
            "spec.gamma": "5", "spec.gamma_max": "5", "spec.tree_width": "2", "spec.policy": "egag"}
        info = user.server_info()
        assert (info["gamma_default"], info["gamma_max"], info["tree_width_default"]) == (5, 5, 2)
        assert info["gamma_policy_default"] == "egag" and info["config"]["spec.gamma"] == "5"
        with pytest.raises(grpc.RpcError) as err:     # the new bound holds for requests too
            user.generate(text="hi", gamma=6)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert admin.set_config(["spec.enabled=false"]) == {"spec.enabled": "false"}
        assert depth(user) == 0
        admin.set_config(["spec.enabled=true", "spec.gamma=3", "spec.gamma_max=6", "spec.tree_width=1",
                          "spec.policy=fixed"])
        assert depth(user) == 3
    registry = server["metrics"].registry
    assert registry.get_sample_value("specd_live_config", {"key": "gamma_default"}) == 3
    assert registry.get_sample_value("specd_live_policy_info", {"policy": "fixed", "version_pin": ""}) == 1


@pytest.mark.parametrize("overrides, message", [
    (["spec.gamma=99"], "spec.gamma=99 is not allowed"),
    (["spec.policy=bogus"], "spec.policy='bogus'"),
    (["server.port=1"], "server.port cannot change on a running server"),
    (["spec.gama=1"], "spec.gama cannot change"),
    (["+spec.gamma=1"], "give key=value"),
    ([], "no overrides given"),
])
def test_bad_changes_are_refused_and_change_nothing(server, overrides, message) -> None:
    before = dict(server["backend"].config)
    with client(server, ADMIN) as admin, pytest.raises(grpc.RpcError) as err:
        admin.set_config(overrides)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert server["backend"].config == before


def test_specd_admin_cli(server, monkeypatch, capsys) -> None:
    from specd.cluster.cli import main

    monkeypatch.setenv("SPECD_ADMIN_TOKEN", ADMIN)
    assert main(["admin", "set", "spec.gamma=4", "--address", server["address"]]) == 0
    assert "spec.gamma=4" in capsys.readouterr().out
    monkeypatch.setenv("SPECD_TOKEN", TOKEN)
    assert main(["admin", "get", "spec.gamma", "--address", server["address"]]) == 0
    assert capsys.readouterr().out.strip() == "spec.gamma=4"
    monkeypatch.delenv("SPECD_ADMIN_TOKEN")       # falls back to SPECD_TOKEN: not an admin token
    assert main(["admin", "set", "spec.gamma=2", "--address", server["address"]]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_plan_update_keeps_every_other_key() -> None:
    current = flatten(load_config(["drafter=ngram", "cluster=ray", "++target.resources={gpu_a:1}"]))
    cfg, changed = plan_update(current, ["spec.gamma=6", "drafter.version_pin=v3"])
    assert changed == {"spec.gamma": "6", "drafter.version_pin": "v3"}
    assert {k: v for k, v in flatten(cfg).items() if k not in changed} == {
        k: v for k, v in current.items() if k not in changed}
    assert set(changed) <= set(LIVE_KEYS)
    with pytest.raises(ConfigError, match="spec.tree_width=9"):
        plan_update(current, ["spec.tree_width=9"])


SECRET = "hunter2-redis-secret"


@pytest.mark.parametrize("override", ["drafter.version_pin=${oc.env:SPECD_REDIS_PASSWORD}",
                                      "spec.gamma=${oc.env:SPECD_REDIS_PASSWORD}",
                                      "drafter.version_pin='${oc.env:SPECD_REDIS_PASSWORD}'",
                                      "spec.policy=${oc.decode:'fixed'}"])
def test_interpolation_is_refused_through_specd_admin_set(server, monkeypatch, capsys, override) -> None:
    """`specd admin set` with a resolver: INVALID_ARGUMENT, the server's variable never read back."""
    from specd.cluster.cli import main

    monkeypatch.setenv("SPECD_REDIS_PASSWORD", SECRET)
    monkeypatch.setenv("SPECD_ADMIN_TOKEN", ADMIN)
    before = dict(server["backend"].config)
    assert main(["admin", "set", override, "--address", server["address"]]) == 1
    out = capsys.readouterr()
    assert "INVALID_ARGUMENT" in out.err and "interpolations and resolvers" in out.err
    assert SECRET not in out.out + out.err
    assert server["backend"].config == before
    with client(server, TOKEN) as user:
        assert SECRET not in str(user.server_info()["config"])


def test_running_values_with_special_characters_replay_and_are_masked(server, monkeypatch) -> None:
    """Running strings holding `=`, `,`, quotes and `${` are replayed exactly, so a live change still
    works; ServerInfo and SetConfig show the Redis URL without its password."""
    url = f"rediss://:{SECRET}@redis.example:6380/0?ssl_cert_reqs=required&health_check_interval=5,6"
    path = "/models/a,b=c 'd' ${not.resolved}"
    running = {**server["backend"].config, "replay.redis_url": url, "target.model_path": path}
    monkeypatch.setattr(server["backend"], "config", running)
    with client(server, ADMIN) as admin, client(server, TOKEN) as user:
        assert admin.set_config(["spec.gamma=2"]) == {"spec.gamma": "2"}
        assert server["backend"].config["replay.redis_url"] == url        # kept exactly, internally
        assert server["backend"].config["target.model_path"] == path
        shown = user.server_info()["config"]
        assert shown["replay.redis_url"] == ("rediss://:***@redis.example:6380/0?ssl_cert_reqs=required"
                                             "&health_check_interval=5,6")
        assert shown["target.model_path"] == path and SECRET not in str(shown)
        admin.set_config([f"spec.gamma={BOUNDS.gamma_default}"])


def test_plan_update_round_trips_awkward_strings() -> None:
    from specd.cluster.admin import quote_string

    values = ["rediss://u:p@h:1/0?a=1,2", "a b,c=d", "it's \"q\"", "back\\slash\\", "x${oc.env:HOME}",
              "two\\${x}", "end\\'", "{not: a dict}", "[1, 2]", "null text", ""]
    for value in values:
        assert load_config([f"target.model_path={quote_string(value)}"]).target.model_path == value
    current = flatten(load_config([f"name={quote_string(v)}" for v in values[:1]]))
    current["target.model_path"] = values[4]
    cfg, changed = plan_update(current, ["spec.gamma=3"])
    assert changed == {"spec.gamma": "3"} and cfg.target.model_path == values[4]


def test_vllm_engine_wide_speculation_keys_are_refused_live() -> None:
    from specd.cluster.admin import plan_update
    from specd.configs import ConfigError, flatten, load_config

    current = flatten(load_config(["target.backend=vllm"]))
    with pytest.raises(ConfigError, match="spec.gamma cannot change live on target.backend=vllm"):
        plan_update(current, ["spec.gamma=2"])
    _, changed = plan_update(current, ["spec.enabled=false"])     # per request, the proposer hears it
    assert changed == {"spec.enabled": "false"}
