"""Other boxes' runtimes as replicas of this gateway: ``[[boxes]]``.

Each box runs its own passerelle, which supervises its runtimes under its own memory budget. The
team's gateway (this one) reads every box on a short interval, each reading with a deadline:

    GET /v1/models       (the box's api_key)  the models it serves, their state and memory
    GET /admin/runtimes  (the box key)         each runtime's capacity (slots) and the box's budget

and turns each model of each box into one replica (:class:`BoxBackend`, named ``BOX/MODEL``)
whose capacity is the sum of that box's runtimes serving it. The replicas join the registry like
any backend, so the one queue keeps fair share, priorities and preemption across boxes, and a box
is never sent more requests than its slots. Requests go to the box's public API, as one tenant
(the box key's); usage and tenants are this gateway's business.

A box that disappears (box_state.py): a refused or reset connection takes its replicas out at
once, two missed readings (timeouts) too; their breakers open, the streams they carry are cut
(the client gets an error event, never a hang), requests queued for the model go to the other
replicas, sessions homed there go elsewhere. When it answers again, its replicas come back.

Placement (placement.py): a model that fits a box runs as a replica wherever its budget has room:
the box's own admin API starts it (``POST /admin/runtimes/NAME/start``).

The key is never logged: it lives in the clients' fixed headers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from passerelle.config import BackendConfig, BoxConfig, TimeoutConfig
from passerelle.endpoints import ENDPOINTS
from passerelle.errors import UpstreamError
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.box_state import BoxState, BoxStatus
from passerelle.runtimes.breaker import BreakerState
from passerelle.runtimes.kinds import KINDS
from passerelle.runtimes.placement import BoxMemory, Placement, RemoteModel, decide, to_start
from passerelle.upstream.client import ConnectFailed, HTTPClientError, Response, ServerDisconnected, UpstreamClient

log = logging.getLogger("passerelle.runtimes.boxes")

_READ_LIMIT = 4 * 1024 * 1024  # one reading's body at most
_BY_PATH = {e.upstream: e.name for e in ENDPOINTS}  # public path -> endpoint name
_START_RETRY_S = 60.0  # a start the box refused is asked again after this
_START_TIMEOUT_S = 900.0  # a box loading a model answers the start once it is ready
_CONTINUABLE = frozenset(c for k in KINDS.values() if (c := k.continuation))  # the dialects resume.py speaks


class BoxBackend(Backend):
    """One model on another box: requests go to that box's passerelle."""

    kind = "passerelle"  # (shown as such: its runtimes' kinds are the box's own business)

    def __init__(self, box: RemoteBox, model: str, endpoints: tuple[str, ...], timeouts: TimeoutConfig) -> None:
        cfg = box.cfg
        super().__init__(BackendConfig(name=f"{cfg.name}/{model}", url=cfg.url, models=(model,), endpoints=endpoints,
                                       api_key=cfg.api_key or cfg.key), timeouts)
        self.box = box
        self.remote_state = "down"
        self._started, self._client = True, self._new_client(self.url)  # (ready for a request at once)

    def set_slots(self, slots: int, taken: int = 0) -> None:
        """The box's slots for this model, less ``taken``: those running requests that did not come
        from here (the box's own users, another gateway), so that this gateway never sends the box
        more than it can start; at least one, so the replica is never shut out by a miscount."""
        free = max(1, slots - taken)
        self.capacity_info.report(free, f"box {self.box.cfg.name}: its runtimes' slots"
                                  + (f", {slots - free} taken by others" if free < slots else ""))
        self._fit_pool()

    def follow(self, *, up: bool, error: str = "") -> None:
        """The box's reading of this model (no request of its own: one reading serves all its replicas)."""
        self.stats = BackendStats(up=up, slots_busy=self.in_flight, slots_total=self.capacity, scraped_at=time.time(),
                                  error=error)

    def cut(self) -> None:
        """The box is gone: end the streams in flight there now (their relay sees the connection
        close and ends the client's stream with an error event) rather than wait for a timeout."""
        if self._client is not None:
            old, self._client = self._client, self._new_client(self.url)
            old.close(busy=True)

    async def scrape(self) -> BackendStats:
        return self.stats  # kept by the box's own reading (RemoteBox.poll)

    async def post(self, path: str, body: bytes, *, request_id: str = "", content_type: bytes = b"application/json",
                   traceparent: bytes = b"") -> Response:
        try:
            return await super().post(path, body, request_id=request_id, content_type=content_type,
                                      traceparent=traceparent)
        except UpstreamError:
            self.box.poke()  # a request could not reach the box: read it now rather than at the next interval
            raise

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "box": self.box.cfg.name, "remote": True,
                "box_state": self.box.status.state.value}


