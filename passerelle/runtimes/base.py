"""The one seam to an outside runtime: :class:`Backend`.

A backend sends a request body to its runtime and hands back the raw response; what the
gateway does with the bytes (relay, timing, accounting) lives in ``relay.py``. Kinds differ
only in how they report load (``stats``) and in small body rewrites (``prepare``).

Example::

    backend = make_backend(BackendConfig(name="a", kind="llama-server", url="http://127.0.0.1:8081",
                                         models=("gemma",)), TimeoutConfig())
    await backend.start()
    resp = await backend.post("/v1/chat/completions", body)   # upstream.Response
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.errors import UpstreamError, UpstreamTimeout
from passerelle.runtimes.breaker import BreakerState, CircuitBreaker
from passerelle.runtimes.capacity import Capacity
from passerelle.upstream.client import ConnectFailed, HTTPClientError, Response, UpstreamClient

_JSON = b"application/json"
CLOSED = BreakerState.CLOSED


@dataclass
class BackendStats:
    """What a runtime reports about its own load; ``None`` where it reports nothing."""

    up: bool = False
    slots_busy: int | None = None
    slots_total: int | None = None
    queue_depth: int | None = None
    kv_cache_usage_ratio: float | None = None
    scraped_at: float = 0.0
    error: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    # prompt tokens the runtime computed (not taken from its cache), and the seconds it took, since
    # it started (its own timings: scheduling/prefill.py learns its prefill rate from them)
    prompt_tokens_total: float | None = None
    prompt_seconds_total: float | None = None


class Backend:
    """One runtime endpoint of kind ``openai`` (any OpenAI-compatible server)."""

    kind = "openai"
    health_path = "/v1/models"
    # Ask for a stream even when the client did not, and assemble the answer in the gateway:
    # for runtimes that notice a departed client only while streaming.
    stream_always = False
    # The inference routes this kind serves (protocols.py names) when its configuration lists
    # none: the allow-list of what the gateway forwards to it. A generic OpenAI-compatible server
    # is only assumed to serve the three classic routes; list more in `endpoints`.
    serves: tuple[str, ...] = ("chat", "completions", "embeddings")
    # A request may name the slot it runs in (llama-server's id_slot): passerelle then knows
    # which slot every stream holds, and resumes a suspended one where its prompt cache is.
    slot_ids = False
    # How a cut stream is continued (proxy/resume.py): "" for a runtime that cannot (its streams
    # are never suspended), else the dialect of the continuation request.
    continuation = ""

    def __init__(self, cfg: BackendConfig, timeouts: TimeoutConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.models = cfg.models
        self.capacity_info = Capacity(cfg.max_concurrency)  # declared, reported or learned
        self.url = cfg.url.rstrip("/")
        self.timeouts = timeouts
        self.in_flight = 0  # requests dispatched and not finished; the scheduler keeps it
        self.peak_in_flight = 0  # the most in flight since the last load poll; the scheduler keeps it
        self.supervised = False  # launched by passerelle: may come back after a crash
        # Where the runtime saves a slot's KV (llama-server's --slot-save-path), when passerelle
        # launched it with one: sessions' KV is saved there (scheduling/session_kv.py); None: not saved
        self.slot_save_dir: Path | None = None
        self.draining = False  # removed by a reload: finishes its requests, takes no new one
        self.fenced = False  # being swapped out: finishes its requests, takes no new one
        self.context_length: int | None = None  # tokens per request, where the runtime says
        # What the runtime says its model can do ("tools", "vision", "audio", "reasoning" -> bool),
        # asked once per start (probe_traits); a trait it does not say is absent (unknown)
        self.traits: dict[str, bool] = {}
        self._asked_traits = False
        self.last_used = time.monotonic()  # last dispatch or release, for idle stop and LRU eviction
        self.stats = BackendStats()
        # Passive ejection: after a few failures in a row the replica gets no requests for a while;
        # then one request probes it (half-open) and its outcome decides (breaker.py).
        self.breaker = CircuitBreaker()
        self._missed_health = False
        self._asked_capacity = False
        self._asked_routes = False
        self._client: UpstreamClient | None = None
        self._started = False
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        if cfg.health_path:
            self.health_path = cfg.health_path
        # what the gateway forwards to this runtime: its configured endpoints or its kind's, plus
        # the routes the operator added for every backend ([server] extra_routes) or for this one;
        # without a configured list, less what the runtime says, once up, that it does not serve (unserved)
        self.declared_endpoints: tuple[str, ...] = (*(cfg.endpoints or self.serves), *cfg.extra_routes)
        self.endpoints = self.declared_endpoints

    @property
    def capacity(self) -> int:
        """Requests this backend is sent at once at most (see capacity.py)."""
        return self.capacity_info.value

    def observe_first_token(self, ttft_s: float, in_flight: int, prompt_tokens: int) -> None:
        """A request sent with ``in_flight`` requests on this backend (itself included) got its
        first token ``ttft_s`` after it was sent: the signal of a runtime that says nothing about
        its own queue (declared and reported capacities do not move on it: a CPU runtime's first
        tokens slow down with every busy slot without any request waiting)."""
        cap = self.capacity_info
        if not cap.declared and not cap.reported:
            cap.limiter.observe_ttft(ttft_s, in_flight, prompt_tokens)
            self._fit_pool()

    def _fit_pool(self) -> None:
        """Room in the connection pool for a capacity that grew (the scheduler never sends more)."""
        if self._client is not None and self._client.limit < self.capacity + 4:
            self._client.limit = self.capacity + 4

    def routable(self, now: float) -> bool:
        """May this replica take a new request now (up, not draining, not fenced, its breaker lets it through)?"""
        breaker = self.breaker
        return (self.stats.up and not self.draining and not self.fenced
                and (breaker.state is CLOSED or breaker.allows(now)))

    # -- lifecycle -------------------------------------------------------------------------
    def configure(self, timeouts: TimeoutConfig) -> None:
        """``[timeouts]`` (a reload's); the connect timeout applies from the next connection."""
        self.timeouts = timeouts
        if self._client is not None:
            self._client.connect_timeout = timeouts.connect_s

    def set_url(self, url: str) -> None:
        url = url.rstrip("/")
        if url != self.url and self._started:
            # a relaunched runtime on a new port: connections to the old one are of no use
            if self._client is not None:
                self._client.close(busy=False)
            self._client = self._new_client(url)
        self.url = url

    def _new_client(self, url: str) -> UpstreamClient | None:
        if not url:  # a runtime passerelle launches has no address until it runs
            return None
        # Sized to the runtime's capacity (the scheduler never sends more), plus room for the
        # health and load probes.
        return UpstreamClient(url, limit=self.capacity + 4, connect_timeout=self.timeouts.connect_s,
                              keepalive_s=4.0, headers=self._headers)

    async def start(self) -> None:
        if not self._started:
            self._started = True
            self._client = self._new_client(self.url)

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self._started = None, False

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            if not self._started:
                raise RuntimeError(f"backend {self.name} is not started")
            raise ConnectFailed(f"runtime {self.name} has no address yet")
        return self._client

    # -- requests --------------------------------------------------------------------------
    def prepare(self, body: bytes, priority_rank: int, slot: int | None = None) -> bytes:
        """Rewrite the body for this runtime (e.g. vLLM's ``priority``, llama-server's
        ``id_slot``); default: untouched."""
        return body

    async def post(self, path: str, body: bytes, *, request_id: str = "", content_type: bytes = _JSON,
                   traceparent: bytes = b"") -> Response:
        """Send ``body`` (``content_type``: a multipart upload keeps its boundary); return once the
        response headers arrived. Raises UpstreamError.

        ``request_id`` goes along as ``X-Request-Id`` (vLLM adopts it), so logs can be matched;
        ``traceparent`` (a W3C trace context, observe/tracing.py) too, so a runtime joins the trace.
        A pooled connection that the runtime had closed is replaced by a fresh one (see
        upstream.py), so that race never becomes a client error."""
        headers = b"Content-Type: " + content_type + b"\r\n"
        if request_id:
            headers += b"X-Request-Id: " + request_id.encode() + b"\r\n"
        if traceparent:
            headers += b"traceparent: " + traceparent + b"\r\n"
        try:
            return await self.client.request(b"POST", path, body, headers=headers)
        except ConnectFailed as exc:
            if exc.timed_out:
                raise UpstreamTimeout("connect", self.timeouts.connect_s, detail=f"runtime '{self.name}'",
                                      retryable=True) from exc
            raise UpstreamError(f"The model runtime '{self.name}' is not reachable ({exc}).", retryable=True) from exc
        except (HTTPClientError, OSError) as exc:
            raise UpstreamError(f"The model runtime '{self.name}' failed: {exc.__class__.__name__}: {exc}",
                                retryable=True) from exc

    async def slot_action(self, slot: int, action: str, filename: str = "",
                          timeout: float = 10.0) -> dict[str, Any] | None:
        """Save, restore or erase ``slot``'s KV (llama-server's ``/slots``); the runtime's answer,
        None where it gave none in ``timeout`` or this kind has no such route."""
        return None

    # -- health and load -------------------------------------------------------------------
    async def _get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        """GET ``path``: its status and whole body within ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            resp = await self.client.request(b"GET", path)
            try:
                return resp.status, await resp.read()
            finally:
                resp.close()

    async def check_health(self, timeout: float = 2.0) -> bool:
        try:
            status, _ = await self._get(self.health_path, timeout)
            return status == 200
        except (TimeoutError, HTTPClientError, OSError):
            return False

    async def scrape(self) -> BackendStats:
        """Refresh ``self.stats``; never raises (a broken runtime is reported as down)."""
        stats = BackendStats(scraped_at=time.time())
        try:
            stats.up = await self.check_health()
            if not stats.up and self.stats.up and not self._missed_health:
                # one missed or slow answer from a busy runtime is not "down" yet; two are
                self._missed_health = True
                stats.up, stats.error = True, "health check missed once"
                self.stats = stats
                return stats
            self._missed_health = not stats.up and self._missed_health
            if stats.up:
                if not self.capacity_info.declared and not self._asked_capacity:
                    self.capacity_info.report(*await self._report_capacity())
                    self._asked_capacity = True  # once per start: a size does not change while it runs
                if not self._asked_routes and not self.cfg.endpoints:
                    # what its kind serves is checked with the runtime; a list the operator wrote
                    # (or the embedded default's, written for its model) is taken as it is
                    self._asked_routes = True  # once per start, like its size
                    gone = await self.unserved()
                    self.endpoints = tuple(e for e in self.declared_endpoints if e not in gone)
                if not self._asked_traits:
                    self._asked_traits = True  # once per start: a model's template does not change while it runs
                    self.traits = await self.probe_traits()
                await self._scrape_load(stats)
                self._follow_queue(stats)
            else:
                self._asked_capacity = self._asked_routes = self._asked_traits = False
        except Exception as exc:  # garbage from a runtime must never break the gateway
            stats.error = f"{exc.__class__.__name__}: {exc}"
        self.stats = stats
        return stats

    async def _scrape_load(self, stats: BackendStats) -> None:
        """Kind-specific load figures; the generic OpenAI server reports none."""

    async def unserved(self) -> set[str]:
        """The endpoints of its kind this runtime says, once up, that it does not serve (a route it
        answers with 501 for want of a model or a start-up flag): they are not advertised nor
        forwarded. Asked once per start, for a backend without an ``endpoints`` list; empty where
        the kind cannot tell."""
        return set()

    async def probe_traits(self) -> dict[str, bool]:
        """What the runtime's model can do, where the runtime can say (``tools``, ``vision``,
        ``audio``, ``reasoning``); asked once per start. Empty where the kind cannot tell: then the
        catalogue's ``[[models]] capabilities`` alone decide."""
        return {}

    async def _probe(self, path: str, body: bytes, timeout: float = 2.0) -> int | None:
        """POST ``body`` (a request the runtime refuses before any work) and return the status;
        None when there is no answer in time."""
        try:
            async with asyncio.timeout(timeout):
                resp = await self.client.request(b"POST", path, body, headers=b"Content-Type: application/json\r\n")
                try:
                    await resp.read(65536)
                    return resp.status
                finally:
                    resp.close()
        except (TimeoutError, HTTPClientError, OSError):
            return None

    async def _report_capacity(self) -> tuple[int | None, str]:
        """How many requests the runtime says it runs at once, and where it said so; (None, "")
        when it does not say (then the capacity is learned)."""
        return None, ""

    def _follow_queue(self, stats: BackendStats) -> None:
        """Feed the runtime's waiting gauge, where it has one, to the learned limit."""
        cap = self.capacity_info
        if stats.queue_depth is not None and not cap.declared:
            cap.limiter.observe_gauge(stats.queue_depth, self.in_flight, max(self.peak_in_flight, self.in_flight))
            self._fit_pool()
        self.peak_in_flight = self.in_flight


    def describe(self) -> dict[str, Any]:
        """This backend's state for the dashboard and ``/admin/stats``."""
        s = self.stats
        return {
            "name": self.name, "kind": self.kind, "url": self.url, "models": list(self.models),
            "up": s.up, "slots_busy": s.slots_busy, "slots_total": s.slots_total,
            "kv_cache_usage_ratio": s.kv_cache_usage_ratio, "queue_depth": s.queue_depth,
            "in_flight": self.in_flight, **self.capacity_info.as_dict(), "breaker": self.breaker.state.value,
            "checked_ago_s": round(time.time() - s.scraped_at, 1) if s.scraped_at else None,
            "error": s.error,
        }
