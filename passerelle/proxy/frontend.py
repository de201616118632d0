"""What a trusted front-end (Open WebUI) says about a request: who the person is, and whether it
is one of its background tasks. Read only for a key marked ``trust_forwarded_user``; any other
caller's headers of these names are ignored.

The person, from one of two sources (``[auth]``):

* the signed token (``forwarded_user_jwt_header``, when ``forwarded_user_jwt_secret`` is set):
  verified (tenants/signed_user.py); its ``sub`` is the person, its ``name`` and ``email`` go
  beside it in usage. A token that fails is a 401 (``unauthorized``); the plain headers are then
  never read, since anybody with the front-end's key could write them;
* otherwise the plain headers: ``forwarded_user_header`` (the id), ``forwarded_name_header``
  (URL-quoted by Open WebUI) and ``forwarded_email_header``.

The task (``forwarded_task_header``, a non-empty value such as ``title_generation``): Open WebUI
fills it from its connection's custom header ``{"X-OpenWebUI-Task": "{{TASK}}"}``, empty for a
user's own chat turn. A task runs at ``task_priority``, never above the key's own class, and gets
``max_tokens = task_max_tokens`` when it sets no output limit (Open WebUI sends none for follow-ups,
tags and queries: one follow-up ran 461 tokens for 36 s at the standard class).

Example::

    person = person_of(cfg.auth, scope, time.time())   # Person("8f1c…", "Alice", "alice@example.org") or None
    task = task_of(cfg.auth, scope)                     # "follow_up_generation", or ""
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from passerelle.config import AuthConfig, ClassConfig
from passerelle.errors import BadForwardedUser
from passerelle.proxy.exchange import Scope
from passerelle.tenants.names import forwarded_user
from passerelle.tenants.signed_user import BadToken, verify

MAX_TASK_CHARS = 64  # Open WebUI's task names are ~25 characters
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


@dataclass(frozen=True, slots=True)
class Person:
    user: str  # as the tenant's last part (tenants/names.py forwarded_user): bounded, safe
    name: str = ""
    email: str = ""


def _headers(scope: Scope, *names: str) -> list[str | None]:
    wanted = [n.lower().encode() for n in names]
    found: list[str | None] = [None] * len(names)
    for k, v in scope["headers"]:
        for i, n in enumerate(wanted):
            if k == n and found[i] is None:
                found[i] = bytes(v).decode("utf-8", "replace")
    return found


def clip_text(value: str, limit: int) -> str:
    """A name or email as kept beside the id: control characters out, trimmed, at most ``limit``."""
    return _CONTROL.sub(" ", value).strip()[:limit]


def person_of(auth: AuthConfig, scope: Scope, now: float) -> Person | None:
    """The person a trusted front-end's request names; None when it names nobody. Raises
    :class:`BadForwardedUser` (401) for a signed token that does not verify."""
    limit = auth.max_user_chars * 4
    if auth.forwarded_user_jwt_secret:
        (token,) = _headers(scope, auth.forwarded_user_jwt_header)
        if token is None:
            return None
        try:
            signed = verify(token, auth.forwarded_user_jwt_secret.encode(), now=now)
        except BadToken as err:
            raise BadForwardedUser(f"The forwarded user token ({auth.forwarded_user_jwt_header}) was refused: "
                                   f"{err}.") from None
        user = forwarded_user(signed.sub, auth.max_user_chars)
        return Person(user, clip_text(signed.name, limit), clip_text(signed.email, limit)) if user else None
    uid, name, email = _headers(scope, auth.forwarded_user_header, auth.forwarded_name_header,
                                auth.forwarded_email_header)
    user = forwarded_user(uid or "", auth.max_user_chars)
    if not user:
        return None
    # (unquote never raises: a broken escape is kept as it is)
    return Person(user, clip_text(unquote(name[:limit * 3] if name else ""), limit), clip_text(email or "", limit))


def task_of(auth: AuthConfig, scope: Scope) -> str:
    """The background task a trusted front-end's request says it is ("" for a user's own turn)."""
    if not auth.forwarded_task_header:
        return ""
    (task,) = _headers(scope, auth.forwarded_task_header)
    return clip_text(task or "", MAX_TASK_CHARS)


def task_class(classes: dict[str, ClassConfig], auth: AuthConfig, cls: ClassConfig) -> ClassConfig:
    """A task's class: ``task_priority``, or ``cls`` (the request's own) where that is less urgent."""
    task = classes.get(auth.task_priority)
    return task if task is not None and task.rank > cls.rank else cls