def _get_json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise ValueError("the answer is not JSON") from None


class RemoteBox:
    """One box: its state, its replicas here, and the reading that keeps them true."""

    def __init__(self, cfg: BoxConfig, timeouts: TimeoutConfig, *, on_change: Callable[[], None]) -> None:
        self.cfg = cfg
        self.timeouts = timeouts
        self.status = BoxStatus(cfg.name)
        self.on_change = on_change
        self.replicas: dict[str, BoxBackend] = {}
        self.models: dict[str, RemoteModel] = {}
        self.memory = BoxMemory()
        self._public: UpstreamClient | None = None
        self._admin: UpstreamClient | None = None
        self._starting: dict[str, float] = {}  # runtime -> when its start was asked
        self._wake: asyncio.Event | None = None  # set by poke: the reading loop reads at once
        self._tasks: set[asyncio.Task[Any]] = set()

    def _clients(self) -> tuple[UpstreamClient, UpstreamClient]:
        if self._public is None or self._admin is None:
            t = self.cfg.timeout_s
            self._public = UpstreamClient(self.cfg.url, limit=2, connect_timeout=t,
                                          headers={"Authorization": f"Bearer {self.cfg.api_key or self.cfg.key}"})
            self._admin = UpstreamClient(self.cfg.admin_url or self.cfg.url, limit=4, connect_timeout=t,
                                         headers={"Authorization": f"Bearer {self.cfg.key}"})
        return self._public, self._admin

    def poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def wait(self, seconds: float) -> None:
        """The reading loop's pause: ``seconds``, or less when a request found the box unreachable."""
        if self._wake is None:
            self._wake = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for c in (self._public, self._admin):
            if c is not None:
                c.close()
        self._public = self._admin = None

    async def _read(self, client: UpstreamClient, path: str) -> Any:
        async with asyncio.timeout(self.cfg.timeout_s):
            resp = await client.request(b"GET", path)
            try:
                body = await resp.read(_READ_LIMIT)
            finally:
                resp.close()
        if resp.status in (401, 403):
            raise ValueError(f"GET {path}: HTTP {resp.status} (is the key that box's [admin] key, and this gateway's "
                             "address in its [admin] allow?)")
        if resp.status != 200:
            raise ValueError(f"GET {path}: HTTP {resp.status}")
        return _get_json(body)

    async def poll(self) -> None:
        """One reading of the box; its replicas follow. Never raises (a box's failure is its state)."""
        public, admin = self._clients()
        try:
            listing, runtimes = await asyncio.gather(self._read(public, "/v1/models"),
                                                     self._read(admin, "/admin/runtimes"))
            self._learn(listing, runtimes)
        except (TimeoutError, HTTPClientError, OSError, ValueError, KeyError, TypeError) as exc:
            cause, hard = _cause(exc, self.cfg.timeout_s)
            self._missed(cause, hard=hard)
            return
        self._answered()

    def _answered(self) -> None:
        """A whole reading arrived (learnt): the box is up, its replicas follow what it said."""
        if self.status.seen_up():
            for replica in self.replicas.values():  # the box is back: no probe needed to believe it
                if replica.breaker.state is not BreakerState.CLOSED:
                    replica.breaker.reset()
            log.info("box %s is up: replicas %s", self.cfg.name,
                     ", ".join(sorted(r.name for r in self.replicas.values())) or "-")
        self._follow()
        if self.cfg.place:
            self._place()

    def _learn(self, listing: Any, runtimes: Any) -> None:
        rows = {r["name"]: r for r in runtimes["runtimes"]}
        budget = runtimes.get("budget") or {}
        self.memory = BoxMemory(max_gib=budget.get("max_loaded_gib") or None,
                                loaded_gib=float(budget.get("loaded_gib") or 0.0))
        models: dict[str, RemoteModel] = {}
        for m in listing["data"]:
            name = m["id"]
            if not isinstance(name, str) or (self.cfg.models and not _wanted(name, self.cfg.models)):
                continue
            served = [rows[n] for n in m.get("backends") or () if n in rows]
            if not served:
                continue
            models[name] = RemoteModel(name, state=str(m.get("state") or "down"), need_gib=m.get("memory_gib"),
                                       runtimes=tuple(r["name"] for r in served))
            endpoints = tuple(_BY_PATH[p] for p in m.get("routes") or () if p in _BY_PATH)
            replica = self.replicas.get(name)
            if replica is None or replica.declared_endpoints != endpoints:
                if replica is not None:
                    self._spawn(replica.close())
                replica = self.replicas[name] = BoxBackend(self, name, endpoints, self.timeouts)
            slots = sum(int(r.get("capacity") or 0) for r in served)
            # its load: what runs there beyond this gateway's own requests (the reading races
            # requests sent or ended meanwhile: off by a few for a second at most, never below one)
            there = sum(int(r.get("in_flight") or 0) for r in served)
            replica.set_slots(max(1, slots), taken=max(0, there - replica.in_flight))
            # a stream suspended for a better class resumes there as a continuation in its
            # runtime's dialect (proxy/resume.py; the box passes the body through), where every
            # runtime serving the model there speaks the same one
            kinds = {r.get("kind") for r in served}
            replica.continuation = next(iter(kinds)) if len(kinds) == 1 and kinds <= _CONTINUABLE else ""
            replica.remote_state = models[name].state
        for gone in set(self.replicas) - set(models):
            self._spawn(self.replicas.pop(gone).close())
        self.models = models

    def _follow(self) -> None:
        for name, replica in self.replicas.items():
            state = self.models[name].state if name in self.models else "down"
            replica.follow(up=self.status.serving and state in ("loaded", "loading", "unloaded"),
                           error="" if state != "down" else f"box {self.cfg.name}: its runtime is down")
        self.on_change()

    def _missed(self, cause: str, *, hard: bool) -> None:
        was = self.status.state
        changed = self.status.missed(cause, hard=hard)
        if not changed:
            return
        if self.status.state is BoxState.DOWN:
            now = time.monotonic()
            for replica in self.replicas.values():
                replica.follow(up=False, error=f"box {self.cfg.name} down: {cause}")
                replica.breaker.trip(now)
                replica.cut()
            log.warning("box %s is DOWN (%s): replicas %s out of the rotation, their breakers open, their streams "
                        "ended", self.cfg.name, cause, ", ".join(sorted(r.name for r in self.replicas.values())) or "-")
            self.on_change()
        else:
            log.warning("box %s is suspect (%s, was %s): one more miss takes its replicas out", self.cfg.name, cause,
                        was.value)

    def _place(self) -> None:
        now = time.monotonic()
        for model in self.models.values():
            runtime = to_start(model, self.memory)
            if runtime is None or now - self._starting.get(runtime, -_START_RETRY_S) < _START_RETRY_S:
                continue
            self._starting[runtime] = now
            log.info("box %s: starting %s for a replica of %s (%s GiB; budget %s GiB, %.1f loaded)", self.cfg.name,
                     runtime, model.name, model.need_gib, self.memory.max_gib, self.memory.loaded_gib)
            self._spawn(self._start(runtime))

    async def _start(self, runtime: str) -> None:
        _, admin = self._clients()
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                resp = await admin.request(b"POST", f"/admin/runtimes/{runtime}/start")
                try:
                    body = await resp.read(_READ_LIMIT)
                finally:
                    resp.close()
        except (TimeoutError, HTTPClientError, OSError) as exc:
            log.warning("box %s: starting %s failed: %s", self.cfg.name, runtime, _cause(exc, _START_TIMEOUT_S)[0])
            return
        if resp.status != 200:
            log.warning("box %s: starting %s refused: HTTP %d %s", self.cfg.name, runtime, resp.status,
                        body[:300].decode("utf-8", "replace"))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def describe(self) -> dict[str, Any]:
        return {"name": self.cfg.name, "url": self.cfg.url, **self.status.describe(),
                "memory": {"max_loaded_gib": self.memory.max_gib, "loaded_gib": self.memory.loaded_gib},
                "replicas": {n: {"backend": r.name, "state": r.remote_state, "up": r.stats.up, "capacity": r.capacity,
                                 "in_flight": r.in_flight} for n, r in sorted(self.replicas.items())}}


