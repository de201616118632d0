"""The gateway in the test's own event loop: the ASGI app called directly, in front of the fake
runtime served on a loopback socket of the same loop. No subprocess, no llama-server: a test of a
request path (errors, limits, keys, retries, disconnects) runs in milliseconds.

    async with fake_runtime(ttft_ms=5, itl_ms=1) as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", {"model": "fake-model", "messages": [...]})
        assert resp.status == 200 and gw.records[-1].cause is Cause.OK
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from passerelle.cli import build_app
from passerelle.config import AuthConfig, BackendConfig, Config
from passerelle.observe.record import RequestRecord
from passerelle.server.app import App
from passerelle.testing.fake_runtime import Connection, FakeBackend, FakeConfig


@dataclass
class Fake:
    url: str
    runtime: FakeBackend

    def backend_config(self, name: str = "fake", **changes: Any) -> BackendConfig:
        base = BackendConfig(name=name, kind="openai", url=self.url, models=("fake-model",), max_concurrency=4)
        return dataclasses.replace(base, **changes)


@contextlib.asynccontextmanager
async def fake_runtime(**options: Any) -> AsyncIterator[Fake]:
    """The fake runtime (passerelle/testing/fake_runtime.py) on a free loopback port of this loop."""
    runtime = FakeBackend(FakeConfig(**{"ttft_ms": 5.0, "itl_ms": 1.0, **options}))
    conns: list[Connection] = []

    def connection() -> Connection:
        conns.append(Connection(runtime))
        return conns[-1]

    server = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Fake(f"http://127.0.0.1:{port}", runtime)
    finally:
        server.close()
        for conn in conns:
            if conn.transport is not None:
                conn.transport.abort()
        await server.wait_closed()


class _Transport:
    """What the gateway finds under a uvicorn send (``send.__self__.transport``)."""

    def __init__(self, resp: Response, gone: asyncio.Event) -> None:
        self.resp, self.gone = resp, gone

    def abort(self) -> None:
        self.resp.aborted = True
        self.gone.set()

    def is_closing(self) -> bool:
        return self.gone.is_set()


class _Cycle:
    """uvicorn's per-request object keeps the transport."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport


class _Bound:
    """The ASGI send: a callable with ``__self__``, as uvicorn's bound method has (the gateway looks
    for the connection there)."""

    def __init__(self, owner: Any, fn: Any) -> None:
        self.__self__ = owner
        self._fn = fn

    async def __call__(self, message: dict[str, Any]) -> None:
        await self._fn(message)


@dataclass
class Response:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    aborted: bool = False  # the gateway dropped the connection
    size: int = 0  # body bytes received (kept in ``chunks`` or not)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[bytes]:
        """The SSE data lines of a streamed answer."""
        return [line[5:].strip() for line in self.body.split(b"\n") if line.startswith(b"data:")]


@dataclass
class InProcessGateway:
    app: App
    records: list[RequestRecord]

    async def request(self, method: str, path: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
                      client: str = "127.0.0.1", leave_after_chunks: int | None = None,
                      stop_reading_after_chunks: int | None = None, timeout: float = 10.0,
                      keep_body: bool = True, disconnect: asyncio.Event | None = None) -> Response:
        """One request through the app. ``leave_after_chunks``: the client hangs up after that many
        body chunks (0: right after the response head). ``stop_reading_after_chunks``: after that
        many, every send blocks as on a full socket, until the gateway aborts the connection
        (``Response.aborted``). ``keep_body=False``: the body is counted (``Response.size``), not kept.
        ``disconnect``: the client hangs up when the test sets it."""
        hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if body:
            hdrs.append((b"content-length", str(len(body)).encode()))
        path_only, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path_only, "raw_path": path_only.encode(), "query_string": query.encode(),
                 "headers": hdrs, "client": (client, 50000), "server": ("127.0.0.1", 8080)}
        resp = Response()
        gone = disconnect if disconnect is not None else asyncio.Event()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if gone.is_set():
                raise OSError("client gone")
            if stop_reading_after_chunks is not None and len(resp.chunks) >= stop_reading_after_chunks \
                    and resp.status:
                await gone.wait()  # flow control: nothing is taken until the connection is dropped
                return
            if message["type"] == "http.response.start":
                resp.status = message["status"]
                resp.headers = dict(message.get("headers", []))
            elif message.get("body"):
                resp.size += len(message["body"])
                if keep_body or not resp.chunks:  # (the first piece is kept: an error's body)
                    resp.chunks.append(message["body"])
            if leave_after_chunks is not None and len(resp.chunks) >= leave_after_chunks and resp.status:
                gone.set()
            if message["type"] == "http.response.body" and not message.get("more_body"):
                gone.set()  # uvicorn answers receive() with a disconnect once the response is complete

        async with asyncio.timeout(timeout):
            await self.app(scope, receive, _Bound(_Cycle(_Transport(resp, gone)), send))
        return resp

    async def post(self, path: str, obj: Any, **kw: Any) -> Response:
        return await self.request("POST", path, orjson.dumps(obj), headers={"content-type": "application/json",
                                                                            **kw.pop("headers", {})}, **kw)

    async def get(self, path: str, **kw: Any) -> Response:
        return await self.request("GET", path, **kw)


@contextlib.asynccontextmanager
async def gateway(*backends: BackendConfig, db: Path | None = None, **sections: Any) -> AsyncIterator[InProcessGateway]:
    """An App for ``backends`` (sections of Config replaced by ``sections``), started and stopped
    in this loop. ``db``: the keys and usage SQLite file (give a tmp_path)."""
    cfg = Config(backends=tuple(backends), **sections)
    if db is not None:
        cfg = dataclasses.replace(cfg, auth=dataclasses.replace(cfg.auth if "auth" in sections else AuthConfig(),
                                                                db=str(db)))
    app = build_app(cfg)
    records: list[RequestRecord] = []
    app.gateway.listeners.append(records.append)
    await app.startup()
    try:
        yield InProcessGateway(app, records)
    finally:
        await app.shutdown()
