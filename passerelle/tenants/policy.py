"""What a request's key allows: the one object the gateway asks about keys, three times a request.

    authenticate(scope, rec)    who is asking: a valid, unexpired key (401 otherwise), or None
                                when the gateway has no keys; failed attempts throttled per
                                (address, presented key prefix), a valid key always passes
    admit(key, rec, cls, est)   may it, now: the model on its allow-list (403), its quota for the
                                day / week / month (429 quota_exceeded), its rpm / tpm (429
                                rate_limited), then a turn among its max_concurrency slots
                                (waiting in the key's own queue, bounded by the class's queue wait
                                and the request's total time)
    finish(ticket, rec)         it ended: the slot goes to the key's next request, the real token
                                count replaces the estimate in the per-minute window and the quotas

and, for the routes around it: :meth:`estimate_prompt` (text at 4 characters a token, images and
audio at a constant), :meth:`me` (``GET /v1/me``), :meth:`snapshot` (``/admin/stats``).

Example::

    policy = KeyPolicy(cfg, KeyRing(store))
    key = policy.authenticate(scope, rec)                          # raises Unauthorized / RateLimited
    ticket = await policy.admit(key, rec, cls, policy.estimate_prompt(data, rec.model) + 256)
    try: ...
    finally: policy.finish(ticket, rec)
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from passerelle.config import ClassConfig, Config
from passerelle.errors import KeyExpired, ModelNotAllowed, Unauthorized
from passerelle.observe.record import RequestRecord
from passerelle.tenants.activity import Activity
from passerelle.tenants.estimate import MediaCosts, estimate_prompt_tokens
from passerelle.tenants.keys import ApiKey, KeyRing, presented_prefix
from passerelle.tenants.limits import FailedAuthThrottle, Grant, KeyLimiter
from passerelle.tenants.quota import Charge, QuotaBook, iso_time, local_time
from passerelle.tenants.usage import billed_tokens

Scope = dict[str, Any]


def presented_key(scope: Scope) -> str:
    """The key a request presents: ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``."""
    bearer = api_key = ""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                bearer = token.strip()
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip()
    return bearer or api_key


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""


@dataclass(slots=True)
class Ticket:
    """One admitted request of a key: its per-minute grant (and slot), and its quota charge."""

    key: ApiKey
    grant: Grant
    charge: Charge | None


class KeyPolicy:
    def __init__(self, cfg: Config, ring: KeyRing | None, *,
                 load_usage: Callable[[str, list[float]], Awaitable[list[tuple[int, int]]]] | None = None) -> None:
        self.ring = ring
        self.limiter = KeyLimiter()
        self.throttle = FailedAuthThrottle(cfg.auth.failed_attempts_per_minute)
        self.quotas = QuotaBook(load_usage)
        self.activity = Activity()
        self.configure(cfg)

    def configure(self, cfg: Config) -> None:
        """``[auth]``, ``[limits]``' media costs and ``[timeouts] total_s`` (at start and at a
        reload); a changed failed-key rate starts a new count."""
        if cfg.auth.failed_attempts_per_minute != self.throttle.per_minute:
            self.throttle = FailedAuthThrottle(cfg.auth.failed_attempts_per_minute)
        self.cfg = cfg
        # The gateway-wide media costs; a model catalogue can answer per model in media_costs().
        self._costs = MediaCosts.of(cfg.limits)

    # -- who is asking --------------------------------------------------------------------------
    @property
    def in_use(self) -> bool:
        """Keys are checked: one exists (or existed), or ``[auth] required``."""
        ring = self.ring
        if ring is None:
            return False
        ring.refresh()
        return ring.any or self.cfg.auth.required

    def authenticate(self, scope: Scope, rec: RequestRecord | None = None) -> ApiKey | None:
        """The caller's key; None when keys are not in use. Raises Unauthorized (KeyExpired) or,
        for a client that keeps presenting a wrong key, RateLimited."""
        if not self.in_use:
            return None
        assert self.ring is not None
        presented = presented_key(scope)
        key = self.ring.lookup(presented) if presented else None
        if key is None:
            client, prefix = (rec.client if rec else client_address(scope)), presented_prefix(presented)
            self.throttle.check(client, prefix)
            self.throttle.failed(client, prefix)
            raise Unauthorized("Missing or invalid API key. Send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
        if rec is not None:
            rec.key_id, rec.tenant = key.id, key.tenant
        if key.expired():
            assert key.expires_at is not None
            who = f" ({key.owner})" if key.owner else ""
            raise KeyExpired(f"This API key ({key.id}) expired at {local_time(key.expires_at)}. "
                             f"Ask its owner{who} or the gateway's operator for a new one.")
        return key

    def authenticate_id(self, key_id: str | None, rec: RequestRecord | None = None) -> ApiKey | None:
        """For a request the gateway makes for a key (a batch line): that key as it is now (revoked
        or expired: Unauthorized); None for work created while keys were not in use."""
        if not self.in_use or key_id is None:
            if self.in_use:
                raise Unauthorized("This work was created without an API key; keys are now required.")
            return None
        assert self.ring is not None
        key = self.ring.get(key_id)
        if key is None:
            raise Unauthorized(f"The API key {key_id} that created this work was revoked.")
        if rec is not None:
            rec.key_id, rec.tenant = key.id, key.tenant
        if key.expired():
            raise KeyExpired(f"The API key {key_id} that created this work has expired.")
        return key

    # -- may it, now ----------------------------------------------------------------------------
    def media_costs(self, model: str) -> MediaCosts:
        """Tokens charged per image / audio part for ``model`` (the ``[limits]`` values for now)."""
        return self._costs

    def estimate_prompt(self, data: dict[str, Any], model: str) -> int:
        return estimate_prompt_tokens(data, self.media_costs(model))

    async def admit(self, key: ApiKey, rec: RequestRecord, cls: ClassConfig, tokens: float) -> Ticket:
        """Check the key's allow-list, quotas and per-minute limits, then wait for a turn among its
        concurrent slots (time spent there counts as the request's queue wait)."""
        if not key.allows(rec.model):
            raise ModelNotAllowed(rec.model, key.models)
        charge = await self.quotas.take(key.id, key.quotas, tokens)  # (shared: atomic in the store)
        try:
            grant = self.limiter.admit(key, tokens, rec.user if key.trust_forwarded_user else "")
        except BaseException:
            self.quotas.release(charge)
            raise
        rec.t_queued = time.perf_counter()
        try:
            # bounded by the request's total time too: one sent with none left would end as the
            # runtime's timeout and count against a healthy replica's breaker
            left = rec.t_arrival + self.cfg.timeouts.total_s - time.perf_counter()
            await self.limiter.wait_turn(grant, key, cls, left)
        except BaseException:
            self.limiter.finish(grant, 0.0)
            self.quotas.release(charge)
            raise
        return Ticket(key, grant, charge)

    def finish(self, ticket: Ticket, rec: RequestRecord) -> None:
        """The request ended (whatever the cause): what it really used replaces the estimates."""
        prompt, completion = billed_tokens(rec)
        # per minute: with no count from the runtime the reservation stands (it may have generated)
        self.limiter.finish(ticket.grant, None if rec.completion_tokens is None else prompt + completion)
        self.quotas.settle(ticket.charge, prompt + completion)  # as the usage row will say

    # -- what the key holder and the operator see ------------------------------------------------
    async def me(self, key: ApiKey) -> dict[str, Any]:
        """``GET /v1/me``: the key's limits, quotas with what is left, and its state now."""
        await self.quotas.ensure(key.id, key.quotas)
        d = key.describe()
        return {
            "object": "api_key", "id": key.id, "tenant": key.tenant, "label": key.label, "owner": key.owner,
            "priority": key.priority or self.cfg.auth.anonymous_priority,
            "max_priority": key.max_priority or key.priority or self.cfg.auth.anonymous_priority,
            "models": list(key.models) or ["*"],
            "limits": {"rpm": key.rpm, "tpm": key.tpm, "max_concurrency": key.max_concurrency,
                       **({"per": "user"} if key.trust_forwarded_user else {})},
            "trust_forwarded_user": key.trust_forwarded_user,
            "quotas": self.quotas.usage(key.id, key.quotas),
            "expires_at": d["expires_at"], "created": d["created"],
            **self.limiter.state(key.id),
        }

    def key_rows(self, keys: Sequence[ApiKey]) -> list[dict[str, Any]]:
        """One row per key for the dashboard: who, activity since start, quota use, state now."""
        now = time.time()
        rows = []
        for k in keys:
            quotas = self.quotas.usage(k.id, k.quotas)
            rows.append({"id": k.id, "tenant": k.tenant, "label": k.label, "owner": k.owner,
                         "models": list(k.models), "expires_at": iso_time(k.expires_at), "expired": k.expired(now),
                         "quotas": quotas, **self.activity.key(k.id, now), **self.limiter.state(k.id)})
        return sorted(rows, key=lambda r: (-r["tokens"], -r["requests"], r["tenant"], r["id"]))

    def snapshot(self) -> dict[str, Any]:
        """``/admin/stats`` additions: the failed-key throttle, tenants, keys."""
        now = time.time()
        keys = self.ring.active if self.ring is not None else []
        return {
            "auth_throttle": self.throttle.snapshot(),
            "tenants": self.activity.tenant_rows(now),
            "keys": self.key_rows(keys),
            "activity_since": iso_time(self.activity.started),
        }
