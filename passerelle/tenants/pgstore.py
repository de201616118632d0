"""Keys and their audit log in PostgreSQL (``[store] url``), shared by every gateway pointed at it.

:class:`PgKeyStore` is a :class:`~passerelle.tenants.keys.KeyStore` whose rows live in PostgreSQL
(psycopg 3): a key created or revoked through one gateway (or ``passerelle keys``) is seen by the
others at their next poll (``[store] poll_s``, 1 s). Usage rows (tenants/pgusage.py) and quotas'
counters (tenants/pgquota.py) are in the same database; batches stay in the instance's files.

The request path never waits on the database: a thread polls the keys' version and, when it
moved, reads the keys; the key ring reads what that thread last read. While the database is
unreachable the keys last read keep being served, the failure is logged once, and the thread
reconnects every ``poll_s``. Every statement has a client-side deadline of ``timeout_s``
(tenants/pgconn.py), so a database that stops answering is noticed as one that is gone. Past
``[store] offline_s`` without a read, requests are refused
(503 ``store_unavailable``) rather than served on keys that may have been revoked since. Writes
(creating, changing, revoking a key) go to the database and fail with it.

Schema migrations are numbered and applied at start, under an advisory lock (two gateways starting
at once migrate once); ``passerelle_schema`` records how far a database was taken.

Example::

    store = PgKeyStore("postgresql://passerelle@db.lan/passerelle")
    key, secret = store.create("team", actor="cli:alice")
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from typing import Any

from passerelle.errors import StoreUnavailable
from passerelle.tenants.keys import ApiKey, KeyStore
from passerelle.tenants.pgconn import connect, db_errors, deadline, first_line, redacted
from passerelle.tenants.workers import Worker

log = logging.getLogger("passerelle.tenants.pgstore")

# Each migration: the statements that take the schema from version N-1 to N (append only).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS api_keys (
        id TEXT PRIMARY KEY, digest BYTEA NOT NULL, tenant TEXT NOT NULL, priority TEXT, max_priority TEXT,
        rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0, max_concurrency INTEGER NOT NULL DEFAULT 0,
        weight DOUBLE PRECISION NOT NULL DEFAULT 1.0, created DOUBLE PRECISION NOT NULL,
        revoked INTEGER NOT NULL DEFAULT 0, label TEXT NOT NULL DEFAULT '', owner TEXT NOT NULL DEFAULT '',
        models TEXT NOT NULL DEFAULT '', quotas TEXT NOT NULL DEFAULT '', expires_at DOUBLE PRECISION,
        updated DOUBLE PRECISION NOT NULL DEFAULT 0, revoked_at DOUBLE PRECISION)""",
        """CREATE TABLE IF NOT EXISTS audit (
        seq BIGSERIAL PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
        key_id TEXT NOT NULL, detail TEXT NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS audit_ts ON audit (ts)",
        "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO meta (name, value) VALUES ('keys_version', 0) ON CONFLICT DO NOTHING",
        """CREATE OR REPLACE FUNCTION passerelle_keys_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN UPDATE meta SET value = value + 1 WHERE name = 'keys_version'; RETURN NULL; END $$""",
        """CREATE OR REPLACE TRIGGER api_keys_changed AFTER INSERT OR UPDATE OR DELETE ON api_keys
        FOR EACH STATEMENT EXECUTE FUNCTION passerelle_keys_changed()""",
    ),
    (  # 2: usage rows (an id each, so a row written back twice is kept once) and quotas' counters
        """CREATE TABLE IF NOT EXISTS usage (
        id UUID PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, tenant TEXT NOT NULL, key_id TEXT NOT NULL DEFAULT '',
        class TEXT NOT NULL, model TEXT NOT NULL, cause TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts)",
        "CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key_id, ts)",
        """CREATE TABLE IF NOT EXISTS quota_use (
        key_id TEXT NOT NULL, period TEXT NOT NULL, start DOUBLE PRECISION NOT NULL,
        tokens DOUBLE PRECISION NOT NULL DEFAULT 0, requests BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (key_id, period, start))""",
    ),
    (  # 3: a key may name the person behind a request (a trusted front-end); usage by person and session
        "ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS trust_forwarded_user INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE usage ADD COLUMN IF NOT EXISTS \"user\" TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage ADD COLUMN IF NOT EXISTS session TEXT NOT NULL DEFAULT ''",
    ),
)
_MIGRATION_LOCK = 0x70617373  # pg_advisory_xact_lock key: "pass"


