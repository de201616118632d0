"""The access log: one line per request, buffered within an event-loop pass, nothing lost on flush."""

from __future__ import annotations

import asyncio
import io

import orjson

from passerelle.errors import Cause
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.record import RequestRecord


class Stream(io.StringIO):
    """Counts the writes that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def record(i: int, cause: Cause = Cause.OK) -> RequestRecord:
    rec = RequestRecord(id=f"req_{i}", endpoint="chat", model="m", backend="b1", stream=True)
    rec.t_first, rec.t_last = rec.t_arrival + 0.05, rec.t_arrival + 0.25
    rec.completion_tokens, rec.prompt_tokens = 5, 3
    rec.finish(cause, 200 if cause is Cause.OK else 499)
    return rec


async def test_lines_of_one_loop_pass_go_out_in_one_write():
    out = Stream()
    log = AccessLog(stream=out)
    for i in range(3):
        log.write(record(i))
    assert out.getvalue() == ""  # not yet: the loop has not finished this pass
    await asyncio.sleep(0)  # one pass of the loop
    lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert [x["request_id"] for x in lines] == ["req_0", "req_1", "req_2"]
    assert out.writes == 1
    assert lines[0]["cause"] == "ok" and lines[0]["completion_tokens"] == 5 and lines[0]["tokens_per_s"] == 20.0
    log.write(record(3, Cause.CLIENT_DISCONNECT))
    log.flush()  # what shutdown does: nothing waits for the next pass
    assert orjson.loads(out.getvalue().splitlines()[-1])["cause"] == "client_disconnect"
    assert out.writes == 2


def test_without_an_event_loop_lines_are_written_at_once():
    out = Stream()
    AccessLog(stream=out).write(record(1))
    assert orjson.loads(out.getvalue())["request_id"] == "req_1"


def test_text_format_and_disabled_log():
    out = Stream()
    AccessLog(stream=out, fmt="text").write(record(7))
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert " req_7 chat m -> 200 ok ttft=50.0ms " in line and "tokens=3/5 backend=b1" in line
    quiet = Stream()
    AccessLog(stream=quiet, enabled=False).write(record(8))
    assert quiet.getvalue() == ""
