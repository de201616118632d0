"""A real ``passerelle serve --config FILE`` reloaded by SIGHUP, each live section checked by what
clients see, not by what the reload says it applied.

The regression: after SIGHUP changed ``[routing] max_session_in_flight`` from 0 to 1 the log said
"applied routing.max_session_in_flight" and four concurrent streams of one session were all
served (a fresh start with 1 answers one 200 and three 429 ``session_limit``); preemption turned
on by a reload never preempted, and ``tenant_queue_share`` was never re-set.
"""

from __future__ import annotations

import signal
import textwrap
import threading
from typing import Any

import httpx

from tests.conftest import upstream_config, wait_until

MODEL = "fake-model"
SESSION = {"x-claude-code-session-id": "6f1c2a9e-0000-4000-8000-000000000001"}  # Claude Code's own header


def reload(gw: Any, config: str) -> None:
    """Write ``config`` and SIGHUP the gateway; back once it says it reloaded (a refusal fails)."""
    start = len(gw.log_text())
    gw.extra["config"].write_text(textwrap.dedent(config))
    gw.proc.send_signal(signal.SIGHUP)

    def reloaded() -> bool:
        new = gw.log_text()[start:]
        assert "Reload refused" not in new, new
        return "configuration reloaded" in new

    wait_until(reloaded, 15, what="the reload in the log")


def requests_seen(fake: Any) -> int:
    return int(httpx.get(fake.url + "/fake/stats", timeout=5).json()["requests"])


def waiting(gw: Any, n: int, cls: str = "standard") -> bool:
    line = f'passerelle_requests_waiting{{model="{MODEL}",priority="{cls}"}} {float(n)}'
    return line in httpx.get(gw.url + "/metrics", timeout=5).text


class Call(threading.Thread):
    """One request in a thread of its own: its status, error code and (streamed) body once done."""

    def __init__(self, gw: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.gw, self.body, self.headers = gw, body, headers or {}
        self.status, self.code, self.text = 0, "", ""
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.gw.url + "/v1/chat/completions", json=self.body, headers=self.headers,
                          timeout=60) as resp:
            self.status, self.text = resp.status_code, resp.read().decode()
        if self.status != 200:
            self.code = httpx.Response(self.status, content=self.text).json()["error"]["code"]

    def result(self) -> tuple[int, str]:
        self.join(60)
        assert not self.is_alive(), "a request did not end within 60 s"
        return self.status, self.code


def chat(max_tokens: int, *, stream: bool = False, user: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                            "messages": [{"role": "user", "content": "Tell me a story"}]}
    if user is not None:
        body["user"] = user
    return body


def four_streams_of_one_session(gw: Any, fake: Any) -> list[tuple[int, str]]:
    """One stream of the session running (the runtime has it), then three more of it at once."""
    seen = requests_seen(fake)
    first = Call(gw, chat(100, stream=True), SESSION)  # (30 ms a token: 3 s)
    wait_until(lambda: requests_seen(fake) > seen, 15, what="the session's first stream running")
    more = [Call(gw, chat(100, stream=True), SESSION) for _ in range(3)]
    return sorted([first.result(), *(c.result() for c in more)])


def test_sighup_max_session_in_flight_0_to_1_serves_one_stream_of_a_session_and_refuses_three(
        gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=30, slots=8)
    backend = upstream_config(fake.url, model=MODEL, kind="openai", slots=8)
    gw = gateway(backend + "[routing]\nmax_session_in_flight = 0\n")
    assert four_streams_of_one_session(gw, fake) == [(200, "")] * 4  # no cap: all four run at once
    reload(gw, backend + "[routing]\nmax_session_in_flight = 1\n")
    assert four_streams_of_one_session(gw, fake) == [(200, ""), *[(429, "session_limit")] * 3]
    # another session is not held by this one's cap
    assert Call(gw, chat(2), {"x-claude-code-session-id": "another"}).result() == (200, "")


