"""Running batches in the idle capacity: each line through the gateway at the batch class, a few at
a time, until it is answered, its window ends, or it is cancelled; resumed after a restart.

    Runner.start()           resume every batch the store has in progress, cancelling or finalizing
    Runner.submit(doc)       run a new batch
    Runner.cancel(id)        cancelling: lines running are ended, those not run are "batch_cancelled"

How hard a batch pushes: at most ``in_flight_per_batch`` of its lines are queued or running, and
at most ``in_flight_per_key`` of all the lines of one key's batches (a semaphore per key, first
come first served, so a key's batches share its turns); and all the batches' lines together only
in the idle capacity (idle.py: a reserve of free slots, and none of what other classes use or wait
for). The scheduler then orders the lines behind every better class, and preemption takes slots back.

A line's outcome is one of: answered (any status the runtime or gateway gave: 200 goes to the
output file, others to the error file, as OpenAI does), a passing failure (the runtime
restarting, the queue full, rate limited: tried again after a pause, up to ``line_attempts``),
or a quota used up (the whole batch pauses until the quota's window allows more; no attempt is
spent). Each answer is committed to the store before the line counts as done (store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from passerelle.batches.idle import IdleGate
from passerelle.batches.internal import Answer, Line, usage_of
from passerelle.batches.store import BatchStore, FileRow, Result
from passerelle.batches.validate import ENDPOINTS, parse_lines
from passerelle.batches.validate import Line as InputLine
from passerelle.config import BatchesConfig
from passerelle.errors import UpstreamError
from passerelle.proxy.assemble import assemble
from passerelle.proxy.gateway import Gateway
from passerelle.proxy.resume import suspendable

log = logging.getLogger("passerelle.batches")

PASSING = {"rate_limit_exceeded", "queue_full", "tenant_queue_full", "queue_timeout", "no_backend", "upstream_error",
           "upstream_timeout", "server_busy", "shutdown"}
MAX_PAUSE_S = 60.0  # a paused batch looks again at least this often


def request_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


def _body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


def error_record(custom_id: str, code: str, message: str) -> bytes:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id, "response": None,
                         "error": {"code": code, "message": message}})


def answer_record(custom_id: str, answer: Answer) -> bytes:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id,
                         "response": {"status_code": answer.status, "request_id": answer.request_id,
                                      "body": _body(answer.body)}, "error": None})


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
    todo: list[InputLine] = field(default_factory=list)
    running: set[Line] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
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
    def __init__(self, store: BatchStore, gateway: Gateway, cfg: BatchesConfig, class_name: str,
                 metrics: BatchMetrics) -> None:
        self.store, self.gateway, self.cfg, self.class_name = store, gateway, cfg, class_name
        self.metrics = metrics
        self.runs: dict[str, Run] = {}
        self._key_turns: dict[str, asyncio.Semaphore] = {}
        self.idle = IdleGate(gateway, class_name, cfg.reserve_slots)
        self._sweeper: asyncio.Task[None] | None = None
        self.lines_done = 0  # since start, for the dashboard

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        for doc in await self.store.run(self.store.batches, None, 1 << 30, None,
                                        ("in_progress", "cancelling", "finalizing")):
            self._launch(doc)
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def stop(self, timeout_s: float = 5.0) -> None:
        """The gateway stops: running lines hang up (their answers are not kept: they run again at
        the next start), and each batch's task ends."""
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

    def submit(self, doc: dict[str, Any]) -> None:
        self._launch(doc)

    def _launch(self, doc: dict[str, Any]) -> None:
        run = Run(doc)
        self.runs[doc["id"]] = run
        run.task = asyncio.ensure_future(self._run(run))
        run.task.set_name(f"batch-{doc['id']}")

    def live(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's document as it is now, counts included, when it runs here."""
        run = self.runs.get(batch_id)
        if run is None:
            return None
        run.doc["request_counts"].update(completed=run.completed, failed=run.failed)
        return run.doc

    async def cancel(self, batch_id: str) -> dict[str, Any] | None:
        run = self.runs.get(batch_id)
        if run is None or run.doc["status"] not in ("in_progress", "validating"):
            return self.live(batch_id)
        run.doc.update(status="cancelling", cancelling_at=int(time.time()))
        await self.store.run(self.store.put_batch, run.doc)
        self.end(run, "cancelled")
        return self.live(batch_id)

    # -- one batch ------------------------------------------------------------------------------
    async def _run(self, run: Run) -> None:
        doc = run.doc
        try:
            content = await self.store.run(self.store.content_path(doc["input_file_id"]).read_bytes)
            lines = parse_lines(content, max_lines=1 << 31)
            done = await self.store.run(self.store.done_lines, doc["id"])
            run.completed, run.failed = await self.store.run(self.store.counts, doc["id"])
            run.todo = [line for line in lines if line.number not in done]
            run.todo.reverse()  # popped from the end: the input's order
            if doc["status"] == "cancelling":
                run.ending = "cancelled"
            elif doc["status"] == "in_progress":
                self.metrics.waiting.inc(len(run.todo))
                try:
                    await self._lines(run)
                finally:
                    self.metrics.waiting.dec(len(run.todo))
            if run.ending == "stopping":
                return  # the gateway stops: what is not answered runs at the next start
            await self._finish(run)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s stopped on an error; it resumes at the next start", doc["id"])
        finally:
            if self.runs.get(doc["id"]) is run:
                del self.runs[doc["id"]]

    async def _lines(self, run: Run) -> None:
        """Run the lines until all are answered, the window ends, or the batch is cancelled or the
        gateway stops (then the lines running are hung up, and their workers end at once)."""
        workers = [asyncio.ensure_future(self._worker(run)) for _ in range(self.cfg.in_flight_per_batch)]
        all_done = asyncio.gather(*workers)
        try:
            await asyncio.wait([all_done], timeout=max(run.doc["expires_at"] - time.time(), 0.0))
        finally:
            if not all_done.done():
                self.end(run, "expired")
            await asyncio.wait([all_done])  # (each worker returns once its line has hung up)
        all_done.result()

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
        while run.todo and not run.ending:
            pause = run.paused_until - time.time()
            if pause > 0:
                await _nap(run, min(pause, MAX_PAUSE_S))
                continue
            run.pause_reason = ""
            line = run.todo.pop()
            async with turns:
                if run.ending:
                    run.todo.append(line)
                    return
                result = await self._line(run, line)
            if result is None:  # paused (a quota), or hung up (cancel, expiry, shutdown): not done
                run.todo.append(line)
                continue
            await self.store.add_result(result)
            self.metrics.waiting.dec()
            self.lines_done += 1
            if result.ok:
                run.completed += 1
                self.metrics.lines.labels("completed").inc()
            else:
                run.failed += 1
                self.metrics.lines.labels("failed").inc()

    async def _line(self, run: Run, line: InputLine) -> Result | None:
        """Run one line to its outcome: its result, or None when it must wait (a quota, an end)."""
        doc = run.doc
        endpoint = ENDPOINTS[line.url]
        # A chat or completions line that can be cut and continued exactly is asked as a stream and
        # assembled here: a stream of the batch class may be preempted (suspended for a better
        # class, resumed later), a non-streamed answer holds its slot to the end.
        streamed = endpoint in ("chat", "completions") and suspendable(line.body, endpoint)
        data = {**line.body, "stream": True, "stream_options": {"include_usage": True}} if streamed else line.body
        body = orjson.dumps(data)
        answer = Answer()
        for attempt in range(self.cfg.line_attempts):
            pool = self.idle.pool_of(line.body.get("model"), endpoint)
            if not await self.idle.enter(pool, doc["_owner"], lambda: bool(run.ending)):
                return None  # the batch ends
            request = Line(line.url, body, key_id=doc["_key_id"], class_name=self.class_name, batch_id=doc["id"],
                           cap=self.gateway.cfg.limits.max_answer_bytes)
            run.running.add(request)
            self.metrics.running.inc()
            try:
                answer = await request.run(self.gateway, endpoint)
            finally:
                run.running.discard(request)
                self.metrics.running.dec()
                self.idle.leave(pool, doc["_owner"])
            if request.too_large:
                return Result(doc["id"], line.number, False, error_record(
                    line.custom_id, "answer_too_large", "The answer was larger than [limits] max_answer_bytes."))
            if run.ending or answer.status == 0:
                return None  # hung up: cancelled or expired; or the gateway is stopping
            if streamed and answer.status == 200:
                _assemble(answer, endpoint)
            code = _error_code(answer)
            if code == "quota_exceeded":
                run.paused_until = time.time() + min(answer_retry_after(answer), MAX_PAUSE_S)
                run.pause_reason = "quota_exceeded"
                return None
            if code in PASSING and attempt + 1 < self.cfg.line_attempts:
                await _nap(run, min(2.0 ** attempt, 30.0))
                if run.ending:
                    return None
                continue
            break
        ptok, ctok = usage_of(answer.body) if answer.status == 200 else (0, 0)
        return Result(doc["id"], line.number, answer.status == 200, answer_record(line.custom_id, answer), ptok, ctok)

    async def _finish(self, run: Run) -> None:
        """Lines not answered get their error (expired, cancelled); the output and error files are
        assembled from the store's rows; the batch ends."""
        doc = run.doc
        now = time.time()
        if run.ending and doc["status"] != "finalizing":
            code, message = (("batch_cancelled", "This request was not run: the batch was cancelled.")
                             if run.ending == "cancelled" else
                             ("batch_expired", "This request could not be run before the batch's completion "
                                               "window ended."))
            left = sorted(run.todo, key=lambda line: line.number)
            for line in left:  # one commit for them all (grouped by the store)
                await self.store.add_result(Result(doc["id"], line.number, False,
                                                   error_record(line.custom_id, code, message)))
            self.metrics.lines.labels(run.ending).inc(len(left))
            run.todo = []
        final = run.ending or doc.get("_final") or "completed"
        if doc["status"] != "finalizing":
            doc.update(status="finalizing", finalizing_at=int(now), _final=final)
            await self.store.run(self.store.put_batch, doc)
        completed, failed = await self.store.run(self.store.counts, doc["id"])
        outputs = []
        for purpose, n, field_name in (("batch_output", completed, "output_file_id"),
                                       ("batch_error", failed, "error_file_id")):
            if n:
                fid = doc.get(f"_{field_name}") or "file-" + secrets.token_hex(12)
                doc[f"_{field_name}"] = fid
                outputs.append(FileRow(fid, doc["_owner"], purpose, f"{doc['id']}_{purpose.split('_')[1]}.jsonl",
                                       0, n, now))
        await self.store.run(self.store.put_batch, doc)  # the files' ids, before they exist
        ptok, ctok = await self.store.run(self.store.tokens, doc["id"])
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final]
        doc.update(status=final, **{stamp: int(time.time())},
                   output_file_id=doc.get("_output_file_id"), error_file_id=doc.get("_error_file_id"),
                   request_counts={"total": doc["request_counts"]["total"], "completed": completed, "failed": failed},
                   usage={"input_tokens": ptok, "output_tokens": ctok, "total_tokens": ptok + ctok})
        run.completed, run.failed = completed, failed
        await self.store.run(self.store.finish, doc, outputs)
        log.info("batch %s %s: %d completed, %d failed", doc["id"], final, completed, failed)

    # -- retention --------------------------------------------------------------------------------
    async def _sweep(self) -> None:
        every = min(self.cfg.retention_h * 3600 / 10, 600.0)
        while True:
            await self.sweep_once()
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


