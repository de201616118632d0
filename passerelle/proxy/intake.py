"""What the gateway reads from a request before it queues it: the body (capped), its class, what
ties it to a replica, and how many tokens it may cost.

Example::

    body = await read_request_body(scope, receive, limit=cfg.server.max_body_bytes)
    cls = priority_class(classes, cfg.auth, scope, key)          # X-Priority within the key's ceiling
    session = session_of(cfg.routing, scope, data, chat_header)   # ("prompt_cache_key", "…") or ("", "")
    affinity = affinity_key(cfg.routing, scope, data, "chat", session)  # "s:…", or "p:…": the opening
"""

from __future__ import annotations

import hashlib
from typing import Any

from passerelle.config import AuthConfig, ClassConfig, RoutingConfig
from passerelle.errors import BodyTooLarge, ClientDisconnect, InvalidRequest, encode_request
from passerelle.proxy.exchange import Receive, Scope, header
from passerelle.tenants.keys import ApiKey


async def read_request_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to exceed ``limit`` bytes."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                if int(value) > limit:
                    raise BodyTooLarge(limit)
            except ValueError:
                raise InvalidRequest("Content-Length is not a number.") from None
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect("client left while sending the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def output_estimate(data: dict[str, Any] | None, length: int | None) -> int:
    """Tokens the request may generate, for admission (tokens per minute, quotas) and fair share:
    its length limit (else 256) times the sequences generated (``n``, and ``best_of``, which
    generates that many to return ``n``).

    >>> output_estimate({"max_tokens": 500, "n": 1000}, 500)
    500000
    """
    sequences = 1
    for name in ("n", "best_of"):
        v = (data or {}).get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > sequences:
            sequences = v
    return (length or 256) * sequences


def with_usage_requested(body: bytes, data: dict[str, Any]) -> bytes:
    """``body`` with ``stream_options.include_usage = true`` (spliced in when absent, so the
    rest of the body keeps its exact bytes)."""
    if "stream_options" not in data:
        i = body.index(b"{")
        return body[: i + 1] + b'"stream_options":{"include_usage":true},' + body[i + 1 :]
    data = dict(data, stream_options={**(data["stream_options"] or {}), "include_usage": True})  # null is valid
    return encode_request(data)


def priority_class(classes: dict[str, ClassConfig], auth: AuthConfig, scope: Scope,
                   key: ApiKey | None) -> ClassConfig:
    """The key's class (or the anonymous one), lowered by X-Priority, raised only up to the
    key's ``max_priority``."""
    base = classes[(key.priority if key and key.priority in classes else None)
                        or auth.anonymous_priority]
    ceiling = classes[(key.max_priority if key and key.max_priority in classes else None)
                           or (base.name if key else auth.anonymous_max_priority)]
    asked = header(scope, b"x-priority")
    if not asked:
        return base
    wanted = classes.get(asked.strip().lower())
    if wanted is None:
        raise InvalidRequest(f"X-Priority must be one of: {', '.join(classes)}.", param="X-Priority")
    if wanted.rank < min(ceiling.rank, base.rank):
        return ceiling if ceiling.rank < base.rank else base
    return wanted

MAX_SESSION_CHARS = 512  # a longer session id is hashed whole all the same; nothing keeps it


_Sources = tuple[tuple[tuple[str, bytes], ...], frozenset[bytes], tuple[tuple[str, tuple[str, ...]], ...]]
# (id of the [routing] section, chat header) -> (that section, its sources). Keyed by identity, not
# by the frozen section's hash (which hashes every field, on every request); the section is kept in
# the entry so that its id is never reused while the entry stands.
_SOURCES: dict[tuple[int, str], tuple[RoutingConfig, _Sources]] = {}


def _session_sources(r: RoutingConfig, chat_header: str) -> _Sources:
    """The headers (name, its lower-case bytes; the set of those bytes) and body paths a session
    is read from, in order: worked out once per configuration, not on every request."""
    entry = _SOURCES.get((id(r), chat_header))
    if entry is not None and entry[0] is r:
        return entry[1]
    names = tuple((n.lower(), n.lower().encode()) for n in (r.session_header, *r.session_headers, chat_header) if n)
    sources = names, frozenset(raw for _, raw in names), tuple((p, tuple(p.split("."))) for p in r.session_fields)
    if len(_SOURCES) >= 16:  # (configurations reloaded many times: start again)
        _SOURCES.clear()
    _SOURCES[(id(r), chat_header)] = (r, sources)
    return sources


def session_of(r: RoutingConfig, scope: Scope, data: dict[str, Any] | None,
               chat_header: str = "") -> tuple[str, str]:
    """``(where, id)``: the session a request names, first found among the [routing] session header,
    ``session_headers`` (Claude Code's ``X-Claude-Code-Session-Id``, Codex's ``session-id``), a
    trusted front-end's chat header (``chat_header``: Open WebUI's ``X-OpenWebUI-Chat-Id``, given only
    for a key that trusts it), then the body's ``session_fields`` (``prompt_cache_key``, Anthropic's
    ``metadata.user_id``, OpenAI's ``user``); ``("", "")`` for none."""
    names, wanted, fields = _session_sources(r, chat_header)
    found: dict[bytes, str] = {}
    for k, v in scope["headers"]:  # one pass over the headers; a header's first value counts
        if k in wanted and k not in found:
            found[k] = bytes(v).decode("latin-1")
    if found:
        for name, raw in names:
            if value := found.get(raw):
                return name, value.strip()
    if not isinstance(data, dict):
        return "", ""
    for path, parts in fields:
        node: Any = data
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and node.strip():
            return path, node.strip()
    return "", ""


def keeps_kv(session: tuple[str, str]) -> bool:
    """Whether a session found by :func:`session_of` has its slot held and its KV kept
    (scheduling/session_kv.py): a session an agent or a front-end names, not the ``user`` field,
    which names a person with many conversations, each its own prompt (a slot held for them
    between unrelated requests costs others' work and saves no prefill)."""
    where, sid = session
    return bool(sid) and where != "user"


def session_hash(session: str) -> str:
    """How a session id is kept and shown (access log, usage, affinity): 24 hex digits of its hash,
    so a client's string never sets an entry's size and a log never shows the id itself."""
    return hashlib.blake2b(session.encode(errors="surrogatepass"), digest_size=12).hexdigest() if session else ""


def affinity_key(r: RoutingConfig, scope: Scope, data: dict[str, Any] | None, endpoint: str,
                 session: tuple[str, str] = ("", "")) -> str:
    """What keeps related requests on one replica: a session (:func:`session_of`, but for the
    ``user`` field), else the conversation's opening (system prompt and first user message, shared
    by every turn, so llama-server's prompt cache is reused: chat, Anthropic messages, Responses
    input), else the ``user``."""
    where, sid = session
    if sid and where != "user":  # (a user has many conversations: their openings tell them apart)
        return "s:" + session_hash(sid)
    if data is None:
        return ""
    if r.prefix_affinity and endpoint in ("chat", "messages", "responses"):
        turns = data.get("input" if endpoint == "responses" else "messages")
        opening: list[Any] = [data.get("system" if endpoint == "messages" else "instructions")]
        for m in turns if isinstance(turns, list) else [turns]:
            opening.append(m)
            if not isinstance(m, dict) or m.get("role") == "user":
                break
        return "p:" + hashlib.blake2b(encode_request(opening), digest_size=12).hexdigest()
    user = data.get("user")
    return "u:" + hashlib.blake2b(user.encode(errors="surrogatepass"), digest_size=12).hexdigest() \
        if isinstance(user, str) else ""
