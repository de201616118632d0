"""Every setting a reload calls live reaches the part that runs with it.

The fields come from runtimes/reload_plan.py itself: each field of the configuration is changed
alone, and those ``plan_reload`` files under ``live`` are the parameters. Each needs a check here
(a value to change it to, and where its running part keeps it), so a new live field without one
fails. The check: after a reload the running part's state changed, and is the state a fresh start
with the new value has (start-up and reload take the same path, service.configure).

The regression behind it: ``[routing] max_session_in_flight``, ``[scheduler] tenant_queue_share``
and the preemption policy were reported "applied" and never reached the session gate, the
scheduler's admission and the preemptor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from passerelle.batches.parts import batch_class
from passerelle.cli import build_app
from passerelle.config import (
    DEFAULT_CLASSES,
    AuthConfig,
    BackendConfig,
    ClassConfig,
    Config,
    ModelConfig,
    RoutingConfig,
    SchedulerConfig,
    ServerConfig,
)
from passerelle.runtimes.reload_plan import plan_reload
from passerelle.scheduling.job import JobState
from passerelle.scheduling.scheduler import Scheduler
from passerelle.server.service import Service
from tests.unit.test_preemption import POLICY, job, running_batch
from tests.unit.test_scheduler import Clock, FakeBackend

Probe = Callable[[Service], Any]


def _other(value: Any) -> Any:
    """Some value unlike ``value`` (only to find out how plan_reload files a field)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        return (*value, "x")
    raise AssertionError(f"no other value for {value!r}")


