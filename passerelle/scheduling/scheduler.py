"""Who goes next: priority classes with aging, fair share between tenants, slot shares, deadlines.

passerelle, not the runtime's first-come-first-served queue, decides the order: a backend never
gets more requests than its capacity (its slots), and the rest wait here. When a slot frees or a
request arrives, the waiting request with the smallest key is dispatched to a replica that fits:

    key = (effective rank, tenant's virtual counter, expected prefill, arrival order)

* effective rank: the class's rank (``interactive`` 0 < ``standard`` 1 < ``batch`` 2) minus one
  for every ``aging_s`` waited, so that nothing starves;
* virtual counter (the Virtual Token Counter of "Fairness in Serving Large Language Models",
  OSDI 2024): service a tenant received, in weighted tokens, divided by its weight. The backlogged
  tenant that has received least goes next. A tenant that returns from idle is lifted to the
  smallest counter among backlogged tenants, so idle time banks no credit;
* expected prefill (prefill.py): within a tenant and class, the request with less prompt to
  compute (not cached where it runs, over the runtime's measured rate) first, so that a session's
  cheap next turn does not wait behind another's cold opening prompt; 0 once a request waited
  ``prefill_defer_s``, so an expensive one is passed over for that long at most;
* arrival order: FIFO within a tenant otherwise.

A class may hold only a share of a backend's slots (``slot_share``), so that a request of a better
class finds a slot free. With preemption (preemption.py, on by default) batch may hold every slot:
a better request that finds every slot busy suspends one batch stream at once (or waits up to
``preempt_after_ms`` for a stream about to end), takes its slot, and the suspended stream queues
again and resumes later as a continuation. Service is charged at dispatch from an estimate
(prompt tokens + max_tokens) and corrected with the real usage at the end.

Admission is fair too: a tenant may hold at most ``tenant_queue_share`` of a class's queue (per
model) while other tenants' requests wait there (429 ``tenant_queue_full`` past it). Alone, a tenant
may fill the whole queue; a request of another tenant that then finds it full takes the place of
the newest queued request of the tenant holding most above its share (which gets the 429), so one
client opening hundreds of streams cannot lock the next person out.

A slot freed by an under-served tenant with nothing queued is held for it for ``hold_s`` (50 ms):
a client that keeps N streams sends its next request a few milliseconds after each answer, and
without the hold that slot would already be gone to a busier tenant's queued request, so a tenant
with few streams would get far less than its share (anticipation, as in the anticipatory disk
scheduler). A tenant that did not come back in time gets no hold again until it does.

Example::

    sched = Scheduler(cfg.scheduler, cfg.routing, cfg.classes)   # sched.configure(...) at a reload
    backend = await sched.acquire(job)     # waits; QueueFull / QueueTimeout / NoBackend
    try: ...
    finally: sched.release(job, prompt_tokens=12, completion_tokens=80)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from passerelle.config import ClassConfig, RoutingConfig, SchedulerConfig, SessionsConfig
from passerelle.errors import NoBackend, QueueFull, QueueTimeout, TenantQueueFull
from passerelle.runtimes.kinds import Backend
from passerelle.scheduling.job import OUTPUT_WEIGHT, PROMPT_WEIGHT, Job, JobState, Suspendable
from passerelle.scheduling.preemption import PreemptionCounts, PreemptionPolicy, Preemptor
from passerelle.scheduling.prefill import PrefillBook
from passerelle.scheduling.session_kv import SessionKv
from passerelle.scheduling.slots import SlotMap

__all__ = ["Job", "JobState", "PreemptionPolicy", "Scheduler"]

# Memory of one entry of the affinity map, its key a hashed 26-character string (the gateway's
# affinity_key); measured in tests/unit/test_client_edges.py. [routing] affinity_max_bytes / this
# is how many conversations the map remembers.
AFFINITY_ENTRY_BYTES = 200

@dataclass
class _Tenant:
    counter: float = 0.0
    waiting: int = 0
    running: int = 0
    released_at: float = -math.inf  # when its last request ended
    submitted_at: float = -math.inf  # when it last sent one
    anticipate: bool = True  # came back within hold_s last time: worth holding a slot for


@dataclass(eq=False)
class _Hold:
    """A freed slot kept for ``tenant``'s next request until ``until``."""

    backend: Backend
    cls: ClassConfig
    tenant: str
    until: float
    timer: asyncio.TimerHandle | None = None