def _assemble(answer: Answer, endpoint: str) -> None:
    """A streamed line's answer as the non-streamed body (proxy/assemble.py), or the error event
    that ended its stream (then a 502, tried again as a passing failure)."""
    raw = answer.body
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data:") and b'"error"' in event[:64]:
            with contextlib.suppress(orjson.JSONDecodeError):
                obj = orjson.loads(event[5:])
                if isinstance(obj, dict) and "error" in obj:
                    answer.status, answer.chunks = 502, [orjson.dumps(obj)]
                    return
    try:
        answer.chunks = [assemble(raw, endpoint)]
    except UpstreamError as err:
        answer.status, answer.chunks = 502, [err.body()]


async def _nap(run: Run, seconds: float) -> None:
    """Wait ``seconds``, or less if the batch ends meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await run.wake.wait()


def _error_code(answer: Answer) -> str:
    """The gateway's error code of an answer (the Anthropic shape has none: its status tells)."""
    if answer.status == 200:
        return ""
    try:
        err = orjson.loads(answer.body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        err = {}
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, str):
        return code
    if isinstance(err, dict) and err.get("type") == "insufficient_quota":
        return "quota_exceeded"
    return {429: "rate_limit_exceeded", 502: "upstream_error", 503: "no_backend",
            504: "upstream_timeout"}.get(answer.status, "")


def answer_retry_after(answer: Answer) -> float:
    return answer.retry_after or MAX_PAUSE_S