def live_fields() -> list[str]:
    """Every ``section.key`` (or whole field, ``classes``) that plan_reload calls live."""
    base, out = Config(), []
    for f in dataclasses.fields(Config):
        value = getattr(base, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                changed = dataclasses.replace(base, **{f.name: dataclasses.replace(
                    value, **{g.name: _other(getattr(value, g.name))})})  # type: ignore[type-var]
                out += plan_reload(base, changed).live
        elif isinstance(value, tuple) and value:  # (classes; backends and models, empty, are the fleet's)
            out += plan_reload(base, dataclasses.replace(base, **{f.name: value[:-1]})).live
        elif not isinstance(value, tuple) and f.name != "source":
            out += plan_reload(base, dataclasses.replace(base, **{f.name: _other(value)})).live
    return out


def _gw(section: str, key: str) -> Probe:
    """What the gateway reads per request (its configuration, set by Gateway.configure)."""
    return lambda s: getattr(getattr(s.gateway.cfg, section), key)


def _timeout(key: str) -> Probe:
    """A timeout, as the gateway's deadline and every backend read it."""
    return lambda s: (getattr(s.gateway.cfg.timeouts, key), [getattr(b.timeouts, key) for b in s.registry.backends])


BULK = (ClassConfig("interactive", 0), ClassConfig("standard", 1), ClassConfig("bulk", 2, preemptible=True))

# field -> (its new value, where the running part keeps it)
CHECKS: dict[str, tuple[Any, Probe]] = {
    "server.max_body_bytes": (1000, _gw("server", "max_body_bytes")),
    "server.max_body_bytes_total": (5000, lambda s: s.body_budget.limit),
    "server.shutdown_grace_s": (3.0, lambda s: s.cfg.server.shutdown_grace_s),  # (begin_shutdown reads it)
    "server.cors_origins": (("https://app.example",), lambda s: sorted(s.cors)),
    "server.body_timeout_s": (7.0, lambda s: (s.body_budget.timeout_s, s.admin_login.budget.timeout_s)),
    "server.max_upload_bytes": (1000, _gw("server", "max_upload_bytes")),
    "server.trusted_proxies": (("10.0.0.0/8",), lambda s: [str(n) for n in s.forwarded.networks]),
    "timeouts.connect_s": (2.0, _timeout("connect_s")),
    "timeouts.first_token_s": (9.0, _timeout("first_token_s")),
    "timeouts.between_tokens_s": (8.0, _timeout("between_tokens_s")),
    "timeouts.total_s": (33.0, lambda s: (_timeout("total_s")(s), s.keys.cfg.timeouts.total_s)),
    "timeouts.client_write_s": (4.0, _gw("timeouts", "client_write_s")),
    "admin.allow": (("10.0.0.0/8",), lambda s: [str(n) for n in s.admin_guard.key_check.networks]),
    "admin.key": ("7f3a9c1e5b2d8046ae19c3f7", lambda s: (s.admin_guard.key, s.keys_api.admin.key, s.batches.admin.key)),
    "admin.hosts": (("gpu.example.org",), lambda s: sorted(s.admin_guard.named)),
    "auth.required": (True, lambda s: s.keys.cfg.auth.required),
    "auth.anonymous_priority": ("interactive", _gw("auth", "anonymous_priority")),
    "auth.anonymous_max_priority": ("interactive", _gw("auth", "anonymous_max_priority")),
    "auth.failed_attempts_per_minute": (3, lambda s: s.keys.throttle.per_minute),
    "auth.max_user_chars": (10, _gw("auth", "max_user_chars")),
    "auth.usage_refused_retention_days": (1.0, lambda s: s.stores.usage.refused_retention_s),  # type: ignore[attr-defined]
    "auth.usage_max_rows": (100, lambda s: s.stores.usage.max_rows),  # type: ignore[attr-defined]
    "auth.forwarded_user_header": ("x-user", _gw("auth", "forwarded_user_header")),
    "auth.forwarded_chat_header": ("x-chat", _gw("auth", "forwarded_chat_header")),
    "auth.forwarded_name_header": ("x-name", _gw("auth", "forwarded_name_header")),
    "auth.forwarded_email_header": ("x-email", _gw("auth", "forwarded_email_header")),
    "auth.forwarded_user_jwt_header": ("x-jwt", _gw("auth", "forwarded_user_jwt_header")),
    "auth.forwarded_user_jwt_secret": ("another-secret", _gw("auth", "forwarded_user_jwt_secret")),
    "auth.forwarded_task_header": ("x-task", _gw("auth", "forwarded_task_header")),
    "auth.task_priority": ("interactive", _gw("auth", "task_priority")),
    "auth.task_max_tokens": (64, _gw("auth", "task_max_tokens")),
    "scheduler.aging_s": (7.0, lambda s: s.scheduler.aging_s),
    "scheduler.hold_s": (0.0, lambda s: s.scheduler.hold_s),
    "scheduler.prefill_defer_s": (3.0, lambda s: s.scheduler.prefill_defer_s),
    "scheduler.max_tenants": (5, lambda s: s.scheduler.max_tenants),
    "scheduler.tenant_queue_share": (0.25, lambda s: s.scheduler.tenant_queue_share),
    "scheduler.preemption": (False, lambda s: (s.scheduler.preemption, s.scheduler.preemptor is not None)),
    "scheduler.preempt_after_ms": (500.0, lambda s: s.scheduler.preemptor.policy.after_s),  # type: ignore[union-attr]
    "scheduler.min_run_s": (9.0, lambda s: s.scheduler.preemptor.policy.min_run_s),  # type: ignore[union-attr]
    "routing.policy": ("round_robin", lambda s: s.scheduler.policy),
    "routing.prefix_affinity": (False, _gw("routing", "prefix_affinity")),
    "routing.affinity_slack": (0.25, lambda s: s.scheduler.affinity_slack),
    "routing.session_header": ("x-conversation", _gw("routing", "session_header")),
    "routing.session_headers": (("x-agent-session",), _gw("routing", "session_headers")),
    "routing.session_fields": (("user",), _gw("routing", "session_fields")),
    "routing.max_session_in_flight": (1, lambda s: s.gateway.sessions.max_in_flight),
    "routing.affinity_max_bytes": (2000, lambda s: s.scheduler.affinity_max_entries),
    "sessions.keep_kv": (False, lambda s: s.scheduler.sessions.on),
    "sessions.hold_percentile": (50.0, lambda s: s.scheduler.sessions.gaps.percentile),
    "sessions.hold_max_s": (7.0, lambda s: s.scheduler.sessions.gaps.max_s),
    "sessions.hold_default_s": (2.0, lambda s: s.scheduler.sessions.gaps.default_s),
    "sessions.save_timeout_s": (3.0, lambda s: s.scheduler.sessions.save_timeout_s),
    "sessions.restore_timeout_s": (4.0, lambda s: s.scheduler.sessions.restore_timeout_s),
    "sessions.max_saved_bytes": (1000, lambda s: s.scheduler.sessions.store.max_bytes),
    "sessions.max_saved_files": (3, lambda s: s.scheduler.sessions.store.max_files),
    "sessions.max_sessions": (5, lambda s: (s.scheduler.sessions.gaps.max_sessions,
                                            s.scheduler.sessions.store.max_files)),
    "runtimes.max_loaded_gib": (12.0, lambda s: s.supervisor.max_loaded_gib),
    "runtimes.max_loaded": ("50%", lambda s: s.supervisor.max_loaded_gib),
    "runtimes.memory": ("ram", lambda s: s.supervisor.memory_kind),
    "runtimes.min_resident_s": (5.0, lambda s: s.swapper.cfg.min_resident_s),
    "runtimes.drain_timeout_s": (5.0, lambda s: s.swapper.cfg.drain_timeout_s),
    "runtimes.swap_policy": ("naive", lambda s: s.swapper.cfg.swap_policy),
    "limits.max_answer_bytes": (1000, _gw("limits", "max_answer_bytes")),
    "limits.max_answer_bytes_total": (5000, lambda s: s.gateway.answers.limit),
    "limits.max_error_bytes": (1000, _gw("limits", "max_error_bytes")),
    "limits.max_event_bytes": (1000, _gw("limits", "max_event_bytes")),
    "limits.image_tokens": (5, lambda s: s.keys.media_costs("m").image_tokens),
    "limits.audio_tokens": (5, lambda s: s.keys.media_costs("m").audio_tokens),
    "classes": (BULK, lambda s: (sorted(s.scheduler.classes), sorted(s.gateway.classes), s.key_manager.classes,
                                 batch_class(s), s.live.classes)),
}

LIVE = live_fields()


def _with(cfg: Config, field: str, value: Any) -> Config:
    section, _, key = field.partition(".")
    if not key:
        return dataclasses.replace(cfg, **{section: value})
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})


