"""passerelle's SQLite file: keys, usage rows, the audit log of key changes, and its migrations.

One file per gateway instance (``Config.db_path``). Tables:

    api_keys  one row per key: its hash, tenant, limits, allow-list, quotas, expiry, label, owner,
              whether it may name the person behind a request (``trust_forwarded_user``, version 3)
    usage     one row per finished request: time, tenant, key id, class, model, cause, tokens
              (version 3: the person a trusted front-end forwarded, ``user``, and the session, hashed)
    audit     one row per change to a key: when, who, what (never a secret)
    meta      keys_version, bumped by triggers on every change to api_keys, so every process
              that has the file open (the gateway, ``passerelle keys``) sees a change within a second

Migrations only add (columns with defaults, tables, indexes, triggers): a file written by an
older passerelle opens with its rows intact (old usage rows have no key id: ``''``).
``PRAGMA user_version`` says how far a file was taken; two processes opening an old file at once
migrate it once (the second waits on the write lock, then finds nothing left to do).

Example::

    conn = connect(tmp_path / "passerelle.db")
    conn.execute("SELECT COUNT(*) FROM api_keys").fetchone()    # (0,)
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

SCHEMA_VERSION = 3

# Version 1: what passerelle 0.1 created.
_V1 = (
    """CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, digest BLOB NOT NULL, tenant TEXT NOT NULL, priority TEXT, max_priority TEXT,
    rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0, max_concurrency INTEGER NOT NULL DEFAULT 0,
    weight REAL NOT NULL DEFAULT 1.0, created REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL, tenant TEXT NOT NULL, class TEXT NOT NULL, model TEXT NOT NULL, cause TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts)",
)

# Version 2: keys for people (allow-list, quotas, expiry, label, owner), usage per key, audit log.
_V2_COLUMNS = {
    "api_keys": (("label", "TEXT NOT NULL DEFAULT ''"), ("owner", "TEXT NOT NULL DEFAULT ''"),
                 ("models", "TEXT NOT NULL DEFAULT ''"),  # JSON list of globs; '' or []: every model
                 ("quotas", "TEXT NOT NULL DEFAULT ''"),  # "2000000/day,10000000/month"
                 ("expires_at", "REAL"),  # Unix time; NULL: never
                 ("updated", "REAL NOT NULL DEFAULT 0"), ("revoked_at", "REAL")),
    "usage": (("key_id", "TEXT NOT NULL DEFAULT ''"),),  # '' for requests without a key
}
_V2 = (
    """CREATE TABLE IF NOT EXISTS audit (
    ts REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, key_id TEXT NOT NULL, detail TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS audit_ts ON audit (ts)",
    "CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key_id, ts)",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('keys_version', 0)",
    *(f"""CREATE TRIGGER IF NOT EXISTS api_keys_{event.lower()} AFTER {event} ON api_keys
    BEGIN UPDATE meta SET value = value + 1 WHERE name = 'keys_version'; END""" for event in ("INSERT", "UPDATE",
                                                                                              "DELETE")),
)

# Version 3: people and sessions behind one key (a front-end that forwards who is asking).
_V3_COLUMNS = {
    "api_keys": (("trust_forwarded_user", "INTEGER NOT NULL DEFAULT 0"),),
    "usage": (("user", "TEXT NOT NULL DEFAULT ''"),  # the forwarded user; '' for none
              ("session", "TEXT NOT NULL DEFAULT ''")),  # the session id, hashed; '' for none
}
_V3 = ("CREATE INDEX IF NOT EXISTS usage_key_user ON usage (key_id, user)",)


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the file to :data:`SCHEMA_VERSION`, adding only; safe with other processes at it."""
    if conn.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")  # one migrating process at a time; the others wait here
    try:
        if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            for stmt in _V1:
                conn.execute(stmt)
            for columns, stmts in ((_V2_COLUMNS, _V2), (_V3_COLUMNS, _V3)):
                for table, cols in columns.items():
                    have = _columns(conn, table)
                    for name, decl in cols:
                        if name not in have:
                            conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
                for stmt in stmts:
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def connect(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """A connection to passerelle's SQLite file (created and migrated as needed), in autocommit
    mode: a block that must be atomic opens its own ``BEGIN``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=10, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # committed rows survive a kill -9 of the process
    # The usage table only grows at its end and keys are few: a 256 KiB page cache is plenty, where
    # SQLite's default (2 MB) would show as the gateway's memory creeping up as the file grows.
    conn.execute("PRAGMA cache_size=-256")
    migrate(conn)
    return conn
