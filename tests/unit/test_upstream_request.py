"""One attempt's request, built in one place (proxy/upstream_request.py): each rewrite of the
client's body, and that they compose in their order."""

from __future__ import annotations

import orjson

from passerelle.config import ClassConfig, Config
from passerelle.proxy.call import Call
from passerelle.proxy.protocols import api_for
from passerelle.proxy.resume import Splice
from passerelle.proxy.upstream_request import upstream_request
from passerelle.runtimes.catalogue import ModelRoute
from passerelle.scheduling.job import Job

CFG = Config()
CHAT = {"model": "served", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


class Runtime:
    """The three things of a backend the request depends on."""

    def __init__(self, *, stream_always: bool = False, continuation: str = "") -> None:
        self.stream_always = stream_always
        self.continuation = continuation
        self.prepared: list[tuple[int, int | None]] = []

    def prepare(self, body: bytes, rank: int, slot: int | None) -> bytes:
        self.prepared.append((rank, slot))
        return body[:-1] + b',"id_slot":%d}' % slot if slot is not None else body


def route(data: dict | None, body: bytes | None = None) -> ModelRoute:
    return ModelRoute(name="public", served="served", pool=[], data=data,
                 body=body if body is not None else orjson.dumps(data), requested="public")


def call(endpoint: str, rt: ModelRoute, *, stream: bool, slot: int | None, rank: int = 2, content_type: str = "",
         splice: Splice | None = None) -> Call:
    """A request after its intake (proxy/call.py): what it asked, its class's rank, its slot."""
    job = Job(pool=[], cls=ClassConfig(name="c", rank=rank), tenant="t")
    job.slot = slot
    return Call(api_for(endpoint), stream, content_type, rt, job, deadline=None, splice=splice)  # type: ignore[arg-type]


def build(data: dict, runtime: Runtime, *, stream: bool, splice: Splice | None = None, slot: int | None = 3):
    return upstream_request(call("chat", route(data), stream=stream, slot=slot, splice=splice), runtime, CFG)  # type: ignore[arg-type]


def test_a_plain_request_goes_as_the_catalogue_left_it_plus_the_runtimes_fields():
    rt = Runtime()
    req = build(CHAT, rt, stream=False)
    assert orjson.loads(req.body) == {**CHAT, "id_slot": 3} and rt.prepared == [(2, 3)]
    assert not req.collect and not req.strip_usage and not req.streamed and req.content_type == b"application/json"


def test_a_chat_stream_without_usage_asks_for_it_and_strips_it_again():
    req = build(CHAT, Runtime(), stream=True, slot=None)
    assert orjson.loads(req.body)["stream_options"] == {"include_usage": True}
    assert req.strip_usage and req.streamed and not req.collect


def test_a_non_streamed_request_to_a_runtime_that_streams_is_collected_with_its_usage():
    req = build(CHAT, Runtime(stream_always=True), stream=False)
    sent = orjson.loads(req.body)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True} and sent["id_slot"] == 3
    assert req.collect and req.streamed and not req.strip_usage


def test_a_resumed_stream_sends_its_continuation_then_usage_then_the_slot():
    splice = Splice(CHAT, "chat")
    splice.text.append("Once upon")  # what the client already received
    req = build(CHAT, Runtime(continuation="llama-server"), stream=True, splice=splice)
    sent = orjson.loads(req.body)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Once upon"} and sent["continue_final_message"]
    assert sent["timings_per_token"] and sent["stream_options"] == {"include_usage": True} and sent["id_slot"] == 3
    assert req.dialect == "llama-server" and req.splice is splice


def test_an_upload_has_its_model_field_rewritten_and_its_file_untouched():
    ctype = b"multipart/form-data; boundary=XX"
    body = (b'--XX\r\nContent-Disposition: form-data; name="model"\r\n\r\npublic\r\n'
            b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n\x00\x01RIFF\r\n--XX--\r\n')
    rt = Runtime()
    req = upstream_request(call("transcriptions", route(None, body), stream=False, slot=None, rank=1,  # type: ignore[arg-type]
                                content_type=ctype.decode()), rt, CFG)
    assert b'name="model"\r\n\r\nserved\r\n' in req.body and b"\x00\x01RIFF" in req.body
    assert req.content_type == ctype and rt.prepared == []
