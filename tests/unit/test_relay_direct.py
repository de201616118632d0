"""The relay's direct path: once the response head is out, a stream's bytes are relayed in the
upstream connection's callback and written straight to the client (no task switch, no send per
chunk), and handed back to the relay's task whenever the client cannot take bytes at once. Against
a real upstream connection on loopback (the path needs the lean client's Response)."""

from __future__ import annotations

from passerelle.config import TimeoutConfig
from passerelle.errors import UpstreamError, UpstreamTooLarge
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.relay import StreamRelay
from passerelle.upstream.client import Response, UpstreamClient
from tests.unit.test_upstream import Server, chunk
from tests.waiting import until

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":6,"total_tokens":13}}\n\n'
DONE = b"data: [DONE]\n\n"
EVENTS = [ROLE, *(CHUNK % i for i in range(6)), USAGE, DONE]


class DirectClient:
    """An exchange as the relay sees it: ``send`` (the awaited way) and ``write_now`` (the direct
    one), recording which way each part of the body went and when the answer was marked finishing."""

    def __init__(self) -> None:
        self.started = False
        self.parts: list[tuple[str, bytes]] = []
        self.can_write = True
        self.finishing_at: int | None = None  # parts written when mark_finishing was called

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.parts.append(("start", b""))

    def mark_finishing(self) -> None:
        self.finishing_at = len(self.parts)

    async def send(self, message: dict[str, object]) -> None:
        self.parts.append(("send", message["body"]))  # type: ignore[arg-type]

    def writable(self) -> bool:
        return self.can_write

    def write_now(self, body: bytes) -> None:
        self.parts.append(("direct", body))

    @property
    def body(self) -> bytes:
        return b"".join(b for _, b in self.parts)

    def got(self, event: bytes) -> bool:
        return event in self.body


async def stream_to(client: DirectClient, *, paced: list[bytes], between=None, strip_usage=False,
                    max_event=1 << 20) -> RequestRecord:
    """Relay a chunked SSE response whose events the server sends one at a time, each once the client
    has the one before (so that each arrives in a read of its own); ``between(i)`` runs before event i."""

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, ev in enumerate(paced):
            if between is not None:
                between(i)
            writer.write(chunk(ev))
            await writer.drain()
            if ev is not ROLE and ev is not DONE and not (strip_usage and ev is USAGE):
                await until(lambda ev=ev: client.got(ev), what="the client has the event")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(handler) as srv:
        upstream = UpstreamClient(srv.url, limit=1)
        rec = RequestRecord(id="r", endpoint="chat", stream=True, backend="b")
        rec.to(State.DISPATCHED)
        timeouts = TimeoutConfig()
        deadline = Deadline(timeouts, rec.t_arrival)
        deadline.start_attempt()
        resp = await upstream.request(b"POST", "/v1/chat/completions", b"{}")
        try:
            relay = StreamRelay(rec, client.send, timeouts, strip_usage=strip_usage, client=client,
                                max_event=max_event)
            assert relay.direct is client
            await relay.run(resp, deadline)
            client.parts.append(("final", relay.final))  # (what the caller's last send writes)
        finally:
            resp.close()
            upstream.close()
    return rec


async def test_after_the_head_the_stream_is_written_directly_and_accounted_alike():
    client = DirectClient()
    rec = await stream_to(client, paced=EVENTS)
    assert client.body == b"".join(EVENTS)  # every byte, in order, nothing twice
    ways = [way for way, _ in client.parts]
    # the head goes out through the client's start, the first content (the role chunk held with
    # it) and every later event straight to the connection
    assert ways[0] == "start" and client.parts[1] == ("direct", ROLE + CHUNK % 0)
    assert set(ways[1:-1]) == {"direct"} and len(ways) >= 7
    # [DONE] is kept for the caller's last send (with the body's end, one write), marked finishing
    assert ways[-1] == "final" and client.parts[-1][1].endswith(DONE) and DONE not in client.body[:-len(DONE)]
    assert client.finishing_at == len(client.parts) - 1
    assert (rec.content_chunks, rec.prompt_tokens, rec.completion_tokens) == (6, 7, 6)
    assert rec.usage_from_server and len(rec.gaps) == 5 and rec.t_last > rec.t_first > 0


