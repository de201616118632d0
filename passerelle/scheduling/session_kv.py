"""Agent sessions keep their KV cache: slots held across tool-call gaps, KV saved and restored.

A session (a request naming one: proxy/intake.py ``session_of``) is keyed by tenant and session
id together (``session_key``): two tenants that use the same session id are two sessions. With
``[sessions] keep_kv`` on, for a runtime whose slots passerelle names (llama-server's ``id_slot``):

1. a session's turn goes to the replica that served it (the scheduler's affinity, by this key)
   and there to the slot that holds its KV (slots.py);
2. after a turn its slot is held for the session's next turn, for a time learned from the
   session's own gaps (session_hold.py), while nobody else waited past their class's
   ``session_wait_s``;
3. when the slot goes to another session after all, the KV it holds is first saved to the
   runtime's ``--slot-save-path`` (``POST /slots/{id}?action=save``), and restored into whatever
   slot the session gets next (``action=restore``), before that turn is sent. The save starts as
   soon as a request waits for the held slot (:meth:`SessionKv.save_ahead`), not when it takes it:
   the wait and the save overlap, and a saved slot is taken at once; where most holds end with
   their slot taken (slots.py ``save_on_release``), as soon as the turn ends. Both have deadlines
   (``save_timeout_s``, ``restore_timeout_s``); one that fails costs a recompute, never the request.
   A slot that passes to another *tenant* is erased after its save, so no tenant's request is
   answered from another tenant's KV left in the slot.

Where the runtime has no save path (not launched by passerelle), sessions still get their slot and
their hold, and llama-server's own host-memory prompt cache (``--cache-ram``) is the fallback.

Saved KV (kv_store.py) is found only by its (tenant, session, replica) key: file names are random,
the mapping lives here, and a session never gets another's file.

Example::

    kv = SessionKv(cfg.sessions)
    plan = kv.plan(job, backend, before)   # at dispatch: what to save and restore (or None)
    await kv.before(job)                   # before the request is sent
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from passerelle.config import SessionsConfig
from passerelle.observe.session_metrics import SessionKvSnapshot
from passerelle.runtimes.kinds import Backend
from passerelle.scheduling.job import Job
from passerelle.scheduling.kv_store import KvPlan, KvStore
from passerelle.scheduling.session_hold import SessionGaps

log = logging.getLogger("passerelle.sessions")

UNMEASURED_SWAP_S = 2.0  # a save and a restore on a runtime where none was timed yet


def session_key(tenant: str, session: str) -> str:
    """The key of a session: its tenant and its (hashed) id, never the id alone. Of fixed length
    (26 characters, like the affinity keys whose map is sized in bytes): ``k:``, 12 hex digits of
    the tenant's hash (:func:`tenant_tag`), 12 of the pair's."""
    if not session:
        return ""
    pair = hashlib.blake2b(f"{tenant}\x00{session}".encode(errors="surrogatepass"), digest_size=6).hexdigest()
    return "k:" + tenant_tag(tenant) + pair


def tenant_tag(tenant: str) -> str:
    return hashlib.blake2b(tenant.encode(errors="surrogatepass"), digest_size=6).hexdigest()


def tenant_of(key: str) -> str:
    """The :func:`tenant_tag` of a session key's tenant."""
    return key[2:14]


@dataclass
class KvCounts:
    saves: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    restores: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0, "missing": 0})
    holds: dict[str, int] = field(default_factory=lambda: {"kept": 0, "taken": 0, "lapsed": 0})
    erases: int = 0
    prompt_tokens: int = 0  # prompt tokens of sessions' turns
    cached_tokens: int = 0  # ...of which the runtime took from its cache


