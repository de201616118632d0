"""The benchmark on the Responses and Anthropic Messages APIs (``--api responses|messages``): the
request bodies it sends and how its client reads those streams."""

import orjson

from passerelle.bench.client import StreamScanner, api_of
from passerelle.bench.workload import Conversation, Workload
from tests.unit.test_grammars import messages_stream, responses_stream


def scan(api: str, events: list[bytes]) -> StreamScanner:
    s = StreamScanner(api)
    for i, ev in enumerate(events):
        s.feed(ev, float(i))
    return s


def test_responses_stream_is_read_by_its_events():
    s = scan("responses", responses_stream(("a", "b", "c")))
    # only the deltas are content: the final event's full text is not a chunk
    assert (s.chunks, s.first, s.itl) == (3, 2.0, [1.0, 1.0])
    assert s.done and s.error is None and (s.prompt_tokens, s.usage_tokens) == (9, 2)
    failed = scan("responses", [*responses_stream()[:3], b'event: response.failed\ndata: {"type":"response.failed",'
                                                          b'"response":{"status":"failed"}}\n\n'])
    assert failed.error == "stream_error"


def test_messages_stream_is_read_by_its_events():
    s = scan("messages", messages_stream())
    assert s.chunks == 4 and s.done and (s.prompt_tokens, s.usage_tokens) == (25, 7)
    cut = scan("messages", messages_stream()[:5])
    assert not cut.done


def test_api_from_the_url():
    assert api_of("http://h/v1/responses") == "responses"
    assert api_of("http://h/v1/messages") == "messages"
    assert api_of("http://h/v1/chat/completions") == "chat"


def test_request_bodies_per_api():
    for api, text_field, budget in (("responses", "input", "max_output_tokens"), ("messages", "messages",
                                                                                 "max_tokens")):
        w = Workload(endpoint=api, turns=2)
        conv = Conversation(w, 0, "m")
        first, _ = conv.next_body()
        second, _ = conv.next_body()
        assert first[budget] == w.max_tokens and first["stream"] is True
        assert "stream_options" not in first  # usage is always in these streams
        assert len(first[text_field]) == 1 and len(second[text_field]) == 3  # the chat grows
        assert first[text_field][0]["role"] == "user"
        orjson.dumps(second)
    assert Workload(endpoint="messages").path == "/v1/messages"