def _base(tmp_path: Path) -> Config:
    return Config(backends=(BackendConfig("b", kind="openai", url="http://127.0.0.1:9", models=("m",),
                                          max_concurrency=2),),
                  server=ServerConfig(state_dir=str(tmp_path / "state")), auth=AuthConfig(db=str(tmp_path / "k.db")))


def test_the_live_fields_are_found_and_each_has_a_check():
    assert {"routing.max_session_in_flight", "scheduler.tenant_queue_share", "scheduler.preemption",
            "classes", "admin.key", "timeouts.total_s"} <= set(LIVE)
    assert not {"server.port", "store.url", "batches.max_lines", "metrics.enabled"} & set(LIVE)  # (restart)
    assert set(LIVE) <= set(CHECKS), f"live fields without a check here: {sorted(set(LIVE) - set(CHECKS))}"


@pytest.mark.parametrize("field", LIVE)
async def test_a_reload_changes_the_running_part_as_a_fresh_start_would(field, tmp_path):
    assert field in CHECKS, f"{field} applies live (runtimes/reload_plan.py) but has no check in CHECKS"
    value, probe = CHECKS[field]
    old = _base(tmp_path)
    new = _with(old, field, value)
    running, fresh = build_app(old, lambda: new).service, build_app(new).service
    try:
        before = probe(running)
        out = await running.reload()
        assert field in out["applied"] and not out["needs_restart"]
        assert probe(running) != before, f"{field}: reported applied, the running part did not change"
        assert probe(running) == probe(fresh), f"{field}: a reload and a start with it disagree"
    finally:
        await running.stop()
        await fresh.stop()


async def test_the_admin_key_and_the_body_deadline_are_held_once(tmp_path):
    # A setting copied onto a plain attribute needs a second assignment in configure, and drifts the
    # day one is forgotten: the admin guard, the login form, the key API and the Batch API read the
    # one key check; the login form reads the body budget's deadline.
    service = build_app(_base(tmp_path)).service
    try:
        check = service.admin_guard.key_check
        assert service.keys_api.admin is check and service.batches.admin is check
        assert service.admin_login.guard is service.admin_guard and service.admin_login.budget is service.body_budget
        check.configure(dataclasses.replace(service.cfg.admin, key="7f3a9c1e5b2d8046ae19c3f7"))
        assert service.keys_api.admin.enabled  # (no second copy left behind with the old key)
    finally:
        await service.stop()


