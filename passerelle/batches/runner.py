"""Running batches in the idle capacity: each line through the gateway at the batch class, a few at
a time, until it is answered, its window ends, or it is cancelled; resumed after a restart.

    Runner.start()           resume every batch the store has in progress, cancelling or finalizing
    Runner.submit(doc)       run a new batch
    Runner.cancel(doc)       cancelling: lines running are ended, those not run are "batch_cancelled"

How hard a batch pushes: at most ``in_flight_per_batch`` of its lines are queued or running, and
at most ``in_flight_per_key`` of all the lines of one key's batches (a semaphore per key, first
come first served, so a key's batches share its turns); and all the batches' lines together only
in the idle capacity (idle.py: a reserve of free slots, and none of what other classes use or wait
for). The scheduler then orders the lines behind every better class, and preemption takes slots back.

Memory: a batch holds the lines it runs and a few read ahead, never its file: its lines are read
from the input a block at a time (validate.py LineReader), those already answered skipped (the
store's rows, asked a block at a time).

A line's outcome is its request's record (internal.py): answered (any status the runtime or
gateway gave: 200 goes to the output file, others to the error file, as OpenAI does), a passing
failure (the runtime restarting, the queue full, rate limited: tried again after a pause, up to
``line_attempts``), or a quota used up (the whole batch pauses until the quota's window allows
more; no attempt is spent). Each answer is committed to the store before the line counts as done
(store.py). A store that fails (a full disk, a database error) pauses the line, which tries again
(1 s, doubling to 30 s) until it can write; the batch's task never dies of it, and cancel always
answers: the batch is ``cancelling`` at once and ends ``cancelled`` once its rows can be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from passerelle.batches.idle import IdleGate
from passerelle.batches.internal import LineRecords, LineRequest
from passerelle.batches.outcome import Outcome, answer_record, error_record, outcome_of, passes
from passerelle.batches.parts import Parts, batch_class
from passerelle.batches.status import BatchStatus, move, status_of
from passerelle.batches.store import STORE_ERRORS, BatchStore, FileRow, Result
from passerelle.batches.validate import ENDPOINTS, Line, LineReader, max_line_bytes, parse_line
from passerelle.config import BatchesConfig
from passerelle.errors import Cause
from passerelle.proxy.resume import suspendable

log = logging.getLogger("passerelle.batches")

T = TypeVar("T")

MAX_PAUSE_S = 60.0  # a paused batch looks again at least this often
MAX_STORE_WAIT_S = 30.0  # a line whose answer the store could not write tries again at least this often
END_GROUP = 512  # lines written at once as cancelled or expired
TRIM_EVERY_S = 10.0  # an ended batch gives memory back at most this often while others run


_LIBC = ctypes.CDLL(None)  # the process's own symbols: the C library's malloc_trim where it has one


def give_back_memory() -> None:
    """Hand the C allocator's free pages back to the system. Ending a batch frees many small
    blocks that glibc keeps (RSS stayed 2x after 40 batches were cancelled, though nothing held
    them); trimming returns them."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class Stopping(Exception):
    """The gateway stops while a batch waits for its store: it resumes at the next start."""


def public(doc: dict[str, Any]) -> dict[str, Any]:
    """The batch as OpenAI shows it (the store's own fields, named with a leading _, left out)."""
    return {k: v for k, v in doc.items() if not k.startswith("_")}


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter("passerelle_batch_lines", "Batch lines ended, by outcome (completed: answered 200; "
                             "failed: answered with an error or out of attempts; expired; cancelled)",
                             ["outcome"], registry=registry)
        self.waiting = Gauge("passerelle_batch_lines_waiting", "Lines of batches in progress not answered yet",
                             registry=registry)
        self.running = Gauge("passerelle_batch_lines_running", "Batch lines queued or running in the gateway now",
                             registry=registry)
        self.batches = Gauge("passerelle_batches_in_progress", "Batches in progress (paused ones included)",
                             registry=registry)


@dataclass
class Run:
    doc: dict[str, Any]
    reader: LineReader | None = None  # its input, where the next lines are read (None: all read)
    ahead: deque[Line] = field(default_factory=deque)  # read, not yet taken (a block at most)
    back: list[Line] = field(default_factory=list)  # taken and given back (paused, hung up): first again
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: set[LineRequest] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    counted: int = 0  # its lines in the waiting gauge
    paused_until: float = 0.0  # wall time: a quota is used up until then
    pause_reason: str = ""
    ending: str = ""  # "cancelled", "expired" or "stopping" (the gateway's shutdown) once decided
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        total: int = self.doc["request_counts"]["total"]
        return total - self.completed - self.failed


