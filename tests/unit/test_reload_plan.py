"""``plan_reload``: what a reload adds, removes, replaces and keeps, which settings apply at once and
which wait for a restart, from the two configurations alone."""

from __future__ import annotations

import dataclasses

import pytest

from passerelle.config import (
    AdminConfig,
    AuthConfig,
    BackendConfig,
    BatchesConfig,
    ClassConfig,
    Config,
    LimitsConfig,
    MetricsConfig,
    ModelConfig,
    RoutingConfig,
    RuntimesConfig,
    SchedulerConfig,
    ServerConfig,
    StoreConfig,
    TimeoutConfig,
    TracingConfig,
)
from passerelle.runtimes.reload_plan import Changes, effective, plan_reload

B1 = BackendConfig("b1", url="http://127.0.0.1:1", models=("m1",))
B2 = BackendConfig("b2", url="http://127.0.0.1:2", models=("m2",))
BASE = Config(backends=(B1, B2))


def with_(**kw) -> Config:
    return dataclasses.replace(BASE, **kw)


# (what changes, the backends' plan, the settings applied at once, the settings needing a restart)
CASES = {
    "nothing": (BASE, Changes(kept=("b1", "b2")), (), ()),
    "a backend added": (with_(backends=(B1, B2, dataclasses.replace(B2, name="b3"))),
                        Changes(added=("b3",), kept=("b1", "b2")), (), ()),
    "a backend removed": (with_(backends=(B2,)), Changes(removed=("b1",), kept=("b2",)), (), ()),
    "a backend replaced": (with_(backends=(dataclasses.replace(B1, max_concurrency=3), B2)),
                           Changes(replaced=("b1",), kept=("b2",)), (), ()),
    "a launch changed": (with_(backends=(dataclasses.replace(B1, url="", launch=("x", "-m", "typo.gguf")), B2)),
                         Changes(replaced=("b1",), kept=("b2",)), (), ()),
    "timeouts": (with_(timeouts=TimeoutConfig(total_s=5.0, connect_s=1.0)), Changes(kept=("b1", "b2")),
                 ("timeouts.connect_s", "timeouts.total_s"), ()),
    "classes": (with_(classes=(ClassConfig("only", 0),)), Changes(kept=("b1", "b2")), ("classes",), ()),
    "scheduler and routing": (with_(scheduler=SchedulerConfig(aging_s=1.0, preemption=False),
                                    routing=RoutingConfig(policy="round_robin")),
                              Changes(kept=("b1", "b2")),
                              ("scheduler.aging_s", "scheduler.preemption", "routing.policy"), ()),
    "limits and the memory budget": (with_(limits=LimitsConfig(image_tokens=1), runtimes=RuntimesConfig(
        drain_timeout_s=1.0)), Changes(kept=("b1", "b2")), ("runtimes.drain_timeout_s", "limits.image_tokens"), ()),
    "auth: live but its database": (with_(auth=AuthConfig(required=True, db="/elsewhere.db")),
                                    Changes(kept=("b1", "b2")), ("auth.required",), ("auth.db",)),
    "admin: key live, listener at restart": (with_(admin=AdminConfig(key="k2", port=9999)),
                                             Changes(kept=("b1", "b2")), ("admin.key",), ("admin.port",)),
    "server: CORS live, the address at restart": (
        with_(server=ServerConfig(port=9000, host="0.0.0.0", cors_origins=("https://a",), state_dir="/s")),
        Changes(kept=("b1", "b2")), ("server.cors_origins",), ("server.host", "server.port", "server.state_dir")),
    "sections read at start-up": (
        with_(store=StoreConfig(url="postgresql://x"), tracing=TracingConfig(enabled=True),
              metrics=MetricsConfig(window_s=5.0), batches=BatchesConfig(max_lines=3)),
        Changes(kept=("b1", "b2")), (), ("metrics.window_s", "batches.max_lines", "tracing.enabled", "store.url")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan(case):
    new, backends, live, restart = CASES[case]
    plan = plan_reload(BASE, new)
    assert plan.backends == backends
    assert plan.live == live
    assert plan.restart == restart


def test_models_of_the_catalogue_and_routes_are_planned_too():
    old = with_(models=(ModelConfig("chat", served_name="m1"), ModelConfig("gone", served_name="m2")),
                backends=(dataclasses.replace(B1, extra_routes=("/v1/x",)), B2))
    new = with_(models=(ModelConfig("chat", served_name="m1", aliases=("gpt-*",)),),
                backends=(B1, dataclasses.replace(B2, extra_routes=("/v1/y",))))
    plan = plan_reload(old, new)
    # m2 is no longer covered by an entry: its bare id becomes a public name
    assert plan.models == Changes(added=("m2",), removed=("gone",), replaced=("chat",))
    assert plan.routes == Changes(added=("/v1/y",), removed=("/v1/x",))
    assert plan.backends == Changes(replaced=("b1", "b2"))
    assert plan.starts == ("b1", "b2") and plan.drains == ("b1", "b2")


def test_the_answer_names_the_backends_as_before_and_the_whole_plan():
    plan = plan_reload(BASE, with_(backends=(dataclasses.replace(B1, max_concurrency=3),),
                                   server=ServerConfig(port=1234)))
    out = plan.as_dict()
    assert (out["added"], out["removed"], out["unchanged"]) == (["b1"], ["b2", "b1"], [])
    assert out["backends"]["replaced"] == ["b1"] and out["backends"]["removed"] == ["b2"]
    assert out["needs_restart"] == ["server.port"] and out["applied"] == []
    assert "NOT applied until a restart: server.port" in plan.summary()
    assert plan_reload(BASE, BASE).summary() == "nothing changed"


def test_effective_keeps_what_needs_a_restart_at_its_running_value():
    new = with_(server=ServerConfig(port=9000, cors_origins=("https://a",)), admin=AdminConfig(key="k2", port=1),
                metrics=MetricsConfig(enabled=False), timeouts=TimeoutConfig(total_s=5.0))
    running = effective(BASE, new)
    assert running.server.port == BASE.server.port and running.server.cors_origins == ("https://a",)
    assert running.admin.key == "k2" and running.admin.port == BASE.admin.port
    assert running.metrics == BASE.metrics and running.timeouts.total_s == 5.0
    # the next reload of the same file still names the change that waits for a restart
    assert plan_reload(running, new).restart == ("server.port", "admin.port", "metrics.enabled")
    assert plan_reload(running, new).live == ()
