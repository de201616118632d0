"""The Batch API's routes, as OpenAI defines them (server/routes.py points here):

    POST   /v1/files                 upload (multipart: ``file``, ``purpose=batch``), checked line by line
    GET    /v1/files                 the caller's files (``purpose``, ``limit``, ``after``)
    GET    /v1/files/{id}            one
    GET    /v1/files/{id}/content    its bytes (an input, or a batch's output or error file)
    DELETE /v1/files/{id}            remove it (not while an active batch reads it)
    POST   /v1/batches               {"input_file_id", "endpoint", "completion_window", "metadata"}
    GET    /v1/batches               the caller's batches (``limit``, ``after``)
    GET    /v1/batches/{id}          one, with its progress
    POST   /v1/batches/{id}/cancel   cancel it

Who sees what: a key sees its own files and batches only (another's answer 404, as if it did not
exist); the admin key (``[admin] key``) sees all, but only from ``[admin] allow``'s networks and
through the admin key's one check (tenants/admin_key.py: throttled before it is compared); from
elsewhere it is the unknown key it is there. Without keys in use, everyone is one owner and the
admin key is not asked for (the placeholder key a client sends then is no attempt at it).

Bounds: an upload is held once (its file part is a view of the body, checked a line at a time,
written from that view); batches in progress are limited per key and in all (``[batches]
max_batches_per_key``, ``max_batches_in_progress``: 429 ``too_many_batches`` with ``Retry-After``).
Every error is a JSON one: a full disk is a 507 ``disk_full``, another fault of the store a 503
``batch_store_error`` (never the server's bare 500), and a failed write leaves no ``.part`` file.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import orjson
from prometheus_client import CollectorRegistry

from passerelle.batches.parts import Parts
from passerelle.batches.runner import BatchMetrics, Runner, public
from passerelle.batches.status import BatchStatus, move
from passerelle.batches.store import STORE_ERRORS, BatchStore, FileRow
from passerelle.batches.validate import (
    ENDPOINTS,
    Summary,
    check_batch,
    check_content,
    check_file,
    check_metadata,
    max_line_bytes,
    window_seconds,
)
from passerelle.config import BatchesConfig
from passerelle.errors import BodyTooLarge, Forbidden, GatewayError, InvalidRequest
from passerelle.proxy.exchange import Receive, Scope, Send, header
from passerelle.proxy.intake import read_request_body
from passerelle.proxy.protocols import form_parts
from passerelle.tenants.admin_key import AdminKeyCheck
from passerelle.tenants.keys import ApiKey
from passerelle.tenants.policy import presented_key

MAX_JSON = 64 * 1024  # a batch's creation request
_FILENAME = re.compile(rb'filename="([^"]*)"', re.I)


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


class FileTooLarge(InvalidRequest):
    status, code = 413, "file_too_large"


class StorageFull(InvalidRequest):
    status, code = 413, "storage_full"


class FileInUse(InvalidRequest):
    status, code = 409, "file_in_use"


class TooManyBatches(GatewayError):
    """A key's batches in progress, or all of them, are at their limit: one must end first."""

    status, type, code = 429, "rate_limit_error", "too_many_batches"


class DiskFull(GatewayError):
    status, type, code = 507, "server_error", "disk_full"


class BatchStoreError(GatewayError):
    status, type, code = 503, "server_error", "batch_store_error"


RETRY_BATCH_S = 60  # Retry-After of too_many_batches: a batch rarely ends sooner


def _store_faults(handler: Callable[[BatchApi, Scope, Receive, Send], Awaitable[None]]
                  ) -> Callable[[BatchApi, Scope, Receive, Send], Awaitable[None]]:
    """A fault of the store (a full disk, a database error) as the API's JSON error, not the
    server's bare 500."""

    @functools.wraps(handler)
    async def guarded(self: BatchApi, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await handler(self, scope, receive, send)
        except STORE_ERRORS as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull("The gateway's disk is full: the Batch API cannot write now; retry later.",
                               retry_after=60) from None
            raise BatchStoreError(f"The Batch API's store failed ({exc.__class__.__name__}); retry later.",
                                  retry_after=5) from None

    return guarded


def _query(scope: Scope) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}


