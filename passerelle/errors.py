"""passerelle's one exception tree, and the one enum of termination causes.

Every request ends in exactly one :class:`Cause`, written in the access log and counted in
``passerelle_requests_total{cause}``. Every error a client can see is a :class:`GatewayError`
rendered in OpenAI's shape ``{"error": {"message", "type", "code"}}``.

    PasserelleError                  base of everything raised on purpose
    ├── ConfigError                  bad configuration; names file, key and line
    └── GatewayError                 ends a request; carries HTTP status, OpenAI type and cause
        ├── InvalidRequest           400 invalid_request_error        cause invalid_request
        │   ├── UnknownModel         404 model_not_found              cause invalid_request
        │   ├── KeyNotFound          404 key_not_found                cause invalid_request
        │   ├── InputTooLong         400 context_length_exceeded      cause invalid_request
        │   └── BodyTooLarge         413 request_too_large            cause invalid_request
        ├── Unauthorized             401 invalid_api_key              cause unauthorized
        │   └── KeyExpired           401 expired_api_key              cause unauthorized
        ├── Forbidden                403 forbidden                    cause forbidden
        │   └── ModelNotAllowed      403 model_not_allowed            cause forbidden
        ├── RateLimited              429 rate_limit_exceeded          cause rate_limited
        ├── QuotaExceeded            429 quota_exceeded               cause quota_exceeded
        ├── QueueFull                429 queue_full                   cause queue_full
        ├── QueueTimeout             429 queue_timeout                cause queue_timeout
        ├── NoBackend                503 no_backend                   cause no_backend
        ├── AnswersBusy              503 answers_busy                 cause answers_busy
        ├── StoreUnavailable         503 store_unavailable            cause store_unavailable
        ├── Standby                  503 standby                      cause standby
        ├── UpstreamError            502 upstream_error               cause upstream_error
        │   ├── UpstreamStatus       the runtime's own 4xx/5xx answer, status passed through
        │   ├── UpstreamTooLarge     502 upstream_too_large (a cap)   cause upstream_error
        │   └── UpstreamTimeout      504 upstream_timeout             cause upstream_timeout
        ├── InternalError            500 internal_error               cause internal_error
        ├── ClientDisconnect         (nobody to answer; 499 in logs)  cause client_disconnect
        └── ClientTimeout            (the client stopped reading; 499) cause client_timeout

Example::

    >>> err = UnknownModel("gpt-9", ["gemma-3-270m"])
    >>> err.status, err.cause.value
    (404, 'invalid_request')
"""

from __future__ import annotations

import enum

import orjson


class Cause(enum.StrEnum):
    """Why a request ended. Exactly one per request."""

    OK = "ok"
    CLIENT_DISCONNECT = "client_disconnect"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    QUEUE_TIMEOUT = "queue_timeout"
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"
    INVALID_REQUEST = "invalid_request"
    NO_BACKEND = "no_backend"
    FORBIDDEN = "forbidden"  # a valid key, not allowed this (e.g. a model outside its allow-list)
    QUOTA_EXCEEDED = "quota_exceeded"  # a key's token quota for the day / week / month is used up
    SHUTDOWN = "shutdown"  # cut short: the gateway stopped past server.shutdown_grace_s
    INTERNAL_ERROR = "internal_error"  # a fault of the gateway itself, never blamed on the runtime
    CLIENT_TIMEOUT = "client_timeout"  # the client stopped reading: the gateway cut the connection
    SERVER_BUSY = "server_busy"  # the gateway's own capacity (bodies held at once), not a model's queue
    ANSWERS_BUSY = "answers_busy"  # answers being assembled at once hold [limits] max_answer_bytes_total
    TENANT_QUEUE_FULL = "tenant_queue_full"  # the tenant holds its share of a class's queue while others wait
    SESSION_LIMIT = "session_limit"  # the session already has [routing] max_session_in_flight requests running
    STORE_UNAVAILABLE = "store_unavailable"  # the shared key store away for longer than [store] offline_s
    STANDBY = "standby"  # this gateway is the standby of an active-passive pair ([store] active_passive)



# The most characters of a client's own string (a model name, a path, a header's value) that an
# error message repeats: a 1 MB model name is not echoed back whole.
ECHO_CHARS = 100


def clip(text: object, limit: int = ECHO_CHARS) -> str:
    """A client's string as an error message may show it: control characters escaped, at most
    ``limit`` characters, the rest cut with an ellipsis.

    >>> clip("gpt-4o"), clip("x" * 500, 8)
    ('gpt-4o', 'xxxxxxx…')
    """
    s = text if isinstance(text, str) else str(text)
    cut = len(s) > limit
    s = s[:limit]
    if not s.isprintable():
        s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
        cut = cut or len(s) > limit
    return s[:limit - 1] + "…" if cut else s


