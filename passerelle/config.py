"""Configuration: one TOML file, ``PASSERELLE_`` environment overrides, frozen dataclasses.

Every value is validated at load; an error names the file, the key, the line and what was
expected. With no file and no backend, the embedded default runtime is used.

Example::

    cfg = load_config("passerelle.toml", env={"PASSERELLE_SERVER_PORT": "9000"})
    cfg.server.port        # 9000
    cfg.backends[0].name   # "local"

Environment overrides take ``PASSERELLE_<SECTION>_<KEY>`` for the scalar keys of every section
(``[server]``, ``[timeouts]``, ``[embedded]``, ``[admin]``, ``[metrics]``, ``[auth]``, ``[limits]``…),
e.g. ``PASSERELLE_TIMEOUTS_TOTAL_S=900``, ``PASSERELLE_ADMIN_KEY=…``; lists as comma-separated values.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
import os
import re
import shutil
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from passerelle import endpoints
from passerelle.errors import ConfigError

log = logging.getLogger(__name__)

BACKEND_KINDS = ("llama-server", "vllm", "ollama", "sglang", "openai")
# The models the embedded runtime serves with no model file given ([embedded] model), the default
# first; each is fetched from a registry package (runtimes/embedded.py BUILTIN).
EMBEDDED_MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
# The inference APIs the gateway forwards, by name (endpoints.py, the one list). A backend serves
# its kind's defaults (runtimes/*.py `serves`) unless its `endpoints` lists others.
ENDPOINT_KINDS = endpoints.NAMES

# Runtimes' management routes (llama-server, vLLM, SGLang, Ollama): never forwarded, not even when
# an operator lists them in `extra_routes`. A path equal to one, or under one, or naming one of
# the words below, is refused.
MANAGEMENT_ROUTES = ("/slots", "/props", "/models", "/v1/models", "/lora-adapters", "/metrics", "/health",
                     "/cors-proxy", "/tools", "/v1/stream", "/v1/streams", "/v1/chat/completions/control",
                     "/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs",
                     "/server_info", "/get_server_info", "/admin", "/ui", "/ready")
MANAGEMENT_WORDS = ("sleep", "wake", "cache", "lora", "weight", "profile", "rpc", "elastic", "pause", "resume",
                    "abort", "shutdown", "memory", "load", "internal_state", "logging")


def is_management_route(path: str) -> bool:
    """Would forwarding ``path`` expose a runtime's management (or the gateway's own) routes?

    >>> is_management_route("/slots/0"), is_management_route("/reset_prefix_cache"), is_management_route("/v1/x")
    (True, True, False)
    """
    p = path.lower().rstrip("/")
    if any(p == m or p.startswith(m + "/") for m in MANAGEMENT_ROUTES):
        return True
    return any(w in p for w in MANAGEMENT_WORDS)


# In a backend's ``launch``, the llama-server passerelle built and cached (``passerelle setup``).
CACHED_LLAMA_SERVER = "{llama-server}"

@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    max_body_bytes_total: int = 256 * 1024 * 1024  # request bodies held at once, all requests; past it: 503
    log_format: str = "json"  # "json" or "text"
    access_log: bool = True
    shutdown_grace_s: float = 30.0
    cors_origins: tuple[str, ...] = ()
    # What a client may hold (docs/limits.md gives each limit and the error past it):
    max_head_bytes: int = 65536  # request line + headers; past it: 431
    max_headers: int = 100  # header lines; past it: 431
    head_timeout_s: float = 10.0  # first byte of a request head -> its end; past it: 408
    body_timeout_s: float = 60.0  # end of the head -> end of the body; past it: 408
    keep_alive_s: float = 30.0  # a connection with no request in progress is closed after this
    max_connections: int = 1024  # open client connections; beyond: the longest idle is closed, else 503
    # Keys, usage and the audit log of this instance. Default: $PASSERELLE_STATE, else next to the
    # configuration file (<name>.state/ beside <name>.toml), else (no file) the user's state directory.
    state_dir: str = ""
    max_upload_bytes: int = 25 * 1024 * 1024  # multipart uploads (/v1/audio/transcriptions)
    # POST paths forwarded as they are to every backend, beyond the built-in inference routes
    # (a runtime's newer inference route); management routes are refused
    extra_routes: tuple[str, ...] = ()
    # Reverse proxies whose X-Forwarded-For, Forwarded and X-Real-IP headers say who the client is
    # (addresses or networks); from any other peer, loopback included, those headers are ignored
    trusted_proxies: tuple[str, ...] = ()


@dataclass(frozen=True)
class TimeoutConfig:
    """Separate limits; each ends a request with its own cause and message."""

    connect_s: float = 5.0  # opening the TCP connection to the runtime
    # request sent -> first content chunk (prompt processing); bounds the wait for the runtime's
    # response head too, for streams and for answers the gateway assembles from a stream
    first_token_s: float = 300.0
    between_tokens_s: float = 60.0  # gap between two content chunks of a running stream
    total_s: float = 900.0  # whole request, from arrival to the last byte (a non-streamed answer too)
    client_write_s: float = 30.0  # a client that accepts no byte this long is cut (cause client_timeout)


@dataclass(frozen=True)
class BackendConfig:
    """One runtime: reached at ``url``, or launched from ``launch`` (then ``url`` is derived).

    In ``launch``, ``{port}`` is replaced by a free local port chosen at start.
    """

    name: str
    kind: str = "openai"
    url: str = ""
    launch: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()  # the inference APIs it serves (ENDPOINT_KINDS); empty: its kind's
    extra_routes: tuple[str, ...] = ()  # more POST paths forwarded to it as they are (see ServerConfig)
    max_concurrency: int = 0  # requests at once; 0: what the runtime reports, else learned (capacity.py)
    health_path: str = ""  # default by kind
    ready_timeout_s: float = 600.0
    api_key: str = ""  # sent upstream as Bearer, for remote OpenAI-compatible servers
    priority: bool = False  # vLLM started with --scheduling-policy priority: send the class
    log_file: str = ""
    flavour: str = ""  # the build it runs (cpu, vulkan, rocm, cuda...), shown by /v1/models and runtime list
    on_demand: bool = False  # launched when its model is first asked for, not at start
    idle_ttl_s: float = 0.0  # stop a launched runtime after this long without requests (0: never)
    memory_gib: float = 0.0  # what it needs loaded; 0: measured once it ran, estimated from the GGUF before
    persistent: bool = False  # pinned: never stopped for the memory budget nor when idle
    # A model split with llama.cpp's RPC (runtimes/rpc.py): the members' rpc-servers, "host:port",
    # the launched llama-server spreads its layers over (--rpc … -sm layer); one replica whose
    # health needs every member
    rpc: tuple[str, ...] = ()
    rpc_split: tuple[float, ...] = ()  # --tensor-split proportions, the members first; empty: by free memory


@dataclass(frozen=True)
class RpcWorkerConfig:
    """A box that lends its memory: llama.cpp's ``rpc-server``, supervised here, listening on
    this box's private address for the head that splits a model over it (runtimes/rpc.py)."""

    name: str
    host: str  # an address of this box on the private link; never a public one unless allow_public
    port: int = 50052
    threads: int = 0  # CPU threads of its CPU device; 0: rpc-server's default
    devices: tuple[str, ...] = ()  # the devices it lends (rpc-server --device); empty: all of them
    cache: bool = False  # rpc-server's local tensor cache (-c): a head's reload sends less
    rpc_server: str = ""  # the binary; empty: the one `passerelle setup` built beside llama-server
    allow_public: bool = False  # the RPC protocol has no authentication: only behind your own firewall
    ready_timeout_s: float = 60.0
    log_file: str = ""


@dataclass(frozen=True)
class BoxConfig:
    """Another box's passerelle whose models this gateway schedules over (runtimes/boxes.py).

    ``key`` authenticates this gateway to the box: that box's ``[admin] key`` (its admin API
    places models there), sent as Bearer and never logged; ``api_key``, a tenant key on the box
    for its inference routes where that box requires keys (default: ``key``).
    """

    name: str
    url: str = ""  # the box's passerelle, e.g. http://10.0.0.2:8080
    key: str = ""
    api_key: str = ""
    admin_url: str = ""  # the box's admin port, where it has one ([admin] port); "": url
    models: tuple[str, ...] = ()  # only these of the box's models (globs allowed); empty: all
    place: bool = True  # start the box's stopped runtimes that fit its memory budget (replicas first)
    poll_s: float = 1.0  # how often the box's health, models and runtimes are read
    timeout_s: float = 1.0  # the deadline of one reading; a box that misses two in a row is down
    allow_http: bool = False  # plain http to an address that is not private (the key would travel in clear)