def _limit(q: dict[str, str]) -> int:
    try:
        n = int(q.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("'limit' must be an integer between 1 and 10000.", param="limit") from None
    if not 1 <= n <= 10000:
        raise InvalidRequest("'limit' must be an integer between 1 and 10000.", param="limit")
    return n


async def _json_response(send: Send, status: int, obj: Any) -> None:
    body = orjson.dumps(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _page(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = rows[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(rows) > limit}


class Caller:
    """Who asks: ``owner`` the key id ("" without keys), None for the admin (sees all)."""

    def __init__(self, owner: str | None, key: ApiKey | None) -> None:
        self.owner, self.key = owner, key

    def sees(self, owner: str) -> bool:
        return self.owner is None or self.owner == owner


class BatchApi:
    """The routes' handlers; ``start()`` opens the store in ``root`` and resumes the batches in it."""

    def __init__(self, cfg: BatchesConfig, root: Path, parts: Parts, registry: CollectorRegistry,
                 admin: AdminKeyCheck) -> None:
        self.cfg, self.root, self.parts, self.admin = cfg, root, parts, admin
        self.metrics = BatchMetrics(registry)
        self._store: BatchStore | None = None
        self._runner: Runner | None = None
        self._creating: dict[str, int] = {}  # batches being created, by owner (counted in the limits)

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            raise NotFound("The Batch API is not started.")
        return self._store

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise NotFound("The Batch API is not started.")
        return self._runner

    async def start(self) -> None:
        if not self.cfg.enabled:
            return
        self._store = store = await asyncio.to_thread(BatchStore, self.root)
        self._runner = Runner(store, self.parts, self.cfg, self.metrics)
        await self._runner.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._store is not None:
            self._store.close()
        self._runner = self._store = None

    def snapshot(self) -> dict[str, Any]:
        """Progress for /admin/stats and the dashboard."""
        return self._runner.snapshot() if self._runner is not None else {"enabled": False}

    def caller(self, scope: Scope) -> Caller:
        if not self.cfg.enabled:
            raise NotFound("The Batch API is turned off on this gateway ([batches] enabled = false).")
        if not self.parts.keys.in_use:
            # Everyone is the one owner and the admin key would see nothing more; the placeholder key
            # an SDK must send ("sk-none") is no guess at it, and must not lock the admin out.
            return Caller("", None)
        presented = presented_key(scope)
        # (only from [admin] allow, never an API key of ours; RateLimited while throttled, nothing compared)
        if self.admin.candidate(scope, presented) and self.admin.verify(scope, "batches", key=presented.encode()):
            return Caller(None, None)
        key = self.parts.keys.authenticate(scope)
        return Caller(key.id if key is not None else "", key)

    # -- files ------------------------------------------------------------------------------------
    @_store_faults
    async def files(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = self.caller(scope)
        if scope["method"] == "POST":
            await _json_response(send, 200, await self._upload(scope, receive, who))
            return
        q = _query(scope)
        limit = _limit(q)
        rows = await self.store.run(self.store.files, who.owner, q.get("purpose"), limit + 1, q.get("after"))
        await _json_response(send, 200, _page([r.describe() for r in rows], limit))

    async def _upload(self, scope: Scope, receive: Receive, who: Caller) -> dict[str, Any]:
        try:
            body = await read_request_body(scope, receive, self.cfg.max_file_bytes + 64 * 1024)
        except BodyTooLarge:
            raise FileTooLarge(f"The file is larger than {self.cfg.max_file_bytes} bytes ([batches] "
                               "max_file_bytes).", param="file") from None
        ctype = header(scope, b"content-type")
        purpose, span, filename = None, None, "upload.jsonl"
        for part in form_parts(body, ctype):
            if part.name == "purpose" and not part.is_file and purpose is None:
                purpose = body[part.start:min(part.end, part.start + 64)].decode("utf-8", "replace").strip()
            elif part.name == "file" and span is None:
                span = (part.start, part.end)  # (the content stays in the body: no copy)
                head = _FILENAME.findall(body[max(0, part.start - 4096):part.start])
                if head:
                    filename = head[-1].decode("utf-8", "replace")[:256]
        if purpose != "batch":
            raise InvalidRequest("'purpose' must be 'batch' (the only files this gateway keeps).", param="purpose")
        if span is None:
            raise InvalidRequest("Missing the 'file' part of the form.", param="file")
        size = span[1] - span[0]
        if size > self.cfg.max_file_bytes:
            raise FileTooLarge(f"The file is larger than {self.cfg.max_file_bytes} bytes ([batches] "
                               "max_file_bytes).", param="file")
        # (in a thread: checking 64 MiB takes seconds the event loop keeps serving in)
        summary = await asyncio.to_thread(check_content, body, *span, max_lines=self.cfg.max_lines,
                                          max_line_bytes=max_line_bytes(self.parts.cfg.server.max_body_bytes))
        total = await self.store.run(self.store.total_bytes)
        if total + size > self.cfg.max_total_bytes:
            raise StorageFull(f"The gateway's batch files would pass {self.cfg.max_total_bytes} bytes in all "
                              "([batches] max_total_bytes): delete files you no longer need.", param="file")
        row = FileRow("file-" + secrets.token_hex(12), who.owner or "", "batch", filename, size, summary.lines,
                      time.time())
        content = memoryview(body)[span[0]:span[1]]
        await self.store.run(self.store.add_file, row, [content])  # on disk before the answer
        return row.describe()

    async def _own_file(self, who: Caller, file_id: str) -> FileRow:
        row = await self.store.run(self.store.file, file_id)
        if row is None or not who.sees(row.owner):
            raise NotFound(f"No such file: {file_id[:100]}.", param="file_id")
        return row

    @_store_faults
    async def file_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = self.caller(scope)
        rest = scope["path"].removeprefix("/v1/files/").strip("/")
        file_id, _, tail = rest.partition("/")
        if tail not in ("", "content") or (tail and scope["method"] not in ("GET", "HEAD")):
            raise NotFound(f"No route for {scope['method']} {scope['path'][:200]}.")
        row = await self._own_file(who, file_id)
        if scope["method"] == "DELETE":
            if await self.store.run(self.store.file_in_use, file_id):
                raise FileInUse(f"The file {file_id} is the input of a batch in progress; cancel it first.")
            await self.store.run(self.store.delete_file, file_id)
            await _json_response(send, 200, {"id": file_id, "object": "file", "deleted": True})
        elif tail == "content":
            await self._content(row, send)
        else:
            await _json_response(send, 200, row.describe())

    async def _content(self, row: FileRow, send: Send) -> None:
        try:
            f = await self.store.run(open, self.store.content_path(row.id), "rb")
        except FileNotFoundError:
            raise NotFound(f"The content of {row.id} is gone.", param="file_id") from None
        try:
            size = os.fstat(f.fileno()).st_size
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/jsonl"),
                                    (b"content-length", str(size).encode())]})
            sent = 0
            while True:
                chunk = await self.store.run(f.read, 1 << 20)
                sent += len(chunk)
                last = not chunk or sent >= size
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return
        finally:
            f.close()

    # -- batches ----------------------------------------------------------------------------------
    @_store_faults
    async def batches(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = self.caller(scope)
        if scope["method"] == "POST":
            await _json_response(send, 200, await self._create(scope, receive, who))
            return
        q = _query(scope)
        limit = _limit(q)
        rows = await self.store.run(self.store.batches, who.owner, limit + 1, q.get("after"))
        await _json_response(send, 200, _page([public(self.runner.live(d["id"]) or d) for d in rows], limit))

    async def _create(self, scope: Scope, receive: Receive, who: Caller) -> dict[str, Any]:
        if who.owner is None and self.parts.keys.in_use:
            raise Forbidden("A batch runs for the API key that creates it, and the admin key is not one: create it "
                            "with the key it should be accounted to.")
        owner = who.owner or ""
        self._admit(owner)
        self._creating[owner] = self._creating.get(owner, 0) + 1
        try:
            return await self._create_batch(scope, receive, who)
        finally:
            self._creating[owner] -= 1
            if not self._creating[owner]:
                del self._creating[owner]

    def _admit(self, owner: str) -> None:
        """Refuse a batch past the limits of batches in progress (those being created count)."""
        mine = self.runner.in_progress(owner) + self._creating.get(owner, 0)
        if mine >= self.cfg.max_batches_per_key:
            raise TooManyBatches(f"This key already has {mine} batches in progress, the most one key may have "
                                 "([batches] max_batches_per_key): wait for one to end, or cancel one.",
                                 retry_after=RETRY_BATCH_S)
        everyone = self.runner.in_progress() + sum(self._creating.values())
        if everyone >= self.cfg.max_batches_in_progress:
            raise TooManyBatches(f"The gateway already runs {everyone} batches, the most it runs at once "
                                 "([batches] max_batches_in_progress): retry later.", retry_after=RETRY_BATCH_S)

    async def _create_batch(self, scope: Scope, receive: Receive, who: Caller) -> dict[str, Any]:
        raw = await read_request_body(scope, receive, MAX_JSON)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequest("The request body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        endpoint = data.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:  # (a list or an object is unhashable)
            raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
        name = ENDPOINTS[endpoint]
        if not self.parts.registry.models_on(name):
            raise InvalidRequest(f"No model is served on {endpoint} here.", param="endpoint")
        window = window_seconds(data.get("completion_window"), self.cfg.max_window_h * 3600)
        metadata = check_metadata(data.get("metadata"))
        file_id = data.get("input_file_id")
        if not isinstance(file_id, str):
            raise InvalidRequest("'input_file_id' must be a file id.", param="input_file_id")
        row = await self._own_file(who, file_id)
        if row.purpose != "batch":
            raise InvalidRequest(f"The file {file_id} is not a batch input (purpose {row.purpose}).",
                                 param="input_file_id")
        summary = await self.store.run(self._check_stored, row.id)
        check_batch(summary, endpoint, lambda model: self._refuses(model, name, endpoint, who.key))
        if await self.store.run(self.store.total_bytes) > self.cfg.max_total_bytes:
            raise StorageFull(f"The gateway's batch files are past {self.cfg.max_total_bytes} bytes in all "
                              "([batches] max_total_bytes): delete files you no longer need.")
        now = int(time.time())
        key = who.key
        doc: dict[str, Any] = {
            "id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": file_id, "completion_window": data["completion_window"],
            "status": BatchStatus.VALIDATING.value,
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + int(window), "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": summary.lines, "completed": 0, "failed": 0}, "metadata": metadata,
            "_owner": who.owner or "", "_key_id": key.id if key else None, "_tenant": key.tenant if key else ""}
        move(doc, BatchStatus.IN_PROGRESS, now)  # (checked above)
        await self.store.run(self.store.put_batch, doc)  # on disk before the answer
        self.runner.submit(doc)
        return public(doc)

    def _check_stored(self, file_id: str) -> Summary:
        """The stored input file checked again, streamed (on the store's thread)."""
        with open(self.store.content_path(file_id), "rb") as f:
            return check_file(f, max_lines=self.cfg.max_lines,
                              max_line_bytes=max_line_bytes(self.parts.cfg.server.max_body_bytes))

    def _refuses(self, model: str, name: str, endpoint: str, key: ApiKey | None) -> str | None:
        catalogue = self.parts.catalogue
        entry = catalogue.lookup(model)
        if entry is None:
            return f"the model {model[:100]!r} is not served here"
        if not catalogue.pool(entry, name):
            return f"the model {model[:100]!r} is not served on this endpoint"
        if key is not None and not key.allows(entry.name):
            return f"this API key may not use the model {model[:100]!r}"
        return None

    @_store_faults
    async def batch_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = self.caller(scope)
        rest = scope["path"].removeprefix("/v1/batches/").strip("/")
        batch_id, _, tail = rest.partition("/")
        if (tail, scope["method"]) not in (("", "GET"), ("", "HEAD"), ("cancel", "POST")):
            raise NotFound(f"No route for {scope['method']} {scope['path'][:200]}.")
        doc = self.runner.live(batch_id) or await self.store.run(self.store.batch, batch_id)
        if doc is None or not who.sees(doc["_owner"]):
            raise NotFound(f"No such batch: {batch_id[:100]}.", param="batch_id")
        if tail == "cancel":
            doc = await self.runner.cancel(doc)
        await _json_response(send, 200, public(doc))

