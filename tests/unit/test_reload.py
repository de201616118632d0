"""A reload carried out: a configuration that cannot serve is refused and the running one stays, a
replacement runtime is ready before the one it replaces stops, every live setting applies at once
(the admin key among them: the old one stops working), and every drain has a deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import sys

import pytest

from passerelle.config import (
    AdminConfig,
    AuthConfig,
    BackendConfig,
    ClassConfig,
    Config,
    LimitsConfig,
    SchedulerConfig,
    ServerConfig,
    TimeoutConfig,
)
from passerelle.runtimes.fleet import drain
from passerelle.runtimes.supervisor import ProcState
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

FAKE = (sys.executable, "-m", "passerelle", "fake-backend", "--port", "{port}", "--ttft-ms", "1", "--itl-ms", "1")
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


def launched(tmp_path, **changes) -> BackendConfig:
    return BackendConfig(name="r", kind="openai", launch=FAKE, models=("fake-model",), max_concurrency=2,
                         log_file=str(tmp_path / "r.log"), ready_timeout_s=60, **changes)


async def test_a_reload_to_a_runtime_that_cannot_start_is_refused_and_the_running_one_stays(tmp_path, caplog):
    # The regression: a misspelt model path stopped the working runtime at once, left the failed one
    # in its place, and logged "Task exception was never retrieved".
    caplog.set_level(logging.INFO)
    bc = launched(tmp_path)
    async with gateway(bc, db=tmp_path / "k.db") as gw:
        old = gw.app.supervisor.get("r")
        assert old is not None and old.state is ProcState.READY
        pid, before = old.pid, list(gw.app.registry.backends)
        # (an unknown flag: the runtime exits at once, as llama-server does on a model file it cannot open)
        gw.app.loader = lambda: Config(backends=(dataclasses.replace(bc, launch=(*FAKE, "--no-such-flag")),))
        tasks_before = asyncio.all_tasks()
        resp = await gw.request("POST", "/admin/reload")
        assert resp.status == 409 and resp.json()["error"]["code"] == "reload_refused"
        message = resp.json()["error"]["message"]
        assert "the running configuration stays" in message and "runtime r did not start" in message
        assert "exited with code" in message
        assert gw.app.supervisor.get("r") is old and old.state is ProcState.READY and old.pid == pid
        assert gw.app.registry.backends == before and not before[0].draining
        assert not gw.app.supervisor.retiring
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200
        # the failed start's tasks have ended; one whose exception nobody took logs it when collected
        await until(lambda: not asyncio.all_tasks() - tasks_before, what="the tasks of the failed start ended")
        gc.collect()
    assert "Task exception was never retrieved" not in caplog.text
    assert "configuration not reloaded, a new runtime failed to start" in caplog.text


async def test_a_replacement_runtime_is_ready_before_the_one_it_replaces_stops(tmp_path):
    bc = launched(tmp_path)
    async with gateway(bc, db=tmp_path / "k.db") as gw:
        old = gw.app.supervisor.get("r")
        assert old is not None
        stops: list[tuple[ProcState, ProcState]] = []
        real = old.stop

        async def stop(grace: float = 10.0) -> None:
            new = gw.app.supervisor.get("r")
            assert new is not None and new is not old
            stops.append((new.state, old.state))  # what ran when the old one was asked to stop
            await real(grace)

        old.stop = stop  # type: ignore[method-assign]
        gw.app.loader = lambda: Config(backends=(dataclasses.replace(bc, max_concurrency=3),))
        out = await gw.app.reload()
        assert out["backends"]["replaced"] == ["r"] and out["added"] == ["r"] and out["removed"] == ["r"]
        new = gw.app.supervisor.get("r")
        assert new is not None and new.state is ProcState.READY  # started and ready within the reload
        await until(lambda: old.state is ProcState.STOPPED, 30, "the replaced runtime stopped")
        assert stops == [(ProcState.READY, ProcState.READY)]
        assert [b.capacity for b in gw.app.registry.backends] == [3]
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200


async def test_every_live_setting_applies_at_once_and_the_rest_are_named(tmp_path):
    async with fake_runtime() as fake, gateway(fake.backend_config(), admin=AdminConfig(key="old-key"),
                                               db=tmp_path / "k.db") as gw:
        app = gw.app
        old_key = {"authorization": "Bearer old-key"}
        assert (await gw.get("/admin/stats", headers=old_key)).status == 200
        port = app.cfg.server.port
        new = Config(
            backends=(fake.backend_config(),), admin=AdminConfig(key="new-key"),
            server=ServerConfig(port=port + 1, cors_origins=("https://app.example",), max_body_bytes=50),
            timeouts=TimeoutConfig(total_s=33.0, connect_s=2.0),
            classes=(ClassConfig("interactive", 0), ClassConfig("standard", 1), ClassConfig("bulk", 2)),
            scheduler=SchedulerConfig(aging_s=7.0, preemption=False), limits=LimitsConfig(max_answer_bytes_total=123),
            auth=AuthConfig(failed_attempts_per_minute=3, db=str(tmp_path / "k.db")))
        app.loader = lambda: new
        out = (await gw.request("POST", "/admin/reload", headers=old_key)).json()
        assert out["backends"]["kept"] == ["fake"] and out["unchanged"] == ["fake"]
        assert out["needs_restart"] == ["server.port"]
        assert {"admin.key", "server.cors_origins", "server.max_body_bytes", "timeouts.total_s", "classes",
                "scheduler.aging_s", "scheduler.preemption", "limits.max_answer_bytes_total",
                "auth.failed_attempts_per_minute"} <= set(out["applied"])
        # the admin key rotated: the old one no longer opens anything
        assert (await gw.get("/admin/stats", headers=old_key)).status == 401
        assert (await gw.get("/admin/stats", headers={"authorization": "Bearer new-key"})).status == 200
        # CORS, the body cap, the classes
        cors = await gw.post("/v1/chat/completions", CHAT, headers={"origin": "https://app.example"})
        assert cors.status == 413 and cors.headers[b"access-control-allow-origin"] == b"https://app.example"
        big = await gw.post("/v1/chat/completions", CHAT, headers={"x-priority": "bulk"})
        assert big.status == 413  # (the body is over 50 bytes)
        assert set(app.scheduler.classes) == set(app.gateway.classes) == {"interactive", "standard", "bulk"}
        assert app.scheduler.aging_s == 7.0 and app.scheduler.preemption is None
        assert app.gateway.answers.limit == 123 and app.gateway.keys.throttle.per_minute == 3
        assert app.gateway.cfg.timeouts.total_s == 33.0
        assert [b.timeouts.connect_s for b in app.registry.backends] == [2.0]
        assert app.cfg.server.port == port  # what needs a restart keeps its running value
        # and a second reload of the same file still says so, and applies nothing more
        again = (await gw.request("POST", "/admin/reload", headers={"authorization": "Bearer new-key"})).json()
        assert again["needs_restart"] == ["server.port"] and again["applied"] == []


async def test_a_drain_has_a_deadline():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        backend = gw.app.registry.backends[0]
        backend.in_flight = 2  # two requests that never end
        waited, cut = await drain([backend], 0.3)
        assert cut == 2 and 0.3 <= waited < 2
        backend.in_flight = 0
        wake = asyncio.Event()
        assert await drain([backend], 30, wake) == (pytest.approx(0, abs=0.1), 0)