# llama-server builds (flavours) the embedded runtime can use (runtimes/flavours.py); auto: this machine's GPU
EMBEDDED_FLAVOURS = ("auto", "cpu", "vulkan", "rocm", "cuda")
# Keys renamed, by table: the old name still loads, with a warning (a configuration only grows).
# [embedded] backend named the llama-server build, a flavour; a backend is a runtime ([[backends]]).
RENAMED_KEYS: dict[str, dict[str, str]] = {"embedded": {"backend": "flavour"}}


@dataclass(frozen=True)
class EmbeddedConfig:
    """The default runtime: a llama-server built from source serving a small model."""

    llama_server: str = ""  # a binary to use instead of PATH / the cached build
    flavour: str = "auto"  # the llama-server build: auto (this machine's GPU), cpu, vulkan, rocm, cuda
    model: str = EMBEDDED_MODELS[0]  # the built-in model served when model_path is empty (EMBEDDED_MODELS)
    model_path: str = ""  # a GGUF to serve instead of the built-in model
    model_id: str = ""  # the id clients use; empty: the built-in model's, or model_path's file name without .gguf
    # Other names clients ask for, served by the embedded model (globs): Claude Code asks for its
    # claude-* models, Codex and the OpenAI SDKs' examples for gpt-*. [] turns them off; a
    # [[models]] entry for the embedded model replaces them.
    aliases: tuple[str, ...] = ("claude-*", "gpt-*")
    slots: int = 4
    # SmolLM2's trained context; a coding agent's first request (Claude Code: about 4,200 tokens
    # with its tools, plus the answer) does not fit in 4,096
    ctx_per_slot: int = 8192
    threads: int = 0  # 0: llama-server's default
    embeddings: bool = True  # serve /v1/embeddings from a second, one-slot process of the same GGUF
    rerank: bool = True  # serve /v1/rerank from a third process (--reranking) with a reranking GGUF
    rerank_model_path: str = ""  # a reranking GGUF (bge-reranker, jina-reranker...); default: a tiny one made locally
    rerank_model_id: str = "tiny-reranker"
    extra_args: tuple[str, ...] = ()

    @property
    def served_id(self) -> str:
        """The model id the embedded chat runtime serves."""
        if self.model_id:
            return self.model_id
        return Path(self.model_path).name.removesuffix(".gguf") if self.model_path else self.model


@dataclass(frozen=True)
class AdminConfig:
    """Who may reach the admin routes (``/admin/*``, ``/ui``, ``/metrics``), and where."""

    allow: tuple[str, ...] = ("127.0.0.0/8", "::1/128")  # client networks; default: loopback only
    key: str = ""  # when set, admin routes also need "Authorization: Bearer KEY" (or the dashboard's login cookie)
    # Host names (beyond loopback, IP literals and this machine's name) the admin routes answer to,
    # e.g. a reverse proxy's public name; "*": any. A Host outside them (DNS rebinding) gets 403.
    hosts: tuple[str, ...] = ()
    port: int = 0  # 0: admin routes on the main port; N: only on this port, not on the main one
    host: str = "127.0.0.1"  # address of the admin port


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True  # per-request latency histograms and the dashboard's rolling window
    tenant_label: bool = True  # false: no "tenant" label (bounds cardinality with many tenants)
    window_s: float = 300.0  # what /admin/stats and /ui summarise: the last N seconds


@dataclass(frozen=True)
class AuthConfig:
    """API keys (``passerelle keys``) and what a request without one may do."""

    required: bool = False  # true: a key is needed even while none exists (else: once one exists)
    db: str = ""  # SQLite file of keys, usage and audit log; default: passerelle.db in the state directory
    anonymous_priority: str = "standard"  # class of a request without a key
    anonymous_max_priority: str = "standard"  # highest class X-Priority may ask for without a key
    # per (client address, presented key prefix); past it that pair gets 429 until the minute is over.
    # A valid key always passes, whatever failed before it from the same address.
    failed_attempts_per_minute: int = 20
    max_user_chars: int = 64  # a request without a key is accounted to its `user`, cut to this (+ a hash)
    # The usage table (one row per finished request): rows of refused requests (no token billed)
    # are deleted after this many days (0: kept), and past usage_max_rows the oldest rows go,
    # refused ones first (0: no cap). Pruned at start and every 10 minutes.
    usage_refused_retention_days: float = 7.0
    usage_max_rows: int = 5_000_000
    # A key marked --trust-forwarded-user (a front-end such as Open WebUI) names the person behind each
    # request in this header; the tenant becomes "<key's tenant>/<user>". Other keys' headers are ignored.
    forwarded_user_header: str = "x-openwebui-user-id"
    forwarded_chat_header: str = "x-openwebui-chat-id"  # the conversation: a session id (affinity, usage)
    # ...and the person's name and email (Open WebUI URL-quotes the name), kept beside the id for
    # `passerelle usage --by user`; cut to max_user_chars * 4
    forwarded_name_header: str = "x-openwebui-user-name"
    forwarded_email_header: str = "x-openwebui-user-email"
    # With a secret (Open WebUI's FORWARD_USER_INFO_HEADER_JWT_SECRET), a trusted key's person comes
    # only from the signed HS256 token in this header (claims sub, email, name; tenant "<tenant>/<sub>");
    # the plain headers above are then ignored, and a bad or expired token is a 401. Never logged.
    forwarded_user_jwt_header: str = "x-openwebui-user-jwt"
    forwarded_user_jwt_secret: str = field(default="", repr=False)
    # A trusted key's request with a non-empty value in this header is a front-end's background task
    # (Open WebUI: a connection header "X-OpenWebUI-Task: {{TASK}}"): it runs at task_priority (never
    # above the key's own class) and, when it sets no output limit, with max_tokens = task_max_tokens.
    forwarded_task_header: str = "x-openwebui-task"
    task_priority: str = "batch"
    task_max_tokens: int = 512  # 0: no default


@dataclass(frozen=True)
class LimitsConfig:
    """Caps on what a runtime sends, and how a request's prompt is estimated at admission.

    Past a cap the request ends with 502 ``upstream_error`` naming it, and the connection to the
    runtime is closed (memory stays bounded whatever it sends).

    The estimate (tokens/minute, quotas, fair share) stands until the runtime's own count replaces
    it at the end: text at about 4 characters a token; an image or audio part a fixed number of
    tokens whatever its size in bytes (a base64 image of 1 MB is still one image). These are the
    gateway-wide values; a per-model value can come from a model catalogue.
    """

    max_answer_bytes: int = 64 * 1024 * 1024  # a non-streamed answer, or the stream it is assembled from
    # answers assembled from streams (llama-server's non-streamed requests), held at once by all
    # requests together; past it: 503 answers_busy
    max_answer_bytes_total: int = 256 * 1024 * 1024
    max_error_bytes: int = 256 * 1024  # the body of a runtime's 4xx/5xx answer
    max_event_bytes: int = 1024 * 1024  # one SSE event of a stream (a line with no end counts as one)
    image_tokens: int = 768  # per image part (image_url, input_image, a data:image/... URL)
    audio_tokens: int = 1500  # per audio part (input_audio, a data:audio/... URL)


@dataclass(frozen=True)
class StoreConfig:
    """A store shared by several gateways: PostgreSQL (psycopg 3), for keys, the audit log, usage
    rows and quotas' counters (tenants/pgstore.py, pgusage.py, pgquota.py), and the lock of an
    active-passive pair (tenants/active.py)."""

    url: str = ""  # postgresql://user:password@host/db; empty: everything in the instance's SQLite file
    poll_s: float = 1.0  # how often each gateway looks for changed keys (and retries a lost database)
    timeout_s: float = 5.0  # client-side deadline of connecting and each statement (tenants/pgconn.py)
    offline_s: float = 300.0  # how long the keys last read are served while the database is away; then 503
    spool_max_mib: int = 256  # usage rows kept on disk (state_dir/usage-spool.jsonl) while the database is away
    active_passive: bool = False  # one gateway serves (it holds the lock), the others stand by
    lock_poll_s: float = 0.5  # how often a standby tries the lock, and the active checks it still holds it


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces of requests (GenAI conventions), sent over OTLP/HTTP; needs the
    ``otel`` extra (``pip install passerelle[otel]``). Off: nothing of OpenTelemetry is loaded."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # an OTLP/HTTP collector's traces URL
    sample_ratio: float = 1.0  # share of traces kept (a client's traceparent decides for its own)
    record_prompts: bool = False  # the request body (cut to 4 KiB) as a span event; never by default
    service_name: str = "passerelle"


