"""Several load-generator processes for one level, started together on the shared monotonic clock.

Each process gets its share of every class's concurrency, request count and rate (and a phase, so
constant-rate arrivals interleave), warms up on its own connections, reports "ready", and starts
when all are ready. Progress comes back as small tallies four times a second, the measurements
once at the end. Processes are spawned (a fresh interpreter each), whatever threads the parent has.
"""

from __future__ import annotations

import asyncio
import math
import queue as queue_mod
import time
from dataclasses import replace
from typing import Any

from passerelle.bench.progress import Progress, Tally
from passerelle.bench.runner import (
    LEVEL_STRIDE,
    BenchError,
    Level,
    LevelResult,
    Marker,
    RunOptions,
    make_session,
    no_mark,
    pool_size,
    run_levels_here,
    run_load,
    run_loop,
    warm_up,
)
from passerelle.bench.target import Target


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if j < total % parts else 0) for j in range(parts)]


def share_level(level: Level, j: int, n: int) -> Level:
    """Process ``j`` of ``n``'s part of a level: concurrency, requests and rate divided."""
    classes = []
    for cls in level.classes:
        conc = _split(cls.concurrency, n)[j] if cls.concurrency else None
        if cls.rate is None and cls.trace is None:
            reqs = None
            if cls.requests is not None:
                weights = _split(cls.concurrency or 0, n)
                total_w = sum(weights) or 1
                shares = [cls.requests * w // total_w for w in weights]
                for k in range(cls.requests - sum(shares)):
                    shares[k % n] += 1
                reqs = shares[j] if weights[j] else 0
            classes.append(replace(cls, concurrency=conc or 0, requests=reqs))
        elif cls.trace is not None:  # every n-th entry, at its own time
            mine = cls.trace[j::n]
            classes.append(replace(cls, trace=mine, requests=len(mine), concurrency=conc))
        else:
            reqs = _split(cls.requests, n)[j] if cls.requests is not None else None
            classes.append(replace(cls, rate=(cls.rate or 0.0) / n, concurrency=conc if cls.concurrency else None,
                                   requests=reqs))
    return replace(level, classes=tuple(classes))


class _Forwarding(Tally):
    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[float] = []
        self.sent = (0, 0, 0, 0)

    def add(self, ok: bool, ttft: float | None, tokens: int) -> None:
        super().add(ok, ttft, tokens)
        if ttft is not None:
            self.fresh.append(ttft)

    def delta(self) -> tuple[int, int, int, int, list[float]]:
        now = (self.done, self.ok, self.errors, self.tokens)
        d = tuple(a - b for a, b in zip(now, self.sent, strict=True))
        self.sent, fresh, self.fresh = now, self.fresh, []
        return (*d, fresh)  # type: ignore[return-value]


def _child(target: Target, level: Level, options: RunOptions, j: int, n: int, out: Any, go: Any,
           start_at: Any, base: int) -> None:
    try:
        run_loop(_child_async(target, level, options, j, n, out, go, start_at, base))
    except BaseException as exc:
        out.put(("error", j, f"{type(exc).__name__}: {exc}"))


async def _child_async(target: Target, level: Level, options: RunOptions, j: int, n: int, out: Any,
                       go: Any, start_at: Any, base: int) -> None:
    mine = share_level(level, j, n)
    async with make_session(pool_size(mine)) as session:
        if any(c.concurrency or c.rate or c.trace for c in mine.classes):
            await warm_up(session, target, mine, math.ceil(options.warmup / n), options.timeout, base + j * 10_000)
        out.put(("ready", j))
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        tally = _Forwarding()

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.25)
                out.put(("tick", j, *tally.delta()))

        ticker = asyncio.create_task(tick())
        try:
            result = await run_load(session, target, mine, timeout=options.timeout, tally=tally,
                                    start_at=start_at.value, index_base=base + j, index_step=n,
                                    phase=j / level.classes[0].rate if level.classes[0].rate else 0.0)
        finally:
            ticker.cancel()
        out.put(("tick", j, *tally.delta()))
        out.put(("done", j, result))


def run_level_processes(target: Target, level: Level, options: RunOptions, progress: Progress,
                        base: int = 0, mark: Any = None) -> LevelResult:
    import multiprocessing as mp

    # spawn: a fresh interpreter per process, safe whatever threads the parent has
    ctx = mp.get_context("spawn")
    n = options.processes
    out = ctx.Queue()
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_child, args=(target, level, options, j, n, out, go, start_at, base), daemon=True)
             for j in range(n)]
    for p in procs:
        p.start()
    tally = Tally()
    done: dict[int, LevelResult] = {}
    ready = 0
    try:
        while len(done) < n:
            try:
                msg = out.get(timeout=0.25)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise BenchError("a load process died") from None
                progress.refresh()
                continue
            kind = msg[0]
            if kind == "error":
                raise BenchError(f"load process {msg[1]}: {msg[2]}")
            if kind == "ready":
                ready += 1
                if ready == n:  # all warmed up: start together, on the shared monotonic clock
                    start_at.value = time.perf_counter() + 0.05
                    tally.started = start_at.value
                    progress.start_level(f"{target.name} {level.label}", level.total_requests, tally)
                    if mark is not None:
                        mark("start")
                    go.set()
            elif kind == "tick":
                tally.merge(*msg[2:])
                progress.refresh()
            elif kind == "done":
                done[msg[1]] = msg[2]
    finally:
        go.set()
        if mark is not None and ready == n:
            mark("end")
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    merged = LevelResult(level, [r for j in sorted(done) for r in done[j].results],
                         [x for res in done.values() for x in res.loop_lag],
                         [x for res in done.values() for x in res.send_lag])
    progress.end_level(merged, f" ({n} processes){options.part}")
    return merged


def run_levels(target: Target, levels: list[Level], options: RunOptions,
               progress: Progress, mark: Marker = no_mark) -> list[LevelResult]:
    """Run ``levels`` against ``target``: in this process, or each level spread over
    ``options.processes`` processes. ``mark`` is told when each level's measured load starts and ends."""
    if options.processes > 1:
        return [run_level_processes(target, level, options, progress, options.index_base + i * LEVEL_STRIDE,
                                    mark=lambda event, i=i: mark(event, i))
                for i, level in enumerate(levels)]
    return run_levels_here(target, levels, options, progress, mark)
