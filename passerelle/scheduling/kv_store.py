"""Saved session KV on disk: which file is whose, and the space it may take.

A runtime saves a slot's KV into its ``--slot-save-path`` under a name passerelle gives it. The
name is random (``<32 hex>.kv``), so it says nothing of the tenant or session; the mapping from
(session key, replica) to a file lives only here, in the gateway's memory, so a session's KV can
be restored for that session on that replica and nothing else. The files of all replicas together
are bounded by ``[sessions] max_saved_bytes`` and ``max_saved_files``: past either, the least
recently saved or restored goes first, its file removed. A gateway that starts (or restarts)
knows no mapping, so every such file left in a save directory is removed then
(runtimes/llama_server.py ``clean_saved_kv``, as the runtime is set up).

Example::

    store = KvStore(cfg.sessions)
    name = store.name_for(key, "llama")          # what to ask the runtime to save as
    store.saved(key, "llama", save_dir, n_written)
    entry = store.lookup(key, "llama")           # restore entry.name, or None
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from passerelle.config import SessionsConfig
from passerelle.runtimes.kinds import Backend


@dataclass
class KvPlan:
    """What to do on a slot before a session's turn is sent: save the KV of the session that held
    it (``save``, a session key), erase it (another tenant's), restore the turn's own (``restore``);
    first, the end of a save of the slot already under way (``wait``)."""

    backend: Backend
    slot: int
    save: str = ""
    erase: bool = False
    restore: str = ""
    # a save of this slot already under way (saved ahead while the request waited): it must end
    # before anything else is sent to the slot, or the runtime would save what comes after
    wait: asyncio.Task[None] | None = None


@dataclass
class Saved:
    name: str
    bytes: int = 0
    tokens: int = 0
    done: bool = False  # the runtime finished writing it (a name handed out, not written yet: False)


class KvStore:
    def __init__(self, cfg: SessionsConfig) -> None:
        self.entries: OrderedDict[tuple[str, str], Saved] = OrderedDict()  # least recently used first
        self.dirs: dict[str, Path] = {}  # replica -> its save directory (for removing files)
        self.bytes = 0
        self.evictions = 0
        self.configure(cfg)

    def configure(self, cfg: SessionsConfig) -> None:
        """The bounds; lower ones evict at once."""
        self.max_bytes = cfg.max_saved_bytes
        self.max_files = min(cfg.max_saved_files, cfg.max_sessions)
        self._evict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_files > 0

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries.values() if e.done)

    def has(self, key: str, replica: str) -> bool:
        e = self.entries.get((key, replica))
        return e is not None and e.done

    def name_for(self, key: str, replica: str) -> str:
        """The file name to save ``key``'s KV on ``replica`` as (its existing one: overwritten)."""
        e = self.entries.get((key, replica))
        if e is None:
            e = self.entries[(key, replica)] = Saved(secrets.token_hex(16) + ".kv")
        return e.name

    def saved(self, key: str, replica: str, directory: Path | None, written: int, tokens: int = 0) -> None:
        """The runtime wrote ``written`` bytes for ``key`` (into ``directory``)."""
        e = self.entries.get((key, replica))
        if e is None:  # (dropped meanwhile: a reload that lowered the bounds)
            return
        if directory is not None:
            self.dirs[replica] = directory
        self.bytes += written - e.bytes
        e.bytes, e.tokens, e.done = written, tokens, True
        self.entries.move_to_end((key, replica))
        self._evict()

    def lookup(self, key: str, replica: str) -> Saved | None:
        """``key``'s saved KV on ``replica`` (now the most recently used), or None."""
        e = self.entries.get((key, replica))
        if e is None or not e.done:
            return None
        self.entries.move_to_end((key, replica))
        return e

    def drop(self, key: str, replica: str, directory: Path | None = None) -> None:
        """Forget ``key``'s file on ``replica`` and remove it (a failed save or restore)."""
        e = self.entries.pop((key, replica), None)
        if e is not None:
            self.bytes -= e.bytes
            self._remove(replica, e.name, directory)

    def drop_replica(self, replica: str) -> None:
        """Forget every file of ``replica`` (removed by a reload, or its files lost)."""
        for k in [k for k in self.entries if k[1] == replica]:
            self.drop(*k)

    def _evict(self) -> None:
        while self.entries and (self.bytes > self.max_bytes or len(self.entries) > self.max_files):
            (key, replica), e = next(iter(self.entries.items()))
            if not e.done and len(self.entries) <= self.max_files:
                break  # (a save in flight is bounded when it ends)
            del self.entries[(key, replica)]
            self.bytes -= e.bytes
            self.evictions += 1
            self._remove(replica, e.name)

    def _remove(self, replica: str, name: str, directory: Path | None = None) -> None:
        directory = directory or self.dirs.get(replica)
        if directory is not None:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