@dataclass(frozen=True)
class BatchesConfig:
    """The Batch API (``/v1/files``, ``/v1/batches``): what it may keep on disk, and how hard its
    lines may push (passerelle/batches/). Every limit's error is in docs/limits.md."""

    enabled: bool = True
    max_file_bytes: int = 64 * 1024 * 1024  # one uploaded file (read whole: it counts in the body budget)
    max_lines: int = 50_000  # lines of one batch input file
    max_total_bytes: int = 4 * 1024 * 1024 * 1024  # all files kept (inputs, outputs, errors) together
    retention_h: float = 168.0  # a finished batch, its output and error files, and unused input files
    in_flight_per_batch: int = 4  # lines of one batch queued or running at once
    in_flight_per_key: int = 8  # lines of one key's batches together (fair share between keys' batches)
    # Slots of each runtime batch lines leave free for other classes' requests (at most its slots
    # less one); batch lines also leave every slot other classes use or wait for (batches/idle.py).
    reserve_slots: int = 1
    max_window_h: float = 168.0  # the longest completion_window accepted
    line_attempts: int = 5  # tries of a line that met a passing failure (runtime down, queue full) before it fails
    max_batches_per_key: int = 16  # batches of one key in progress at once (429 too_many_batches past it)
    max_batches_in_progress: int = 128  # batches of all keys in progress at once (429 too_many_batches past it)


@dataclass(frozen=True)
class SchedulerConfig:
    aging_s: float = 30.0  # a waiting request moves up one class per aging_s waited (0: never)
    hold_s: float = 0.05  # a freed slot waits this long for the next request of an under-served tenant (0: off)
    max_tenants: int = 10000  # tenants remembered for fair share; the least recently seen idle one goes first
    # A tenant may hold at most this share of a class's queue (per model) while other tenants' requests
    # wait; alone it may fill the queue, and a newcomer then takes the place of its newest queued request.
    # 1.0: off.
    tenant_queue_share: float = 0.5
    # Preemption (scheduling/preemption.py): a request of a better class that finds every slot it
    # may use busy suspends a stream of a preemptible class at once (or after preempt_after_ms at
    # most, while a stream there is expected to end by itself within it), which resumes later as
    # a continuation, the client seeing one unbroken stream.
    preemption: bool = True
    preempt_after_ms: float = 50.0
    min_run_s: float = 2.0  # a stream is not suspended twice within this
    # Within a tenant and class, the request with less prompt to compute (its uncached tokens over
    # the runtime's measured prefill rate, scheduling/prefill.py) goes first; one that has waited
    # this long is passed over no more. 0: first come, first served.
    prefill_defer_s: float = 10.0


@dataclass(frozen=True)
class SessionsConfig:
    """Agent sessions keep their KV cache across tool-call gaps (scheduling/session_kv.py)."""

    keep_kv: bool = True  # off: a session is placed as any conversation; nothing held, saved or restored
    hold_percentile: float = 90.0  # a session's slot is held for this percentile of its own gaps...
    hold_max_s: float = 30.0  # ...at most this long (0: no hold)
    hold_default_s: float = 5.0  # ...or this long before two of its gaps are known
    save_timeout_s: float = 10.0  # a slot's KV saved (before another session takes its slot) within this
    restore_timeout_s: float = 10.0  # a session's KV restored within this, else its prompt is computed again
    max_saved_bytes: int = 4 << 30  # saved KV on disk, all runtimes together; least recently used goes first
    max_saved_files: int = 256  # saved KV files, all runtimes together
    max_sessions: int = 10000  # sessions whose gaps and saved KV are remembered (least recent forgotten)


@dataclass(frozen=True)
class RuntimesConfig:
    """The memory budget of launched runtimes, and how the scheduler swaps models within it."""

    max_loaded_gib: float = 0.0  # memory budget of launched runtimes; 0: no budget
    max_loaded: str = ""  # the budget as a share of the machine's memory, e.g. "90%" (instead of max_loaded_gib)
    memory: str = "total"  # what counts against the budget: "total" (RAM + GPU), "ram" or "gpu"
    min_resident_s: float = 30.0  # a loaded model with queued work is not swapped out before this
    drain_timeout_s: float = 120.0  # a model swapped out, or a backend a reload removed, finishes within this
    swap_policy: str = "fair"  # "fair": swap by priority and fair share; "naive": evict on every miss


MEMORY_KINDS = ("total", "ram", "gpu")
SWAP_POLICIES = ("fair", "naive")
CAPABILITIES = ("chat", "completions", "embeddings", "rerank", "vision", "tools", "reasoning", "audio")
TOOLS_MODES = ("refuse", "ignore")
# `[[models]] tool_calls`: the tool-call markup repaired into each API's tool calls (proxy/repair.py);
# "auto" recognises any of them, "off" passes the runtime's answer through untouched
TOOL_CALL_FORMATS = ("off", "auto", "hermes", "qwen3-xml", "mistral", "llama3", "harmony")


@dataclass(frozen=True)
class ModelConfig:
    """One public model of the catalogue (``[[models]]``): what clients ask for, and how a request
    for it reaches a runtime.

    ``served_name`` is the model id a backend lists in ``models`` (default: ``name``); the request's
    ``model`` is rewritten to it. ``defaults`` are set when the client sent no value, ``set`` always,
    ``cap`` bounds numbers (``max_tokens`` bounds the output limit under each API's name for it:
    ``max_completion_tokens``, Responses' ``max_output_tokens``) and ``strip`` removes keys.
    ``fallbacks`` are other models tried in order when this one cannot serve before the request's
    queue wait runs out.

    Example (TOML)::

        [[models]]
        name = "chat"
        aliases = ["gpt-4o*", "claude-*"]
        served_name = "qwen2.5-14b"
        cap = { max_tokens = 2048 }
        fallbacks = ["chat-small"]
    """

    name: str
    aliases: tuple[str, ...] = ()  # other names clients use; globs allowed ("gpt-4o*")
    served_name: str = ""  # model id of the backends to route to; "" = name
    backends: tuple[str, ...] = ()  # only these backends of that model ("" = all that serve it)
    defaults: tuple[tuple[str, Any], ...] = ()  # body keys set when absent
    set: tuple[tuple[str, Any], ...] = ()  # body keys always set (override the client)
    cap: tuple[tuple[str, float], ...] = ()  # numeric keys bounded (set when absent)
    strip: tuple[str, ...] = ()  # body keys removed
    context_length: int = 0  # tokens; 0 = as the runtime reports
    capabilities: tuple[str, ...] = ()  # default: from the backends' endpoints
    fallbacks: tuple[str, ...] = ()  # other models tried in order when this one cannot serve
    # A request with tools to a model that cannot use them: "refuse" (a 400 naming the model and
    # the capability) or "ignore" (served without them, with an X-Passerelle-Warning header)
    tools: str = "refuse"
    truncate_input: bool = False  # embeddings: an input past the context is cut to it (else a 400)
    embed_batch: int = 32  # embeddings: inputs per request to the runtime; more are split and run at once
    tool_calls: str = "off"  # tool-call markup left in text, delivered as tool calls: a TOOL_CALL_FORMATS name
    owned_by: str = "passerelle"
    description: str = ""

    @property
    def target(self) -> str:
        return self.served_name or self.name


@dataclass(frozen=True)
class RoutingConfig:
    """How a request picks among the replicas serving its model."""

    policy: str = "least_loaded"  # or "round_robin"
    prefix_affinity: bool = True  # a chat stays on the replica that served its opening (prompt cache)
    affinity_slack: float = 1.0  # ...while that replica is at most this much busier (fraction of slots)
    session_header: str = "x-session-id"  # requests with the same value (or the same `user`) stick together
    # Where coding agents and front-ends name their session (first found wins): headers, then body
    # fields (dotted paths). The session keeps a conversation on one replica, and is logged hashed.
    session_headers: tuple[str, ...] = ("x-claude-code-session-id", "session-id", "session_id")
    # (opencode sends its session as promptCacheKey, camel case, with its provider's setCacheKey on)
    session_fields: tuple[str, ...] = ("prompt_cache_key", "promptCacheKey", "session_id", "metadata.user_id", "user")
    max_session_in_flight: int = 16  # requests of one session at once; past it: 429 session_limit (0: no cap)
    affinity_max_bytes: int = 8 * 1024 * 1024  # memory of which replica served a conversation; oldest forgotten