def test_preemption_turned_on_by_sighup_cuts_a_batch_stream_for_a_better_request(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=20, slots=1)  # one slot, as a one-slot llama-server
    backend = upstream_config(fake.url, model=MODEL, kind="llama-server", slots=1)
    gw = gateway(backend + "[scheduler]\npreemption = false\n")
    reload(gw, backend + "[scheduler]\npreemption = true\npreempt_after_ms = 50\n")
    seen = requests_seen(fake)
    batch = Call(gw, chat(150, stream=True), {"x-priority": "batch"})  # (20 ms a token: 3 s alone)
    wait_until(lambda: requests_seen(fake) > seen, 15, what="the batch stream running")
    assert Call(gw, chat(3)).result() == (200, "")  # standard: it had to take the batch stream's slot
    assert batch.result() == (200, "") and batch.text.rstrip().endswith("data: [DONE]")
    # the runtime saw the batch stream, the standard request, and the batch stream's continuation
    assert requests_seen(fake) - seen == 3
    lines = [line for line in gw.access_log() if line["priority"] == "batch"]
    assert [(line["cause"], line.get("suspensions")) for line in lines] == [("ok", 1)]


def test_tenant_queue_share_set_by_sighup_refuses_a_tenant_past_its_share(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=20, slots=1)
    config = (upstream_config(fake.url, model=MODEL, kind="openai", slots=1)
              + '[[classes]]\nname = "standard"\nmax_queue = 4\n' + "[scheduler]\nhold_s = 0\n")
    gw = gateway(config + "tenant_queue_share = 1.0\n")

    def third_of_b() -> tuple[int, str]:
        """With the slot held and a's request waiting, b queues two requests, then a third."""
        seen = requests_seen(fake)
        hog = Call(gw, chat(150, stream=True, user="hog"))  # holds the one slot for 3 s
        wait_until(lambda: requests_seen(fake) > seen, 15, what="the slot taken")
        queued = [Call(gw, chat(2, user="a"))]
        wait_until(lambda: waiting(gw, 1), 15, what="a's request queued")
        queued += [Call(gw, chat(2, user="b")) for _ in range(2)]
        wait_until(lambda: waiting(gw, 3), 15, what="b's two requests queued")
        third = Call(gw, chat(2, user="b"))
        if third.status == 0:  # (queued, or on its way to an answer)
            wait_until(lambda: third.status or waiting(gw, 4), 15, what="b's third request queued or refused")
        out = third.result()
        assert hog.result() == (200, "") and [c.result() for c in queued] == [(200, "")] * 3
        return out

    assert third_of_b() == (200, "")  # 1.0: a tenant may fill the queue
    reload(gw, config + "tenant_queue_share = 0.5\n")
    assert third_of_b() == (429, "tenant_queue_full")  # 0.5 of 4: two places while a waits


def test_sighup_applies_the_server_limits_timeouts_classes_and_auth_sections(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=2)
    backend = upstream_config(fake.url, model=MODEL, kind="openai")
    gw = gateway(backend)
    big = {**chat(2), "messages": [{"role": "user", "content": "x" * 600}]}
    assert Call(gw, big).result() == (200, "")
    assert Call(gw, chat(400)).result() == (200, "")
    assert Call(gw, chat(2), {"x-priority": "bulk"}).result() == (400, "invalid_request")
    reload(gw, backend + "[server]\nmax_body_bytes = 400\n" + "[limits]\nmax_answer_bytes = 1024\n"
           + '[[classes]]\nname = "bulk"\nrank = 3\n')
    assert Call(gw, big).result() == (413, "request_too_large")  # [server] max_body_bytes
    assert Call(gw, chat(400)).result() == (502, "upstream_too_large")  # [limits] max_answer_bytes
    assert Call(gw, chat(2), {"x-priority": "bulk"}).result() == (200, "")  # a class the reload added
    reload(gw, backend + "[timeouts]\ntotal_s = 1\n")
    stream = Call(gw, chat(1000, stream=True))  # 2 s at 2 ms a token: cut by [timeouts] total_s
    assert stream.result() == (200, "") and "upstream_timeout" in stream.text and "[DONE]" not in stream.text
    reload(gw, backend + "[auth]\nrequired = true\n")
    assert Call(gw, chat(2)).result() == (401, "invalid_api_key")