class _Conn:
    """psycopg's connection under the SQL KeyStore writes: ``?`` placeholders, BEGIN IMMEDIATE, and
    each statement within ``timeout_s`` (tenants/pgconn.py)."""

    def __init__(self, raw: Any, timeout_s: float = 5.0) -> None:
        self.raw, self.timeout_s = raw, timeout_s

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        """One statement within ``timeout_s``; the database failing or silent is a 503
        (:class:`StoreUnavailable`) for whoever asked, never an internal error."""
        if sql == "BEGIN IMMEDIATE":
            sql = "BEGIN"
        try:
            with deadline(self.raw, self.timeout_s):
                return self.raw.execute(sql.replace("?", "%s"), args)
        except db_errors() as exc:
            raise StoreUnavailable(f"The shared store is out of reach ({first_line(exc)}); try again later.",
                                   retry_after=5) from exc

    def close(self) -> None:
        self.raw.close()


_connect = connect


def migrate(conn: Any) -> int:
    """Apply the migrations this database lacks; returns its version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS passerelle_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT max(version) FROM passerelle_schema").fetchone()
        have = row[0] or 0
        for version, statements in enumerate(MIGRATIONS, 1):
            if version > have:
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("INSERT INTO passerelle_schema (version) VALUES (%s)", (version,))
                log.info("store: schema migrated to version %d", version)
    return len(MIGRATIONS)


class PgKeyStore(KeyStore):
    """Keys and the audit log in PostgreSQL at ``url``; reads for the request path come from a
    polling thread's last read (see the module's notes)."""

    _audit_order = "ts DESC, seq DESC"

    def __init__(self, url: str, *, poll_s: float = 1.0, timeout_s: float = 5.0, offline_s: float = 300.0) -> None:
        self.url, self.poll_s, self.timeout_s, self.offline_s = url, poll_s, timeout_s, offline_s
        self.path = redacted(url)  # type: ignore[assignment]  # (shown where a file's path is)
        self._lock = threading.Lock()
        raw = _connect(url, timeout_s)
        self.conn = _Conn(raw, timeout_s)  # type: ignore[assignment]
        with deadline(raw, max(timeout_s, 30.0)):  # (a migration may take longer than one statement)
            migrate(raw)
        self._cached_version = -1
        self._cached: builtins.list[ApiKey] = []
        self.last_read = 0.0  # time.monotonic() of the last successful read
        self.failing = False
        self._read()
        self._stop = threading.Event()
        self.worker = Worker("pg-keys", self._poll, self._stop)
        self.worker.start()

    # -- the request path's reads: what the poller last read ---------------------------------
    def version(self) -> int:
        self.usable()
        return self._cached_version

    def usable(self) -> None:
        if self.failing and time.monotonic() - self.last_read > self.offline_s:
            raise StoreUnavailable(f"The gateway's key store has been out of reach for more than "
                                   f"{self.offline_s:g} s ([store] offline_s); it cannot check keys until it is "
                                   "back.", retry_after=self.poll_s)

    @property
    def up(self) -> bool:
        return not self.failing

    def describe(self) -> dict[str, Any]:
        """For ``/health``: whether the database answers, and how old the keys served are."""
        age = time.monotonic() - self.last_read
        return {"up": not self.failing, "keys_age_s": round(age, 1),
                "serving_keys": not self.failing or age <= self.offline_s,
                "keys_from": "cache" if self.failing else "database"}

    def cached_keys(self) -> builtins.list[ApiKey]:
        return list(self._cached)

    def _read(self) -> None:
        version = KeyStore.version(self)
        if version != self._cached_version:
            self._cached = KeyStore.list(self)
            self._cached_version = version
        self.last_read = time.monotonic()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.failing:
                    with self._lock:
                        self.conn.close()
                        self.conn = _Conn(_connect(self.url, self.timeout_s), self.timeout_s)  # type: ignore[assignment]
                self._read()
                if self.failing:
                    log.warning("store %s reachable again", self.path)
                    self.failing = False
            except Exception as exc:
                if not self.failing:
                    log.error("store %s unreachable (%s): serving the keys read %.0f s ago for at most %g s "
                              "([store] offline_s) until it is back", self.path, first_line(exc),
                              time.monotonic() - self.last_read, self.offline_s)
                    self.failing = True

    def close(self) -> None:
        self._stop.set()
        self.worker.join(self.timeout_s + self.poll_s + 1)
        with self._lock:
            self.conn.close()