@dataclass(frozen=True)
class ClassConfig:
    """A priority class; lower rank is more urgent. The defaults are interactive, standard, batch."""

    name: str
    rank: int = 1
    max_queue: int = 512  # waiting requests; past it: 429 queue_full
    max_queue_wait_s: float = 120.0  # past it: 429 queue_timeout
    slot_share: float = 1.0  # fraction of each backend's slots the class may hold (at least one)
    preemptible: bool = False  # its streams may be suspended for a better class, and resumed
    # A request of this class that waited this long takes a slot held for another session's next
    # turn ([sessions]); until then it leaves held slots alone, unless that session's KV, saved
    # while it waits, is on disk sooner.
    session_wait_s: float = 1.0


# With preemption on (the default) batch may use every slot: a better class that arrives takes
# one back at once. With it off, batch keeps a quarter of the slots free.
DEFAULT_CLASSES = (
    ClassConfig("interactive", 0, max_queue=256, max_queue_wait_s=60.0, slot_share=1.0, session_wait_s=0.5),
    ClassConfig("standard", 1, max_queue=512, max_queue_wait_s=120.0, slot_share=1.0, session_wait_s=1.0),
    ClassConfig("batch", 2, max_queue=4096, max_queue_wait_s=1800.0, slot_share=1.0, preemptible=True,
                session_wait_s=10.0),
)
BATCH_SLOT_SHARE_WITHOUT_PREEMPTION = 0.75


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    runtimes: RuntimesConfig = field(default_factory=RuntimesConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    batches: BatchesConfig = field(default_factory=BatchesConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    classes: tuple[ClassConfig, ...] = DEFAULT_CLASSES
    backends: tuple[BackendConfig, ...] = ()
    models: tuple[ModelConfig, ...] = ()
    boxes: tuple[BoxConfig, ...] = ()
    rpc_workers: tuple[RpcWorkerConfig, ...] = ()
    source: str = "<defaults>"

    @property
    def uses_embedded(self) -> bool:
        """No runtime of its own and no other box to send work to: the embedded default serves (a box
        that only lends its memory to a split, [[rpc_workers]], serves no model itself)."""
        return not self.backends and not self.boxes and not self.rpc_workers

    def state_path(self, env: Mapping[str, str] | None = None) -> Path:
        """This instance's state directory (keys, usage, audit log), in order:

        1. ``[server] state_dir`` (relative to the configuration file's folder);
        2. ``$PASSERELLE_STATE``;
        3. next to the configuration file: ``/etc/llm/gw.toml`` → ``/etc/llm/gw.state``;
        4. the user's state directory (``~/.local/state/passerelle``), for the default
           configuration only (no file), so two gateways with two files never share keys.

        Example::

            >>> Config(source="/srv/team/gw.toml").state_path(env={})
            PosixPath('/srv/team/gw.state')
        """
        env = os.environ if env is None else env
        src = None if self.source.startswith("<") else Path(self.source).expanduser().absolute()
        if self.server.state_dir:
            configured = Path(self.server.state_dir).expanduser()
            return configured if configured.is_absolute() or src is None else src.parent / configured
        if env.get("PASSERELLE_STATE"):
            return Path(env["PASSERELLE_STATE"])
        if src is not None:
            return src.parent / f"{src.stem}.state"
        return Path.home() / ".local" / "state" / "passerelle"

    def db_path(self, env: Mapping[str, str] | None = None) -> Path:
        """The SQLite file of keys, usage and the audit log: ``[auth] db``, else in :meth:`state_path`."""
        return Path(self.auth.db).expanduser() if self.auth.db else self.state_path(env) / "passerelle.db"


_ARRAYS = ("backends", "classes", "models", "boxes", "rpc_workers")  # the arrays of tables ([[backends]] …)
_SECTIONS: dict[str, type] = {"server": ServerConfig, "timeouts": TimeoutConfig, "embedded": EmbeddedConfig,
                              "admin": AdminConfig, "metrics": MetricsConfig, "auth": AuthConfig,
                              "scheduler": SchedulerConfig, "routing": RoutingConfig, "sessions": SessionsConfig,
                              "runtimes": RuntimesConfig, "limits": LimitsConfig,
                              "batches": BatchesConfig, "tracing": TracingConfig,
                              "store": StoreConfig}



def _line_of(text: str, header: str | None, key: str, nth: int = 0) -> int | None:
    """Best-effort line number of ``key = …`` inside the ``nth`` table named ``header``."""
    lines = text.splitlines()
    start, seen = 0, -1
    if header is not None:
        pat = re.compile(rf"^\s*\[\[?\s*{re.escape(header)}\s*\]\]?\s*(#.*)?$")
        for i, line in enumerate(lines):
            if pat.match(line):
                seen += 1
                if seen == nth:
                    start = i
                    break
        else:
            return None
    keypat = re.compile(rf"^\s*(\"?{re.escape(key)}\"?\s*=|\[\[?\s*{re.escape(key)}\s*\]\]?)")
    for i in range(start, len(lines)):
        if i > start and header is not None and lines[i].lstrip().startswith("["):
            break
        if keypat.match(lines[i]):
            return i + 1
    return None


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, from_env: bool) -> Any:
    """Return ``value`` as ``tp`` or raise ValueError (strings from the environment are parsed)."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        if from_env and isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ValueError
        return tuple(_coerce(v, typing.get_args(tp)[0], from_env) for v in value)
    if origin is types.UnionType:
        raise ValueError
    if tp is bool:
        if from_env and isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise ValueError
        return value
    if tp is int:
        if from_env and isinstance(value, str):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError
        return value
    if tp is float:
        if from_env and isinstance(value, str):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    raise ValueError


def _build(cls: type, table: Mapping[str, Any], *, file: str, text: str, header: str | None,
           nth: int = 0, env: Mapping[str, str] | None = None, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    dotted = f"{header}." if header else ""
    for key in table:
        if key not in names:
            raise ConfigError(f"unknown key; expected one of: {', '.join(sorted(names))}", file=file,
                              key=f"{dotted}{key}", line=_line_of(text, header, key, nth))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if env is not None and (raw := env.get(f"{prefix}{f.name.upper()}")) is not None:
            try:
                values[f.name] = _coerce(raw, tp, from_env=True)
            except ValueError:
                raise ConfigError(f"expected {_describe(tp)}, got {raw!r}", file="environment",
                                  key=f"{prefix}{f.name.upper()}") from None
        elif f.name in table:
            try:
                values[f.name] = _coerce(table[f.name], tp, from_env=False)
            except ValueError:
                raise ConfigError(f"expected {_describe(tp)}, got {table[f.name]!r}", file=file,
                                  key=f"{dotted}{f.name}", line=_line_of(text, header, f.name, nth)) from None
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        missing = str(exc).split("argument")[-1].strip(": '")
        raise ConfigError("missing required key", file=file, key=f"{dotted}{missing}",
                          line=_line_of(text, header, "name", nth)) from None


def _renamed(name: str, table: dict[str, Any], env: Mapping[str, str], *, file: str,
             text: str) -> tuple[dict[str, Any], Mapping[str, str]]:
    """``table`` and ``env`` with a renamed key's old spelling read as the new one (RENAMED_KEYS)."""
    for old, new in RENAMED_KEYS.get(name, {}).items():
        if old in table:
            if new in table:
                raise ConfigError(f"set twice: {old} is the old name of {new}; keep {new}", file=file,
                                  key=f"{name}.{old}", line=_line_of(text, name, old))
            log.warning("%s: [%s] %s is deprecated; it is called %s now", file, name, old, new)
            table = {(new if k == old else k): v for k, v in table.items()}
        old_var, new_var = f"PASSERELLE_{name.upper()}_{old.upper()}", f"PASSERELLE_{name.upper()}_{new.upper()}"
        if old_var in env and new_var not in env:
            log.warning("%s is deprecated; it is called %s now", old_var, new_var)
            env = {**env, new_var: env[old_var]}
    return table, env


def _check(cond: bool, message: str, *, file: str, key: str, text: str, header: str | None,
           field_name: str, nth: int = 0) -> None:
    if not cond:
        raise ConfigError(message, file=file, key=key, line=_line_of(text, header, field_name, nth))


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                upstreams: tuple[BackendConfig, ...] = ()) -> Config:
    """Load, override from ``env`` (default ``os.environ``) and validate; raise ConfigError."""
    env = os.environ if env is None else env
    file, text, data = "<defaults>", "", {}
    if path is not None:
        file = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration: {exc.strerror}", file=file) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"not valid TOML: {exc}", file=file) from None
    for key in data:
        if key not in (*_SECTIONS, *_ARRAYS):
            raise ConfigError("unknown section; expected one of: "
                              f"{', '.join([*_SECTIONS, *_ARRAYS])}",
                              file=file, key=key, line=_line_of(text, None, key))
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError("expected a table", file=file, key=name, line=_line_of(text, None, name))
        table, section_env = _renamed(name, table, env, file=file, text=text)
        sections[name] = _build(cls, table, file=file, text=text, header=name, env=section_env,
                                prefix=f"PASSERELLE_{name.upper()}_")
    server: ServerConfig = sections["server"]
    _check(server.log_format in ("json", "text"), "expected 'json' or 'text'", file=file,
           key="server.log_format", text=text, header="server", field_name="log_format")
    _check(0 < server.port < 65536, "expected a port between 1 and 65535", file=file, key="server.port",
           text=text, header="server", field_name="port")
    _check(server.max_body_bytes > 0, "expected a positive size", file=file, key="server.max_body_bytes",
           text=text, header="server", field_name="max_body_bytes")
    _check_client_limits(server, file=file, text=text)
    _check(server.max_body_bytes_total >= server.max_body_bytes, "expected at least server.max_body_bytes",
           file=file, key="server.max_body_bytes_total", text=text, header="server", field_name="max_body_bytes_total")
    _check(server.max_upload_bytes > 0, "expected a positive size", file=file, key="server.max_upload_bytes",
           text=text, header="server", field_name="max_upload_bytes")
    _check_routes(server.extra_routes, file=file, text=text, header="server", key="server.extra_routes")
    timeouts: TimeoutConfig = sections["timeouts"]
    for f in dataclasses.fields(TimeoutConfig):
        _check(getattr(timeouts, f.name) > 0, "expected a positive number of seconds", file=file,
               key=f"timeouts.{f.name}", text=text, header="timeouts", field_name=f.name)

    limits: LimitsConfig = sections["limits"]
    for name in ("max_answer_bytes", "max_error_bytes", "max_event_bytes"):
        _check(getattr(limits, name) >= 1024, "expected a size in bytes of at least 1024", file=file,
               key=f"limits.{name}", text=text, header="limits", field_name=name)
    _check(limits.max_answer_bytes_total >= limits.max_answer_bytes, "expected at least limits.max_answer_bytes",
           file=file, key="limits.max_answer_bytes_total", text=text, header="limits",
           field_name="max_answer_bytes_total")

    _check_batches(sections["batches"], file=file, text=text)
    _check_sessions(sections["sessions"], file=file, text=text)
    store: StoreConfig = sections["store"]
    _check(not store.url or store.url.startswith(("postgresql://", "postgres://")),
           "expected a postgresql:// URL", file=file, key="store.url", text=text, header="store", field_name="url")
    for name in ("poll_s", "timeout_s", "offline_s", "lock_poll_s"):
        _check(getattr(store, name) > 0, "expected a positive number of seconds", file=file, key=f"store.{name}",
               text=text, header="store", field_name=name)
    _check(store.spool_max_mib > 0, "expected a positive number of MiB", file=file, key="store.spool_max_mib",
           text=text, header="store", field_name="spool_max_mib")
    _check(bool(store.url) or not store.active_passive, "active_passive needs [store] url (the lock is in PostgreSQL)",
           file=file, key="store.active_passive", text=text, header="store", field_name="active_passive")
    tracing: TracingConfig = sections["tracing"]
    _check(0.0 <= tracing.sample_ratio <= 1.0, "expected a share between 0 and 1", file=file,
           key="tracing.sample_ratio", text=text, header="tracing", field_name="sample_ratio")
    _check(tracing.endpoint.startswith(("http://", "https://")), "expected an http(s) URL", file=file,
           key="tracing.endpoint", text=text, header="tracing", field_name="endpoint")
    _check_admin(sections["admin"], server, file=file, text=text)
    _check_admin_key(sections["admin"].key, env, file=file, text=text)
    metrics: MetricsConfig = sections["metrics"]
    _check(10 <= metrics.window_s <= 86400, "expected a number of seconds between 10 and 86400", file=file,
           key="metrics.window_s", text=text, header="metrics", field_name="window_s")

    flavour = "backend" if "backend" in data.get("embedded", {}) else "flavour"  # (as the file spells it)
    _check(sections["embedded"].flavour in EMBEDDED_FLAVOURS, f"expected one of {', '.join(EMBEDDED_FLAVOURS)}",
           file=file, key=f"embedded.{flavour}", text=text, header="embedded", field_name=flavour)
    classes = _load_classes(data.get("classes", []), sections["auth"], file=file, text=text,
                            preemption=sections["scheduler"].preemption)
    _check(sections["routing"].policy in ("least_loaded", "round_robin"), "expected 'least_loaded' or 'round_robin'",
           file=file, key="routing.policy", text=text, header="routing", field_name="policy")
    _check(sections["scheduler"].aging_s >= 0, "expected zero or a positive number of seconds", file=file,
           key="scheduler.aging_s", text=text, header="scheduler", field_name="aging_s")
    _check(0 <= sections["scheduler"].hold_s <= 1, "expected seconds between 0 and 1", file=file,
           key="scheduler.hold_s", text=text, header="scheduler", field_name="hold_s")
    _check(0 <= sections["scheduler"].preempt_after_ms <= 60_000, "expected milliseconds between 0 and 60000",
           file=file, key="scheduler.preempt_after_ms", text=text, header="scheduler", field_name="preempt_after_ms")
    _check(sections["scheduler"].prefill_defer_s >= 0, "expected zero or a positive number of seconds", file=file,
           key="scheduler.prefill_defer_s", text=text, header="scheduler", field_name="prefill_defer_s")
    _check(sections["scheduler"].min_run_s >= 0, "expected zero or a positive number of seconds", file=file,
           key="scheduler.min_run_s", text=text, header="scheduler", field_name="min_run_s")
    _check(sections["scheduler"].max_tenants >= 100, "expected at least 100", file=file,
           key="scheduler.max_tenants", text=text, header="scheduler", field_name="max_tenants")
    _check(sections["routing"].affinity_max_bytes >= 65536, "expected at least 65536 bytes", file=file,
           key="routing.affinity_max_bytes", text=text, header="routing", field_name="affinity_max_bytes")
    _check(0.0 < sections["scheduler"].tenant_queue_share <= 1.0, "expected a share above 0 and at most 1",
           file=file, key="scheduler.tenant_queue_share", text=text, header="scheduler",
           field_name="tenant_queue_share")
    _check(sections["routing"].max_session_in_flight >= 0, "expected zero (no cap) or a positive integer",
           file=file, key="routing.max_session_in_flight", text=text, header="routing",
           field_name="max_session_in_flight")
    _check(sections["auth"].task_max_tokens >= 0, "expected zero (no default) or a positive number of tokens",
           file=file, key="auth.task_max_tokens", text=text, header="auth", field_name="task_max_tokens")
    _check(16 <= sections["auth"].max_user_chars <= 4096, "expected between 16 and 4096 characters", file=file,
           key="auth.max_user_chars", text=text, header="auth", field_name="max_user_chars")
    for name in ("image_tokens", "audio_tokens"):
        _check(getattr(sections["limits"], name) >= 0, "expected zero or a positive number of tokens", file=file,
               key=f"limits.{name}", text=text, header="limits", field_name=name)
    _check(sections["auth"].failed_attempts_per_minute > 0, "expected a positive integer", file=file,
           key="auth.failed_attempts_per_minute", text=text, header="auth", field_name="failed_attempts_per_minute")
    for name in ("usage_refused_retention_days", "usage_max_rows"):
        _check(getattr(sections["auth"], name) >= 0, "expected zero (off) or a positive number", file=file,
               key=f"auth.{name}", text=text, header="auth", field_name=name)

    embedded: EmbeddedConfig = sections["embedded"]
    _check(embedded.model in EMBEDDED_MODELS, f"expected one of {', '.join(EMBEDDED_MODELS)} (or a GGUF in "
           "model_path)", file=file, key="embedded.model", text=text, header="embedded", field_name="model")
    _check(embedded.slots > 0 and embedded.ctx_per_slot >= 256, "expected at least 1 slot of at least 256 tokens",
           file=file, key="embedded.ctx_per_slot" if embedded.slots > 0 else "embedded.slots", text=text,
           header="embedded", field_name="ctx_per_slot" if embedded.slots > 0 else "slots")

    raw_backends = data.get("backends", [])
    if not isinstance(raw_backends, list):
        raise ConfigError("expected an array of tables ([[backends]])", file=file, key="backends")
    backends: list[BackendConfig] = []
    for i, table in enumerate(raw_backends):
        b: BackendConfig = _build(BackendConfig, table, file=file, text=text, header="backends", nth=i)
        key = f"backends[{i}]"
        ck: dict[str, Any] = dict(file=file, text=text, header="backends", nth=i)
        _check(b.kind in BACKEND_KINDS, f"expected one of {', '.join(BACKEND_KINDS)}", key=f"{key}.kind",
               field_name="kind", **ck)
        _check(bool(b.url) != bool(b.launch), "give exactly one of 'url' or 'launch'", key=f"{key}.url",
               field_name="url" if b.url else "name", **ck)
        _check(not b.url or b.url.startswith(("http://", "https://")), "expected an http(s) URL",
               key=f"{key}.url", field_name="url", **ck)
        _check(not b.launch or "{port}" in " ".join(b.launch),
               "the launch command must contain {port} so passerelle can choose the port",
               key=f"{key}.launch", field_name="launch", **ck)
        program = b.launch[0] if b.launch else ""
        _check(not program or program == CACHED_LLAMA_SERVER or shutil.which(program) is not None,
               f"the program {program!r} is not an executable file or a command on PATH (or "
               f"{CACHED_LLAMA_SERVER!r}, the llama-server `passerelle setup` built)",
               key=f"{key}.launch", field_name="launch", **ck)
        _check(bool(b.models), "list at least one model id this backend serves", key=f"{key}.models",
               field_name="models" if "models" in table else "name", **ck)
        _check(set(b.endpoints) <= set(ENDPOINT_KINDS),
               f"expected a list drawn from {', '.join(ENDPOINT_KINDS)}", key=f"{key}.endpoints",
               field_name="endpoints", **ck)
        _check_routes(b.extra_routes, key=f"{key}.extra_routes", **ck)
        _check(b.max_concurrency >= 0, "expected 0 (from the runtime) or a positive integer",
               key=f"{key}.max_concurrency",
               field_name="max_concurrency", **ck)
        _check(not b.on_demand or bool(b.launch), "on_demand needs a 'launch' command", key=f"{key}.on_demand",
               field_name="on_demand", **ck)
        _check(b.name not in {o.name for o in backends}, f"duplicate backend name '{b.name}'",
               key=f"{key}.name", field_name="name", **ck)
        _check_split(b, key=key, ck=ck)
        shared = [m for m in b.rpc if any(m in o.rpc for o in backends)]
        _check(not shared, f"{shared[0] if shared else ''} is a member of another backend's split: an rpc-server "
               "serves one head at a time", key=f"{key}.rpc", field_name="rpc", **ck)
        backends.append(b)
    backends.extend(upstreams)
    _check_runtimes(sections["runtimes"], file=file, text=text)
    models = _load_models(data.get("models", []), file=file, text=text)
    _check(all(a.strip() for a in sections["embedded"].aliases), "expected model names or globs, none empty",
           file=file, key="embedded.aliases", text=text, header="embedded", field_name="aliases")
    boxes = _load_boxes(data.get("boxes", []), {b.name for b in backends}, file=file, text=text)
    served = {m for b in backends for m in b.models} or ({sections["embedded"].served_id} if not boxes else set())
    names = {m.name for m in models} | served
    for i, m in enumerate(models):
        ck = dict(file=file, text=text, header="models", nth=i)
        # (what other boxes serve is known once they answer: an entry may name it)
        _check(m.target in served or bool(boxes),
               f"no backend serves '{m.target}'; served: {', '.join(sorted(served))}",
               key=f"models[{i}].served_name", field_name="served_name" if m.served_name else "name", **ck)
        known = {b.name for b in backends}
        # (another box's replica is BOX/MODEL: known once the box answers)
        unknown = [n for n in m.backends if n not in known and n.partition("/")[0] not in {x.name for x in boxes}]
        _check(not unknown, f"unknown backend; expected some of {', '.join(sorted(known))}"
               + (" or BOX/MODEL of a [[boxes]] box" if boxes else ""),
               key=f"models[{i}].backends", field_name="backends", **ck)
        missing = [f for f in m.fallbacks if f not in names and not boxes]
        _check(not missing, f"unknown fallback '{missing[0] if missing else ''}'; expected a [[models]] name "
               "or a model a backend serves", key=f"models[{i}].fallbacks", field_name="fallbacks", **ck)
    return Config(server=server, timeouts=timeouts, embedded=sections["embedded"], admin=sections["admin"],
                  metrics=metrics, auth=sections["auth"], scheduler=sections["scheduler"], classes=classes,
                  routing=sections["routing"], sessions=sections["sessions"], runtimes=sections["runtimes"],
                  limits=limits, batches=sections["batches"], tracing=tracing, store=store,
                  backends=tuple(backends), models=models, boxes=boxes,
                  rpc_workers=_load_rpc_workers(data.get("rpc_workers", []), file=file, text=text), source=file)


