"""A batch line's outcome: from its request's record (internal.py) to its row of the output or
error file, as OpenAI writes them.

    {"id": "batch_req_…", "custom_id": "a", "response": {"status_code": 200, "request_id": "req_…",
     "body": {…}}, "error": null}                                      an answer (any status)
    {"id": "batch_req_…", "custom_id": "b", "response": null,
     "error": {"code": "batch_cancelled", "message": "…"}}               a line not run

The status, the cause and the token counts are the record's (the gateway's own measure, as in the
metrics and the usage store); only a streamed answer's body is assembled (proxy/assemble.py), into
the body a non-streamed request gets.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from passerelle.batches.internal import Answer
from passerelle.errors import Cause, UpstreamError
from passerelle.observe.record import RequestRecord
from passerelle.proxy.assemble import assemble

# Causes (and statuses) a line may meet and pass: tried again after a pause.
PASSING = frozenset({Cause.RATE_LIMITED, Cause.QUEUE_FULL, Cause.TENANT_QUEUE_FULL, Cause.QUEUE_TIMEOUT,
                     Cause.NO_BACKEND, Cause.UPSTREAM_ERROR, Cause.UPSTREAM_TIMEOUT, Cause.SERVER_BUSY,
                     Cause.SHUTDOWN, Cause.ANSWERS_BUSY, Cause.SESSION_LIMIT})
PASSING_STATUS = frozenset({429, 502, 503, 504})  # (a runtime's own 429 or 503 is counted invalid_request)


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


def answer_record(custom_id: str, status: int, request: str, body: bytes) -> bytes:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": request, "body": _body(body)},
                         "error": None})


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a line's answer was: its status (the record's: a stream the runtime broke after its
    head is not a 200), its request id, the body kept for the output or error file, its record."""

    status: int
    request_id: str
    body: bytes
    record: RequestRecord | None


def outcome_of(rec: RequestRecord, answer: Answer, streamed: str) -> Outcome:
    """The line's outcome from its request's record; ``streamed``: the endpoint whose stream the
    answer is (then it is assembled into the body a non-streamed request gets), or "" for none."""
    if rec.cause is Cause.OK:
        body = answer.body
        if streamed:
            try:
                body = assemble(body, streamed)
            except UpstreamError as err:
                return Outcome(err.status, answer.request_id, err.body(), rec)
        return Outcome(200, answer.request_id, body, rec)
    if answer.status == rec.status:  # the error was the answer's head: its body is the error
        return Outcome(rec.status, answer.request_id, answer.body, rec)
    # the stream began, then broke: the record says how
    detail = {"message": rec.error or "The request failed.", "type": "server_error",
              "code": rec.cause.value if rec.cause else "internal_error"}
    return Outcome(rec.status, answer.request_id, orjson.dumps({"error": detail}), rec)


def passes(out: Outcome) -> bool:
    """A failure the line may meet and pass (the runtime restarting, a full queue, rate limited):
    it is tried again after a pause."""
    rec = out.record
    return out.status != 200 and ((rec is not None and rec.cause in PASSING) or out.status in PASSING_STATUS)
