"""The person a front-end names in a signed token: Open WebUI's ``X-OpenWebUI-User-Jwt``.

Open WebUI (0.12, with ``FORWARD_USER_INFO_HEADER_JWT_SECRET`` set) sends, instead of its plain
``X-OpenWebUI-User-*`` headers, one HS256 JSON Web Token with the claims ``sub`` (its user id),
``email``, ``name``, ``role``, ``iss`` ("open-webui"), ``iat`` and ``exp`` (300 s later by default).
Anybody holding the front-end's API key can write plain headers; only a holder of the shared secret
can write this token. So with ``[auth] forwarded_user_jwt_secret`` set, the person behind a trusted
key's request comes from a verified token alone.

The verifier is written here with hmac/hashlib/base64 (a few lines; no JWT library is a
dependency), and refuses rather than guesses:

* at most :data:`MAX_TOKEN_CHARS` characters, three base64url parts, JSON objects;
* the header's ``alg`` must be ``HS256`` exactly (``none``, ``HS512``, RS256... are refused: the
  algorithm is the verifier's choice, never the token's);
* the signature compared in constant time (:func:`hmac.compare_digest`);
* ``exp`` required and ``nbf`` honoured when present, both with :data:`LEEWAY_S` of clock skew;
* ``sub`` a non-empty string.

Every refusal is a :class:`BadToken` whose message says why without echoing the token.

Example::

    person = verify(token, b"shared secret", now=time.time())   # SignedUser(sub=..., email=..., name=...)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

import orjson

MAX_TOKEN_CHARS = 4096  # Open WebUI's tokens are ~300 characters; a longer one is refused unread
LEEWAY_S = 30.0  # clock skew allowed between the front-end's clock and ours


class BadToken(ValueError):
    """A token that does not name a person: malformed, wrongly signed, expired, or not yet valid."""


@dataclass(frozen=True, slots=True)
class SignedUser:
    sub: str
    email: str = ""
    name: str = ""
    role: str = ""


def _b64(part: str) -> bytes:
    if not part or len(part) % 4 == 1 or not part.isascii():
        raise BadToken("the token is not base64url")
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError):
        raise BadToken("the token is not base64url") from None


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadToken(f"the token's {what} is not JSON") from None
    if not isinstance(value, dict):
        raise BadToken(f"the token's {what} is not a JSON object")
    return value


def _time(claims: dict[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise BadToken(f"the token's '{name}' is not a number")
    return float(value)


def _text(claims: dict[str, Any], name: str) -> str:
    value = claims.get(name)
    return value if isinstance(value, str) else ""


def verify(token: str, secret: bytes, *, now: float, leeway_s: float = LEEWAY_S) -> SignedUser:
    """The person ``token`` names, once its HS256 signature with ``secret`` and its times are
    checked; :class:`BadToken` otherwise (never another exception, whatever ``token`` holds)."""
    if not secret:
        raise BadToken("no secret is configured to check the token")
    if len(token) > MAX_TOKEN_CHARS:
        raise BadToken(f"the token is longer than {MAX_TOKEN_CHARS} characters")
    if not token.isascii():
        raise BadToken("the token is not base64url")
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise BadToken("the token does not have three parts")
    head_b64, body_b64, sig_b64 = parts
    header = _json_object(_b64(head_b64), "header")
    if header.get("alg") != "HS256":
        raise BadToken("the token's algorithm is not HS256")
    signature = _b64(sig_b64)
    expected = hmac.new(secret, f"{head_b64}.{body_b64}".encode("ascii"), hashlib.sha256).digest()
    if not hmac.compare_digest(signature, expected):
        raise BadToken("the token's signature does not match the configured secret")
    claims = _json_object(_b64(body_b64), "claims")
    exp, nbf = _time(claims, "exp"), _time(claims, "nbf")
    if exp is None:
        raise BadToken("the token has no expiry ('exp')")
    if now > exp + leeway_s:
        raise BadToken("the token has expired")
    if nbf is not None and now < nbf - leeway_s:
        raise BadToken("the token is not valid yet ('nbf')")
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.strip():
        raise BadToken("the token names nobody ('sub')")
    return SignedUser(sub=sub, email=_text(claims, "email"), name=_text(claims, "name"), role=_text(claims, "role"))


def sign(claims: dict[str, Any], secret: bytes, *, alg: str = "HS256") -> str:
    """A token as Open WebUI writes one (for tests and ``passerelle`` users checking a set-up)."""
    def enc(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
    head = enc(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    body = enc(json.dumps(claims, separators=(",", ":")).encode())  # (json: any int, as PyJWT writes)
    sig = hmac.new(secret, f"{head}.{body}".encode("ascii"), hashlib.sha256).digest()
    return f"{head}.{body}.{enc(sig)}"
