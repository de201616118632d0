"""Load generation: closed loops, open loops, warm-up, prompt calibration, several processes.

A closed loop keeps ``concurrency`` requests in flight: each worker sends its next request when
the previous one ends. An open loop sends at a constant or Poisson ``rate`` whatever the answers
do; with a ``concurrency`` cap as well, a request that waits for a free place has its clock
started only when it is actually sent, so the generator's own queue never counts in TTFT.

Everything runs on one event loop per process (uvloop); ``processes > 1`` hands each level to
``processes.run_level_processes``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from passerelle.bench.client import HttpClient, RequestResult, send
from passerelle.bench.progress import Progress, Tally
from passerelle.bench.target import Target, discover
from passerelle.bench.workload import ENDPOINTS, Conversation, TrafficClass, Workload

T = TypeVar("T")
# Prompt indexes: every (target, level, class, process, conversation) gets its own, so no prompt
# repeats — a runtime's prefix cache would otherwise serve a later level from an earlier one.
LEVEL_STRIDE = 10_000_000
CLASS_STRIDE = 1_000_000
WARMUP_OFFSET = 900_000  # within a level's first class: warm-up, then calibration probes


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Level:
    """One point of a sweep: the classes sent together (a single one for a plain bench)."""

    classes: tuple[TrafficClass, ...]
    duration: float | None = None
    concurrency: int | None = None  # the level's label in results (closed loop or cap)
    rate: float | None = None

    @property
    def label(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append(f"rate {self.rate:g}/s")
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        return ", ".join(parts) or "scenario"

    @property
    def total_requests(self) -> int | None:
        if self.duration is not None or any(c.requests is None for c in self.classes):
            return None
        return sum(c.requests or 0 for c in self.classes)


@dataclass
class LevelResult:
    """A level's measurements; one made of ``segments`` (the rounds of an interleaved compare)
    pools their requests, and its wall time is the sum of theirs."""

    level: Level
    results: list[RequestResult]
    loop_lag: list[float] = field(default_factory=list)  # oversleep of a 10 ms ticker: generator load
    send_lag: list[float] = field(default_factory=list)  # open loop: lateness of each arrival
    segments: list[LevelResult] = field(default_factory=list)

    @property
    def started(self) -> float:
        return min((r.t_send for r in self.results), default=0.0)

    @property
    def ended(self) -> float:
        return max((r.t_done for r in self.results), default=0.0)

    @property
    def wall_s(self) -> float:
        if self.segments:
            return sum(s.wall_s for s in self.segments)
        return max(self.ended - self.started, 1e-9)

    @classmethod
    def pooled(cls, level: Level, parts: list[LevelResult]) -> LevelResult:
        if len(parts) == 1:
            return replace(parts[0], level=level)
        return cls(level, [r for p in parts for r in p.results], [x for p in parts for x in p.loop_lag],
                   [x for p in parts for x in p.send_lag], segments=list(parts))


@dataclass(frozen=True)
class RunOptions:
    warmup: int = 1
    timeout: float | None = 300.0
    processes: int = 1
    index_base: int = 0  # distinct per target of a compare, so a shared backend never sees a repeat
    part: str = ""  # what part of a level this run is (a round of a compare), said after its progress line


def run_loop(coro: Awaitable[T]) -> T:
    """Run a coroutine on a fresh uvloop (asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def make_session(limit: int) -> HttpClient:
    """A client whose pool never makes a request wait for a connection (0: unlimited)."""
    return HttpClient(limit + 8 if limit else 0)


def pool_size(level: Level) -> int:
    if any((c.rate is not None or c.trace is not None) and c.concurrency is None for c in level.classes):
        return 0
    return sum(c.concurrency or 0 for c in level.classes)


async def sleep_until(deadline: float) -> None:
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


# --- one level -----------------------------------------------------------------------------
async def run_load(session: Any, target: Target, level: Level, *, timeout: float | None,
                   tally: Tally | None = None, start_at: float | None = None,
                   index_base: int = 0, index_step: int = 1, phase: float = 0.0) -> LevelResult:
    """Send one level's load and return every request's measurement."""
    if start_at is not None:
        await sleep_until(start_at)
    out = LevelResult(level, [])
    start = time.perf_counter()
    deadline = start + level.duration if level.duration is not None else None
    lag_task = asyncio.create_task(_watch_loop_lag(out.loop_lag))

    def record(result: RequestResult) -> None:
        out.results.append(result)
        if tally is not None:
            tally.add(result.ok, result.ttft, result.output_tokens)

    async def one(cls: TrafficClass, conv: Conversation, prompt_tokens: int | None = None,
                  max_tokens: int | None = None) -> RequestResult:
        turn = conv.turn
        body, _ = conv.next_body(prompt_tokens, max_tokens)
        result = await send(session, url[cls.workload.endpoint], body, {**target.headers(), **cls.headers()},
                            cls.name, timeout)
        result.turn = turn
        record(result)
        return result

    url = {e: target.base_url + path for e, path in ENDPOINTS.items()}
    assert target.model is not None
    model = target.model
    jobs = []
    for k, cls in enumerate(level.classes):
        base = index_base + k * CLASS_STRIDE  # disjoint prompt indexes per class (and process: step)
        if cls.trace is not None:
            jobs.append(_replay(cls, model, one, deadline, base, index_step, start, out.send_lag))
        elif cls.rate is None:
            jobs.append(_closed(cls, model, one, deadline, base, index_step))
        else:
            jobs.append(_open(cls, model, one, deadline, base, index_step, start + phase, out.send_lag))
    try:
        await asyncio.gather(*jobs)
    finally:
        lag_task.cancel()
    return out


async def _closed(cls: TrafficClass, model: str, one: Callable[..., Awaitable[RequestResult]],
                  deadline: float | None, base: int, step: int) -> None:
    sent = itertools.count()
    conversations = itertools.count()

    async def worker() -> None:
        conv: Conversation | None = None
        while True:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            if cls.requests is not None and next(sent) >= cls.requests:
                return
            if conv is None or conv.finished:
                conv = Conversation(cls.workload, base + next(conversations) * step, model)
            if not (await one(cls, conv)).ok:
                conv = None  # a chat whose turn failed is abandoned, as a user would

    await asyncio.gather(*(worker() for _ in range(cls.concurrency or 0)))


async def _open(cls: TrafficClass, model: str, one: Callable[..., Awaitable[RequestResult]],
                deadline: float | None, base: int, step: int, first: float, send_lag: list[float]) -> None:
    assert cls.rate is not None and cls.rate > 0
    rng = random.Random(f"arrivals:{cls.workload.seed}:{base}")
    cap = asyncio.Semaphore(cls.concurrency) if cls.concurrency else None
    turns = cls.workload.turns
    n_conv = math.ceil(cls.requests / turns) if cls.requests is not None else None
    pending: set[asyncio.Task[None]] = set()

    async def conversation(index: int) -> None:
        conv = Conversation(cls.workload, index, model)
        while not conv.finished:
            if cap is None:
                result = await one(cls, conv)
            else:
                async with cap:  # waiting here is the generator's queue, outside the request's clock
                    result = await one(cls, conv)
            if not result.ok:
                return

    at = first
    for i in itertools.count():
        if (n_conv is not None and i >= n_conv) or (deadline is not None and at >= deadline):
            break
        await sleep_until(at)
        send_lag.append(time.perf_counter() - at)
        task = asyncio.create_task(conversation(base + i * step))
        pending.add(task)
        task.add_done_callback(pending.discard)
        at += rng.expovariate(cls.rate) if cls.poisson else 1.0 / cls.rate
    if pending:
        await asyncio.gather(*list(pending))


async def _replay(cls: TrafficClass, model: str, one: Callable[..., Awaitable[RequestResult]],
                  deadline: float | None, base: int, step: int, first: float, send_lag: list[float]) -> None:
    """A recorded trace: request i at ``first + t_i / speed`` with its own lengths (open loop)."""
    assert cls.trace is not None
    cap = asyncio.Semaphore(cls.concurrency) if cls.concurrency else None
    pending: set[asyncio.Task[RequestResult]] = set()

    async def capped(conv: Conversation, prompt: int, output: int) -> RequestResult:
        assert cap is not None
        async with cap:  # the generator's own queue: outside the request's clock
            return await one(cls, conv, prompt, output)

    for i, entry in enumerate(cls.trace):
        at = first + entry.t / cls.trace_speed
        if deadline is not None and at >= deadline:
            break
        await sleep_until(at)
        send_lag.append(time.perf_counter() - at)
        conv = Conversation(cls.workload, base + i * step, model)
        coro = (one(cls, conv, entry.prompt_tokens, entry.output_tokens) if cap is None
                else capped(conv, entry.prompt_tokens, entry.output_tokens))
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*list(pending))


