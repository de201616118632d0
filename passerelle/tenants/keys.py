"""API keys and tenants, stored in SQLite as SHA-256 hashes only, every change in the audit log.

A key looks like ``psk_<id>_<secret>``; the id finds the record, and the hash of the whole key is
compared with :func:`hmac.compare_digest`, so a lookup takes the same time whatever the guess.
The key itself is printed once, at creation, and never stored.

A key carries who it is for (tenant, label, owner), what it may use (``models``: globs, empty for
all), for how long (``expires_at``), whether it is a trusted front-end's (``trust_forwarded_user``:
the person it names in a header becomes the tenant), and its limits (per minute: ``rpm``, ``tpm``; at once:
``max_concurrency``; over a day / week / month: ``quotas``).

Example::

    store = KeyStore(path)
    key, secret = store.create("team-a", actor="cli:ops", priority="interactive", rpm=60,
                               models=("llama-3-8b*",))
    ring = KeyRing(store)
    ring.lookup(secret).tenant       # "team-a"
    ring.lookup(secret).allows("llama-3-8b-instruct")   # True
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import orjson

from passerelle.paths import state_dir
from passerelle.tenants.db import connect
from passerelle.tenants.quota import Quota, format_quotas, iso_time, read_quotas

PREFIX = "psk"
_KEY = re.compile(r"^psk_([0-9a-f]{12})_")


def default_db_path() -> Path:
    """The user's store, for the default configuration (no file); see ``Config.db_path``."""
    return state_dir() / "passerelle.db"


def _hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def presented_prefix(presented: str) -> str:
    """The part of a presented key that may be shown and used to tell clients apart: ``psk_<id>``
    for a key of ours, else its first 8 characters (never enough to be a secret)."""
    m = _KEY.match(presented)
    if m:
        return f"{PREFIX}_{m.group(1)}"
    return presented[:8] if presented else "(none)"


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    priority: str | None = None  # the class of its requests (default: the anonymous class)
    max_priority: str | None = None  # the most urgent class X-Priority may ask for
    rpm: int = 0  # requests per minute, 0: unlimited
    tpm: int = 0  # tokens per minute (prompt + max_tokens reserved), 0: unlimited
    max_concurrency: int = 0  # requests at once (more wait in the key's own queue), 0: unlimited
    weight: float = 1.0  # fair-share weight of its tenant
    created: float = 0.0
    revoked: bool = False
    digest: bytes = b""
    label: str = ""  # what the key is for: "CI", "laptop"
    owner: str = ""  # who to ask about it: a person or a team address
    models: tuple[str, ...] = ()  # globs of the models it may use; empty: every model
    quotas: tuple[Quota, ...] = ()  # tokens per day / week / month
    expires_at: float | None = None  # Unix time; None: never
    updated: float = 0.0
    revoked_at: float | None = None
    # A front-end's key (Open WebUI): the user it forwards in [auth] forwarded_user_header becomes the
    # request's tenant, "<tenant>/<user>". A key without the mark never has its tenant set by a header.
    trust_forwarded_user: bool = False

    def allows(self, model: str) -> bool:
        return not self.models or any(fnmatchcase(model, glob) for glob in self.models)

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

    def describe(self) -> dict[str, Any]:
        """The key as the APIs show it: everything but its hash."""
        return {
            "id": self.id, "tenant": self.tenant, "label": self.label, "owner": self.owner,
            "priority": self.priority, "max_priority": self.max_priority, "models": list(self.models),
            "rpm": self.rpm, "tpm": self.tpm, "max_concurrency": self.max_concurrency, "weight": self.weight,
            "quotas": [str(q) for q in self.quotas], "expires_at": iso_time(self.expires_at),
            "expired": self.expired(), "created": iso_time(self.created), "updated": iso_time(self.updated or None),
            "revoked": self.revoked, "revoked_at": iso_time(self.revoked_at),
            "trust_forwarded_user": self.trust_forwarded_user,
        }


# The columns a caller may set, and how each is written to and read from its column.
EDITABLE = ("tenant", "label", "owner", "priority", "max_priority", "rpm", "tpm", "max_concurrency", "weight",
            "models", "quotas", "expires_at", "trust_forwarded_user")