def _private_host(host: str) -> bool:
    """An address of a private network (or loopback, link-local), or a name of the local network
    (one label, or ending .local, .lan, .internal, .home.arpa): plain http to it stays on the LAN."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "." not in host or host.endswith((".local", ".lan", ".internal", ".home.arpa"))
    return ip.is_private or ip.is_loopback or ip.is_link_local


def _load_boxes(raw: Any, backend_names: set[str], *, file: str, text: str) -> tuple[BoxConfig, ...]:
    """``[[boxes]]``: other boxes' passerelles; each name unique (their replicas are named
    ``NAME/model``), each URL http(s), plain http only to a private address unless allowed."""
    if not isinstance(raw, list):
        raise ConfigError("expected an array of tables ([[boxes]])", file=file, key="boxes")
    out: list[BoxConfig] = []
    for i, table in enumerate(raw):
        b: BoxConfig = _build(BoxConfig, table, file=file, text=text, header="boxes", nth=i)
        key = f"boxes[{i}]"
        ck: dict[str, Any] = dict(file=file, text=text, header="boxes", nth=i)
        _check(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", b.name)),
               "expected a name of letters, digits, '.', '_' or '-' (at most 63)", key=f"{key}.name",
               field_name="name", **ck)
        _check(b.name not in {o.name for o in out} and b.name not in backend_names,
               f"duplicate name '{b.name}' (boxes and backends are named apart)", key=f"{key}.name",
               field_name="name", **ck)
        for name in ("url", "admin_url"):
            url = getattr(b, name)
            if name == "admin_url" and not url:
                continue
            parts = urllib.parse.urlsplit(url)
            _check(parts.scheme in ("http", "https") and bool(parts.hostname), "expected an http(s) URL",
                   key=f"{key}.{name}", field_name=name if name in table else "name", **ck)
            _check(parts.scheme == "https" or b.allow_http or _private_host(parts.hostname or ""),
                   f"plain http to {parts.hostname}, not a private address: the box key would travel in clear; "
                   "use https, or set allow_http = true", key=f"{key}.{name}", field_name=name, **ck)
        _check(bool(b.key), "give the box key (that box's [admin] key): its admin API and health need it",
               key=f"{key}.key", field_name="key" if "key" in table else "name", **ck)
        _check(0.1 <= b.poll_s <= 60, "expected seconds between 0.1 and 60", key=f"{key}.poll_s",
               field_name="poll_s", **ck)
        _check(0.1 <= b.timeout_s <= 30, "expected seconds between 0.1 and 30", key=f"{key}.timeout_s",
               field_name="timeout_s", **ck)
        out.append(b)
    return tuple(out)


def rpc_endpoint(text: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for an IPv6 address) as (host, port); None if it is not one."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", text.strip())
    if m is None:
        return None
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return (host, int(port)) if 0 < int(port) < 65536 else None


def _check_split(b: BackendConfig, *, key: str, ck: dict[str, Any]) -> None:
    """A split head: a llama-server passerelle launches, its members' endpoints, its shares."""
    if not b.rpc:
        _check(not b.rpc_split, "rpc_split needs rpc (the members)", key=f"{key}.rpc_split", field_name="rpc_split",
               **ck)
        return
    _check(b.kind == "llama-server" and bool(b.launch), "rpc needs a llama-server that passerelle launches "
           "(kind = \"llama-server\" and a launch command)", key=f"{key}.rpc", field_name="rpc", **ck)
    bad = [m for m in b.rpc if rpc_endpoint(m) is None]
    _check(not bad, f"expected host:port, got {bad[0] if bad else ''!r}", key=f"{key}.rpc", field_name="rpc", **ck)
    _check(len(set(b.rpc)) == len(b.rpc), "a member is listed twice", key=f"{key}.rpc", field_name="rpc", **ck)
    _check(not {"--rpc", "--tensor-split", "-ts", "-sm", "--split-mode"} & set(b.launch),
           "leave --rpc, --tensor-split and --split-mode out of launch: passerelle adds them from rpc and rpc_split",
           key=f"{key}.launch", field_name="launch", **ck)
    _check(not b.rpc_split or (len(b.rpc_split) >= len(b.rpc) and all(x >= 0 for x in b.rpc_split)
                               and sum(b.rpc_split) > 0),
           "expected one share per member (then one per GPU of this box), none negative",
           key=f"{key}.rpc_split", field_name="rpc_split", **ck)