async def _watch_loop_lag(out: list[float], interval: float = 0.01) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(interval)
        out.append(max(time.perf_counter() - t - interval, 0.0))


async def preconnect(session: Any, target: Target, n: int) -> None:
    """Open ``n`` pooled connections with cheap GETs, so measured requests find them ready."""
    from passerelle.bench.client import get_json

    if n > 0:
        await asyncio.gather(*(get_json(session, f"{target.base_url}/v1/models", target.headers())
                               for _ in range(min(n, 1024))))


async def warm_up(session: Any, target: Target, level: Level, n: int, timeout: float | None,
                  index_base: int = 0) -> None:
    """``n`` requests of the first class at the level's concurrency, not measured; then fill the pool."""
    expected = pool_size(level) or max(1, math.ceil(sum(c.rate or 0 for c in level.classes)), 4)
    await preconnect(session, target, expected)
    if n <= 0:
        return
    cls = level.classes[0]
    conc = max(1, min(n, cls.concurrency or n))
    warm = Level((replace(cls, rate=None, concurrency=conc, requests=n, trace=None),))
    result = await run_load(session, target, warm, timeout=timeout, index_base=index_base + WARMUP_OFFSET)
    if not any(r.ok for r in result.results):
        first = result.results[0]
        raise BenchError(f"{target.name}: every warm-up request failed: {first.error} {first.detail}".strip())


