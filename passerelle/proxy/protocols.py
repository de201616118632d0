"""What the gateway knows about each inference API it forwards: one :class:`Api` per endpoint.

The body goes to the runtime untouched; the gateway reads only the few fields it acts on (the
model it routes by, whether the answer streams, the token budget it charges limits and fair share
with) and checks only what it relies on. Each API also says (these first five from
``passerelle/endpoints.py``, the one list of endpoints, with their public paths):

* ``upstream``: the runtime's path (aliases such as ``/rerank`` all go to ``/v1/rerank``);
* ``grammar``: how its stream speaks (grammars.py): OpenAI chunks, Responses events, Anthropic
  Messages events, llama-server's native chunks, transcription events;
* ``scheduled``: it occupies a runtime slot, so it queues for one (tokenize and token counting
  do not: they run beside generation, at once);
* ``errors``: the shape of the errors the gateway itself sends: OpenAI's
  ``{"error": {"message", "type", "code"}}`` or Anthropic's
  ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's error types;
* ``collect``: for runtimes that notice a departed client only while streaming (llama-server), a
  non-streaming request is asked as a stream and assembled in the gateway, so the slot frees at
  once when the client leaves.

Example::

    >>> api = API["messages"]
    >>> req = api.parse(b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}', None)
    >>> (req.model, req.stream, req.max_tokens, api.upstream)
    ('m', False, 5, '/v1/messages')
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

# (the error shapes re-exported: the gateway's modules name them from here)
from passerelle.endpoints import ANTHROPIC as ANTHROPIC
from passerelle.endpoints import ENDPOINTS, Endpoint
from passerelle.endpoints import OPENAI as OPENAI
from passerelle.errors import GatewayError, InvalidRequest, UpstreamStatus


@dataclass(slots=True)
class Parsed:
    """The fields of one request that the gateway acts on."""

    model: str | None
    stream: bool = False
    max_tokens: int | None = None
    user: str | None = None
    data: dict[str, Any] | None = None  # the JSON body; None for a multipart form


@dataclass(frozen=True, slots=True)
class Api:
    name: str
    upstream: str
    grammar: str = "chat"
    required: tuple[str, ...] = ()
    scheduled: bool = True
    can_stream: bool = True
    errors: str = OPENAI
    form: bool = False  # multipart/form-data (audio): the model is the form's `model` field
    model_optional: bool = False  # llama-server's own routes: the model may be left out when one model serves them
    collect: bool = False
    generates: bool = True  # produces output tokens (estimated from its token budget)
    budget: tuple[str, ...] = ("max_completion_tokens", "max_tokens")  # fields bounding the output

    def parse(self, body: bytes, content_type: str | None) -> Parsed:
        """Validate what the gateway relies on; everything else is the runtime's business."""
        if self.form:
            return _parse_form(body, content_type)
        data = _json_object(body)
        model = data.get("model")
        if model is None:
            if not self.model_optional:
                raise InvalidRequest("Missing required parameter: 'model'.", param="model")
        elif not isinstance(model, str) or not model:
            raise InvalidRequest("'model' must be a non-empty string.", param="model")
        for name in self.required:
            if data.get(name) is None:
                raise InvalidRequest(f"Missing required parameter: '{name}'.", param=name)
        _check_fields(self.name, data)
        stream = bool(data.get("stream")) and self.can_stream
        budget = next((data[k] for k in self.budget if data.get(k) is not None), None)
        user = data.get("user")
        return Parsed(model=model, stream=stream, max_tokens=budget, user=user, data=data)


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return data


# (built once: _check_fields runs on every request; a union like ``bool | None`` written in a call
# is a new object each time, and isinstance with a tuple is the faster test)
_TEXT_FIELD = {"completions": "prompt", "embeddings": "input", "responses": "input"}
_STR_OR_LIST = (str, list)
_BOOL_OR_NONE = (bool, type(None))
_COUNTS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "n", "best_of")


