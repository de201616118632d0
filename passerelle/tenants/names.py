"""The tenant a request without a key is accounted to: its OpenAI ``user`` field, bounded.

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

_HASH_CHARS = 12  # 48 bits of blake2b over the whole value


def user_tenant(user: str, max_chars: int = 64) -> str:
    if len(user) <= max_chars:
        return user
    digest = hashlib.blake2b(user.encode(errors="surrogatepass"), digest_size=_HASH_CHARS // 2).hexdigest()
    return user[: max_chars - _HASH_CHARS - 1] + "~" + digest