_COLUMNS = ("id, tenant, priority, max_priority, rpm, tpm, max_concurrency, weight, created, revoked, digest, "
            "label, owner, models, quotas, expires_at, updated, revoked_at, trust_forwarded_user")


def _to_column(name: str, value: Any) -> Any:
    if name == "models":
        return orjson.dumps(list(value)).decode() if value else ""
    if name == "quotas":
        return format_quotas(tuple(value))
    if name == "trust_forwarded_user":
        return int(bool(value))
    return value


def _from_row(r: tuple[Any, ...]) -> ApiKey:
    (key_id, tenant, priority, max_priority, rpm, tpm, conc, weight, created, revoked, digest, label, owner,
     models, quotas, expires_at, updated, revoked_at, trust) = r
    return ApiKey(key_id, tenant, priority, max_priority, rpm, tpm, conc, weight, created, bool(revoked),
                  bytes(digest), label or "", owner or "", tuple(orjson.loads(models)) if models else (),
                  read_quotas(quotas or ""), expires_at, updated or 0.0, revoked_at, bool(trust))


class KeyStore:
    """The keys in one SQLite file. Every change writes an audit row in the same transaction.
    (tenants/pgstore.py keeps them in PostgreSQL, shared by several gateways.)"""

    _audit_order = "ts DESC, rowid DESC"

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path else default_db_path()
        self.conn = connect(self.path)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def _write(self, actor: str, action: str, key_id: str, detail: dict[str, Any], sql: str,
               args: tuple[Any, ...]) -> int:
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                n = self.conn.execute(sql, args).rowcount
                if n:
                    self.conn.execute("INSERT INTO audit (ts, actor, action, key_id, detail) VALUES (?,?,?,?,?)",
                                      (time.time(), actor, action, key_id, orjson.dumps(detail).decode()))
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
        return n

    def create(self, tenant: str, *, actor: str = "unknown", **fields: Any) -> tuple[ApiKey, str]:
        """A new key; the secret string is returned once and never stored. ``fields`` are
        :data:`EDITABLE` names (``max_priority`` defaults to ``priority``)."""
        unknown = set(fields) - set(EDITABLE)
        if unknown:
            raise TypeError(f"unknown key fields: {', '.join(sorted(unknown))}")
        key_id = secrets.token_hex(6)
        secret = f"{PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
        now = time.time()
        if not fields.get("max_priority"):
            fields["max_priority"] = fields.get("priority")
        given: dict[str, Any] = {k: (tuple(v) if k in ("models", "quotas") else v) for k, v in fields.items()}
        rec = ApiKey(key_id, tenant, created=now, updated=now, digest=_hash(secret), **given)
        values = {name: _to_column(name, getattr(rec, name)) for name in EDITABLE}
        names = ", ".join(["id", "digest", "created", "updated", "revoked", *values])
        marks = ", ".join("?" * (5 + len(values)))
        self._write(actor, "create", key_id, {"tenant": tenant, **_shown(rec, EDITABLE)},
                    f"INSERT INTO api_keys ({names}) VALUES ({marks})",
                    (key_id, rec.digest, now, now, 0, *values.values()))
        return rec, secret

    def get(self, key_id: str) -> ApiKey | None:
        with self._lock:
            row = self.conn.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _from_row(row) if row else None

    def list(self, *, include_revoked: bool = True) -> list[ApiKey]:
        with self._lock:
            rows = self.conn.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created").fetchall()
        keys = [_from_row(r) for r in rows]
        return keys if include_revoked else [k for k in keys if not k.revoked]

    def update(self, key_id: str, *, actor: str = "unknown", **changes: Any) -> ApiKey | None:
        """Change an active key's fields; None when there is no active key ``key_id``."""
        unknown = set(changes) - set(EDITABLE)
        if unknown:
            raise TypeError(f"unknown key fields: {', '.join(sorted(unknown))}")
        old = self.get(key_id)
        if old is None or old.revoked:
            return None
        given: dict[str, Any] = {k: (tuple(v) if k in ("models", "quotas") else v) for k, v in changes.items()}
        new = dataclasses.replace(old, updated=time.time(), **given)
        changed = [n for n in changes if getattr(old, n) != getattr(new, n)]
        if not changed:
            return old
        sets = ", ".join(f"{n} = ?" for n in changed)
        detail = {n: {"from": v_old, "to": v_new} for n, v_old, v_new in
                  zip(changed, _shown(old, changed).values(), _shown(new, changed).values(), strict=True)}
        n = self._write(actor, "update", key_id, detail,
                        f"UPDATE api_keys SET {sets}, updated = ? WHERE id = ? AND revoked = 0",
                        (*(_to_column(c, getattr(new, c)) for c in changed), new.updated, key_id))
        return new if n else None

    def revoke(self, key_id: str, *, actor: str = "unknown") -> bool:
        now = time.time()
        return self._write(actor, "revoke", key_id, {},
                           "UPDATE api_keys SET revoked = 1, revoked_at = ?, updated = ? WHERE id = ? AND revoked = 0",
                           (now, now, key_id)) == 1

    def audit_log(self, *, limit: int = 100, key_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """The newest changes first: ``{"ts", "actor", "action", "key_id", "detail"}``."""
        args: tuple[Any, ...] = (key_id, limit) if key_id else (limit,)
        where = "WHERE key_id = ?" if key_id else ""
        with self._lock:
            rows = self.conn.execute(f"SELECT ts, actor, action, key_id, detail FROM audit {where} "
                                     f"ORDER BY {self._audit_order} LIMIT ?", args).fetchall()
        return [{"ts": iso_time(ts), "actor": actor, "action": action, "key_id": kid, "detail": orjson.loads(detail)}
                for ts, actor, action, kid, detail in rows]

    def cached_keys(self) -> builtins.list[ApiKey]:
        """Every key, as the key ring reads them on the request path (here: from the file)."""
        return self.list()

    def usable(self) -> None:
        """Raise StoreUnavailable when the keys in memory may no longer be trusted (a shared store's)."""

    def version(self) -> int:
        """Changes whenever anyone (this process or ``passerelle keys``) changes a key."""
        with self._lock:
            return int(self.conn.execute("SELECT value FROM meta WHERE name = 'keys_version'").fetchone()[0])


def _shown(key: ApiKey, names: Any) -> dict[str, Any]:
    """Fields as the audit log keeps them (plain JSON values)."""
    out = {}
    for n in names:
        v = getattr(key, n)
        out[n] = ([str(q) for q in v] if n == "quotas" else list(v) if n == "models"
                  else iso_time(v) if n == "expires_at" else v)
    return out


class KeyRing:
    """The active keys in memory, reloaded when the store changes (checked at most once a second)."""

    def __init__(self, store: KeyStore, *, refresh_s: float = 1.0) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self._keys: dict[str, ApiKey] = {}
        self._tenants: frozenset[str] = frozenset()
        self._ever = False
        self._version = -1
        self._checked = 0.0
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> None:
        self.store.usable()  # (a shared store away for too long raises, on every request)
        now = time.monotonic()
        if not force and now - self._checked < self.refresh_s:
            return
        self._checked = now
        version = self.store.version()
        if force or version != self._version:
            self._version = version
            every = self.store.cached_keys()
            self._keys = {k.id: k for k in every if not k.revoked}
            self._tenants = frozenset(k.tenant for k in every)
            self._ever = bool(every)

    def has_tenant(self, tenant: str) -> bool:
        """Whether some key, active or revoked, belongs to ``tenant`` (metrics label those only)."""
        self.refresh()
        return tenant in self._tenants

    @property
    def any(self) -> bool:
        """True once a key was ever created: revoking the last key must not open the gateway."""
        return self._ever

    @property
    def active(self) -> list[ApiKey]:
        return list(self._keys.values())

    def get(self, key_id: str) -> ApiKey | None:
        return self._keys.get(key_id)

    def lookup(self, presented: str) -> ApiKey | None:
        """The active key matching ``presented``, or None."""
        self.refresh()
        parts = presented.split("_", 2)
        candidate = self._keys.get(parts[1]) if len(parts) == 3 and parts[0] == PREFIX else None
        # Compare against a dummy digest when the id is unknown, so both paths cost the same.
        digest = candidate.digest if candidate else b"\0" * 32
        ok = hmac.compare_digest(_hash(presented), digest)
        return candidate if ok and candidate else None