def _check_fields(endpoint: str, data: dict[str, Any]) -> None:
    if endpoint in ("chat", "messages", "count_tokens", "apply_template"):
        value = data.get("messages")
        if value is not None and (not isinstance(value, list) or not value
                                  or not all(isinstance(m, dict) for m in value)):
            raise InvalidRequest("'messages' must be a non-empty array of message objects.", param="messages")
    text = _TEXT_FIELD.get(endpoint)
    if text is not None and text in data and not isinstance(data[text], _STR_OR_LIST):
        raise InvalidRequest(f"'{text}' must be a string or an array.", param=text)
    if endpoint == "rerank":
        docs = data.get("documents", data.get("texts"))
        if not isinstance(docs, list) or not docs:
            raise InvalidRequest("'documents' must be a non-empty array.", param="documents")
    if "stream" in data and not isinstance(data["stream"], _BOOL_OR_NONE):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    for key in _COUNTS:
        v = data.get(key)
        if v is None:
            continue
        if key == "n_predict" and v == -1:  # llama-server: no limit
            continue
        least = 1 if key in ("n", "best_of") else 0  # (how many sequences: admission counts each)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise InvalidRequest(f"'{key}' must be {'a positive' if least else 'a non-negative'} integer.",
                                 param=key)
    so = data.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string.", param="user")


# -- multipart forms (audio) -------------------------------------------------------------------
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.I)
_NAME = re.compile(rb'\bname="([^"]*)"', re.I)
_MAX_HEAD = 4096  # a part's headers; a longer head is not a field the gateway reads


class FormPart(NamedTuple):
    name: str
    is_file: bool
    start: int  # the value's first byte in the body
    end: int  # one past its last byte (the CRLF before the next delimiter is not the value's)


def form_parts(body: bytes, content_type: str | None) -> Iterator[FormPart]:
    """The parts of a multipart/form-data body, in order, found by scanning for the boundary: no
    part is copied, whatever the size of the file in it.

    Example::

        >>> body = b'--b\\r\\nContent-Disposition: form-data; name="model"\\r\\n\\r\\nwhisper\\r\\n--b--\\r\\n'
        >>> [(p.name, body[p.start:p.end]) for p in form_parts(body, "multipart/form-data; boundary=b")]
        [('model', b'whisper')]
    """
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Expected a multipart/form-data body (Content-Type: multipart/form-data; boundary=...).")
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise InvalidRequest("The multipart Content-Type has no boundary.")
    delimiter = b"--" + m.group(1).encode("latin-1")
    pos = body.find(delimiter)
    while pos != -1:
        start = pos + len(delimiter)
        pos = body.find(delimiter, start)
        end = len(body) if pos == -1 else pos
        head_end = body.find(b"\r\n\r\n", start, min(end, start + _MAX_HEAD + 4))
        if head_end == -1:
            continue  # the closing delimiter, or a part without a head the gateway can read
        head = body[start:head_end]
        disposition = next((line for line in head.split(b"\r\n") if line.lower().startswith(b"content-disposition")),
                           b"")
        name = _NAME.search(disposition)
        if name is None:
            continue
        value_end = end - 2 if end - 2 >= head_end + 4 and body.startswith(b"\r\n", end - 2) else end
        yield FormPart(name.group(1).decode("utf-8", "replace"), b"filename=" in disposition.lower(), head_end + 4,
                       value_end)


def form_fields(body: bytes, content_type: str | None, names: tuple[str, ...]) -> dict[str, str]:
    """The small text fields ``names`` of a multipart/form-data body (file parts are skipped; the
    first of a repeated field counts).

    Example::

        >>> body = b'--b\\r\\nContent-Disposition: form-data; name="model"\\r\\n\\r\\nwhisper\\r\\n--b--\\r\\n'
        >>> form_fields(body, 'multipart/form-data; boundary=b', ("model",))
        {'model': 'whisper'}
    """
    out: dict[str, str] = {}
    for part in form_parts(body, content_type):
        if not part.is_file and part.name in names and part.name not in out:
            out[part.name] = body[part.start:min(part.end, part.start + 1024)].decode("utf-8", "replace")
    return out


def replace_form_field(body: bytes, content_type: str | None, name: str, value: str) -> bytes:
    """``body`` with the value of its text field ``name`` replaced by ``value``, every other byte
    as it was (the file parts are neither parsed nor decoded): the model catalogue's rewrite of an
    upload's ``model``. One copy of the body, which the gateway has read whole, within
    ``max_upload_bytes``.

    Example::

        >>> body = b'--b\\r\\nContent-Disposition: form-data; name="model"\\r\\n\\r\\nwhisper-1\\r\\n--b--\\r\\n'
        >>> replace_form_field(body, "multipart/form-data; boundary=b", "model", "large-v3")
        b'--b\\r\\nContent-Disposition: form-data; name="model"\\r\\n\\r\\nlarge-v3\\r\\n--b--\\r\\n'
    """
    part = next((p for p in form_parts(body, content_type) if p.name == name and not p.is_file), None)
    if part is None:
        raise InvalidRequest(f"Missing required form field: '{name}'.", param=name)
    view = memoryview(body)
    return b"".join((view[:part.start], value.encode(), view[part.end:]))