class Runner:
    def __init__(self, store: BatchStore, parts: Parts, cfg: BatchesConfig, metrics: BatchMetrics) -> None:
        self.store, self.parts, self.cfg = store, parts, cfg
        self.metrics = metrics
        self.runs: dict[str, Run] = {}
        self._key_turns: dict[str, asyncio.Semaphore] = {}
        self.idle = IdleGate(parts, cfg.reserve_slots)
        self.records = LineRecords()
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.lines_done = 0  # since start, for the dashboard
        self._trimmed_at = 0.0

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.parts.gateway.listeners.append(self.records.observe)
        for doc in await self.store.run(self.store.batches, None, 1 << 30, None,
                                        ("in_progress", "cancelling", "finalizing")):
            self._launch(doc)
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def stop(self, timeout_s: float = 5.0) -> None:
        """The gateway stops: running lines hang up (their answers are not kept: they run again at
        the next start), and each batch's task ends."""
        self._closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.idle.close()
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        for run in list(self.runs.values()):
            self.end(run, "stopping")
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout_s)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late)
        with contextlib.suppress(ValueError):
            self.parts.gateway.listeners.remove(self.records.observe)

    def submit(self, doc: dict[str, Any]) -> None:
        self._launch(doc)

    def in_progress(self, owner: str | None = None) -> int:
        """Batches not ended here: all, or those of ``owner``."""
        return sum(1 for r in self.runs.values() if owner is None or r.doc["_owner"] == owner)

    def _launch(self, doc: dict[str, Any]) -> None:
        run = Run(doc)
        self.runs[doc["id"]] = run
        self.metrics.batches.set(len(self.runs))
        run.task = asyncio.ensure_future(self._run(run))
        run.task.set_name(f"batch-{doc['id']}")

    def live(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's document as it is now, counts included, when it runs here."""
        run = self.runs.get(batch_id)
        if run is None:
            return None
        run.doc["request_counts"].update(completed=run.completed, failed=run.failed)
        return run.doc

    async def cancel(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Cancel the batch ``doc`` (as the store or :meth:`live` has it); its document now. It is
        ``cancelling`` at once, even when the store cannot write it yet (then its task writes it)."""
        run = self.runs.get(doc["id"])
        if run is None:  # (not running here though live: its task ended on a fault; end it now)
            if not status_of(doc).live:
                return doc
            move(doc, BatchStatus.CANCELLING, time.time())
            self._launch(doc)
            run = self.runs[doc["id"]]
        elif status_of(run.doc).live:
            move(run.doc, BatchStatus.CANCELLING, time.time())
            self.end(run, "cancelled")
        else:
            return self.live(doc["id"]) or doc
        try:
            await self.store.run(self.store.put_batch, run.doc)
        except STORE_ERRORS as exc:  # (its task writes it once the store can)
            log.warning("batch %s: cancelling not written yet (%s)", doc["id"], exc)
        return self.live(doc["id"]) or run.doc

    # -- the store, which may fail ----------------------------------------------------------------
    async def _durably(self, run: Run, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, tried again while the store fails (1 s, doubling to 30 s) until it works or
        the gateway stops (then :class:`Stopping`)."""
        delay = 1.0
        while True:
            try:
                out = await call()
            except STORE_ERRORS as exc:
                if isinstance(exc, FileNotFoundError):
                    raise
                if not run.pause_reason.startswith("store_error"):
                    log.warning("batch %s: the store failed (%s: %s); its lines wait until it works again",
                                run.doc["id"], exc.__class__.__name__, exc)
                run.pause_reason = f"store_error: {exc.__class__.__name__}"
            else:
                if run.pause_reason.startswith("store_error"):
                    run.pause_reason = ""
                return out
            if run.ending == "stopping" or self._closing.is_set():
                raise Stopping
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._closing.wait()
            delay = min(delay * 2, MAX_STORE_WAIT_S)

    def _open(self, run: Run) -> None:
        """Open the batch's input (on the store's thread)."""
        f = open(self.store.content_path(run.doc["input_file_id"]), "rb")  # noqa: SIM115 (closed with the run)
        run.reader = LineReader(f, max_line_bytes(self.parts.cfg.server.max_body_bytes))

    async def _next(self, run: Run) -> Line | None:
        """The next line to run: one given back first, else the next one not answered; None at the end."""
        if run.back:
            return run.back.pop()
        async with run.reading:
            while not run.ahead:
                reader = run.reader
                if reader is None:
                    return None
                block = await self.store.run(reader.read, max(2 * self.cfg.in_flight_per_batch, 16))
                if not block:
                    run.reader = None
                    await self.store.run(reader.close)
                    return None
                done = await self.store.run(self.store.done_among, run.doc["id"], block[0][0], block[-1][0])
                run.ahead.extend(parse_line(n, raw) for n, raw in block if n not in done)
            return run.ahead.popleft()

    # -- one batch ------------------------------------------------------------------------------
    async def _run(self, run: Run) -> None:
        doc = run.doc
        try:
            run.completed, run.failed = await self._durably(run, lambda: self.store.run(self.store.counts,
                                                                                     doc["id"]))
            status = status_of(doc)
            if status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
                try:
                    await self._durably(run, lambda: self.store.run(self._open, run))
                except FileNotFoundError:
                    await self._fail(run, "input_file_missing", "The batch's input file is gone.")
                    return
            if status is BatchStatus.CANCELLING:
                run.ending = "cancelled"
            elif status is BatchStatus.IN_PROGRESS:
                run.counted = run.waiting
                self.metrics.waiting.inc(run.counted)
                await self._lines(run)
            if run.ending == "stopping":
                return  # the gateway stops: what is not answered runs at the next start
            await self._finish(run)
        except Stopping:
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a fault of the gateway: the batch fails rather than stays in progress
            log.exception("batch %s failed inside the gateway", doc["id"])
            with contextlib.suppress(Stopping):
                await self._fail(run, "internal_error", f"The gateway met a fault ({exc.__class__.__name__}); "
                                                        "see its log.")
        finally:
            self.metrics.waiting.dec(run.counted)
            run.counted = 0
            if run.reader is not None:
                with contextlib.suppress(OSError):
                    run.reader.close()
                run.reader = None
            if self.runs.get(doc["id"]) is run:
                del self.runs[doc["id"]]
            self.metrics.batches.set(len(self.runs))
            if not self.runs or time.monotonic() - self._trimmed_at > TRIM_EVERY_S:
                self._trimmed_at = time.monotonic()
                give_back_memory()

    async def _fail(self, run: Run, code: str, message: str) -> None:
        doc = run.doc
        doc["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                     "line": None}]}
        doc["request_counts"].update(completed=run.completed, failed=run.failed)
        if status_of(doc) is not BatchStatus.FAILED:
            move(doc, BatchStatus.FAILED, time.time())
        await self._durably(run, lambda: self.store.run(self.store.put_batch, doc))
        log.warning("batch %s failed: %s", doc["id"], message)

    async def _lines(self, run: Run) -> None:
        """Run the lines until all are answered, the window ends, or the batch is cancelled or the
        gateway stops (then the lines running are hung up, and their workers end at once)."""
        workers = [asyncio.ensure_future(self._worker(run)) for _ in range(self.cfg.in_flight_per_batch)]
        try:
            await asyncio.wait(workers, timeout=max(run.doc["expires_at"] - time.time(), 0.0))
        finally:
            if any(not w.done() for w in workers):
                self.end(run, "expired")
            await asyncio.wait(workers)  # (each worker returns once its line has hung up)
        for w in workers:  # (every one is waited for before the reader closes; the first fault tells)
            if not w.cancelled() and (exc := w.exception()) is not None:
                raise exc

    def end(self, run: Run, why: str) -> None:
        """Stop ``run``: no line starts any more, the running ones hang up, naps end."""
        run.ending = run.ending or why
        run.wake.set()
        for line in run.running:
            line.hang_up()
        self.idle.pump()  # (its lines held back stop waiting)

    async def _worker(self, run: Run) -> None:
        owner = run.doc["_owner"]
        turns = self._key_turns.setdefault(owner, asyncio.Semaphore(self.cfg.in_flight_per_key))
        while not run.ending:
            pause = run.paused_until - time.time()
            if pause > 0:
                await _nap(run, min(pause, MAX_PAUSE_S))
                continue
            line = await self._durably(run, lambda: self._next(run))
            if line is None:
                return
            run.pause_reason = ""
            async with turns:
                if run.ending:
                    run.back.append(line)
                    return
                result = await self._line(run, line)
            if result is None:  # paused (a quota), or hung up (cancel, expiry, shutdown): not done
                run.back.append(line)
                continue
            await self._durably(run, partial(self.store.add_result, result))
            self.metrics.waiting.dec()
            run.counted -= 1
            self.lines_done += 1
            if result.ok:
                run.completed += 1
                self.metrics.lines.labels("completed").inc()
            else:
                run.failed += 1
                self.metrics.lines.labels("failed").inc()

    async def _line(self, run: Run, line: Line) -> Result | None:
        """Run one line to its outcome: its result, or None when it must wait (a quota, an end)."""
        doc = run.doc
        endpoint = ENDPOINTS[line.url]
        # A chat or completions line that can be cut and continued exactly is asked as a stream and
        # assembled here: a stream of the batch class may be preempted (suspended for a better
        # class, resumed later), a non-streamed answer holds its slot to the end.
        streamed = endpoint in ("chat", "completions") and suspendable(line.body, endpoint)
        data = {**line.body, "stream": True, "stream_options": {"include_usage": True}} if streamed else line.body
        body = orjson.dumps(data)
        outcome = Outcome(0, "", b"", None)
        for attempt in range(self.cfg.line_attempts):
            pool = self.idle.pool_of(line.body.get("model"), endpoint)
            if not await self.idle.enter(pool, doc["_owner"], lambda: bool(run.ending)):
                return None  # the batch ends
            request = LineRequest(line.url, body, key_id=doc["_key_id"], class_name=batch_class(self.parts),
                                  batch_id=doc["id"], records=self.records,
                                  cap=self.parts.cfg.limits.max_answer_bytes)
            run.running.add(request)
            self.metrics.running.inc()
            try:
                answer = await request.run(self.parts.gateway, endpoint)
            finally:
                run.running.discard(request)
                self.metrics.running.dec()
                self.idle.leave(pool, doc["_owner"])
            if request.too_large:
                return Result(doc["id"], line.number, False, error_record(
                    line.custom_id, "answer_too_large", "The answer was larger than [limits] max_answer_bytes."))
            rec = request.record
            if run.ending or rec is None or rec.cause in (Cause.CLIENT_DISCONNECT, Cause.CLIENT_TIMEOUT):
                return None  # hung up: cancelled or expired; or the gateway is stopping
            outcome = outcome_of(rec, answer, endpoint if streamed else "")
            if rec.cause is Cause.QUOTA_EXCEEDED:
                run.paused_until = time.time() + min(answer.retry_after or MAX_PAUSE_S, MAX_PAUSE_S)
                run.pause_reason = "quota_exceeded"
                return None
            if passes(outcome) and attempt + 1 < self.cfg.line_attempts:
                await _nap(run, min(2.0 ** attempt, 30.0))
                if run.ending:
                    return None
                continue
            break
        ok = outcome.status == 200
        rec = outcome.record
        return Result(doc["id"], line.number, ok, answer_record(line.custom_id, outcome.status, outcome.request_id,
                                                                outcome.body),
                      (rec.prompt_tokens or 0) if ok and rec else 0, (rec.completion_tokens or 0) if ok and rec else 0)

    async def _end_lines(self, run: Run) -> int:
        """Lines not answered get the batch's end (cancelled, expired) as their error, a group of
        rows at a time, read from the input as the lines to run are: the lines written."""
        doc = run.doc
        code, message = (("batch_cancelled", "This request was not run: the batch was cancelled.")
                         if run.ending == "cancelled" else
                         ("batch_expired", "This request could not be run before the batch's completion "
                                           "window ended."))
        written = 0
        while True:
            group: list[Result] = []
            while len(group) < END_GROUP and (line := await self._durably(run, lambda: self._next(run))):
                group.append(Result(doc["id"], line.number, False, error_record(line.custom_id, code, message)))
            if not group:
                return written
            await self._durably(run, partial(self.store.run, self.store.insert_results, group))
            written += len(group)
            self.metrics.lines.labels(run.ending).inc(len(group))
            self.metrics.waiting.dec(min(len(group), run.counted))
            run.counted = max(run.counted - len(group), 0)

    async def _finish(self, run: Run) -> None:
        """Lines not answered get their error (expired, cancelled); the output and error files are
        assembled from the store's rows; the batch ends."""
        doc = run.doc
        status = status_of(doc)
        if run.ending in ("cancelled", "expired") and status is not BatchStatus.FINALIZING:
            await self._end_lines(run)
        final = (BatchStatus.CANCELLED if status is BatchStatus.CANCELLING
                 else BatchStatus(run.ending or doc.get("_final") or "completed"))
        if final is not BatchStatus.CANCELLED and status is not BatchStatus.FINALIZING:
            move(doc, BatchStatus.FINALIZING, time.time())
            doc["_final"] = final.value
            await self._durably(run, lambda: self.store.run(self.store.put_batch, doc))
        completed, failed = await self._durably(run, lambda: self.store.run(self.store.counts, doc["id"]))
        now = time.time()
        outputs = []
        for purpose, n, field_name in (("batch_output", completed, "output_file_id"),
                                       ("batch_error", failed, "error_file_id")):
            if n:
                fid = doc.get(f"_{field_name}") or "file-" + secrets.token_hex(12)
                doc[f"_{field_name}"] = fid
                outputs.append(FileRow(fid, doc["_owner"], purpose, f"{doc['id']}_{purpose.split('_')[1]}.jsonl",
                                       0, n, now))
        await self._durably(run, lambda: self.store.run(self.store.put_batch, doc))  # the files' ids, first
        ptok, ctok = await self._durably(run, lambda: self.store.run(self.store.tokens, doc["id"]))
        ended = dict(doc)
        move(ended, final, time.time())
        ended.update(output_file_id=doc.get("_output_file_id"), error_file_id=doc.get("_error_file_id"),
                     request_counts={"total": doc["request_counts"]["total"], "completed": completed,
                                     "failed": failed},
                     usage={"input_tokens": ptok, "output_tokens": ctok, "total_tokens": ptok + ctok})
        await self._durably(run, lambda: self.store.run(self.store.finish, ended, outputs))
        doc.update(ended)
        run.completed, run.failed = completed, failed
        log.info("batch %s %s: %d completed, %d failed", doc["id"], final.value, completed, failed)

    # -- retention --------------------------------------------------------------------------------
    async def _sweep(self) -> None:
        every = min(self.cfg.retention_h * 3600 / 10, 600.0)
        while True:
            try:
                await self.sweep_once()
            except STORE_ERRORS as exc:  # (tried again at the next round)
                log.warning("batch retention: the store failed (%s: %s)", exc.__class__.__name__, exc)
            except Exception:  # a fault of the gateway must not end retention for good: the next round
                log.exception("batch retention failed inside the gateway; tried again in %g s", every)
            await asyncio.sleep(every)

    async def sweep_once(self, now: float | None = None) -> tuple[int, int]:
        """Delete finished batches and unused files past their retention: (batches, files)."""
        horizon = (now or time.time()) - self.cfg.retention_h * 3600
        await self.store.run(self.store.remove_orphans)
        batches, files = await self.store.run(self.store.expired_before, horizon)
        for b in batches:
            await self.store.run(self.store.drop_batch, b)
        for f in files:
            await self.store.run(self.store.delete_file, f)
        return len(batches), len(files)

    def snapshot(self) -> dict[str, Any]:
        """For /admin/stats and the dashboard."""
        rows = []
        for run in self.runs.values():
            d = run.doc
            rows.append({"id": d["id"], "tenant": d.get("_tenant", ""), "endpoint": d["endpoint"],
                         "status": d["status"], "total": d["request_counts"]["total"], "completed": run.completed,
                         "failed": run.failed, "running": len(run.running), "waiting": run.waiting,
                         "paused": run.pause_reason or None, "expires_at": d["expires_at"]})
        return {"in_progress": len(rows), "lines_done_since_start": self.lines_done,
                "lines_waiting": sum(r["waiting"] for r in rows), "batches": rows}


async def _nap(run: Run, seconds: float) -> None:
    """Wait ``seconds``, or less if the batch ends meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await run.wake.wait()
