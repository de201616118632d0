"""Tenant names: the one a request without a key is accounted to (its OpenAI ``user`` field,
bounded), a trusted front-end's person (``"<key's tenant>/<user>"``), and those a key may be given.

``user`` is any string a client chooses; it names a tenant in fair share, usage and logs, so its
length is bounded here (the number of tenants is bounded where they are kept: the scheduler
forgets the least recently seen idle ones, metrics label only the keys' tenants). A longer value
keeps its first characters, to stay readable, and a hash of the whole, so that two users who share
a long prefix stay two tenants.

Example::

    >>> user_tenant("alice", 64)
    'alice'
    >>> t = user_tenant("x" * 10_000, 32)
    >>> len(t), t[:19], t[19]
    (32, 'xxxxxxxxxxxxxxxxxxx', '~')
"""

from __future__ import annotations

import hashlib
import re

_HASH_CHARS = 12  # 48 bits of blake2b over the whole value
# Controls, DEL, the separators and bidi overrides: a header's value must not forge a log line or a
# report's row; "/" too, which separates a key's tenant from its user.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069/]")


def user_tenant(user: str, max_chars: int = 64) -> str:
    if len(user) <= max_chars:
        return user
    digest = hashlib.blake2b(user.encode(errors="surrogatepass"), digest_size=_HASH_CHARS // 2).hexdigest()
    return user[: max_chars - _HASH_CHARS - 1] + "~" + digest


def forwarded_user(value: str, max_chars: int = 64) -> str:
    """The user a trusted front-end forwarded, as the last part of a tenant ``"<key's tenant>/<user>"``:
    trimmed, its unsafe characters replaced by ``_``, bounded like :func:`user_tenant` ("" stays "").

    >>> forwarded_user("  8f1c2a/../admin ")
    '8f1c2a_.._admin'
    """
    return user_tenant(_UNSAFE.sub("_", value.strip()), max_chars)


PERSON_SEPARATOR = "/"


def key_tenant_problem(name: str) -> str | None:
    """Why ``name`` cannot be a key's tenant (None: it can). A name with ``/`` is the tenant of a
    trusted front-end's person (``webui/alice``, :func:`forwarded_user`): a key given it would
    share that person's fair share, limits and usage rows.

    >>> key_tenant_problem("webui"), key_tenant_problem("webui/alice") is not None
    (None, True)
    """
    if PERSON_SEPARATOR in name:
        return (f"must not contain '{PERSON_SEPARATOR}': names like 'webui/alice' are the people behind a front-end's "
                "key (--trust-forwarded-user)")
    return None