@dataclass
class _DrainRate:
    """Dispatches per second over a sliding window, for an honest Retry-After."""

    window_s: float = 60.0
    times: deque[float] = field(default_factory=deque)

    def add(self, now: float) -> None:
        self.times.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.times and self.times[0] < now - self.window_s:
            self.times.popleft()

    def rate(self, now: float) -> float:
        self._trim(now)
        if len(self.times) < 2:
            return 0.0
        span = max(now - self.times[0], 1e-3)
        return len(self.times) / span


class Scheduler:
    """The queue and the books of every replica's slots; ``[scheduler]``, ``[routing]`` and the
    classes are applied by :meth:`configure`, at start and at every reload."""

    def __init__(self, cfg: SchedulerConfig, routing: RoutingConfig, classes: tuple[ClassConfig, ...], *,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.on_change = on_change
        self.waiting: list[Job] = []
        self.tenants: OrderedDict[str, _Tenant] = OrderedDict()  # least recently submitting first
        self.share_refusals = 0  # requests refused or displaced for holding a tenant's share (/admin/stats)
        self.running: dict[tuple[str, str], int] = {}  # (backend, class) -> requests
        self.served_tokens: dict[str, float] = {}  # tenant -> weighted tokens, for reports
        self._seq = itertools.count()
        self._drain = _DrainRate()
        self._drains: dict[str, _DrainRate] = {}  # per replica: how fast a place in its queue moves
        self._vtime = 0.0  # counter of the tenant dispatched last: where a newcomer starts
        self.affinity: OrderedDict[str, str] = OrderedDict()  # conversation/session -> replica name
        self._rr = itertools.count()
        self.holds: list[_Hold] = []
        self.hold_counts = {"kept": 0, "lapsed": 0}  # holds used by their tenant / given up
        # Suspends a running stream for a better class (preemption.py); None: preemption is off.
        self.preemption: PreemptionPolicy | None = None
        self.preemptor: Preemptor | None = None
        self.preempt_counts = PreemptionCounts()  # across the preemptors reloads build
        self._slots: dict[str, SlotMap] = {}  # backend -> its named slots (runtimes with slot ids)
        # Sessions keep their KV (session_kv.py): held slots, saves and restores; [sessions] is
        # applied by sessions.configure
        self.sessions = SessionKv(SessionsConfig())
        # Per runtime its measured prefill rate, per conversation what its last turn left cached
        self.prefill = PrefillBook()
        self._wake_at = math.inf  # the earliest open breaker seen by the last dispatch
        self._wake_timer: asyncio.TimerHandle | None = None
        self._wake_timer_at = math.inf
        # Called when a request is left waiting and whenever a slot is released: the swapper
        # (swapper.py) decides then whether a model must be loaded or unloaded.
        self.on_need: Callable[[], None] | None = None
        self.configure(cfg, routing, classes)

    def configure(self, cfg: SchedulerConfig, routing: RoutingConfig, classes: tuple[ClassConfig, ...]) -> None:
        """Apply ``[scheduler]``, ``[routing]``'s replica choice and the classes (at start, and at
        a reload: requests already queued keep the class they were admitted with)."""
        self.classes = {c.name: c for c in classes}
        self.aging_s = cfg.aging_s
        self.max_tenants = cfg.max_tenants  # past it, the least recently seen idle tenants are forgotten
        self.tenant_queue_share = cfg.tenant_queue_share  # of a class's queue, per tenant, while others wait
        self.hold_s = cfg.hold_s
        self.policy = routing.policy  # "least_loaded" (with affinity) or "round_robin"
        self.affinity_slack = routing.affinity_slack  # how much busier than the least loaded an affine replica may be
        self.affinity_max_entries = routing.affinity_max_bytes // AFFINITY_ENTRY_BYTES
        self.prefill_defer_s = cfg.prefill_defer_s
        self.prefill.configure(self.affinity_max_entries)
        while len(self.affinity) > self.affinity_max_entries:
            self.affinity.popitem(last=False)
        if len(self.tenants) > self.max_tenants:
            self._forget_idle_tenants()
        policy = PreemptionPolicy.of(cfg)
        if policy != self.preemption:
            self._preempt_with(policy)

    def _preempt_with(self, policy: PreemptionPolicy | None) -> None:
        """A new preemptor for ``policy`` (None: preemption off). Streams suspended already are
        queued jobs and resume as any; streams that may be cut go to the new preemptor, or, off,
        are never cut."""
        old, self.preemption = self.preemptor, policy
        self.preemptor = Preemptor(self, policy, self.preempt_counts) if policy is not None else None
        if old is not None:
            if self.preemptor is not None:
                self.preemptor.take_over(old)
            else:
                old.close()
        elif self.preemptor is not None:
            self.preemptor.arm()

    # -- public ----------------------------------------------------------------------------
    def waiting_by_class(self) -> dict[str, int]:
        out = dict.fromkeys(self.classes, 0)
        for j in self.waiting:  # (a request queued before a reload renamed its class counts under its own)
            out[j.cls.name] = out.get(j.cls.name, 0) + 1
        return out

    def retry_after(self, ahead: int | None = None) -> float:
        """Seconds until ``ahead`` queued requests (default: all) have drained at the recent rate."""
        ahead = len(self.waiting) if ahead is None else ahead
        rate = self._drain.rate(self.clock())
        if rate <= 0:
            return 5.0 if not ahead else min(60.0, 5.0 * ahead)
        return min(300.0, max(1.0, (ahead + 1) / rate))

    def submit(self, job: Job) -> None:
        """Admit ``job`` (raise QueueFull/NoBackend) and dispatch what can go now."""
        if not any(b.stats.up and not b.draining for b in job.pool) and not job.can_wait_for_start:
            raise NoBackend("No backend serving this model is up right now.", retry_after=self.retry_after())
        self._admit(job)
        now = self.clock()
        if job.session and self.sessions.on:
            self.sessions.gaps.arrived(job.session, now)
        job.to(JobState.WAITING)
        job.seq, job.enqueued_at, job.queued_at = next(self._seq), now, now
        t = self.tenants.setdefault(job.tenant, _Tenant(counter=self._vtime))
        self.tenants.move_to_end(job.tenant)
        back_soon = self.hold_s > 0 and now - t.released_at <= self.hold_s
        t.anticipate = t.anticipate or back_soon
        t.submitted_at = now
        if t.waiting == 0 and t.running == 0 and not back_soon:
            # Back from idle (nothing queued, nothing running): no banked credit. Start at the
            # least-served backlogged tenant, or where the last dispatch was when nobody waits.
            # A tenant with requests running, or one back within hold_s, is not idle, so a
            # closed-loop client that resubmits as each answer ends keeps its place.
            floor = min((self.tenants[j.tenant].counter for j in self.waiting), default=self._vtime)
            t.counter = max(t.counter, floor)
        t.waiting += 1
        if len(self.tenants) > self.max_tenants:
            self._forget_idle_tenants()
        queued = bool(self.waiting)
        if queued:  # (alone in the queue, its cost orders nothing: it is weighed only if it stays)
            self._expect_prefill(job)
        self.waiting.append(job)
        self.dispatch()
        if job.backend is None:
            if not queued:
                self._expect_prefill(job)
            if self.preemptor is not None:
                self.preemptor.arm()
            if self.on_change:
                self.on_change()
            if self.on_need:
                self.on_need()

    def _admit(self, job: Job) -> None:
        """Raise QueueFull or TenantQueueFull unless ``job`` may queue (the module docstring's fair
        admission); may displace another tenant's newest queued request to make room."""
        bound = job.cls.max_queue
        if not self.waiting and bound > 0:  # (most requests: nothing queued, nothing to count)
            return
        # The limit is per model and class: one model's full queue must not refuse another's requests.
        same = [j for j in self.waiting if j.cls is job.cls and j.model == job.model]
        queued = len(same)
        share = max(1, math.floor(self.tenant_queue_share * bound + 1e-9))
        if share < bound:
            mine = sum(1 for j in same if j.tenant == job.tenant)
            if mine >= share and mine < queued:
                self.share_refusals += 1
                raise TenantQueueFull(
                    f"This client already has {mine} requests waiting in the '{job.cls.name}' queue for model "
                    f"'{job.model}', its share while others wait ({share} of {bound}); retry later.",
                    retry_after=self.retry_after(mine))
            if queued >= bound and mine < share:
                counts: dict[str, int] = {}
                for j in same:
                    counts[j.tenant] = counts.get(j.tenant, 0) + 1
                hog = max(counts, key=counts.__getitem__)
                victims = [j for j in same if j.tenant == hog and j.state is JobState.WAITING and j.starts == 0
                           and j.future is not None and not j.future.done()]
                if counts[hog] > share and victims:
                    victim = max(victims, key=lambda j: j.seq)
                    self._remove(victim)
                    self.share_refusals += 1
                    assert victim.future is not None
                    victim.future.set_exception(TenantQueueFull(
                        f"The '{job.cls.name}' queue for model '{job.model}' is full and this client holds "
                        f"{counts[hog]} of its {bound} places, more than its share ({share}) while others "
                        "wait; its newest request gave its place up. Retry later.",
                        retry_after=self.retry_after(counts[hog] - 1)))
                    return
        if queued >= bound:
            raise QueueFull(f"The '{job.cls.name}' queue for model '{job.model}' is full ({bound} "
                            "waiting); retry later.", retry_after=self.retry_after(queued))

    async def acquire(self, job: Job) -> Backend:
        """Wait for a slot; the backend it is on. Cancelling the caller removes the job at once.
        A suspended job is already queued again: this waits for it to resume."""
        loop = asyncio.get_running_loop()
        if job.backend is not None:  # suspended, and resumed before its caller came back for it
            return job.backend
        if job.state is JobState.SUSPENDED and job.future is not None:
            if job.future.done():
                return job.future.result()
        else:
            job.future = loop.create_future()
            self.submit(job)
            if job.backend is not None:
                return job.backend
        wait = job.cls.max_queue_wait_s if job.max_wait_s is None else min(job.cls.max_queue_wait_s, job.max_wait_s)
        job.timer = loop.call_later(max(0.0, wait), self._expire, job)
        try:
            return await job.future
        except BaseException:
            if job.backend is not None and not (job.future.done() and job.future.exception()):
                self.release(job)  # dispatched in the same instant the caller left
            else:
                self._remove(job)
            raise
        finally:
            job.timer.cancel()

    def release(self, job: Job, *, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
        """Give the slot back and correct the tenant's charge with the real usage."""
        b = job.backend
        if job.starts and (prompt_tokens is not None or completion_tokens is not None):
            actual = PROMPT_WEIGHT * (prompt_tokens or 0) + OUTPUT_WEIGHT * (completion_tokens or 0)
            self._charge(job.tenant, (actual - job.charged) / job.weight, actual - job.charged)
            job.charged = actual
        if b is None:
            if job.state is JobState.SUSPENDED:  # never resumed (the client left)
                self._remove(job)
            return
        self._free(job, b, ended=True)
        job.to(JobState.DONE)
        self.prefill.observe(b.name, b.stats)
        if home := self._home_key(job):
            self.prefill.turn_ended(home, job.est_prompt_tokens)
        t = self.tenants[job.tenant]
        t.running -= 1
        now = t.released_at = self.clock()
        if self.hold_s > 0 and t.waiting == 0 and t.anticipate and self._contested(b, job.cls, t, now):
            self._hold(_Hold(b, job.cls, job.tenant, now + self.hold_s))
        self.dispatch()
        if self.on_need:
            self.on_need()

    def key(self, job: Job) -> tuple[float, float, int]:
        """``job``'s place in the order now (smaller goes first): see the module docstring."""
        return self.place(job, self.clock())

    def fail_waiting(self, which: Callable[[Job], bool], error: Callable[[], Exception]) -> int:
        """End every waiting job for which ``which(job)`` is true with a new ``error()`` (e.g. the
        only runtime that could serve them failed to start); how many."""
        failed = 0
        for job in [j for j in self.waiting if which(j)]:
            self._remove(job)
            if job.future is not None and not job.future.done():
                job.future.set_exception(error())
                failed += 1
        return failed

    def _free(self, job: Job, b: Backend, ended: bool = False) -> None:
        """The slot's bookkeeping, for a release (``ended``) or a suspension. A session's slot
        keeps its KV, and after its turn ended is held for its next turn (session_hold.py)."""
        job.backend = None
        b.in_flight -= 1
        b.last_used = time.monotonic()  # idle time counts from the end of the last request
        self.running[(b.name, job.cls.name)] -= 1
        if self.preemptor is not None:
            self.preemptor.forbid(job)
        if job.slot is not None and b.name in self._slots:
            if job.session and self.sessions.on:
                now = self.clock()
                ttl = self.sessions.gaps.left(job.session, now) if ended else 0.0
                slots = self._slots[b.name]
                slots.give(job, job.session, now + ttl if ttl > 0 else -math.inf)
                if ended and job.slot is not None and slots.save_on_release and \
                        self.sessions.save_as_it_ends(b, job.session):
                    self._save(b, slots, job.slot, job.session)
            else:
                self._slots[b.name].give(job)

    # -- preemption (preemption.py decides; these are the books it keeps) ----------------------
    def allow_suspend(self, job: Job, stream: Suspendable) -> None:
        """From now on ``job``'s stream may be cut for a better class (``stream.suspend()``)."""
        if self.preemptor is not None:
            self.preemptor.allow(job, stream)

    def forbid_suspend(self, job: Job) -> None:
        if self.preemptor is not None:
            self.preemptor.forbid(job)

    def suspend(self, job: Job) -> None:
        """Free ``job``'s slot now and queue it again to resume (its stream is being cut upstream)."""
        assert job.backend is not None
        job.resume_slot, job.suspended_at = job.slot, self.clock()
        self._free(job, job.backend)
        job.to(JobState.SUSPENDED)
        self._requeue(job, job.suspended_at)
        self.dispatch()
        if self.on_change:
            self.on_change()

    def only_slots_busy(self, b: Backend, job: Job, now: float) -> bool:
        """Could ``job`` start on ``b`` now but for every slot of it being busy? (Not: its class
        already holds its share, nor the replica is excluded or kept out by its breaker.)"""
        return (b.name not in job.exclude and b.routable(now) and b.in_flight >= b.capacity
                and self.running.get((b.name, job.cls.name), 0) < self._limit(b, job.cls))

    def _requeue(self, job: Job, now: float) -> None:
        """Queue a suspended job again: its place in its tenant's order (``seq``) stays, and its
        aging counts every wait so far, not the time it ran."""
        t = self.tenants[job.tenant]
        t.running -= 1
        t.waiting += 1
        job.waited_s += max(0.0, job.started_at - job.enqueued_at)
        job.enqueued_at = now - job.waited_s
        job.queued_at = now
        if job.future is not None:
            job.future = job.future.get_loop().create_future()
        self.waiting.append(job)

    def expire_due(self) -> None:
        """Fail every job whose queue wait is over, end every hold past its time (the loop's
        timers do this in production)."""
        now = self.clock()
        for job in [j for j in self.waiting if now - j.enqueued_at >= min(j.cls.max_queue_wait_s,
                                                                        j.max_wait_s or math.inf)]:
            self._expire(job)
        for hold in [h for h in self.holds if h.until <= now]:
            self._hold_expired(hold)
        if self.preemptor is not None:
            self.preemptor.check()

    # -- internals -------------------------------------------------------------------------
    def _charge(self, tenant: str, virtual: float, tokens: float) -> None:
        self.tenants[tenant].counter += virtual
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0.0) + tokens

    def _forget_idle_tenants(self) -> None:
        """Drop the least recently seen tenants with nothing queued, running or held, down to
        ``max_tenants``: tenant names come from clients (``user`` without keys). One that comes back
        starts afresh, as one back from idle does anyway."""
        held = {h.tenant for h in self.holds}
        while len(self.tenants) > self.max_tenants:
            name = next((n for n, t in self.tenants.items() if not (t.waiting or t.running or n in held)), None)
            if name is None:
                return
            del self.tenants[name]
            self.served_tokens.pop(name, None)

    def _remove(self, job: Job) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
            job.to(JobState.DONE)
            self.tenants[job.tenant].waiting -= 1
            if self.on_change:
                self.on_change()

    def _expire(self, job: Job) -> None:
        if job not in self.waiting:
            return
        self._remove(job)
        if job.future is not None and not job.future.done():
            ahead = sum(1 for j in self.waiting if j.seq < job.seq)
            waited = self.clock() - job.enqueued_at
            job.future.set_exception(QueueTimeout(
                f"Waited {waited:.3g} s in the '{job.cls.name}' queue without a free slot"
                + ("." if waited >= job.cls.max_queue_wait_s - 0.01 else " (the request's total timeout ran out)."),
                retry_after=self.retry_after(ahead)))

    # -- holds -----------------------------------------------------------------------------
    def _contested(self, b: Backend, cls: ClassConfig, t: _Tenant, now: float) -> bool:
        """Would a better-served tenant's queued request (not of a better class) take this slot?"""
        return any(b in j.pool and self.place(j, now)[0] >= cls.rank and self.tenants[j.tenant].counter > t.counter
                   for j in self.waiting)

    def _hold(self, hold: _Hold) -> None:
        self.holds.append(hold)
        with contextlib.suppress(RuntimeError):  # no loop (a synchronous caller): expire_due() ends it
            hold.timer = asyncio.get_running_loop().call_later(self.hold_s, self._hold_expired, hold)

    def _hold_expired(self, hold: _Hold) -> None:
        if hold in self.holds:
            self.holds.remove(hold)
            self.hold_counts["lapsed"] += 1
            t = self.tenants[hold.tenant]
            if t.submitted_at < hold.until - self.hold_s:  # it did not come back in time (not: it
                t.anticipate = False  # came back with fewer requests than it had holds)
            self.dispatch()

    def _held(self, b: Backend, job: Job, rank: float) -> tuple[int, int]:
        """Slots of ``b`` held for other tenants that ``job`` must leave alone: in all, of its class.
        A request of a better class than the hold's ignores it, and so does one of a tenant that
        has received less service than the hold's (the fair-share order stands)."""
        total = same = 0
        counter = self.tenants[job.tenant].counter
        for h in self.holds:
            if (h.backend is b and h.tenant != job.tenant and rank >= h.cls.rank
                    and counter > self.tenants[h.tenant].counter):
                total += 1
                same += h.cls is job.cls
        return total, same

    def _limit(self, backend: Backend, cls: ClassConfig) -> int:
        return max(1, math.floor(cls.slot_share * backend.capacity + 1e-9))

    def _fit(self, job: Job) -> Backend | None:
        """The replica this job may start on now, or None to keep it waiting.

        A job with an affinity (a conversation, a session) goes to its home replica, the one that
        served it before and holds its prompt cache, while home is at most ``affinity_slack`` of
        its slots busier than the least loaded replica, counting requests queued for each, or busier
        still while the places ahead at home drain sooner than its cached prompt would be computed
        elsewhere (:meth:`_miss_slack`); if home is full within that bound, the job waits for it
        rather than recompute its prompt elsewhere. Past the bound it spills to the least loaded
        replica (prefix-only routing collapses under skew). Other jobs go to the least loaded
        replica (equally loaded: where its prompt costs least), or the next in turn (``round_robin``).
        """
        now = self.clock()
        usable = []
        held_back = []  # up, but their circuit breaker keeps them out for now
        for b in job.pool:
            if b.name in job.exclude:
                continue
            if b.routable(now):
                usable.append(b)
            elif b.stats.up and not b.draining and not b.fenced:  # (fenced: being swapped out)
                held_back.append(b)
                if (at := b.breaker.retry_at) is not None and at < self._wake_at:
                    self._wake_at = at  # an open breaker: look again when it lets a probe through
        if not usable:
            # The breaker chooses among replicas; it never leaves a model without one. With every
            # replica held back, a runtime that failed is still better than a queue that waits for
            # nothing (its own error reaches the client, rather than a queue timeout).
            usable = held_back
        rank = self.place(job, now)[0] if self.holds else 0.0
        free = []
        sessions = self.sessions.on and job.slotted and bool(self._slots)
        for b in usable:
            total, same = self._held(b, job, rank) if self.holds else (0, 0)
            if sessions and (slots := self._slots.get(b.name)) is not None and slots.holds:
                # slots held for other sessions' next turns (their KV not saved yet): left alone
                # until this job waited its class's session_wait_s (or less: what moving that KV
                # out and back costs here), or the holds end (look again then); the one it waits
                # for is saved meanwhile, and counts as free once saved
                held, first = slots.held_against(job.session, now)
                budget = job.queued_at + self.sessions.yield_after(b, job.cls.session_wait_s)
                if held and now < budget:
                    total += held
                    self._wake_at = min(self._wake_at, budget, first)
                    if b.in_flight + total >= b.capacity:  # it waits for a held slot: save that one now
                        self._save_ahead(b, slots, job.session, now)
            if (b.in_flight + total < b.capacity
                    and self.running.get((b.name, job.cls.name), 0) + same < self._limit(b, job.cls)):
                free.append(b)
        if self.policy == "round_robin":
            return free[next(self._rr) % len(free)] if free else None
        home_key = self._home_key(job)
        home_name = self.affinity.get(home_key) if home_key else None
        home = next((b for b in usable if b.name == home_name), None)
        if home is not None and len(usable) > 1:
            queued: dict[str, int] = {}
            for j in self.waiting:  # queued for a replica: homed there, or it is their only one
                if j is job:
                    continue
                k = self._home_key(j)
                name = self.affinity.get(k) if k else (j.pool[0].name if len(j.pool) == 1 else None)
                if name is not None:
                    queued[name] = queued.get(name, 0) + 1

            def pending(b: Backend) -> float:
                return (b.in_flight + queued.get(b.name, 0)) / b.capacity

            over = pending(home) - min(pending(b) for b in usable if b is not home) - self.affinity_slack
            if over <= 0 or over <= self._miss_slack(job, home, usable):
                return home if home in free else None
        if not free:
            return None
        if len(free) > 1 and job.est_prompt_tokens:  # equally loaded: where its prompt costs least
            return min(free, key=lambda b: (b.in_flight / b.capacity, self._prefill_s(job, b)))
        return min(free, key=lambda b: b.in_flight / b.capacity)

    def _save_ahead(self, b: Backend, slots: SlotMap, session: str, now: float) -> None:
        """Save the KV of the held slot a request waits for while it waits: once saved, the slot
        can go at once (its session's KV comes back by a restore), and the save is not added to
        the waiting request's time when it takes the slot."""
        target = slots.to_save(session, now, {i for name, i in self.sessions.ahead if name == b.name})
        if target is not None:
            self._save(b, slots, *target)

    def _save(self, b: Backend, slots: SlotMap, slot: int, key: str) -> None:
        """Start saving ``key``'s KV on ``slot`` of ``b``; the slot counts as saved once it is,
        unless it moved on meanwhile."""

        def done(ok: bool) -> None:
            if ok and slots.mark_saved(slot, key):
                self.dispatch()

        self.sessions.save_ahead(b, slot, key, done)

    def _miss_slack(self, job: Job, home: Backend, usable: list[Backend]) -> float:
        """How much busier than the others (in ``pending`` units) ``home`` may be before ``job``
        spills, beyond ``affinity_slack``, for its prompt cached there: the places in home's queue
        that drain (at home's recent dispatch rate) within what computing its cached part again
        elsewhere would cost. 0 for a job with nothing cached at home, or a home with no recent rate."""
        drain = self._drains.get(home.name)
        if drain is None or not job.est_prompt_tokens or not self._cached_on(job, home):
            return 0.0
        miss = min(self._prefill_s(job, b) for b in usable if b is not home) - self._prefill_s(job, home)
        return max(0.0, miss) * drain.rate(self.clock()) / home.capacity

    def _home_key(self, job: Job) -> str:
        """What ``job``'s replica and slot affinity is kept by: its session, else its conversation."""
        return job.session if job.session and self.sessions.on else job.affinity

    def _cached_on(self, job: Job, b: Backend) -> bool:
        """Does ``b`` hold ``job``'s conversation's KV, as far as passerelle knows: a slot that
        served it last (or is held for it), or saved KV to restore; without named slots, ``b``
        served it last (the runtime's own slot choice keeps it)."""
        key = self._home_key(job)
        if not key:
            return False
        slots = self._slots.get(b.name)
        if slots is None:
            return self.affinity.get(key) == b.name
        if key in slots.key or key in slots.kv:
            return True
        return bool(job.session) and self.sessions.on and self.sessions.store.has(job.session, b.name)

    def _expect_prefill(self, job: Job) -> None:
        """``job.prefill_s``: its prompt's compute time on the replica of its pool where it is least."""
        if self.prefill_defer_s > 0 and job.est_prompt_tokens:
            job.prefill_s = min((self._prefill_s(job, b) for b in job.pool if b.name not in job.exclude), default=0.0)

    def _prefill_s(self, job: Job, b: Backend) -> float:
        """Seconds ``b`` is expected to compute ``job``'s prompt for (prefill.py)."""
        tokens = self.prefill.uncached(self._home_key(job), job.est_prompt_tokens, cached_here=self._cached_on(job, b))
        return tokens / self.prefill.rate(b.name)

    def place(self, job: Job, now: float) -> tuple[float, float, int]:
        """``job``'s place by class and fair share at ``now`` (smaller goes first; what preemption
        and the swapper compare): the module docstring's key without the expected prefill."""
        promoted = int((now - job.enqueued_at) // self.aging_s) if self.aging_s > 0 else 0
        return (job.cls.rank - promoted, self.tenants[job.tenant].counter, job.seq)

    def order(self, job: Job, now: float) -> tuple[float, float, float, int]:
        """``job``'s place in the dispatch order at ``now`` (smaller goes first): the module
        docstring's key, its expected prefill counted until it waited ``prefill_defer_s``."""
        rank, counter, seq = self.place(job, now)
        prefill = job.prefill_s if now - job.enqueued_at < self.prefill_defer_s else 0.0
        return (rank, counter, prefill, seq)

    def dispatch(self) -> None:
        """Start every waiting job that can start now, best key first."""
        changed = False
        while self.waiting:
            now = self.clock()
            best: Job | None = None
            best_key: tuple[float, float, float, int] | None = None
            best_backend: Backend | None = None
            for job in self.waiting:
                if job.future is not None and job.future.done():
                    continue
                key = self.order(job, now)
                if best_key is not None and key >= best_key:
                    continue
                backend = self._fit(job)
                if backend is not None:
                    best, best_key, best_backend = job, key, backend
            if best is None or best_backend is None:
                break
            self._start(best, best_backend, now)
            changed = True
        if self._wake_at != math.inf:
            self._wake_later()
        if changed and self.on_change:
            self.on_change()

    def _wake_later(self) -> None:
        """Dispatch again when the earliest open breaker that kept a job waiting lets a probe through
        (nothing else may happen meanwhile to call :meth:`dispatch`)."""
        at, self._wake_at = self._wake_at, math.inf
        if not self.waiting or (self._wake_timer is not None and self._wake_timer_at <= at):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): it calls dispatch() itself
            return
        if self._wake_timer is not None:
            self._wake_timer.cancel()
        self._wake_timer_at = at
        self._wake_timer = loop.call_later(max(0.0, at - self.clock()) + 0.001, self._woken)

    def _woken(self) -> None:
        self._wake_timer = None
        self._wake_timer_at = math.inf
        self.dispatch()

    def _start(self, job: Job, backend: Backend, now: float) -> None:
        resumed = job.state is JobState.SUSPENDED
        job.to(JobState.RUNNING)
        self.waiting.remove(job)
        t = self.tenants[job.tenant]
        t.waiting -= 1
        t.running += 1
        job.backend = backend
        job.started_at = now
        sessions = self.sessions.on
        if job.slotted and backend.slot_ids and (self.preemption is not None or sessions):
            slots = self._slots.get(backend.name)
            if slots is None:
                slots = self._slots[backend.name] = SlotMap(backend.capacity, self.sessions.counts.holds)
            slots.grow(backend.capacity)
            if sessions:
                job.slot, before, saved = slots.take_for(job, now, job.session)
                if before or job.session:
                    job.kv = self.sessions.plan(job, backend, job.slot, before, saved)
            else:
                job.slot = slots.take(job, now)
        if self.holds:  # the tenant's next request came: its hold (on this replica first) is used up
            mine = [h for h in self.holds if h.tenant == job.tenant]
            if mine:
                hold = next((h for h in mine if h.backend is backend), mine[0])
                self.holds.remove(hold)
                self.hold_counts["kept"] += 1
                if hold.timer is not None:
                    hold.timer.cancel()
        backend.in_flight += 1
        if self.holds:
            # Holds beyond the replica's free slots stand for no slot any more (a better class or a
            # less-served tenant took it): drop them, without counting against their tenants.
            on_b = [h for h in self.holds if h.backend is backend]
            for h in on_b[:max(0, backend.in_flight + len(on_b) - backend.capacity)]:
                self.holds.remove(h)
                if h.timer is not None:
                    h.timer.cancel()
        backend.last_used = time.monotonic()
        job.probe = backend.breaker.dispatched(now)  # half-open: this request decides whether it comes back
        if home := self._home_key(job):
            self.affinity[home] = backend.name
            self.affinity.move_to_end(home)
            if len(self.affinity) > self.affinity_max_entries:
                self.affinity.popitem(last=False)
        self.running[(backend.name, job.cls.name)] = self.running.get((backend.name, job.cls.name), 0) + 1
        job.starts += 1
        if job.starts == 1:  # (a retry on another replica or a resume is not charged again)
            job.charged = job.estimate
            self._charge(job.tenant, job.estimate / job.weight, job.estimate)
        if resumed:
            self.preempt_counts.resumes += 1
        if self.prefill_defer_s > 0 and job.starts == 1:
            if now - job.enqueued_at >= self.prefill_defer_s:
                self.prefill.aged += 1
            elif any(j.seq < job.seq and j.tenant == job.tenant and j.cls is job.cls for j in self.waiting):
                self.prefill.deferred += 1  # it went before an earlier request of its tenant and class
        self._vtime = t.counter
        self._drain.add(now)
        drain = self._drains.get(backend.name)
        if drain is None:
            drain = self._drains[backend.name] = _DrainRate()
        drain.add(now)
        if job.future is not None and not job.future.done():
            job.future.set_result(backend)
