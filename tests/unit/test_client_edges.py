"""What a client controls, bounded, in-process (tests/inprocess.py): the body's deadline and budget,
the key checked before the body, state built from client strings (tenants, labels, affinity),
valid input that used to fail, reload of an emptied file, and requests ended by a shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import tracemalloc
from collections import OrderedDict
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from passerelle import cli
from passerelle.config import Config, RoutingConfig, SchedulerConfig, ServerConfig, load_config
from passerelle.errors import Cause, ConfigError
from passerelle.observe.accesslog import AccessLog, record_fields
from passerelle.observe.record import RequestRecord
from passerelle.scheduling.scheduler import AFFINITY_ENTRY_BYTES
from passerelle.server.service import ReloadRefused
from passerelle.tenants.keys import KeyStore
from passerelle.tenants.names import user_tenant
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    """Keys and usage of these gateways in the test's folder, not the user's state directory."""
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path / "state"))


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


def settled(gw) -> bool:
    s = gw.app.scheduler
    return not s.waiting and not any(s.running.values()) and all(b.in_flight == 0 for b in gw.app.registry.backends)


class Client:
    """A hand-driven client: ``parts`` are the body pieces it sends; ``None`` in them means it
    goes silent (never sends the rest)."""

    def __init__(self, parts: list[bytes | None], headers: dict[str, str] | None = None,
                 length: int | None = None) -> None:
        self.parts = parts
        body_len = length if length is not None else sum(len(p) for p in parts if p)
        self.headers = [(b"content-type", b"application/json"), (b"content-length", str(body_len).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]
        self.received = 0  # receive() calls
        self.status = 0
        self.resp_headers: dict[bytes, bytes] = {}
        self.body = b""
        self.done = asyncio.Event()

    def scope(self, path: str = "/v1/chat/completions") -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                "headers": self.headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if self.parts:
            part = self.parts.pop(0)
            if part is not None:
                return {"type": "http.request", "body": part, "more_body": bool(self.parts)}
        await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.resp_headers = dict(message["headers"])
        else:
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                self.done.set()

    def error(self) -> dict[str, Any]:
        return orjson.loads(self.body)["error"]


async def test_a_body_that_stops_coming_gets_408_within_body_timeout_s():
    async with fake_runtime() as fake, gateway(fake.backend_config(), server=ServerConfig(body_timeout_s=0.3)) as gw:
        client = Client([b'{"model": "fake-model",', None], length=200)
        async with asyncio.timeout(3):
            await gw.app(client.scope(), client.receive, client.send)
        assert client.status == 408 and client.error()["code"] == "request_timeout"
        assert client.resp_headers[b"connection"] == b"close"  # the rest of the body is not read
        assert gw.records[0].cause is Cause.INVALID_REQUEST and gw.records[0].status == 408
        assert gw.app.body_budget.used == 0 and settled(gw)


async def test_the_key_is_checked_before_the_body_is_read(tmp_path):
    KeyStore(tmp_path / "keys.db").create("alice")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db") as gw:
        client = Client([None], length=8 * 1024 * 1024 - 1)  # announces 8 MiB, never sends them
        async with asyncio.timeout(3):
            await gw.app(client.scope(), client.receive, client.send)
        assert client.status == 401 and client.received == 0
        assert gw.records[0].cause is Cause.UNAUTHORIZED


async def test_bodies_held_at_once_have_a_budget():
    server = ServerConfig(max_body_bytes=1024, max_body_bytes_total=1500)
    async with fake_runtime() as fake, gateway(fake.backend_config(), server=server) as gw:
        body = orjson.dumps({**CHAT, "pad": "x" * 700})
        first = Client([body[:500], None], length=len(body))  # holds 500 bytes, silent
        task = asyncio.create_task(gw.app(first.scope(), first.receive, first.send))
        await until(lambda: gw.app.body_budget.used >= 500, 3, "the first body's 500 bytes held")
        second = Client([body[:600], body[600:]])
        three = Client([body[:600], body[600:]])
        await gw.app(second.scope(), second.receive, second.send)  # 500 + 777 fits
        assert second.status == 200
        held = gw.app.body_budget.used
        assert held == 500  # the second's body was given back when it ended
        await gw.app(three.scope(), three.receive, three.send)
        assert three.status == 200
        first.done.set()  # the first one's client leaves
        await task
        assert gw.app.body_budget.used == 0
        # now one that does not fit beside a held one
        gw.app.body_budget.used = 1000  # as if other requests held 1000 bytes
        over = Client([body])
        await gw.app(over.scope(), over.receive, over.send)
        assert over.status == 503 and over.error()["code"] == "server_busy" and over.resp_headers[b"retry-after"]
        assert gw.records[-1].cause is Cause.SERVER_BUSY and gw.app.body_budget.used == 1000


async def test_stream_options_null_is_valid():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": None})
        assert resp.status == 200 and resp.events()[-1] == b"[DONE]"
        assert not any(b'"usage"' in e for e in resp.events())  # the client did not ask for usage
        assert gw.records[0].cause is Cause.OK and gw.records[0].usage_from_server
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream_options": None})
        assert resp.status == 200


async def test_tenants_from_user_are_bounded_in_length_and_number_and_never_labels():
    async with fake_runtime() as fake, gateway(fake.backend_config(),
                                               scheduler=SchedulerConfig(max_tenants=100)) as gw:
        for i in range(150):
            resp = await gw.post("/v1/chat/completions", {**CHAT, "user": f"{i:03d}" + "u" * 10_000})
            assert resp.status == 200
        assert {len(r.tenant) for r in gw.records} == {64}
        assert len({r.tenant for r in gw.records}) == 150  # distinct users stay distinct
        assert len(gw.app.scheduler.tenants) == 100 and len(gw.app.scheduler.served_tokens) == 100
        text = generate_latest(gw.app.metrics.registry)
        assert b'tenant="other"' in text and b"uuuu" not in text
        assert settled(gw)


async def test_a_keys_tenant_gets_its_own_label(tmp_path):
    _, secret = KeyStore(tmp_path / "keys.db").create("alice")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db") as gw:
        resp = await gw.post("/v1/chat/completions", CHAT, headers={"authorization": f"Bearer {secret}"})
        assert resp.status == 200
        assert b'tenant="alice"' in generate_latest(gw.app.metrics.registry)


async def test_affinity_keys_are_hashed_and_the_map_is_sized_in_bytes():
    routing = RoutingConfig(affinity_max_bytes=65536)
    async with fake_runtime() as fake, gateway(fake.backend_config("a"), fake.backend_config("b"),
                                               routing=routing) as gw:
        for i in range(400):
            resp = await gw.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": str(i)}]},
                                 headers={"x-session-id": f"{i}" + "s" * 50_000})
            assert resp.status == 200
        keys = list(gw.app.scheduler.affinity)
        assert {len(k) for k in keys} == {26}
        assert len(keys) == 65536 // AFFINITY_ENTRY_BYTES


async def test_a_huge_model_name_is_clipped_wherever_it_is_kept():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "model": "m" * 1_000_000})
        assert resp.status == 404 and gw.records[0].cause is Cause.INVALID_REQUEST
        assert len(orjson.dumps(record_fields(gw.records[0]))) < 2048  # the access-log line
        assert len(gw.app.stores.usage._rows[-1][4]) == 256  # the usage row's model
        [err] = gw.app.live.snapshot(backends=[], waiting={})["recent_errors"]
        assert len(err["model"]) == 256 and len(err["error"]) <= 512


def test_one_affinity_entry_costs_at_most_affinity_entry_bytes():
    import hashlib

    names = ["replica-a", "replica-b"]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        m: OrderedDict[str, str] = OrderedDict()
        for i in range(20_000):
            m["s:" + hashlib.blake2b(str(i).encode(), digest_size=12).hexdigest()] = names[i % 2]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown / 20_000 <= AFFINITY_ENTRY_BYTES, grown / 20_000
    assert len(m) == 20_000


def test_user_tenant_keeps_short_names_and_cuts_long_ones_with_a_hash():
    assert user_tenant("alice", 64) == "alice"
    a, b = user_tenant("x" * 100 + "1", 32), user_tenant("x" * 100 + "2", 32)
    assert len(a) == len(b) == 32 and a != b and a.startswith("x" * 19 + "~")


def test_the_text_access_log_escapes_what_a_client_chose():
    out: list[str] = []

    class Sink:
        def write(self, s: str) -> None:
            out.append(s)

        def flush(self) -> None:
            pass

    log = AccessLog(fmt="text", stream=Sink())  # type: ignore[arg-type]
    rec = RequestRecord(id="req_1", endpoint="chat", model="m\n12:00:00 req_forged chat x -> 200 ok",
                        tenant="\x1b[2Jeve\u2028")
    rec.finish(Cause.OK, 200)
    log.write(rec)
    log.flush()
    text = "".join(out)
    assert text.count("\n") == 1 and "\x1b" not in text and "\u2028" not in text
    assert "m\\x0a12:00:00 req_forged" in text and "tenant=\\x1b[2Jeve\\u2028" in text


def test_passerelle_usage_escapes_tenant_names(tmp_path, capsys):
    store = KeyStore(tmp_path / "u.db")
    with store.conn:
        store.conn.execute("INSERT INTO usage (ts, tenant, class, model, cause, prompt_tokens, completion_tokens) "
                           "VALUES (?,?,?,?,?,?,?)", (1e10, "\x1b]0;pwned\x07bob", "standard", "m", "ok", 1, 2))
    assert cli.main(["usage", "--db", str(tmp_path / "u.db")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07bob" in out


async def test_reload_refuses_a_file_without_backends_while_backends_are_configured(tmp_path):
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        gw.app.loader = lambda: Config()  # an emptied file: valid TOML, "the embedded default"
        with pytest.raises(ReloadRefused) as info:
            await gw.app.reload()
        assert info.value.status == 409 and "--force" in info.value.message
        resp = await gw.request("POST", "/admin/reload")
        assert resp.status == 409 and resp.json()["error"]["code"] == "reload_refused"
        assert [b.name for b in gw.app.registry.backends] == ["fake"] and not gw.app.registry.backends[0].draining
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200


async def test_a_forced_reload_of_a_file_without_backends_goes_ahead(monkeypatch):
    async with fake_runtime() as fake, fake_runtime() as other, gateway(fake.backend_config()) as gw:
        gw.app.loader = lambda: Config()
        # a second fake runtime stands in for the embedded default (building llama-server is not the point)
        monkeypatch.setattr("passerelle.server.service.expand",
                            lambda cfg: dataclasses.replace(cfg, backends=(other.backend_config("local"),)))
        resp = await gw.request("POST", "/admin/reload?force=1")
        assert resp.status == 200
        assert {k: resp.json()[k] for k in ("added", "removed", "unchanged")} == {
            "added": ["local"], "removed": ["fake"], "unchanged": []}
        assert resp.json()["backends"] == {"added": ["local"], "removed": ["fake"], "replaced": [], "kept": []}
        assert not gw.app.backends_configured  # from now on, the embedded default is what runs
        # its first health check
        await until(lambda: any(b.name == "local" and b.stats.up for b in gw.app.registry.backends), 10,
                    "the embedded runtime up (its first health check)")
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 200


async def test_requests_running_past_the_grace_period_end_with_an_error_and_the_cause_shutdown():
    async with fake_runtime(itl_ms=50.0) as fake, gateway(fake.backend_config(max_concurrency=1),
                                                          server=ServerConfig(shutdown_grace_s=0.2)) as gw:
        streaming = asyncio.create_task(gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 500}))
        queued = asyncio.create_task(gw.post("/v1/chat/completions", CHAT))
        await until(lambda: len(gw.app.gateway.open) >= 2 and gw.app.scheduler.waiting, 3,
                    "one request streaming, one queued")
        gw.app.begin_shutdown()
        async with asyncio.timeout(5):
            stream, waiting = await streaming, await queued
        assert stream.status == 200 and b"[DONE]" not in stream.body
        assert orjson.loads(stream.events()[-1])["error"]["code"] == "shutting_down"
        assert waiting.status == 503 and waiting.json()["error"]["code"] == "shutting_down"
        assert [r.cause for r in gw.records] == [Cause.SHUTDOWN, Cause.SHUTDOWN]
        assert not gw.app.gateway.open and settled(gw)


async def test_the_shutdown_speaks_each_apis_own_error_shape():
    msg = {"model": "fake-model", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
    async with fake_runtime(itl_ms=50.0) as fake, \
            gateway(fake.backend_config(kind="llama-server", max_concurrency=1),
                    server=ServerConfig(shutdown_grace_s=0.2)) as gw:
        streaming = asyncio.create_task(gw.post("/v1/messages", {**msg, "stream": True}))
        queued = asyncio.create_task(gw.post("/v1/messages", msg))
        await until(lambda: len(gw.app.gateway.open) >= 2 and gw.app.scheduler.waiting, 3,
                    "one request streaming, one queued")
        gw.app.begin_shutdown()
        async with asyncio.timeout(5):
            stream, waiting = await streaming, await queued
        last = stream.body.rstrip().split(b"\n\n")[-1]
        assert last.startswith(b"event: error\ndata: ")  # Anthropic's error event, not OpenAI's
        assert orjson.loads(last.split(b"data: ", 1)[1])["error"]["type"] == "overloaded_error"
        assert waiting.status == 503 and waiting.json()["type"] == "error"
        assert waiting.headers[b"request-id"] == waiting.headers[b"x-request-id"]
        assert [r.cause for r in gw.records] == [Cause.SHUTDOWN, Cause.SHUTDOWN] and settled(gw)


async def test_the_shutdown_ends_a_responses_stream_with_its_own_error_event():
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 500, "stream": True}
    async with fake_runtime(itl_ms=50.0) as fake, \
            gateway(fake.backend_config(kind="llama-server"), server=ServerConfig(shutdown_grace_s=0.2)) as gw:
        streaming = asyncio.create_task(gw.post("/v1/responses", body))
        await until(lambda: any(ex.started for ex in gw.app.gateway.open), 3, "the stream started")
        gw.app.begin_shutdown()
        async with asyncio.timeout(5):
            stream = await streaming
        last = stream.body.rstrip().split(b"\n\n")[-1]
        assert last.startswith(b"event: error\ndata: ")  # Responses' error event, not a chat chunk
        event = orjson.loads(last.split(b"data: ", 1)[1])
        assert event["type"] == "error" and event["code"] == "shutting_down"
        assert [r.cause for r in gw.records] == [Cause.SHUTDOWN] and settled(gw)


async def test_the_shutdown_cuts_a_client_that_does_not_read_at_its_write_deadline():
    # A client that stopped reading (a stream, and a whole answer sent in pieces whose last bytes
    # never go out) must not hold the shutdown: each gets write_timeout_s, then its connection is
    # dropped. It used to be left open, so the server waited for it until its own deadline.
    async with fake_runtime(itl_ms=2.0) as fake, \
            gateway(fake.backend_config(), server=ServerConfig(shutdown_grace_s=0.2)) as gw:
        stuck = [asyncio.create_task(gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 100_000},
                                             stop_reading_after_chunks=3)),
                 asyncio.create_task(gw.post("/v1/embeddings", {"model": "fake-model", "input": ["word"] * 4000},
                                             stop_reading_after_chunks=1))]
        # both blocked on a write the client does not take
        await until(lambda: len(gw.app.gateway.open) >= 2 and all(ex.writing_since for ex in gw.app.gateway.open), 5,
                    "both blocked on a write the client does not take")
        loop = asyncio.get_running_loop()
        start = loop.time()
        gw.app.begin_shutdown()
        async with asyncio.timeout(5):
            stream, whole = await stuck[0], await stuck[1]
        took = loop.time() - start
        assert stream.aborted and whole.aborted
        assert 0.2 + 1.0 <= took < 0.2 + 1.0 + 0.5, took  # grace, then the 1 s write deadline
        assert len(whole.body) <= 1 << 18  # one piece went out, the rest never will
        assert [r.cause for r in gw.records] == [Cause.SHUTDOWN, Cause.SHUTDOWN] and settled(gw)
        assert not gw.app.gateway.open


@pytest.mark.parametrize(("text", "key"), [
    ("[server]\nmax_head_bytes = 100\n", "server.max_head_bytes"),
    ("[server]\nhead_timeout_s = 0\n", "server.head_timeout_s"),
    ("[server]\nmax_connections = 2\n", "server.max_connections"),
    ("[server]\nmax_body_bytes = 2000\nmax_body_bytes_total = 1000\n", "server.max_body_bytes_total"),
    ("[auth]\nmax_user_chars = 4\n", "auth.max_user_chars"),
    ("[scheduler]\nmax_tenants = 1\n", "scheduler.max_tenants"),
    ("[routing]\naffinity_max_bytes = 10\n", "routing.affinity_max_bytes"),
])
def test_client_limits_are_validated_at_load(tmp_path, text, key):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    field = key.split(".")[1]
    assert info.value.key == key
    assert info.value.line == next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(field))


def test_client_limits_defaults():
    s = load_config(env={}).server
    assert (s.max_head_bytes, s.max_headers, s.head_timeout_s, s.body_timeout_s, s.keep_alive_s,
            s.max_connections, s.max_body_bytes_total) == (65536, 100, 10.0, 60.0, 30.0, 1024, 256 * 1024 * 1024)
    cfg = load_config(env={})
    assert (cfg.auth.max_user_chars, cfg.scheduler.max_tenants, cfg.routing.affinity_max_bytes) == (64, 10_000,
                                                                                                8 * 1024 * 1024)
