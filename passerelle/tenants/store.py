"""Which key store an instance uses: ``[store] url`` (PostgreSQL, shared by several gateways) or
its own SQLite file (``Config.db_path``). Usage rows and quotas follow the same choice (tenants/stores.py)."""

from __future__ import annotations

import os

from passerelle.config import Config
from passerelle.tenants.keys import KeyStore


def open_key_store(cfg: Config, db: str | os.PathLike[str] | None = None) -> KeyStore:
    """``db`` (a file named on the command line) first, then ``[store] url``, then the SQLite file."""
    if db:
        return KeyStore(db)
    if cfg.store.url:
        from passerelle.tenants.pgstore import PgKeyStore

        return PgKeyStore(cfg.store.url, poll_s=cfg.store.poll_s, timeout_s=cfg.store.timeout_s,
                          offline_s=cfg.store.offline_s)
    return KeyStore(cfg.db_path())