def _parse_form(body: bytes, content_type: str | None) -> Parsed:
    fields = form_fields(body, content_type, ("model", "stream"))
    model = fields.get("model", "").strip()
    if not model:
        raise InvalidRequest("Missing required form field: 'model'.", param="model")
    if sum(1 for p in form_parts(body, content_type) if p.name == "model" and not p.is_file) > 1:
        # the gateway routes by the first; a runtime may read the last
        raise InvalidRequest("The form has more than one 'model' field.", param="model")
    return Parsed(model=model, stream=fields.get("stream", "").strip().lower() == "true")


# -- the APIs ----------------------------------------------------------------------------------
# How each endpoint's body is read; its paths, grammar, error shape and scheduling are endpoints.py's.
_PARSING: dict[str, dict[str, Any]] = {
    "chat": dict(required=("messages",), collect=True),
    "completions": dict(required=("prompt",), collect=True),
    "embeddings": dict(required=("input",), can_stream=False),
    # (Responses' `input` may be left out, e.g. with a stored prompt: the runtime decides)
    "responses": dict(collect=True, budget=("max_output_tokens",)),
    "responses_input_tokens": dict(can_stream=False),
    "messages": dict(required=("messages",), collect=True),
    "count_tokens": dict(required=("messages",), can_stream=False),
    "rerank": dict(required=("query",), can_stream=False),
    "tokenize": dict(can_stream=False, model_optional=True),
    "detokenize": dict(required=("tokens",), can_stream=False, model_optional=True),
    "apply_template": dict(required=("messages",), can_stream=False, model_optional=True),
    "infill": dict(required=("input_prefix", "input_suffix"), model_optional=True, collect=True,
                   budget=("n_predict", "max_tokens")),
    "transcriptions": dict(form=True),
}


def _api(e: Endpoint) -> Api:
    return Api(e.name, e.upstream, e.grammar, scheduled=e.scheduled, errors=e.errors, generates=e.generates,
               **_PARSING.get(e.name, {}))


API: dict[str, Api] = {e.name: _api(e) for e in ENDPOINTS}


def passthrough(path: str) -> Api:
    """An operator-added route (``extra_routes``): forwarded as is, scheduled, any stream relayed."""
    return Api(path, path, "generic")


def api_for(endpoint: str) -> Api:
    return API.get(endpoint) or passthrough(endpoint)


# -- error shapes ------------------------------------------------------------------------------
# Anthropic's error types by HTTP status (its SDKs pick the exception class by the status).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")


def _message_of(err: GatewayError) -> str:
    """The message to show: the runtime's own for an error it answered, else the gateway's."""
    if isinstance(err, UpstreamStatus):
        try:
            obj = orjson.loads(err.raw)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            inner = obj.get("error")
            msg = inner.get("message") if isinstance(inner, dict) else inner if isinstance(inner, str) else None
            msg = msg or obj.get("message") or obj.get("detail")
            if isinstance(msg, str) and msg:
                return msg
        return err.raw.decode("utf-8", "replace").strip()[:2000] or f"HTTP {err.status}"
    return err.message


def anthropic_body(err: GatewayError) -> bytes:
    """``err`` in Anthropic's error shape; a runtime's answer already in that shape passes as is."""
    if isinstance(err, UpstreamStatus) and re.match(rb'\s*\{\s*"type"\s*:\s*"error"', err.raw) and err.is_json:
        return err.raw
    return orjson.dumps({"type": "error", "error": {"type": anthropic_type(err.status), "message": _message_of(err)}})


def error_body(err: GatewayError, style: str) -> tuple[bytes, bytes]:
    """The error response body for ``err`` and its content type, in the API's shape: always JSON
    (a runtime's error page, say ``text/html``, is wrapped, and its content type stays behind)."""
    return (anthropic_body(err) if style == ANTHROPIC else err.body()), b"application/json"
