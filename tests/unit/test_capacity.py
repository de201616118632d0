"""Capacity from the runtime: declared, reported or learned (runtimes/capacity.py, limiter.py).

The learned limit is driven here by a simulated runtime on a simulated clock: N slots served
first come first served, like llama-server's or the fake runtime's, a first token ``ttft`` after
a request gets its slot, one token every ``itl`` after that; 100 closed-loop clients behind a
gateway that sends at most the limit. A minute of that load takes a fraction of a second.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.runtimes.capacity import Capacity
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.limiter import AdaptiveLimit


@dataclass
class SimRuntime:
    """A runtime with ``slots(t)`` sequences at once and a FIFO queue, driven by a gateway that
    keeps ``clients`` streams going and sends at most ``limit.value`` of them."""

    slots: Callable[[float], int]
    limit: AdaptiveLimit = field(default_factory=AdaptiveLimit)
    clients: int = 100
    ttft: float = 0.05
    itl: float = 0.01
    tokens: int = 32
    gauge: bool = False  # the runtime has a waiting gauge, polled every 2 s (else: first tokens)
    seed: int = 7
    in_flight_samples: list[tuple[float, int]] = field(default_factory=list)  # (t, in flight), every 0.1 s
    limits: list[tuple[float, int]] = field(default_factory=list)  # (t, limit), every second

    def run(self, until: float) -> None:
        rng = random.Random(self.seed)
        events: list[tuple[float, int, str, object]] = []
        seq = 0

        def at(t: float, kind: str, data: object = None) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(events, (t, seq, kind, data))

        waiting_here: list[int] = []  # clients queued in the gateway
        queued_there: list[dict] = []  # requests queued in the runtime
        running = in_flight = peak = 0
        now = 0.0

        def start(req: dict) -> None:
            at(now + self.ttft, "first", req)
            at(now + self.ttft + (self.tokens - 1) * self.itl, "end", req)

        def send() -> None:
            nonlocal in_flight, peak, running
            while waiting_here and in_flight < self.limit.value:
                in_flight += 1
                peak = max(peak, in_flight)
                req = {"client": waiting_here.pop(0), "sent": now, "with": in_flight}
                if running < self.slots(now):
                    running += 1
                    start(req)
                else:
                    queued_there.append(req)

        for c in range(self.clients):
            at(rng.random() * 0.01, "arrive", c)
        at(0.1, "sample")
        at(1.0, "second")
        if self.gauge:
            at(2.0, "poll")
        while events:
            now, _, kind, data = heapq.heappop(events)
            if now > until:
                break
            if kind == "arrive":
                waiting_here.append(data)  # type: ignore[arg-type]
                send()
            elif kind == "first" and not self.gauge:
                req = data
                self.limit.observe_ttft(now - req["sent"], req["with"], prompt_tokens=30)  # type: ignore[index]
            elif kind == "end":
                running -= 1
                in_flight -= 1
                while queued_there and running < self.slots(now):
                    running += 1
                    start(queued_there.pop(0))
                at(now, "arrive", data["client"])  # type: ignore[index]
            elif kind == "poll":
                self.limit.observe_gauge(len(queued_there), in_flight, peak)
                peak = in_flight
                at(now + 2.0, "poll")
            elif kind == "sample":
                self.in_flight_samples.append((now, in_flight))
                at(now + 0.1, "sample")
            elif kind == "second":
                self.limits.append((now, self.limit.value))
                at(now + 1.0, "second")

    def mean_in_flight(self, start: float, end: float) -> float:
        xs = [n for t, n in self.in_flight_samples if start <= t < end]
        return sum(xs) / len(xs)

    def limits_between(self, start: float, end: float) -> list[int]:
        out = [v for t, v in self.limits if start <= t < end]
        assert out, "the simulation did not reach that time"
        return out


@pytest.mark.parametrize("gauge", [False, True], ids=["first-token", "waiting-gauge"])
def test_learns_a_capacity_of_48_within_a_minute_and_keeps_it_full(gauge):
    sim = SimRuntime(slots=lambda t: 48, gauge=gauge)
    sim.run(until=60.0)
    assert sim.limit.value < 256 and sim.limit.signal == ("gauge" if gauge else "ttft")
    # over the last half minute: never below capacity for long (the runtime's slots stay full),
    # never more than a few requests queued in the runtime, out of passerelle's sight
    late = sim.limits_between(30, 60)
    assert all(48 <= v <= 56 for v in late), late
    assert sim.mean_in_flight(30, 60) >= 48


@pytest.mark.parametrize("gauge", [False, True], ids=["first-token", "waiting-gauge"])
def test_backs_off_when_the_runtime_starts_queueing_and_raises_again_when_it_stops(gauge):
    # 48 sequences, then only 24 (a runtime short of memory), then 48 again
    sim = SimRuntime(slots=lambda t: 24 if 40 <= t < 80 else 48, gauge=gauge)
    sim.run(until=140.0)
    assert all(v >= 48 for v in sim.limits_between(30, 40))
    assert all(24 <= v <= 30 for v in sim.limits_between(50, 80)), sim.limits_between(40, 80)
    assert all(48 <= v <= 56 for v in sim.limits_between(120, 140)), sim.limits_between(80, 140)


def test_a_runtime_that_never_queues_keeps_the_high_start():
    sim = SimRuntime(slots=lambda t: 1000, clients=64)
    sim.run(until=30.0)
    assert sim.limit.value == 256 and sim.limit.decreases == 0
    assert sim.mean_in_flight(5, 30) == 64


def test_slow_first_tokens_of_long_prompts_are_not_taken_for_queueing():
    limit = AdaptiveLimit(window=8)
    for _ in range(40):  # unloaded: 40 ms for 30-token prompts, 400 ms for 3,000-token prompts
        for prompt, ttft in ((30, 0.04), (3000, 0.4)):
            limit.observe_ttft(ttft, in_flight=limit.value, prompt_tokens=prompt)
    assert limit.decreases == 0


def test_a_waiting_gauge_sets_the_limit_to_what_the_runtime_runs():
    limit = AdaptiveLimit()
    limit.observe_gauge(waiting=3, in_flight=51, peak=51)
    assert (limit.value, limit.signal) == (48, "gauge")
    limit.observe_gauge(waiting=0, in_flight=20, peak=30)  # not kept full: no reason to raise
    assert limit.value == 48
    limit.observe_gauge(waiting=0, in_flight=48, peak=48)
    assert limit.value == 52  # kept full, nothing waited: up a tenth
    limit.observe_gauge(waiting=9, in_flight=4, peak=4)  # others' requests waiting, not ours
    assert limit.value == 52


def test_sources_declared_reported_learned():
    assert Capacity(declared=8).describe() == "8 (declared: max_concurrency)"
    cap = Capacity()
    assert (cap.value, cap.source) == (256, "learned")
    assert cap.describe() == "256 (learned: not lowered yet; lowered when the runtime queues)"
    cap.report(4, "/props total_slots")
    assert (cap.value, cap.source, cap.describe()) == (4, "reported", "4 (reported: /props total_slots)")
    cap.limiter.observe_gauge(waiting=1, in_flight=4, peak=4)  # a runtime that runs fewer than it says
    assert (cap.value, cap.source) == (3, "learned")
    assert cap.describe() == "3 (learned: from the runtime's waiting gauge; reported 4)"
    assert Capacity(declared=8).as_dict()["capacity_source"] == "declared"


async def serve(routes: dict[str, tuple[int, str]]):
    app = web.Application()
    for path, (status, text) in routes.items():
        async def handler(_req, status=status, text=text):
            return web.Response(status=status, text=text)
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


VLLM_INFO = '{"vllm_config": {"scheduler_config": {"max_num_seqs": 64}, "parallel_config": {"data_parallel_size": 2}}}'


@pytest.mark.parametrize(("kind", "routes", "want"), [
    ("llama-server", {"/health": (200, "{}"), "/props": (200, '{"build_info": "b1", "total_slots": 6}')},
     (6, "reported", "6 (reported: /props total_slots)")),
    ("llama-server", {"/health": (200, "{}"), "/props": (404, ""), "/slots": (200, '[{"id":0},{"id":1}]')},
     (2, "reported", "2 (reported: /slots)")),
    ("vllm", {"/health": (200, ""), "/server_info": (200, VLLM_INFO)},
     (128, "reported", "128 (reported: /server_info max_num_seqs)")),
    ("vllm", {"/health": (200, "")}, (256, "learned", None)),  # not in development mode: learned
    ("sglang", {"/health": (200, ""), "/get_server_info": (200, '{"max_running_requests": 48}')},
     (48, "reported", "48 (reported: /get_server_info max_running_requests)")),
    ("ollama", {"/api/version": (200, '{"version": "0.9"}'), "/api/ps": (200, '{"models": []}')},
     (256, "learned", None)),
    ("openai", {"/v1/models": (200, '{"data": []}')}, (256, "learned", None)),
])
async def test_each_kind_reports_its_size_or_leaves_it_to_be_learned(kind, routes, want):
    runner, url = await serve(routes)
    b = make_backend(BackendConfig(name="b", kind=kind, url=url, models=("m",)), TimeoutConfig())
    await b.start()
    try:
        s = await b.scrape()
        assert s.up and not s.error
        value, source, detail = want
        assert (b.capacity, b.capacity_info.source) == (value, source)
        if detail:
            assert b.capacity_info.describe() == detail
        assert b.client.limit >= b.capacity  # the connection pool has room for all of them
    finally:
        await b.close()
        await runner.cleanup()


async def test_a_declared_capacity_is_never_asked_for_nor_moved():
    runner, url = await serve({"/health": (200, "{}"), "/props": (200, '{"total_slots": 6}'),
                               "/metrics": (200, "llamacpp:requests_deferred 5\n")})
    b = make_backend(BackendConfig(name="b", kind="llama-server", url=url, models=("m",), max_concurrency=3),
                     TimeoutConfig())
    await b.start()
    try:
        b.in_flight = 3
        await b.scrape()
        for _ in range(100):
            b.observe_first_token(5.0, 3, 30)
        assert (b.capacity, b.capacity_info.source) == (3, "declared")
    finally:
        await b.close()
        await runner.cleanup()


async def test_first_tokens_move_only_a_learned_capacity():
    runner, url = await serve({"/health": (200, "{}"), "/props": (200, '{"total_slots": 4}')})
    b = make_backend(BackendConfig(name="b", kind="llama-server", url=url, models=("m",)), TimeoutConfig())
    await b.start()
    try:
        await b.scrape()
        for i in range(200):  # a CPU runtime's first tokens slow down as its slots fill: not a queue
            b.observe_first_token(0.05 * (1 + i % 4), 1 + i % 4, 30)
        assert (b.capacity, b.capacity_info.source) == (4, "reported")
    finally:
        await b.close()
        await runner.cleanup()