class SessionKv:
    """The sessions' side of the scheduler: learned holds, and the save/restore plans."""

    def __init__(self, cfg: SessionsConfig) -> None:
        # what moving a session's KV out of a slot and back costs on each replica, measured (s)
        self.swap_s: dict[str, float] = {}
        self.gaps = SessionGaps(cfg)
        self.store = KvStore(cfg)
        self.counts = KvCounts()
        # saves under way ahead of a request that waits for a held slot: (replica, slot) -> its task
        self.ahead: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._void: set[asyncio.Task[None]] = set()  # ...whose result is not to be kept
        self.configure(cfg)

    def configure(self, cfg: SessionsConfig) -> None:
        self.on = cfg.keep_kv
        self.save_timeout_s = cfg.save_timeout_s
        self.restore_timeout_s = cfg.restore_timeout_s
        self.gaps.configure(cfg)
        self.store.configure(cfg)

    def plan(self, job: Job, backend: Backend, slot: int, before: str, saved: bool = False) -> KvPlan | None:
        """At dispatch of ``job`` (of session ``job.session``, or none) on ``slot``, which held the
        KV of session ``before`` (``saved`` already, or not): the work before its request is sent,
        None for none."""
        key = job.session
        saving = backend.slot_save_dir is not None and self.store.enabled
        p = KvPlan(backend, slot, wait=self.ahead.get((backend.name, slot)))
        if before and before != key:
            if saving and not saved and p.wait is None:  # (a save under way writes it)
                p.save = before
            p.erase = tenant_of(before) != tenant_tag(job.tenant)  # (another tenant's request never sees it)
        if key and before != key and saving and self.store.has(key, backend.name):
            p.restore = key
        return p if (p.save or p.erase or p.restore or p.wait) else None

    def save_ahead(self, b: Backend, slot: int, key: str, done: Callable[[bool], None]) -> bool:
        """Start saving ``key``'s KV held on ``slot`` of ``b`` now, while a request waits for that
        slot, or as its turn ends (``save_as_it_ends``); ``done(ok)`` when it ends. False when
        nothing was started (no save path, one under way on that slot, or no running loop)."""
        if b.slot_save_dir is None or not self.store.enabled or (b.name, slot) in self.ahead:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a synchronous caller: the save is made when the slot is taken)
            return False

        async def run() -> None:
            ok = False
            try:
                ok = await self._save(b, slot, key)
            except Exception:  # (as in before(): a bug here costs a recompute, never a request)
                log.exception("session KV on %s slot %d: not saved ahead", b.name, slot)
            finally:
                task = self.ahead.pop((b.name, slot))
                if task in self._void:
                    # the slot was used before this save ended: what it wrote may be the next
                    # request's KV, never to be restored as this session's
                    self._void.discard(task)
                    self.store.drop(key, b.name, b.slot_save_dir)
                    ok = False
                done(ok)

        self.ahead[(b.name, slot)] = loop.create_task(run(), name=f"kv-save-{b.name}-{slot}")
        return True

    async def before(self, job: Job) -> None:
        """Carry out ``job.kv`` (then cleared); never raises: a failed step costs a recompute."""
        p, job.kv = job.kv, None
        if p is None:
            return
        b = p.backend
        try:
            if p.wait is not None:
                # bounded by the save's own deadline (slot_action's); shielded: the save goes on
                # whatever becomes of this request
                try:
                    await asyncio.wait_for(asyncio.shield(p.wait), self.save_timeout_s + 1)
                except TimeoutError:
                    self._void.add(p.wait)
            if p.save:
                await self._save(b, p.slot, p.save)
            if p.erase:
                self.counts.erases += 1
                await b.slot_action(p.slot, "erase", timeout=self.save_timeout_s)
            if p.restore:
                await self._restore(b, p.slot, p.restore)
        except Exception:  # (a bug here must not fail the client's request: its turn is recomputed)
            log.exception("session KV on %s slot %d: not prepared", b.name, p.slot)

    def save_as_it_ends(self, b: Backend, key: str) -> bool:
        """Where holds are mostly taken (slots.py ``save_on_release``): is ``key``'s KV worth saving
        as its turn ends? Not for a session that usually comes back sooner than a save and a
        restore take on ``b`` (an agent whose tools return at once): it keeps its slot, and its
        next turn would wait for that save, as nothing is sent to a slot while it is saved."""
        typical = self.gaps.median(key)
        return typical is None or typical > self.swap_s.get(b.name, UNMEASURED_SWAP_S)

    def yield_after(self, b: Backend, budget: float) -> float:
        """How long a request waits for a slot of ``b`` held for another session, its class
        allowing ``budget``: no longer than saving that session's KV and restoring it later costs,
        as measured on ``b`` (a hold is worth keeping only while it saves more than it costs)."""
        swap = self.swap_s.get(b.name)
        return budget if swap is None or b.slot_save_dir is None or not self.store.enabled else min(budget, swap)

    def _measured(self, b: Backend, seconds: float) -> None:
        old = self.swap_s.get(b.name)
        self.swap_s[b.name] = seconds if old is None else 0.8 * old + 0.2 * seconds

    async def _save(self, b: Backend, slot: int, key: str) -> bool:
        name = self.store.name_for(key, b.name)
        t0 = time.monotonic()
        answer = await b.slot_action(slot, "save", name, timeout=self.save_timeout_s)
        written = answer.get("n_written") if answer is not None else None
        if answer is None or not isinstance(written, int):
            self.counts.saves["failed"] += 1
            self.store.drop(key, b.name, b.slot_save_dir)  # (a half-written file is removed)
            return False
        self.counts.saves["ok"] += 1
        self._measured(b, 2 * (time.monotonic() - t0))  # (a restore reads what a save wrote: about as long)
        self.store.saved(key, b.name, b.slot_save_dir, written, tokens=int(answer.get("n_saved") or 0))
        return True

    async def _restore(self, b: Backend, slot: int, key: str) -> None:
        entry = self.store.lookup(key, b.name)
        if entry is None:  # evicted since the plan was made
            self.counts.restores["missing"] += 1
            return
        answer = await b.slot_action(slot, "restore", entry.name, timeout=self.restore_timeout_s)
        if answer is None:
            self.counts.restores["failed"] += 1
            self.store.drop(key, b.name, b.slot_save_dir)
            # a restore cut half-way may leave the slot with part of it: start from an empty slot
            await b.slot_action(slot, "erase", timeout=self.save_timeout_s)
            return
        self.counts.restores["ok"] += 1
        log.debug("session KV restored on %s slot %d: %s tokens", b.name, slot, answer.get("n_restored"))

    def snapshot(self) -> SessionKvSnapshot:
        """The counts, for the metrics (observe/session_metrics.py)."""
        c = self.counts
        return SessionKvSnapshot(saves=dict(c.saves), restores=dict(c.restores), holds=dict(c.holds),
                                 erases=c.erases, evictions=self.store.evictions, bytes=self.store.bytes,
                                 files=self.store.files, prompt_tokens=c.prompt_tokens,
                                 cached_tokens=c.cached_tokens)

    def finished(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """A session's turn ended: count its prompt tokens and those the runtime had cached."""
        self.counts.prompt_tokens += prompt_tokens or 0
        self.counts.cached_tokens += cached_tokens or 0
