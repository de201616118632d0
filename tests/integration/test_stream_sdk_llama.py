"""Each API's stream as its official SDK helpers read it, through the gateway in front of a real
llama-server (whose Responses events lack ``sequence_number``, ``output_index`` and
``content_index``: the gateway supplies them); and a stream its client cuts, on every API, is
charged at least what the client read, in the access log and the usage store alike."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from passerelle.chunks import is_content
from tests.conftest import MODEL_ID, upstream_config, wait_until

pytestmark = pytest.mark.llama

ASK = "Tell me about lighthouses."


@pytest.fixture
def gw(gateway, llama_server):
    return gateway(upstream_config(llama_server.url))


def test_openai_responses_stream_helper_and_typed_events(gw):
    client = gw.openai()
    with client.responses.stream(model=MODEL_ID, input=ASK, max_output_tokens=6,
                                 extra_body={"ignore_eos": True}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) >= 1 and final.output_text == "".join(deltas) and final.usage.output_tokens == 6

    events = list(client.responses.create(model=MODEL_ID, input=ASK, max_output_tokens=6, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = [e for e in events if e.type == "response.output_text.delta"]
    item = next(e.item for e in events if e.type == "response.output_item.added")
    assert text and {(e.output_index, e.content_index, e.item_id) for e in text} == {(0, 0, item.id)}
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in done] == [0]


def test_anthropic_messages_stream_helper(gw):
    with gw.anthropic().messages.stream(model=MODEL_ID, max_tokens=6, messages=[{"role": "user", "content": ASK}],
                                        extra_body={"ignore_eos": True}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens == 6


CUT = {  # API: (path, body)
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": ASK}], "max_tokens": 40}),
    "completions": ("/v1/completions", {"prompt": ASK, "max_tokens": 40}),
    "responses": ("/v1/responses", {"input": ASK, "max_output_tokens": 40}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": ASK}], "max_tokens": 40}),
}


@pytest.mark.parametrize("api", list(CUT))
def test_a_stream_the_client_cuts_is_charged_at_least_what_it_read(gw, tmp_path, api):
    path, body = CUT[api]
    read = 0
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", gw.url + path, json={"model": MODEL_ID, "stream": True, "ignore_eos": True, **body}) as r:
        request_id = r.headers["x-request-id"]
        event: list[str] = []
        for line in r.iter_lines():
            if line:
                event.append(line)
                continue
            if is_content(api, "\n".join(event).encode()):
                read += 1
                if read == 3:
                    break
            event = []
    line = gw.log_for(request_id)
    assert line["cause"] == "client_disconnect"
    assert read <= line["completion_tokens"] < 40  # (the runtime stops generating when it is cut)
    assert line["prompt_tokens"] > 0
    db = tmp_path / "state" / "passerelle.db"

    def row():
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT prompt_tokens, completion_tokens FROM usage WHERE cause = ?",
                                ("client_disconnect",)).fetchone()

    assert wait_until(row, 10, what="the usage row") == (line["prompt_tokens"], line["completion_tokens"])
