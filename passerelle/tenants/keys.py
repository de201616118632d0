"""API keys and tenants, stored in SQLite as SHA-256 hashes only.

A key looks like ``psk_<id>_<secret>``; the id finds the record, and the hash of the whole key is
compared with :func:`hmac.compare_digest`, so a lookup takes the same time whatever the guess.
The key itself is printed once, at creation, and never stored.

Example::

    store = KeyStore(path)
    key, secret = store.create("team-a", priority="interactive", rpm=60)
    auth = KeyRing(store)
    auth.lookup(secret).tenant     # "team-a"
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from passerelle.paths import state_dir

PREFIX = "psk"


def default_db_path() -> Path:
    return state_dir() / "passerelle.db"


def _hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    priority: str | None = None  # the class of its requests (default: the anonymous class)
    max_priority: str | None = None  # the most urgent class X-Priority may ask for
    rpm: int = 0  # requests per minute, 0: unlimited
    tpm: int = 0  # tokens per minute (prompt + max_tokens reserved), 0: unlimited
    max_concurrency: int = 0  # requests at once, 0: unlimited
    weight: float = 1.0  # fair-share weight of its tenant
    created: float = 0.0
    revoked: bool = False
    digest: bytes = b""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, digest BLOB NOT NULL, tenant TEXT NOT NULL, priority TEXT, max_priority TEXT,
    rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0, max_concurrency INTEGER NOT NULL DEFAULT 0,
    weight REAL NOT NULL DEFAULT 1.0, created REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL, tenant TEXT NOT NULL, class TEXT NOT NULL, model TEXT NOT NULL, cause TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
"""

_COLUMNS = "id, tenant, priority, max_priority, rpm, tpm, max_concurrency, weight, created, revoked, digest"


def connect(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """A connection to passerelle's SQLite file (created with its tables when missing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=10, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # committed rows survive a kill -9 of the process
    # The usage table only grows at its end and keys are few: a 256 KiB page cache is plenty, where
    # SQLite's default (2 MB) would show as the gateway's memory creeping up as the file grows.
    conn.execute("PRAGMA cache_size=-256")
    conn.executescript(_SCHEMA)
    return conn


class KeyStore:
    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path else default_db_path()
        self.conn = connect(self.path)
        self._lock = threading.Lock()

    def create(self, tenant: str, *, priority: str | None = None, max_priority: str | None = None, rpm: int = 0,
               tpm: int = 0, max_concurrency: int = 0, weight: float = 1.0) -> tuple[ApiKey, str]:
        """A new key; the secret string is returned once and never stored."""
        key_id = secrets.token_hex(6)
        secret = f"{PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
        rec = ApiKey(key_id, tenant, priority, max_priority or priority, rpm, tpm, max_concurrency, weight,
                     time.time(), False, _hash(secret))
        with self._lock:
            self.conn.execute(f"INSERT INTO api_keys ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                              (rec.id, rec.tenant, rec.priority, rec.max_priority, rec.rpm, rec.tpm,
                               rec.max_concurrency, rec.weight, rec.created, 0, rec.digest))
        return rec, secret

    def list(self, *, include_revoked: bool = True) -> list[ApiKey]:
        with self._lock:
            rows = self.conn.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created").fetchall()
        keys = [ApiKey(*r[:9], bool(r[9]), bytes(r[10])) for r in rows]
        return keys if include_revoked else [k for k in keys if not k.revoked]

    def revoke(self, key_id: str) -> bool:
        with self._lock:
            cur = self.conn.execute("UPDATE api_keys SET revoked = 1 WHERE id = ? AND revoked = 0", (key_id,))
        return cur.rowcount == 1

    def data_version(self) -> int:
        """Changes whenever another connection (e.g. ``passerelle keys create``) commits."""
        with self._lock:
            return self.conn.execute("PRAGMA data_version").fetchone()[0]


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
        now = time.monotonic()
        if not force and now - self._checked < self.refresh_s:
            return
        self._checked = now
        version = self.store.data_version()
        if force or version != self._version:
            self._version = version
            every = self.store.list()
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

    def lookup(self, presented: str) -> ApiKey | None:
        """The active key matching ``presented``, or None."""
        self.refresh()
        parts = presented.split("_", 2)
        candidate = self._keys.get(parts[1]) if len(parts) == 3 and parts[0] == PREFIX else None
        # Compare against a dummy digest when the id is unknown, so both paths cost the same.
        digest = candidate.digest if candidate else b"\0" * 32
        ok = hmac.compare_digest(_hash(presented), digest)
        return candidate if ok and candidate else None