def _wanted(model: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(model, p) for p in patterns)


def _cause(exc: BaseException, timeout_s: float) -> tuple[str, bool]:
    """What went wrong in words, and whether it is a hard failure (refused, reset, unreachable)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s", False
    if isinstance(exc, ConnectFailed):
        return (f"connect timeout: {exc}", False) if exc.timed_out else (f"connection failed: {exc}", True)
    if isinstance(exc, ServerDisconnected | ConnectionError):
        return f"connection reset: {exc}", True
    if isinstance(exc, OSError):
        return f"unreachable: {exc}", True
    if isinstance(exc, ValueError | KeyError | TypeError):
        return f"unexpected answer: {exc}", False
    return f"{exc.__class__.__name__}: {exc}", False


class Boxes:
    """Every ``[[boxes]]`` box: their reading loops, their replicas, where each model runs."""

    def __init__(self, boxes: tuple[BoxConfig, ...], timeouts: TimeoutConfig) -> None:
        self.timeouts = timeouts
        self.boxes = [RemoteBox(c, timeouts, on_change=self._changed) for c in boxes]
        self.on_change: Callable[[list[Backend]], None] | None = None  # the replica list or their health changed
        self._tasks: dict[RemoteBox, asyncio.Task[None]] = {}  # each box's reading loop
        self._leaving: list[BoxBackend] = []  # replicas of boxes a reload removed, finishing their requests
        self._split: dict[str, tuple[str, ...]] = {}  # models marked split (fit no box alone): on which boxes

    def __bool__(self) -> bool:
        return bool(self.boxes)

    def replicas(self) -> list[Backend]:
        return [*(r for box in self.boxes for r in box.replicas.values()), *self._leaving]

    def reconfigure(self, boxes: tuple[BoxConfig, ...], timeouts: TimeoutConfig) -> list[BoxBackend]:
        """A reload's ``[[boxes]]``, by name: a box whose configuration is unchanged is not touched;
        a box added (or replaced: same name, another configuration) is read at once; a box removed
        (or replaced) is no longer read and its replicas take no new request. Returns those
        replicas: the caller waits for their requests to end (a stream on a box that goes from the
        list still ends whole), then calls :meth:`forget`."""
        self.timeouts = timeouts
        old = {box.cfg.name: box for box in self.boxes}
        kept: list[RemoteBox] = []
        for c in boxes:
            box = old.get(c.name)
            if box is not None and box.cfg == c:
                kept.append(old.pop(c.name))
                continue
            box = RemoteBox(c, timeouts, on_change=self._changed)
            kept.append(box)
            self._tasks[box] = asyncio.create_task(self._read_now(box), name=f"passerelle-box-{c.name}")
        leaving: list[BoxBackend] = []
        for box in old.values():
            task = self._tasks.pop(box, None)
            if task is not None:
                task.cancel()
            box.close()
            for replica in box.replicas.values():
                replica.draining = True
                leaving.append(replica)
            log.info("box %s removed from the configuration: no longer read; replicas %s finish their requests",
                     box.cfg.name, ", ".join(sorted(r.name for r in box.replicas.values())) or "-")
        self.boxes = kept
        self._leaving += leaving
        self._changed()
        return leaving

    async def forget(self, replicas: list[BoxBackend]) -> None:
        """Replicas of removed boxes whose requests ended (or were cut at the drain's deadline): gone."""
        self._leaving = [r for r in self._leaving if r not in replicas]
        for r in replicas:
            await r.close()
        self._changed()

    async def _read_now(self, box: RemoteBox) -> None:
        await box.poll()
        await self._loop(box)

    def _changed(self) -> None:
        self._plan()
        if self.on_change is not None:
            self.on_change(self.replicas())

    async def start(self) -> None:
        """Read every box once (a box that does not answer is DOWN, not an error), then keep reading."""
        await asyncio.gather(*(box.poll() for box in self.boxes))
        self._tasks = {box: asyncio.create_task(self._loop(box), name=f"passerelle-box-{box.cfg.name}")
                       for box in self.boxes}

    async def _loop(self, box: RemoteBox) -> None:
        while True:
            if box.status.state is not BoxState.SUSPECT:  # a suspect box is read again at once
                await box.wait(box.cfg.poll_s)
            try:
                await box.poll()
            except Exception:  # the loop must outlive any one box's misbehaviour
                log.exception("reading box %s failed", box.cfg.name)
                await asyncio.sleep(box.cfg.poll_s)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for box in self.boxes:
            box.close()
        for r in self._leaving:
            await r.close()

    def _decide(self) -> list[Placement]:
        """Where each model runs, from the boxes that serve now (a box that is down says nothing)."""
        serving = [box for box in self.boxes if box.status.serving]
        names = sorted({m for box in serving for m in box.models})
        return [decide(m, {box.cfg.name: (box.models[m], box.memory) for box in serving if m in box.models})
                for m in names]

    def placements(self) -> list[dict[str, object]]:
        return [p.as_dict() for p in self._decide()]

    def _plan(self) -> None:
        """A model found to fit no box alone, or whose boxes changed (one went, one came): said in
        the log once, with the boxes and shares a split over them would take (placement.shares)."""
        split = {p.model: p for p in self._decide() if p.mode == "split"}
        for name, p in sorted(split.items()):
            if self._split.get(name) != p.boxes:
                log.warning("model %s fits no box alone: %s (boxes %s)", name, p.why, ", ".join(p.boxes))
        self._split = {name: p.boxes for name, p in split.items()}

    def health(self) -> list[dict[str, object]]:
        """For ``/health``: each box's state and its cause."""
        return [{"name": box.cfg.name, **box.status.describe(),
                 "replicas_up": sum(r.stats.up for r in box.replicas.values())} for box in self.boxes]

    def describe(self) -> dict[str, Any]:
        return {"boxes": [box.describe() for box in self.boxes], "placements": self.placements()}