class PasserelleError(Exception):
    """Base of every error passerelle raises on purpose."""


class ConfigError(PasserelleError):
    """A configuration that cannot be used; the message names the file, the key and the line."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None) -> None:
        where = ":".join(str(p) for p in (file, line) if p is not None)
        prefix = f"{where}: " if where else ""
        keypart = f"key '{key}': " if key else ""
        super().__init__(f"{prefix}{keypart}{message}")
        self.file, self.key, self.line = file, key, line


class GatewayError(PasserelleError):
    """An error that ends a request and is shown to its client in OpenAI's error shape."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    cause = Cause.INTERNAL_ERROR

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type, "code": self.code}})

    def sse_event(self) -> bytes:
        """The error as one SSE event, sent when a stream cannot be finished."""
        return b"data: " + self.body() + b"\n\n"

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return [(b"retry-after", str(max(1, int(-(-self.retry_after // 1)))).encode())]


class InvalidRequest(GatewayError):
    status, type, code, cause = 400, "invalid_request_error", "invalid_request", Cause.INVALID_REQUEST

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputTooLong(InvalidRequest):
    """An input longer than the runtime takes at once: an embedding's or a rerank document's is
    never split, so its whole length must fit the runtime's context (llama-server: its physical
    batch). llama-server answers that with a 500 of its own; it is the client's input that is too long."""

    code = "context_length_exceeded"

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"The input is {tokens} tokens, more than the {limit} tokens this model's runtime takes "
                         "in one input; shorten it or split it.", param="input")
        self.tokens, self.limit = tokens, limit


def encode_request(data: object) -> bytes:
    """A client's JSON, changed by the gateway (a model alias, parameter rules, the usage option, a
    stream asked for instead, a continuation), as bytes again. orjson writes 254 levels of nesting
    and reads 1,024: a request nested deeper than the gateway can write is the client's error (400),
    never the gateway's (the same request passes untouched where the gateway changes nothing)."""
    try:
        return orjson.dumps(data)
    except TypeError:  # (parsed JSON holds nothing else orjson cannot write)
        raise InvalidRequest("The request's JSON is nested too deeply for the gateway to rewrite it "
                             "(at most 254 levels).") from None


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


class MethodNotAllowed(InvalidRequest):
    status, code = 405, "method_not_allowed"


class UnknownModel(InvalidRequest):
    status, code = 404, "model_not_found"

    def __init__(self, model: str, served: list[str]) -> None:
        listed = ", ".join(served) if served else "none"
        super().__init__(f"The model '{clip(model)}' does not exist here. Models served: {listed}.", param="model")


class KeyNotFound(InvalidRequest):
    status, code = 404, "key_not_found"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"No active API key with id '{clip(key_id)}'; GET /admin/keys or 'passerelle keys list' "
                         "lists them.", param="id")


class BodyTooLarge(InvalidRequest):
    status, code = 413, "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body is larger than the limit of {limit} bytes.")


class Unauthorized(GatewayError):
    status, type, code, cause = 401, "invalid_request_error", "invalid_api_key", Cause.UNAUTHORIZED


class KeyExpired(Unauthorized):
    code = "expired_api_key"


class BadForwardedUser(Unauthorized):
    """A trusted front-end's signed user token that does not verify (proxy/frontend.py)."""

    code = "invalid_user_token"


class Forbidden(GatewayError):
    status, type, code, cause = 403, "permission_error", "forbidden", Cause.FORBIDDEN


class ModelNotAllowed(Forbidden):
    code = "model_not_allowed"

    def __init__(self, model: str, allowed: tuple[str, ...] | list[str]) -> None:
        super().__init__(f"This API key may not use the model '{clip(model)}'. "
                         f"Models it may use: {', '.join(allowed)}.")


class RateLimited(GatewayError):
    status, type, code, cause = 429, "rate_limit_error", "rate_limit_exceeded", Cause.RATE_LIMITED


class QuotaExceeded(GatewayError):
    """A key's token quota over a long window is used up; ``Retry-After`` is the window's end.

    The type is OpenAI's ``insufficient_quota`` (clients that know it do not retry at once)."""

    status, type, code, cause = 429, "insufficient_quota", "quota_exceeded", Cause.QUOTA_EXCEEDED


class QueueFull(GatewayError):
    status, type, code, cause = 429, "rate_limit_error", "queue_full", Cause.QUEUE_FULL


class TenantQueueFull(GatewayError):
    """The tenant holds its share (``[scheduler] tenant_queue_share``) of a class's queue while other
    tenants' requests wait, or a newcomer took the place of its newest queued request."""

    status, type, code, cause = 429, "rate_limit_error", "tenant_queue_full", Cause.TENANT_QUEUE_FULL


class SessionLimit(GatewayError):
    status, type, code, cause = 429, "rate_limit_error", "session_limit", Cause.SESSION_LIMIT


class QueueTimeout(GatewayError):
    status, type, code, cause = 429, "rate_limit_error", "queue_timeout", Cause.QUEUE_TIMEOUT


class NoBackend(GatewayError):
    status, type, code, cause = 503, "server_error", "no_backend", Cause.NO_BACKEND


class StoreUnavailable(GatewayError):
    """The shared key store ([store] url) has been out of reach for longer than ``[store] offline_s``:
    the keys last read are no longer trusted (one may have been revoked since)."""

    status, type, code, cause = 503, "server_error", "store_unavailable", Cause.STORE_UNAVAILABLE


class Standby(GatewayError):
    """This gateway is the standby of an active-passive pair: another one holds the lock and serves."""

    status, type, code, cause = 503, "server_error", "standby", Cause.STANDBY


class AnswersBusy(GatewayError):
    """The answers the gateway assembles from streams at once would hold more than ``[limits]
    max_answer_bytes_total``: the gateway's own memory is the limit, not the runtime (cause
    ``answers_busy``; its runtime connection is closed, so the runtime stops generating)."""

    status, type, code, cause = 503, "server_error", "answers_busy", Cause.ANSWERS_BUSY

    def __init__(self, limit: int) -> None:
        super().__init__(f"The gateway already holds {limit} bytes of answers being assembled "
                         "([limits] max_answer_bytes_total); retry shortly.", retry_after=1)


class UpstreamError(GatewayError):
    status, type, code, cause = 502, "server_error", "upstream_error", Cause.UPSTREAM_ERROR

    def __init__(self, message: str, *, retryable: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        # True when the runtime could not take the request (unreachable, broke before answering,
        # 503/429): another replica may, if the client has received nothing yet.
        self.retryable = retryable


class UpstreamTooLarge(UpstreamError):
    """What the runtime sent is larger than a cap of ``[limits]``; the message names the cap.

    Example::

        >>> UpstreamTooLarge("answer", 64, "max_answer_bytes").message
        "The model runtime's answer is larger than the gateway's limit of 64 bytes ([limits] max_answer_bytes)."
    """

    code = "upstream_too_large"

    def __init__(self, what: str, limit: int, setting: str) -> None:
        super().__init__(f"The model runtime's {what} is larger than the gateway's limit of {limit} bytes "
                         f"([limits] {setting}).")
        self.setting = setting


class UpstreamTimeout(UpstreamError):
    """A deadline of the request passed while the runtime had the turn: ``phase`` is which one
    (connect, first token, between tokens, total). Only a connect timeout may be retried on another
    replica: the runtime never saw the request."""

    status, type, code, cause = 504, "server_error", "upstream_timeout", Cause.UPSTREAM_TIMEOUT

    def __init__(self, phase: str, seconds: float, *, detail: str = "", retryable: bool = False) -> None:
        more = f"; {detail}" if detail else ""
        super().__init__(f"The model runtime did not answer in time ({phase} timeout of {seconds:g} s{more}).",
                         retryable=retryable)
        self.phase = phase


class UpstreamStatus(UpstreamError):
    """The runtime answered with a non-2xx status; its status and body are passed to the client.

    A 4xx from the runtime is the client's fault (e.g. a prompt longer than the context), so it
    counts as ``invalid_request``; a 5xx as ``upstream_error``.
    """

    def __init__(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        super().__init__(f"upstream answered HTTP {status}")
        self.status = status
        self.raw = body
        self.content_type = content_type
        self.cause = Cause.INVALID_REQUEST if 400 <= status < 500 else Cause.UPSTREAM_ERROR
        self.retryable = status in (429, 503)

    @property
    def is_json(self) -> bool:
        """Is the runtime's body a JSON object (then it may be passed on as it is)?"""
        try:
            return isinstance(orjson.loads(self.raw), dict)
        except orjson.JSONDecodeError:
            return False

    def body(self) -> bytes:
        if self.raw.lstrip().startswith(b'{"error"') and self.is_json:
            return self.raw
        text = self.raw.decode("utf-8", "replace").strip()[:2000] or f"HTTP {self.status}"
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return orjson.dumps({"error": {"message": text, "type": kind, "code": f"upstream_{self.status}"}})


class InternalError(GatewayError):
    """A fault of the gateway itself (a bug): logged with its traceback, never blamed on the runtime."""

    status, type, code, cause = 500, "server_error", "internal_error", Cause.INTERNAL_ERROR


class ClientDisconnect(GatewayError):
    status, type, code, cause = 499, "client_error", "client_disconnect", Cause.CLIENT_DISCONNECT


class ClientTimeout(GatewayError):
    """The client accepted no byte for ``[timeouts] client_write_s`` while the gateway had some to
    send: its connection is cut (nobody is told; 499 in the logs)."""

    status, type, code, cause = 499, "client_error", "client_timeout", Cause.CLIENT_TIMEOUT
