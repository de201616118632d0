"""The key API on the admin listener, and the key holder's own ``/v1/me`` routes.

    GET    /admin/keys              every key (never a secret), with its activity and quota use
    POST   /admin/keys              create one: {"tenant": …, "models": […], "quotas": ["2M/day"], …};
                                    201 with {"key": "psk_…", …}: the secret, shown this once
    GET    /admin/keys/ID           one key
    PATCH  /admin/keys/ID           change its fields (limits, models, quotas, expiry, label, owner)
    DELETE /admin/keys/ID           revoke it
    GET    /admin/audit?key=ID      who changed what, when (newest first)

    GET    /v1/me                   the calling key: its limits, quotas and what is left of them
    GET    /v1/me/usage?since=7d    its requests and tokens by model (since: 90m, 24h, 7d, a date), and
                                    for a front-end's key (trust_forwarded_user) by person: "users",
                                    paged as OpenAI pages its lists: ``limit`` (100, at most 1000)
                                    people by name after ``after`` (the last page's ``last_user``),
                                    ``has_more`` when another page follows

The admin routes sit behind the admin guard (loopback by default) and, since they hand out
keys, also need ``[admin] key`` to be set: without it they answer 403 and say so (``passerelle
keys`` on the box works either way: it writes the same store through the same code,
:class:`~passerelle.tenants.manage.KeyManager`). The audit log names the actor as
``admin API from ADDRESS`` plus the ``X-Passerelle-Actor`` header when the caller gives one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import orjson

from passerelle.errors import Forbidden, InvalidRequest, NotFound
from passerelle.proxy.exchange import Receive, Scope, Send, header
from passerelle.server.responses import json_response
from passerelle.tenants.admin_key import AdminKeyCheck
from passerelle.tenants.keys import ApiKey, KeyStore
from passerelle.tenants.manage import KeyManager
from passerelle.tenants.people import PeopleBook
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.quota import iso_time
from passerelle.tenants.usage import UsageReports, UsageSink, parse_since

MAX_BODY = 64 * 1024
USERS_PAGE, MAX_USERS_PAGE = 100, 1000  # people in one answer of /v1/me/usage: default, most
MAX_MODELS = 1000  # model rows of /v1/me/usage (the largest), whatever model names requests gave
MAX_CURSOR = 512  # characters of 'after' (a user name is cut to [auth] max_user_chars anyway)


async def read_json(receive: Receive) -> dict[str, Any]:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise InvalidRequest("The client left while sending the body.")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise InvalidRequest(f"The body is larger than {MAX_BODY} bytes.")
        chunks.append(chunk)
        if not msg.get("more_body"):
            break
    raw = b"".join(chunks)
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return data


def _query(scope: Scope) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}


def actor(scope: Scope) -> str:
    client = scope.get("client")
    who = f"admin API from {client[0] if client else 'a local socket'}"
    named = header(scope, b"x-passerelle-actor")
    return f"{who} ({named.strip()[:100]})" if named and named.strip() else who


def _activity(row: dict[str, Any]) -> dict[str, Any]:
    return {n: row[n] for n in ("requests", "tokens", "failed", "limited", "last_seen_s_ago", "running", "queued",
                                "quotas")}


@dataclass
class KeysApi:
    """The handlers, with what they work on (the app's key store, policy and usage store)."""

    admin: AdminKeyCheck  # [admin] key's one check: without a key, keys are not managed over HTTP
    store: KeyStore
    manager: KeyManager
    policy: KeyPolicy
    recorder: UsageSink
    reader: UsageReports
    people: PeopleBook | None = None  # names and emails beside a front-end's people (tenants/people.py)

    def _require_admin_key(self) -> None:
        if not self.admin.enabled:
            raise Forbidden("Managing keys over HTTP needs an admin key: set [admin] key in the configuration "
                            "(or PASSERELLE_ADMIN_KEY), or use 'passerelle keys' on the gateway's machine.")

    def _changed(self) -> None:
        if self.policy.ring is not None:  # this process's own change: no need to wait for the poll
            self.policy.ring.refresh(force=True)

    def _shown(self, key: ApiKey) -> dict[str, Any]:
        return {**key.describe(), "activity": _activity(self.policy.key_rows([key])[0])}

    async def collection(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /admin/keys: list; POST: create."""
        self._require_admin_key()
        if scope["method"] == "POST":
            key, secret = self.manager.create(await read_json(receive), actor=actor(scope))
            self._changed()
            await json_response(send, 201, {"key": secret, **self._shown(key),
                                            "note": "The key is shown only this once; it is stored hashed."})
            return
        query = _query(scope)
        keys = self.store.list(include_revoked=query.get("revoked") in ("1", "true", "yes"))
        rows = {r["id"]: r for r in self.policy.key_rows(keys)}
        await json_response(send, 200, {"object": "list", "data": [
            {**k.describe(), "activity": _activity(rows[k.id])} for k in keys]})

    async def item(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET, PATCH, DELETE /admin/keys/ID."""
        self._require_admin_key()
        key_id = scope["path"].removeprefix("/admin/keys/").strip("/")
        method = scope["method"]
        if method == "PATCH":
            key = self.manager.update(key_id, await read_json(receive), actor=actor(scope))
            self._changed()
        elif method == "DELETE":
            key = self.manager.revoke(key_id, actor=actor(scope))
            self._changed()
        else:
            key = self.manager.get(key_id)
        await json_response(send, 200, self._shown(key))

    async def audit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /admin/audit?key=ID&limit=N."""
        self._require_admin_key()
        query = _query(scope)
        try:
            limit = max(1, min(1000, int(query.get("limit", "100"))))
        except ValueError:
            raise InvalidRequest("'limit' must be an integer.", param="limit") from None
        await json_response(send, 200, {"object": "list",
                                        "data": self.store.audit_log(limit=limit, key_id=query.get("key") or None)})

    # -- the key holder's own routes -----------------------------------------------------------
    def _caller(self, scope: Scope) -> ApiKey:
        key = self.policy.authenticate(scope)
        if key is None:
            raise NotFound("This gateway does not use API keys, so there is no key to describe.")
        return key

    async def me(self, scope: Scope, receive: Receive, send: Send) -> None:
        await json_response(send, 200, await self.policy.me(self._caller(scope)))

    async def me_usage(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self._caller(scope)
        query = _query(scope)
        try:
            since = parse_since(query.get("since") or "30d")
        except ValueError:
            raise InvalidRequest("'since' must be a date (2026-11-30), a time (2026-11-30T12:00) or a duration "
                                 "back from now (90m, 24h, 7d).", param="since") from None
        limit, after = _users_page(query)
        await self.recorder.flush()  # what just finished counts
        rows = await self.reader.report(since=since, by=("model",), key_id=key.id, limit=MAX_MODELS + 1)
        whole = rows  # every model's row: the total is their sum, else one more query sums them all
        if len(rows) > MAX_MODELS:
            rows, whole = rows[:MAX_MODELS], await self.reader.report(since=since, by=("key",), key_id=key.id)
        total = {n: sum(r[n] for r in whole) for n in ("requests", "prompt_tokens", "completion_tokens",
                                                       "total_tokens", "not_ok", "limited")}
        # one more than asked: whether another page follows (after "" leaves out rows without a user)
        users = await self.reader.report(since=since, by=("user",), key_id=key.id, after=after, limit=limit + 1)
        more = len(users) > limit
        users = users[:limit]
        named = await self.people.lookup(key.id, [r["user"] for r in users]) if self.people and users else {}
        paged = {"users": [{**r, "tenant": f"{key.tenant}/{r['user']}", "last_seen": iso_time(r["last_seen"]),
                            **dict(zip(("name", "email"), named.get(r["user"], ("", "")), strict=True))}
                           for r in users],
                 "has_more": more, "last_user": users[-1]["user"] if users else None}
        await json_response(send, 200, {
            "object": "usage", "key": key.id, "tenant": key.tenant, "since": iso_time(since),
            "until": iso_time(time.time()), "total": total,
            "data": [{**r, "last_seen": iso_time(r["last_seen"])} for r in rows],
            **(paged if users or after or key.trust_forwarded_user else {})})


def _users_page(query: dict[str, str]) -> tuple[int, str]:
    """``limit`` and ``after`` of /v1/me/usage's people ("" : from the first)."""
    try:
        limit = int(query.get("limit", USERS_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_USERS_PAGE:
        raise InvalidRequest(f"'limit' must be an integer between 1 and {MAX_USERS_PAGE}.", param="limit")
    after = query.get("after", "")
    if len(after) > MAX_CURSOR:
        raise InvalidRequest(f"'after' must be a user name of at most {MAX_CURSOR} characters (the last "
                             "page's last_user).", param="after")
    return limit, after