async def test_a_client_that_cannot_take_bytes_now_gets_them_through_send_in_order():
    client = DirectClient()

    def between(i: int) -> None:  # events 3 and 4 arrive while the client's connection is paused
        client.can_write = i not in (3, 4)

    rec = await stream_to(client, paced=EVENTS, between=between, strip_usage=True)
    assert client.body == b"".join(e for e in EVENTS if e is not USAGE)  # (the usage chunk stripped)
    by_body = {body: way for way, body in client.parts}
    assert by_body[CHUNK % 2] == "send" and by_body[CHUNK % 3] == "send"
    assert by_body[CHUNK % 1] == "direct" and by_body[CHUNK % 5] == "direct"
    assert rec.content_chunks == 6 and rec.completion_tokens == 6


async def test_an_error_met_in_the_callback_is_raised_by_the_relay():
    client = DirectClient()
    big = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 5000 + b'"}}]}\n\n'
    try:
        await stream_to(client, paced=[ROLE, CHUNK % 0, big, DONE], max_event=4096)
    except UpstreamTooLarge:
        pass
    else:
        raise AssertionError("an event over max_event_bytes must end the relay")
    assert client.body == ROLE + CHUNK % 0  # nothing of the oversized event went out


async def test_a_runtime_error_before_done_is_relayed_with_it_and_then_raised():
    """An error event and [DONE] in one read: both reach the client at once (the caller then sends
    the gateway's own error event as the body's end), none is kept for a last send that never comes."""
    client = DirectClient()
    error = b'data: {"error":{"message":"boom","type":"server_error"}}\n\n'
    try:
        await stream_to(client, paced=[ROLE, CHUNK % 0, CHUNK % 1, error + DONE])
    except UpstreamError as exc:
        assert "reported an error" in exc.message
    else:
        raise AssertionError("a runtime's error event must end the relay with an error")
    assert client.body == ROLE + CHUNK % 0 + CHUNK % 1 + error + DONE


class StartWithClient(DirectClient):
    """A client that also sends its head with the first part of the body (``Exchange.start_with``)."""

    async def start_with(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.started = True
        self.parts.append(("start+first", body))


async def test_before_the_first_token_the_callback_holds_the_role_chunk_and_the_head_goes_with_the_first(
        monkeypatch):
    """The role chunk is held in the upstream connection's callback (the relay's task is not woken
    for it: no read at all); the task wakes for the first content and sends the head with it."""
    client = StartWithClient()
    resp_of: list = []
    takes: list[int] = []

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await until(lambda: resp_of and resp_of[0].sink is not None, what="the relay waits in the callback")
        writer.write(chunk(ROLE))
        await writer.drain()
        await until(lambda: takes, what="the callback took the role chunk")
        for ev in EVENTS[1:]:
            writer.write(chunk(ev))
            await writer.drain()
            if ev is not DONE:
                await until(lambda ev=ev: client.got(ev), what="the client has the event")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(handler) as srv:
        upstream = UpstreamClient(srv.url, limit=1)
        rec = RequestRecord(id="r", endpoint="chat", stream=True, backend="b")
        rec.to(State.DISPATCHED)
        timeouts = TimeoutConfig()
        deadline = Deadline(timeouts, rec.t_arrival)
        deadline.start_attempt()
        resp = await upstream.request(b"POST", "/v1/chat/completions", b"{}")
        reads: list[int] = []
        readany, take = Response.readany, Response.take

        async def counted_read(self: Response) -> bytes:
            reads.append(1)
            return await readany(self)

        def counted_take(self: Response) -> bytes:
            takes.append(1)
            return take(self)

        monkeypatch.setattr(Response, "readany", counted_read)
        monkeypatch.setattr(Response, "take", counted_take)
        resp_of.append(resp)
        try:
            relay = StreamRelay(rec, client.send, timeouts, strip_usage=False, client=client)
            await relay.run(resp, deadline)
        finally:
            resp.close()
            upstream.close()
    assert reads == []  # every byte came through the callback, the role chunk too
    assert client.parts[0] == ("start+first", ROLE + CHUNK % 0)
    assert {way for way, _ in client.parts[1:]} == {"direct"} and relay.final.endswith(DONE)
    assert client.body + relay.final == b"".join(EVENTS)
    assert (rec.content_chunks, rec.completion_tokens) == (6, 6)