def _load_rpc_workers(raw: Any, *, file: str, text: str) -> tuple[RpcWorkerConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError("expected an array of tables ([[rpc_workers]])", file=file, key="rpc_workers")
    out: list[RpcWorkerConfig] = []
    for i, table in enumerate(raw):
        w: RpcWorkerConfig = _build(RpcWorkerConfig, table, file=file, text=text, header="rpc_workers", nth=i)
        key = f"rpc_workers[{i}]"
        ck: dict[str, Any] = dict(file=file, text=text, header="rpc_workers", nth=i)
        try:
            address = ipaddress.ip_address(w.host)
        except ValueError:
            raise ConfigError("expected an IP address of this box (rpc-server binds one address)", file=file,
                              key=f"{key}.host", line=_line_of(text, "rpc_workers", "host", i)) from None
        private = (address.is_private or address.is_loopback or address.is_link_local) and not address.is_unspecified
        _check(private or w.allow_public, f"{w.host} is {'every address' if address.is_unspecified else 'public'}: "
               "the RPC protocol has no authentication, so bind it to a private link (or set allow_public = true "
               "behind a firewall of your own)", key=f"{key}.host", field_name="host", **ck)
        _check(0 < w.port < 65536, "expected a port between 1 and 65535", key=f"{key}.port", field_name="port", **ck)
        _check(w.threads >= 0, "expected 0 (rpc-server's default) or a number of threads", key=f"{key}.threads",
               field_name="threads", **ck)
        _check(w.ready_timeout_s > 0, "expected a positive number of seconds", key=f"{key}.ready_timeout_s",
               field_name="ready_timeout_s", **ck)
        _check(not w.rpc_server or shutil.which(w.rpc_server) is not None,
               f"the program {w.rpc_server!r} is not an executable file or a command on PATH",
               key=f"{key}.rpc_server", field_name="rpc_server", **ck)
        _check(w.name not in {o.name for o in out}, f"duplicate rpc worker name '{w.name}'", key=f"{key}.name",
               field_name="name", **ck)
        _check((w.host, w.port) not in {(o.host, o.port) for o in out}, f"{w.host}:{w.port} is taken by another "
               "rpc worker", key=f"{key}.port", field_name="port", **ck)
        out.append(w)
    return tuple(out)


def _check_sessions(s: SessionsConfig, *, file: str, text: str) -> None:
    ck: dict[str, Any] = dict(file=file, text=text, header="sessions")
    _check(0 < s.hold_percentile <= 100, "expected a percentile in (0, 100]", key="sessions.hold_percentile",
           field_name="hold_percentile", **ck)
    for name in ("hold_max_s", "hold_default_s"):
        _check(0 <= getattr(s, name) <= 3600, "expected seconds between 0 and 3600", key=f"sessions.{name}",
               field_name=name, **ck)
    for name in ("save_timeout_s", "restore_timeout_s"):
        _check(0 < getattr(s, name) <= 600, "expected a positive number of seconds, at most 600",
               key=f"sessions.{name}", field_name=name, **ck)
    _check(s.max_saved_bytes >= 0, "expected a size in bytes (0: save nothing)", key="sessions.max_saved_bytes",
           field_name="max_saved_bytes", **ck)
    _check(s.max_saved_files >= 0, "expected a number of files (0: save nothing)", key="sessions.max_saved_files",
           field_name="max_saved_files", **ck)
    _check(s.max_sessions >= 1, "expected at least 1", key="sessions.max_sessions", field_name="max_sessions", **ck)


def _check_batches(b: BatchesConfig, *, file: str, text: str) -> None:
    ck: dict[str, Any] = dict(file=file, text=text, header="batches")
    _check(b.max_file_bytes >= 1024, "expected a size in bytes of at least 1024", key="batches.max_file_bytes",
           field_name="max_file_bytes", **ck)
    _check(b.max_total_bytes >= b.max_file_bytes, "expected at least batches.max_file_bytes",
           key="batches.max_total_bytes", field_name="max_total_bytes", **ck)
    for name in ("max_lines", "in_flight_per_batch", "in_flight_per_key", "line_attempts", "max_batches_per_key",
                 "max_batches_in_progress"):
        _check(getattr(b, name) >= 1, "expected a positive integer", key=f"batches.{name}", field_name=name, **ck)
    _check(b.reserve_slots >= 0, "expected zero or a positive integer", key="batches.reserve_slots",
           field_name="reserve_slots", **ck)
    for name in ("retention_h", "max_window_h"):
        _check(getattr(b, name) > 0, "expected a positive number of hours", key=f"batches.{name}",
               field_name=name, **ck)


def _check_runtimes(rt: RuntimesConfig, *, file: str, text: str) -> None:
    ck: dict[str, Any] = dict(file=file, text=text, header="runtimes")
    _check(rt.max_loaded_gib >= 0, "expected zero (no budget) or a positive number of GiB",
           key="runtimes.max_loaded_gib", field_name="max_loaded_gib", **ck)
    _check(not rt.max_loaded or budget_share(rt.max_loaded) is not None,
           "expected a share of the machine's memory like \"90%\" (above 0, at most 100)",
           key="runtimes.max_loaded", field_name="max_loaded", **ck)
    _check(not (rt.max_loaded and rt.max_loaded_gib), "give one of max_loaded_gib or max_loaded, not both",
           key="runtimes.max_loaded", field_name="max_loaded", **ck)
    _check(rt.memory in MEMORY_KINDS, f"expected one of {', '.join(MEMORY_KINDS)}", key="runtimes.memory",
           field_name="memory", **ck)
    _check(rt.swap_policy in SWAP_POLICIES, f"expected one of {', '.join(SWAP_POLICIES)}",
           key="runtimes.swap_policy", field_name="swap_policy", **ck)
    for name in ("min_resident_s", "drain_timeout_s"):
        _check(getattr(rt, name) >= 0, "expected zero or a positive number of seconds", key=f"runtimes.{name}",
               field_name=name, **ck)


def budget_share(text: str) -> float | None:
    """``"90%"`` → 0.9; None when ``text`` is not a share in (0, 100] %."""
    t = text.strip()
    if not t.endswith("%"):
        return None
    try:
        share = float(t[:-1]) / 100
    except ValueError:
        return None
    return share if 0 < share <= 1 else None


_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}
_JSON_SCALAR = (str, int, float, bool)


