"""The supervisor's state machine against real child processes (the fake runtime, `sleep`): every
transition it makes is an allowed one, a stop during a start leaves no process behind, and a reload
that changes a launched backend under the same name stops the old process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest

from passerelle.cli import build_app
from passerelle.config import BackendConfig, Config, RuntimesConfig, TimeoutConfig
from passerelle.runtimes.factory import build_runtime
from passerelle.runtimes.supervisor import _ALLOWED, ProcState, RuntimeFailed, RuntimeProcess, Supervisor
from tests.waiting import until

FAKE = (sys.executable, "-m", "passerelle", "fake-backend", "--port", "{port}", "--ttft-ms", "1", "--itl-ms", "1")
S = ProcState


def runtime(tmp_path, name="r", launch=FAKE, **kw) -> RuntimeProcess:
    bc = BackendConfig(name=name, kind="openai", launch=launch, models=("fake-model",),
                       log_file=str(tmp_path / f"{name}.log"), ready_timeout_s=60)
    _, proc = build_runtime(bc, TimeoutConfig())
    assert proc is not None
    for k, v in kw.items():
        setattr(proc, k, v)
    return proc


def track(proc: RuntimeProcess) -> list[tuple[S, S]]:
    """Every transition the process makes, checked against the table as it happens."""
    seen: list[tuple[S, S]] = []
    real = proc._set

    def spy(state: S) -> None:
        before = proc.state
        real(state)
        if state is not before:
            assert state in _ALLOWED[before]
            seen.append((before, state))

    proc._set = spy  # type: ignore[method-assign]
    return seen


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped counts as gone: it holds no memory and no port
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] == "Z"


async def test_start_ready_stop_stopping_stopped(tmp_path):
    proc = runtime(tmp_path)
    seen = track(proc)
    await proc.start()
    assert proc.state is S.READY and proc.backend.stats.up
    pid = proc.pid
    await proc.stop()
    assert seen == [(S.STOPPED, S.STARTING), (S.STARTING, S.READY), (S.READY, S.STOPPING), (S.STOPPING, S.STOPPED)]
    assert gone(pid) and not proc.backend.stats.up
    await proc.stop()  # a second stop is a no-op
    assert proc.state is S.STOPPED
    await proc.backend.close()


def test_an_illegal_transition_raises(tmp_path):
    proc = runtime(tmp_path)
    with pytest.raises(RuntimeError, match="illegal transition STOPPED -> READY"):
        proc._set(S.READY)
    assert "DRAINING" not in S.__members__  # stopping is STOPPING; draining is a reload's word


async def test_a_stop_during_a_start_leaves_no_process(tmp_path):
    proc = runtime(tmp_path, launch=("sleep", "30", "{port}"))  # never answers /v1/models
    seen = track(proc)
    starting = asyncio.create_task(proc.start())
    await until(lambda: proc.pid is not None, 20, "the runtime's process spawned")
    pid = proc.pid
    await proc.stop(grace=2)
    with pytest.raises(RuntimeFailed, match="stopped while starting"):
        await starting
    assert proc.state is S.STOPPED and gone(pid)
    assert seen == [(S.STOPPED, S.STARTING), (S.STARTING, S.STOPPING), (S.STOPPING, S.STOPPED)]
    await proc.backend.close()


async def test_a_crash_is_failed_then_restarted_to_ready(tmp_path):
    proc = runtime(tmp_path)
    seen = track(proc)
    await proc.start()
    first = proc.pid
    os.kill(first, 9)
    await until(lambda: proc.restarts == 1 and proc.state is S.READY, 30, "the killed runtime restarted and ready")
    assert proc.pid != first
    assert seen[2:] == [(S.READY, S.FAILED), (S.FAILED, S.STARTING), (S.STARTING, S.READY)]
    await proc.stop()
    await proc.backend.close()


async def test_a_start_while_a_stop_runs_waits_for_it(tmp_path):
    proc = runtime(tmp_path)
    track(proc)
    await proc.start()
    stopping = asyncio.create_task(proc.stop())
    await asyncio.sleep(0)
    await proc.start()  # must not go STOPPING -> STARTING
    await stopping
    assert proc.state is S.READY
    await proc.stop()
    await proc.backend.close()


async def test_a_reload_that_changes_a_launched_backend_stops_the_old_process(tmp_path):
    # The regression: the new process took the old one's place in the supervisor, so the old one
    # was never stopped (it kept its memory and port, and was restarted after a crash).
    bc = BackendConfig(name="r", kind="openai", launch=FAKE, models=("fake-model",), max_concurrency=2,
                       log_file=str(tmp_path / "r.log"), ready_timeout_s=60)
    configs = [Config(backends=(bc,))]
    app = build_app(configs[0], loader=lambda: configs[-1])
    await app.startup()
    try:
        old = app.supervisor.get("r")
        assert old is not None and old.state is S.READY
        old_pid = old.pid
        configs.append(Config(backends=(dataclasses.replace(bc, max_concurrency=3),)))
        out = await app.reload()
        assert out["added"] == ["r"] and out["removed"] == ["r"]
        new = app.supervisor.get("r")
        assert new is not None and new is not old
        await until(lambda: old.state is S.STOPPED and gone(old_pid) and new.state is S.READY, 60,
                    "the old runtime stopped and gone, the new one ready")
        assert not app.supervisor.retiring and app.supervisor.get("r") is new
        assert [b.capacity for b in app.registry.backends] == [3]
    finally:
        await app.shutdown()
    assert new.state is S.STOPPED


async def test_shutdown_stops_a_process_still_draining_after_a_reload(tmp_path):
    proc = runtime(tmp_path)
    sup = Supervisor([proc], RuntimesConfig())
    await sup.start_all()
    proc.backend.in_flight = 1  # a request still running: the retire waits
    sup.retiring.add(proc)
    del sup.processes["r"]
    await sup.stop_all()
    assert proc.state is S.STOPPED
    await proc.backend.close()
