"""Batch lines only in the idle capacity (passerelle/batches/idle.py), in process against the fake
runtime with 4 slots: a reserve of free slots for an arriving request, none of what other classes
use or wait for, and every idle slot when nothing else runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from passerelle.config import BatchesConfig, load_config
from passerelle.errors import ConfigError
from passerelle.scheduling.scheduler import Job
from tests.inprocess import InProcessGateway, fake_runtime, gateway
from tests.unit.test_batches import create, jsonl, line, settle, upload
from tests.waiting import until

SLOTS = 4  # the fake backend's max_concurrency (tests/inprocess.py)


class Watch:
    """Each time the runner lets batch lines go, its lines in flight then against the rule worked
    out here from the scheduler's own counts; the batch's peak in the scheduler; and for each
    request of another class, whether a slot was free when it came."""

    def __init__(self, gw: InProcessGateway, reserve: int) -> None:
        self.sched, self.reserve = gw.app.scheduler, reserve
        self.gate = gw.app.batches.runner.idle
        (self.backend,) = gw.app.gateway.registry.backends
        self.batch_peak = 0
        self.violations: list[str] = []
        self.others_at_once: list[bool] = []
        submit: Callable[[Job], None] = self.sched.submit
        pump: Callable[[], None] = self.gate.pump

        def watched_submit(job: Job) -> None:
            submit(job)
            if job.cls.name != "batch":
                self.others_at_once.append(job.backend is not None)
            else:
                batch = self.sched.running.get((self.backend.name, "batch"), 0)
                self.batch_peak = max(self.batch_peak, batch + sum(j.cls.name == "batch" for j in self.sched.waiting))

        def watched_pump() -> None:
            before = sum(self.gate._in.values())
            pump()
            if sum(self.gate._in.values()) > before:
                self._check()

        self.sched.submit = watched_submit  # type: ignore[method-assign]
        self.gate.pump = watched_pump  # type: ignore[method-assign]

    def _check(self) -> None:
        sched, mine = self.sched, sum(self.gate._in.values())
        batch = sched.running.get((self.backend.name, "batch"), 0)
        others = self.backend.in_flight - batch
        waiting = sum(1 for j in sched.waiting if j.cls.name != "batch")
        allowed = SLOTS - max(self.reserve, others) - waiting
        if mine > allowed:
            self.violations.append(f"{mine} batch lines with {others} others running, {waiting} waiting")


async def batch_lines_running(gw: InProcessGateway, n: int, timeout: float = 10.0) -> None:
    await until(lambda: sum(len(r.running) for r in gw.app.batches.runner.runs.values()) >= n, timeout,
                "the batch's lines running")


async def interactive(gw: InProcessGateway, tokens: int = 8) -> Any:
    resp = await gw.post("/v1/chat/completions", {"model": "fake-model", "max_tokens": tokens,
                                                  "messages": [{"role": "user", "content": "now"}]})
    assert resp.status == 200, resp.body
    return resp


async def test_batch_lines_leave_the_reserve_and_what_waiting_requests_need(tmp_path):
    rows = [line(f"i{i}", max_tokens=8) for i in range(60)]
    cfg = BatchesConfig(in_flight_per_batch=8, in_flight_per_key=8)  # more than the slots: the gate bounds
    async with fake_runtime(ttft_ms=40, itl_ms=5, slots=SLOTS) as fake, \
            gateway(fake.backend_config(), db=tmp_path / "k.db", batches=cfg) as gw:
        watch = Watch(gw, reserve=1)
        f = (await upload(gw, jsonl(rows))).json()
        b = (await create(gw, f["id"])).json()
        await batch_lines_running(gw, SLOTS - 1)
        # the reserve: a request arriving alone finds a slot free, again and again
        for _ in range(3):
            await interactive(gw)
        assert watch.others_at_once == [True, True, True]
        # more at once than the reserve: the batch backs off while they wait, and grows back after
        await asyncio.gather(*(interactive(gw) for _ in range(SLOTS + 2)))
        done = await settle(gw, b["id"])
        assert done["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        assert watch.violations == []
        assert watch.batch_peak == SLOTS - 1  # capacity - reserve, reached and never passed
        assert gw.app.batches.runner.idle.held_back > 0
        assert gw.app.batches.runner.idle._in == {}  # every line let through was let go


async def test_with_nothing_else_running_the_batch_uses_every_idle_slot(tmp_path):
    rows = [line(f"z{i}") for i in range(30)]
    cfg = BatchesConfig(in_flight_per_batch=8, in_flight_per_key=8, reserve_slots=0)
    async with fake_runtime(ttft_ms=30, slots=SLOTS) as fake, \
            gateway(fake.backend_config(), db=tmp_path / "k.db", batches=cfg) as gw:
        watch = Watch(gw, reserve=0)
        f = (await upload(gw, jsonl(rows))).json()
        done = await settle(gw, (await create(gw, f["id"])).json()["id"])
        assert done["request_counts"]["completed"] == 30
        assert watch.batch_peak == SLOTS and watch.violations == []


async def test_a_one_slot_runtime_still_runs_batch_lines_when_idle(tmp_path):
    rows = [line(f"o{i}") for i in range(5)]
    async with fake_runtime(slots=1) as fake, \
            gateway(fake.backend_config(max_concurrency=1), db=tmp_path / "k.db") as gw:
        f = (await upload(gw, jsonl(rows))).json()
        done = await settle(gw, (await create(gw, f["id"])).json()["id"])
        assert done["request_counts"]["completed"] == 5


async def test_cancel_ends_the_lines_held_back(tmp_path):
    rows = [line(f"h{i}", max_tokens=50) for i in range(20)]
    cfg = BatchesConfig(in_flight_per_batch=8, in_flight_per_key=8, reserve_slots=3)
    async with fake_runtime(ttft_ms=50, itl_ms=20, slots=SLOTS) as fake, \
            gateway(fake.backend_config(), db=tmp_path / "k.db", batches=cfg) as gw:
        f = (await upload(gw, jsonl(rows))).json()
        b = (await create(gw, f["id"])).json()
        await batch_lines_running(gw, 1)  # one line runs (4 slots - 3 kept), seven wait in the gate
        runner = gw.app.batches.runner
        await until(lambda: len(runner.idle._waiters) >= 7, 10)
        assert sum(len(r.running) for r in runner.runs.values()) == 1 and len(runner.idle._waiters) == 7
        await gw.post(f"/v1/batches/{b['id']}/cancel", {})
        done = await settle(gw, b["id"])
        assert done["status"] == "cancelled"
        assert runner.idle._waiters == [] and runner.idle._in == {}


def test_reserve_slots_must_not_be_negative(tmp_path: Path):
    path = tmp_path / "p.toml"
    path.write_text("[batches]\nreserve_slots = -1\n")
    with pytest.raises(ConfigError, match="expected zero or a positive integer") as info:
        load_config(path, env={})
    assert info.value.key == "batches.reserve_slots" and info.value.line == 2