async def test_start_up_and_a_reload_take_the_same_path(tmp_path, monkeypatch):
    calls: list[Config] = []
    real = Service.configure

    def configure(self: Service, cfg: Config) -> None:
        calls.append(cfg)
        real(self, cfg)

    monkeypatch.setattr(Service, "configure", configure)
    old = _base(tmp_path)
    new = _with(old, "routing.max_session_in_flight", 1)
    service = build_app(old, lambda: new).service
    try:
        assert [c.routing for c in calls] == [old.routing]  # start-up: Service.configure, once
        await service.reload()
        assert [c.routing for c in calls] == [old.routing, new.routing] and service.cfg is calls[-1]
    finally:
        await service.stop()


# -- the scheduler's preemptor, rebuilt by configure: what it does to streams in flight -----------
OFF = SchedulerConfig(hold_s=0, preemption=False)
ON = dataclasses.replace(OFF, preemption=True, preempt_after_ms=POLICY.after_s * 1000, min_run_s=POLICY.min_run_s)


def _scheduler(clock: Clock, cfg: SchedulerConfig) -> Scheduler:
    return Scheduler(cfg, RoutingConfig(), DEFAULT_CLASSES, clock=clock)


async def test_preemption_turned_on_by_configure_preempts():
    clock, b = Clock(), FakeBackend(capacity=1)
    s = _scheduler(clock, OFF)
    assert s.preemptor is None
    s.configure(ON, RoutingConfig(), DEFAULT_CLASSES)
    ((bulk, stream),) = running_batch(s, b, 1, clock)
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.06
    assert s.preemptor is not None
    s.preemptor.check()
    assert stream.calls == 1 and chat.backend is b and bulk.state is JobState.SUSPENDED
    assert s.preempt_counts.suspensions == 1


async def test_a_new_policy_takes_over_the_streams_that_may_be_cut():
    clock, b = Clock(), FakeBackend(capacity=1)
    s = _scheduler(clock, ON)
    ((_bulk, stream),) = running_batch(s, b, 1, clock)
    old = s.preemptor
    s.configure(dataclasses.replace(ON, preempt_after_ms=500.0), RoutingConfig(), DEFAULT_CLASSES)
    assert s.preemptor is not old and s.preemptor is not None and s.preemptor.policy.after_s == 0.5
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.01
    old.check()
    assert stream.calls == 0  # the old preemptor no longer acts
    s.preemptor.check()  # (a stream not about to end is cut at once, whatever preempt_after_ms)
    assert stream.calls == 1 and chat.backend is b  # a stream allowed before the change, cut by the new preemptor


async def test_preemption_turned_off_lets_a_suspended_stream_resume_and_cuts_no_more():
    clock, b = Clock(), FakeBackend(capacity=1)
    s = _scheduler(clock, ON)
    ((bulk, stream),) = running_batch(s, b, 1, clock)
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.06
    assert s.preemptor is not None
    s.preemptor.check()
    assert bulk.state is JobState.SUSPENDED
    s.configure(OFF, RoutingConfig(), DEFAULT_CLASSES)
    assert s.preemptor is None and s.preemption is None
    s.release(chat)
    assert bulk.backend is b and bulk.state is JobState.RUNNING  # resumed
    assert (s.preempt_counts.suspensions, s.preempt_counts.resumes) == (1, 1)
    s.allow_suspend(bulk, stream)  # (nothing to allow it to any more)
    other = job([b], "interactive")
    s.submit(other)
    clock.now += 5
    s.expire_due()
    assert stream.calls == 1 and other.backend is None


async def test_a_models_tool_calls_setting_applies_at_a_reload(tmp_path):
    """``[[models]] tool_calls`` is the catalogue's (a models change, carried out by the catalogue at
    once): after a reload the next request's route has the new format, as a fresh start gives it."""
    old = dataclasses.replace(_base(tmp_path), models=(ModelConfig("m"),))
    new = dataclasses.replace(old, models=(ModelConfig("m", tool_calls="hermes"),))
    running, fresh = build_app(old, lambda: new).service, build_app(new).service

    def route_of(s: Service) -> str:
        return s.catalogue.resolve("m", "chat", {"model": "m", "messages": []}, b"{}").entry.tool_calls

    try:
        assert route_of(running) == "off"
        out = await running.reload()
        assert out["models"]["replaced"] == ["m"] and not out["needs_restart"]
        assert route_of(running) == route_of(fresh) == "hermes"
    finally:
        await running.stop()
        await fresh.stop()
