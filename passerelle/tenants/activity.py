"""What each key and tenant did since the gateway started, for the dashboard and ``/admin/stats``.

Fed with every finished request (a gateway listener). O(1) per request; the tenants kept are
bounded (the least recently seen is forgotten past :data:`MAX_TENANTS`; without keys a tenant is
the request's ``user`` field, which any client can fill with anything).

Example::

    activity = Activity()
    gateway.listeners.append(activity.observe)
    activity.keys["3f9c0a1b2c4d"].requests
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from passerelle.errors import Cause
from passerelle.observe.record import RequestRecord
from passerelle.tenants.usage import billed_tokens

MAX_TENANTS = 1000
LIMITED = (Cause.RATE_LIMITED, Cause.QUOTA_EXCEEDED)


@dataclass(slots=True)
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed: int = 0  # ended with another cause than ok
    limited: int = 0  # refused by the key's limits: rate_limited, quota_exceeded
    last_seen: float = 0.0  # Unix time of the last request's end

    def add(self, rec: RequestRecord, now: float) -> None:
        prompt, completion = billed_tokens(rec)
        self.requests += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.failed += rec.cause is not Cause.OK
        self.limited += rec.cause in LIMITED
        self.last_seen = now

    def describe(self, now: float) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens": self.prompt_tokens + self.completion_tokens, "failed": self.failed,
                "limited": self.limited,
                "last_seen_s_ago": round(now - self.last_seen, 1) if self.last_seen else None}


class Activity:
    def __init__(self) -> None:
        self.started = time.time()
        self.keys: dict[str, Tally] = {}
        self.tenants: OrderedDict[str, Tally] = OrderedDict()

    def observe(self, rec: RequestRecord) -> None:
        now = time.time()
        if rec.key_id:
            self.keys.setdefault(rec.key_id, Tally()).add(rec, now)
        tally = self.tenants.get(rec.tenant)
        if tally is None:
            tally = self.tenants[rec.tenant] = Tally()
            if len(self.tenants) > MAX_TENANTS:
                self.tenants.popitem(last=False)
        else:
            self.tenants.move_to_end(rec.tenant)
        tally.add(rec, now)

    def key(self, key_id: str, now: float) -> dict[str, Any]:
        return (self.keys.get(key_id) or Tally()).describe(now)

    def tenant_rows(self, now: float) -> list[dict[str, Any]]:
        rows = [{"tenant": name, **t.describe(now)} for name, t in self.tenants.items()]
        return sorted(rows, key=lambda r: (-r["tokens"], -r["requests"], r["tenant"]))