def _json_value(value: Any) -> bool:
    """Can ``value`` (from TOML) go into a JSON request body? (TOML dates cannot.)"""
    if isinstance(value, _JSON_SCALAR):
        return True
    if isinstance(value, list):
        return all(_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(v) for k, v in value.items())
    return False


def _load_models(raw: Any, *, file: str, text: str) -> tuple[ModelConfig, ...]:
    """``[[models]]``: the catalogue of public model names (see :class:`ModelConfig`)."""
    if not isinstance(raw, list):
        raise ConfigError("expected an array of tables ([[models]])", file=file, key="models")
    out: list[ModelConfig] = []
    for i, table in enumerate(raw):
        key = f"models[{i}]"
        ck: dict[str, Any] = dict(file=file, text=text, header="models", nth=i)
        tables = {k: table.pop(k) for k in ("defaults", "set", "cap") if k in table}
        m: ModelConfig = _build(ModelConfig, table, file=file, text=text, header="models", nth=i)
        parsed: dict[str, Any] = {}
        for name, value in tables.items():
            _check(isinstance(value, dict) and _json_value(value),
                   "expected a table of request keys and JSON values, e.g. { temperature = 0.2 }",
                   key=f"{key}.{name}", field_name=name, **ck)
            if name == "cap":
                _check(all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value.values()),
                       "expected non-negative numbers, e.g. { max_tokens = 1024 }", key=f"{key}.cap",
                       field_name="cap", **ck)
            _check("model" not in value, "'model' is set by served_name, not here", key=f"{key}.{name}",
                   field_name=name, **ck)
            parsed[name] = tuple(value.items())
        m = dataclasses.replace(m, **parsed)
        _check(bool(m.name.strip()) and not any(c in m.name for c in "*?["),
               "expected a non-empty name without glob characters", key=f"{key}.name", field_name="name", **ck)
        _check("model" not in m.strip, "'model' cannot be stripped", key=f"{key}.strip", field_name="strip", **ck)
        bad = [c for c in m.capabilities if c not in CAPABILITIES]
        _check(not bad, f"unknown capability {bad[0] if bad else ''!r}; expected some of {', '.join(CAPABILITIES)}",
               key=f"{key}.capabilities", field_name="capabilities", **ck)
        _check(m.context_length >= 0, "expected a positive number of tokens", key=f"{key}.context_length",
               field_name="context_length", **ck)
        _check(m.tools in TOOLS_MODES, f"expected one of {', '.join(TOOLS_MODES)}", key=f"{key}.tools",
               field_name="tools", **ck)
        _check(m.embed_batch >= 1, "expected at least 1 input per request", key=f"{key}.embed_batch",
               field_name="embed_batch", **ck)
        _check(m.tool_calls in TOOL_CALL_FORMATS, f"expected one of {', '.join(TOOL_CALL_FORMATS)}",
               key=f"{key}.tool_calls", field_name="tool_calls", **ck)
        taken = {n for o in out for n in (o.name, *o.aliases)}
        clash = next((n for n in (m.name, *m.aliases) if n in taken), None)
        where = "name" if clash == m.name else "aliases"
        _check(clash is None, f"the name '{clash}' is already used by another model", key=f"{key}.{where}",
               field_name=where, **ck)
        _check(m.name not in m.fallbacks, "a model cannot be its own fallback", key=f"{key}.fallbacks",
               field_name="fallbacks", **ck)
        out.append(m)
    return tuple(out)


