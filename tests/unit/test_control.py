"""Runtime control routes (server/control.py): data out, GatewayErrors for what cannot be done."""

from __future__ import annotations

import orjson
import pytest

from passerelle.config import BackendConfig, RuntimesConfig, TimeoutConfig
from passerelle.errors import InvalidRequest
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.supervisor import RuntimeProcess, Supervisor
from passerelle.server import control
from passerelle.server.routes import NotFound


def supervisor(tmp_path) -> Supervisor:
    backend = make_backend(BackendConfig(name="r1", models=("m",), launch=("true", "{port}")), TimeoutConfig())
    proc = RuntimeProcess(backend, ("true", "{port}"), log_path=tmp_path / "r1.log")
    (tmp_path / "r1.log").write_text("".join(f"line {i}\n" for i in range(50)))
    return Supervisor([proc], RuntimesConfig())


def test_runtimes_lists_every_launched_runtime(tmp_path):
    rows = control.runtimes(supervisor(tmp_path))["runtimes"]
    assert [(r["name"], r["state"], r["pid"]) for r in rows] == [("r1", "stopped", None)]
    assert control.runtimes(None) == {"runtimes": [], "budget": {}, "swaps": {}}


async def test_log_tail_is_bounded_and_checked(tmp_path):
    sup = supervisor(tmp_path)
    out = await control.runtime_action(sup, "/admin/runtimes/r1/logs", "GET", b"lines=3")
    assert out == "line 47\nline 48\nline 49\n"
    with pytest.raises(InvalidRequest, match="whole number"):
        await control.runtime_action(sup, "/admin/runtimes/r1/logs", "GET", b"lines=many")


@pytest.mark.parametrize(("path", "method", "error"), [
    ("/admin/runtimes/nope/start", "POST", NotFound),
    ("/admin/runtimes/r1", "POST", NotFound),
    ("/admin/runtimes/r1/explode", "POST", InvalidRequest),
    ("/admin/runtimes/r1/start", "GET", InvalidRequest),
])
async def test_unknown_runtimes_and_actions_are_refused(tmp_path, path, method, error):
    with pytest.raises(error):
        await control.runtime_action(supervisor(tmp_path), path, method, b"")


def test_runtime_list_shows_every_backend_and_where_its_capacity_came_from(tmp_path):
    sup = supervisor(tmp_path)
    external = make_backend(BackendConfig(name="box2", kind="vllm", url="http://192.0.2.10:8000", models=("m",),
                                          max_concurrency=32), TimeoutConfig())
    learned = make_backend(BackendConfig(name="any", url="http://192.0.2.11:8000", models=("m",)), TimeoutConfig())
    body = control.runtimes(sup, [sup.get("r1").backend, external, learned])
    rows = {r["name"]: r for r in body["runtimes"]}
    assert [r["name"] for r in body["runtimes"]] == ["r1", "box2", "any"]  # the launched one once
    assert (rows["box2"]["state"], rows["box2"]["capacity"], rows["box2"]["capacity_source"]) == \
        ("external", 32, "declared")
    assert (rows["any"]["capacity"], rows["any"]["capacity_source"]) == (256, "learned")
    text = control.render(orjson.dumps(body))
    assert "box2: 32 (declared: max_concurrency)" in text
    assert "any: 256 (learned: not lowered yet; lowered when the runtime queues)" in text
    line = next(x for x in text.splitlines() if x.startswith("box2"))
    assert "external" in line and " 32 declared" in line