# --- preparation ---------------------------------------------------------------------------
async def calibrate(session: Any, target: Target, workload: Workload,
                    timeout: float | None = 120.0) -> tuple[Workload, str]:
    """Measure the target's tokens per word of the prompt text with probe prompts (max_tokens 1).

    Two passages, each sent at half and at one and a half times the estimated length: the slope is
    tokens per word, the intercept the template's tokens. Bracketing the requested length keeps
    the estimate right there even where tokenization is not quite linear. Returns the adjusted
    workload and a sentence for the report.
    """
    assert target.model is not None
    probe = replace(workload, turns=1, include_usage=True, prompt_spread=0)
    words = max(8.0, (workload.prompt_tokens - workload.prompt_overhead) / workload.tokens_per_word)
    sizes = (max(4, round(words / 2)), max(12, round(words * 1.5)))
    slopes, intercepts = [], []
    for passage in range(2):
        points = []
        for n_words in sizes:
            # the same index gives the same passage: the two sizes share their first words
            conv = Conversation(probe, WARMUP_OFFSET + 50_000 + passage, target.model)
            body = conv.body_for_words(n_words, 1)
            r = await send(session, target.base_url + workload.path, body, target.headers(), timeout=timeout)
            # only the prompt's length counts: a one-token answer may well be empty text (a byte of a
            # multi-byte character), which is no error here
            if (not r.ok and r.error != "no_content") or r.prompt_tokens is None:
                reason = f"{r.error} {r.detail}".strip() if not r.ok else "the server reports no usage"
                return workload, (f"prompt lengths estimated at {workload.tokens_per_word:g} tokens/word "
                                  f"({reason})")
            points.append((n_words, r.prompt_tokens))
        (w1, p1), (w2, p2) = points
        slopes.append((p2 - p1) / (w2 - w1))
        intercepts.append(p1 - slopes[-1] * w1)
    ratio, overhead = sum(slopes) / 2, sum(intercepts) / 2
    if not (0.3 <= ratio <= 4.0 and -50.0 <= overhead <= 1000.0):
        return workload, f"prompt calibration gave implausible values ({ratio:.2f} tokens/word); kept defaults"
    return (replace(workload, tokens_per_word=round(ratio, 4), prompt_overhead=round(max(overhead, 0.0), 1)),
            f"prompt lengths calibrated on the target: {ratio:.3f} tokens/word + {max(overhead, 0):.0f} "
            "tokens of template and instruction")


def prepare(target: Target, workload: Workload, *, calibrate_prompts: bool = True) -> tuple[Target, Workload, str]:
    """Discover the target's model and versions, then size prompts for its tokenizer."""

    async def go() -> tuple[Target, Workload, str]:
        async with make_session(4) as session:
            found = await discover(session, target)
            if not calibrate_prompts:
                return found, workload, "prompt calibration off"
            tuned, note = await calibrate(session, found, workload)
            return found, tuned, note

    return run_loop(go())


# --- a sweep against one target --------------------------------------------------------------
# Told "start" when a level's measured load begins (after its warm-up) and "end" when it is over,
# with the level's index: the memory and runtime monitor brackets its samples with these.
Marker = Callable[[str, int], None]


def no_mark(event: str, index: int) -> None:
    pass


def run_levels_here(target: Target, levels: list[Level], options: RunOptions,
                    progress: Progress, mark: Marker = no_mark) -> list[LevelResult]:
    """Every level in this process, one after the other (``processes.run_levels`` chooses)."""
    return run_loop(_run_levels(target, levels, options, progress, mark))


async def _refresh(progress: Progress) -> None:
    while True:
        progress.refresh()
        await asyncio.sleep(0.25)


async def _run_levels(target: Target, levels: list[Level], options: RunOptions,
                      progress: Progress, mark: Marker) -> list[LevelResult]:
    sizes = [pool_size(level) for level in levels]
    out = []
    async with make_session(0 if 0 in sizes else max(sizes)) as session:
        for i, level in enumerate(levels):
            base = options.index_base + i * LEVEL_STRIDE
            await warm_up(session, target, level, options.warmup, options.timeout, base)
            tally = Tally()
            progress.start_level(f"{target.name} {level.label}", level.total_requests, tally)
            ticker = asyncio.create_task(_refresh(progress))
            mark("start", i)
            try:
                result = await run_load(session, target, level, timeout=options.timeout, tally=tally,
                                        index_base=base)
            finally:
                ticker.cancel()
                mark("end", i)
            progress.end_level(result, options.part)
            out.append(result)
    return out