def _check_client_limits(server: ServerConfig, *, file: str, text: str) -> None:
    ck: dict[str, Any] = dict(file=file, text=text, header="server")
    _check(server.max_head_bytes >= 4096, "expected at least 4096 bytes", key="server.max_head_bytes",
           field_name="max_head_bytes", **ck)
    _check(server.max_headers >= 16, "expected at least 16", key="server.max_headers", field_name="max_headers", **ck)
    for name in ("head_timeout_s", "body_timeout_s", "keep_alive_s"):
        _check(getattr(server, name) > 0, "expected a positive number of seconds", key=f"server.{name}",
               field_name=name, **ck)
    _check(server.shutdown_grace_s >= 0, "expected zero or a positive number of seconds",
           key="server.shutdown_grace_s", field_name="shutdown_grace_s", **ck)
    _check(server.max_connections >= 16, "expected at least 16", key="server.max_connections",
           field_name="max_connections", **ck)


def _check_routes(routes: tuple[str, ...], *, file: str, text: str, header: str, key: str, nth: int = 0) -> None:
    for route in routes:
        _check(route.startswith("/") and "?" not in route and "#" not in route and " " not in route,
               f"expected a path such as /v1/score, got {route!r}", file=file, key=key, text=text, header=header,
               field_name="extra_routes", nth=nth)
        _check(not is_management_route(route),
               f"{route} is (or looks like) a runtime's management route; passerelle never forwards those",
               file=file, key=key, text=text, header=header, field_name="extra_routes", nth=nth)


def _check_admin(admin: AdminConfig, server: ServerConfig, *, file: str, text: str) -> None:
    ck: dict[str, Any] = dict(file=file, text=text, header="admin")
    for net in server.trusted_proxies:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise ConfigError(f"expected an address or network like 127.0.0.1 or 10.0.0.0/8, got {net!r}",
                              key="server.trusted_proxies", line=_line_of(text, "server", "trusted_proxies"),
                              file=file) from None
    for net in admin.allow:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise ConfigError(f"expected an address or network like 127.0.0.0/8 or ::1, got {net!r}",
                              key="admin.allow", line=_line_of(text, "admin", "allow"), file=file) from None
    _check(0 <= admin.port < 65536, "expected 0 (the main port) or a port between 1 and 65535",
           key="admin.port", field_name="port", **ck)
    _check(admin.port != server.port, "the admin port must differ from server.port", key="admin.port",
           field_name="port", **ck)
    _check(admin.key == admin.key.strip(), "the key must not start or end with spaces", key="admin.key",
           field_name="key", **ck)
    for name in admin.hosts:
        _check(bool(name) and (name == "*" or re.fullmatch(r"[A-Za-z0-9.\-_]+", name) is not None),
               f"expected a host name like gpu.example.org (no port, no scheme) or \"*\", got {name!r}",
               key="admin.hosts", field_name="hosts", **ck)


MIN_ADMIN_KEY_CHARS = 16
# Placeholders of examples and docs (lower case, letters and digits only): a key containing one is
# a copied example, whatever its length.
_EXAMPLE_KEYS = ("changeme", "replaceme", "yourkey", "youradminkey", "adminkey", "example", "placeholder",
                 "password", "generateone", "opensslrand")


def admin_key_weakness(key: str) -> str | None:
    """Why ``key`` is too weak for ``[admin] key`` (None: it is not, or it is unset). The admin key
    opens every tenant's traffic and batches, and a guesser may try it at the throttle's rate for
    as long as they like: too short, too little variety (one character, a repeated unit, a run like
    ``abcdef…``), an example's placeholder (``change-me-admin``), or the shape of an API key."""
    if not key:
        return None
    plain = re.sub(r"[^a-z0-9]", "", key.lower())
    for word in _EXAMPLE_KEYS:
        if word in plain:
            return f"contains {word!r}, a placeholder of examples"
    if len(key) < MIN_ADMIN_KEY_CHARS:
        return f"is shorter than {MIN_ADMIN_KEY_CHARS} characters ({len(key)})"
    if key.startswith("psk_"):
        return "has the shape of an API key (psk_…), which the Batch API would take for one"
    if len(set(key)) < 5:
        return f"uses only {len(set(key))} different characters"
    if any(key == (key[:n] * (len(key) // n + 1))[:len(key)] for n in range(1, len(key) // 2 + 1)):
        return "repeats a shorter part"
    steps = sum(abs(ord(b) - ord(a)) <= 1 for a, b in itertools.pairwise(key))
    if steps >= 0.75 * (len(key) - 1):
        return "is mostly a run of neighbouring characters (like abcdef or 1234)"
    return None


def _check_admin_key(key: str, env: Mapping[str, str], *, file: str, text: str) -> None:
    why = admin_key_weakness(key)
    if why is None:
        return
    message = (f"the admin key {why}; it opens every tenant's traffic and batches, so it must be hard to guess. "
               "Generate one with: openssl rand -hex 24")
    if env.get("PASSERELLE_ADMIN_KEY") is not None:
        raise ConfigError(message, file="environment", key="PASSERELLE_ADMIN_KEY")
    raise ConfigError(message, file=file, key="admin.key", line=_line_of(text, "admin", "key"))


def _load_classes(raw: Any, auth: AuthConfig, *, file: str, text: str, preemption: bool = True
                  ) -> tuple[ClassConfig, ...]:
    """``[[classes]]`` entries replace the default class of the same name or add a class. An
    entry that does not say ``preemptible`` keeps the default class's (batch: true)."""
    if not isinstance(raw, list):
        raise ConfigError("expected an array of tables ([[classes]])", file=file, key="classes")
    by_name = {c.name: c for c in DEFAULT_CLASSES}
    if not preemption:
        by_name["batch"] = dataclasses.replace(by_name["batch"], slot_share=BATCH_SLOT_SHARE_WITHOUT_PREEMPTION)
    for i, table in enumerate(raw):
        c: ClassConfig = _build(ClassConfig, table, file=file, text=text, header="classes", nth=i)
        if "preemptible" not in table and c.name in by_name:
            c = dataclasses.replace(c, preemptible=by_name[c.name].preemptible)
        ck: dict[str, Any] = dict(file=file, text=text, header="classes", nth=i)
        _check(c.max_queue > 0, "expected a positive integer", key=f"classes[{i}].max_queue",
               field_name="max_queue", **ck)
        _check(c.max_queue_wait_s > 0, "expected a positive number of seconds", key=f"classes[{i}].max_queue_wait_s",
               field_name="max_queue_wait_s", **ck)
        _check(0 < c.slot_share <= 1, "expected a fraction in (0, 1]", key=f"classes[{i}].slot_share",
               field_name="slot_share", **ck)
        _check(c.session_wait_s >= 0, "expected zero or a positive number of seconds",
               key=f"classes[{i}].session_wait_s", field_name="session_wait_s", **ck)
        by_name[c.name] = c
    for key in ("anonymous_priority", "anonymous_max_priority", "task_priority"):
        _check(getattr(auth, key) in by_name, f"expected one of the classes: {', '.join(by_name)}",
               file=file, key=f"auth.{key}", text=text, header="auth", field_name=key)
    return tuple(sorted(by_name.values(), key=lambda c: c.rank))


def with_server(cfg: Config, **changes: Any) -> Config:
    """A copy of ``cfg`` with ``[server]`` fields replaced (command-line flags win over the file)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **changes))
