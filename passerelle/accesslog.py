"""One structured line per request, written when it ends, with its termination cause.

JSON lines by default (``--log-format text`` for people). Never the prompt or the completion.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

from passerelle.request import RequestRecord


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def record_fields(rec: RequestRecord) -> dict[str, object]:
    ttft = rec.ttft
    gen_time = (rec.t_last - rec.t_first) if rec.t_first and rec.t_last > rec.t_first else 0.0
    tokens = rec.output_tokens
    return {
        "ts": round(time.time(), 3),
        "request_id": rec.id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "backend": rec.backend,
        "tenant": rec.tenant,
        "priority": rec.priority,
        "stream": rec.stream,
        "status": rec.status,
        "cause": rec.cause.value if rec.cause else None,
        "queue_ms": _ms(rec.queue_wait),
        "ttft_ms": _ms(ttft),
        "duration_ms": _ms(rec.duration),
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens if rec.completion_tokens is not None else rec.content_chunks,
        "tokens_per_s": round((tokens - 1) / gen_time, 2) if gen_time > 0 and tokens > 1 else None,
        "client": rec.client,
        **({"error": rec.error} if rec.error else {}),
    }


class AccessLog:
    def __init__(self, *, enabled: bool = True, fmt: str = "json", stream=None) -> None:
        self.enabled = enabled
        self.fmt = fmt
        self.logger = logging.getLogger("passerelle.access")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        if not self.logger.handlers:
            handler = logging.StreamHandler(stream or sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)

    def write(self, rec: RequestRecord) -> None:
        if not self.enabled:
            return
        fields = record_fields(rec)
        if self.fmt == "json":
            self.logger.info(orjson.dumps(fields).decode())
        else:
            self.logger.info(
                "%s %s %s %s -> %s %s ttft=%sms dur=%sms tokens=%s/%s backend=%s tenant=%s class=%s",
                time.strftime("%H:%M:%S"), rec.id, rec.endpoint, rec.model, rec.status, fields["cause"],
                fields["ttft_ms"], fields["duration_ms"], fields["prompt_tokens"], fields["completion_tokens"],
                rec.backend or "-", rec.tenant, rec.priority)
