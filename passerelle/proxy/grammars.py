"""How each API's event stream speaks: which event is content, which carries usage, which ends the
stream, which reports an error, and the error event the gateway sends in that API's own words.

The relay (relay.py) scans OpenAI chat/completions chunks itself; every other stream is read
through one of these grammars, one instance per stream (Anthropic's usage comes in two events).
Nothing is buffered and only usage-carrying events are decoded as JSON. Which event is content is
defined once for the gateway and the benchmark (passerelle/chunks.py). Where a runtime leaves out
a field the API defines and the official SDKs' stream helpers index with (llama-server's Responses
events have no ``sequence_number``, ``output_index`` nor ``content_index``), the grammar supplies it,
spliced first into the event's data object (AMENDED); an event that has its fields passes as it came.

* Responses (``/v1/responses``): every ``response.*.delta`` is content (output text, reasoning
  text and summaries, refusals, function-call arguments); ``response.completed`` /
  ``response.incomplete`` carry usage and end the stream; ``response.failed`` and ``error`` are
  errors.
* Anthropic Messages (``/v1/messages``): ``content_block_delta`` with ``text_delta``,
  ``thinking_delta`` or ``input_json_delta`` is content; usage comes from ``message_start``
  (input) and ``message_delta`` (output: ``message_start``'s is a start, not a count);
  ``message_stop`` ends it; ``event: error`` is an error.
* llama-server's native chunks (``/infill``): a non-empty ``content`` is content; the chunk with
  ``"stop": true`` carries ``tokens_evaluated`` / ``tokens_predicted`` and ends the stream.
* Transcriptions: ``transcript.text.delta`` is content, ``transcript.text.done`` carries usage.
* Generic (operator-added routes): every data event is content; ``[DONE]`` or the close ends it.

An event's type is its ``event:`` line, or else the first ``"type"`` of its data.

Example::

    >>> g = make("messages")
    >>> g.scan(b'event: content_block_delta\\ndata: {"type":"content_block_delta","index":0,'
    ...        b'"delta":{"type":"text_delta","text":"Hi"}}\\n\\n') == CONTENT
    True
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from passerelle.chunks import LLAMA, MESSAGES, RESPONSES, TRANSCRIPTION
from passerelle.errors import GatewayError
from passerelle.proxy.protocols import anthropic_body

CONTENT, END, ERROR, AMENDED = 1, 2, 4, 8

_EVENT = re.compile(rb"^event:[ \t]*([^\r\n]*)", re.M)
_TYPE = re.compile(rb'"type"\s*:\s*"([^"]*)"')
_DATA_ERROR = re.compile(rb'^data:\s*\{\s*"error"', re.M)
_DONE = re.compile(rb"^data:\s*\[DONE\]\s*$", re.M)
_LLAMA_STOP = re.compile(rb'"stop"\s*:\s*true')
_STRING = re.compile(rb'\s*:\s*"((?:[^"\\]|\\.)*)"')  # after a key: its string value, still escaped
_NUMBERED = re.compile(rb'"(?:sequence_number|output_index|content_index)"')
_OUTPUT_INDEX = re.compile(rb'"output_index"\s*:\s*(\d+)')
_CONTENT_INDEX = re.compile(rb'"content_index"\s*:\s*(\d+)')
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')
# Responses events that are about one response (a sequence number is all they lack), and those about
# a content part of an output item (they have a content_index besides the item's output_index)
_WHOLE = frozenset((b"response.created", b"response.in_progress", b"response.queued", b"response.completed",
                    b"response.incomplete", b"response.failed", b"error"))
_PART = re.compile(rb"response\.(?:content_part|output_text|refusal|reasoning_text)\.")


def event_type(ev: bytes) -> bytes:
    """``ev``'s type: its ``event:`` line, else the first ``"type"`` in its data."""
    m = _EVENT.search(ev) if b"event:" in ev else None
    if m is not None:
        return m.group(1).strip()
    m = _TYPE.search(ev)
    return m.group(1) if m is not None else b""


def data_json(ev: bytes) -> Any:
    """The JSON of ``ev``'s data lines (joined as SSE says), or None."""
    lines = [line[5:].strip() for line in ev.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


MAX_COUNT = 2**53  # a token count the gateway takes from a runtime: exact as a float, and a SQLite integer


def token_count(value: Any) -> int | None:
    """``value`` if it is a token count (an integer from 0 to 2**53), else None: a runtime's
    negative or huge figure would break a counter, a quota or a usage row."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else None


def usage_of(obj: Any) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens from any of the runtimes' answers: OpenAI's ``usage``
    (``prompt_tokens``/``completion_tokens``), Responses' and Anthropic's (``input_tokens``/
    ``output_tokens``, Anthropic's cached input added back), llama-server's native fields."""
    if not isinstance(obj, dict):
        return None, None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else obj.get("message")
        usage = resp.get("usage") if isinstance(resp, dict) else None
    if isinstance(usage, dict):
        p = token_count(usage.get("prompt_tokens", usage.get("input_tokens")))
        c = token_count(usage.get("completion_tokens", usage.get("output_tokens")))
        if p is not None and "input_tokens" in usage:
            p = token_count(p + sum(v for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
                                    if (v := token_count(usage.get(k))) is not None))
        total = token_count(usage.get("total_tokens"))
        if c is None and p is not None and total is not None:
            c = token_count(total - p)  # rerank and embeddings: input only
        return p, c
    return token_count(obj.get("tokens_evaluated")), token_count(obj.get("tokens_predicted"))


def with_fields(ev: bytes, fields: bytes) -> bytes:
    """``ev`` with ``fields`` (``"name":value`` pairs, comma-separated) first in its data object;
    ``ev`` itself when its data is not an object. The rest of its bytes are kept as they are."""
    at = ev.find(b"data:")
    if at < 0:
        return ev
    brace = at + 6 if ev[at + 5:at + 7] == b" {" else at + 5 if ev[at + 5:at + 6] == b"{" else -1
    if brace < 0:  # (not the usual `data: {`: spaces or tabs before it, or no object at all)
        brace = ev.find(b"{", at + 5)
        if brace < 0 or ev[at + 5:brace].strip():
            return ev
    after = brace + 1
    while after < len(ev) and ev[after] in b" \t\r\n":
        after += 1
    sep = b"" if ev[after:after + 1] == b"}" else b","
    return ev[:brace + 1] + fields + sep + ev[brace + 1:]


def _string_at(ev: bytes, key: bytes) -> bytes | None:
    """The raw (still escaped) JSON string value of the first ``key`` (``b'"name"'``) in ``ev``;
    None when there is none."""
    i = ev.find(key)
    if i < 0:
        return None
    i += len(key)
    if ev[i:i + 2] == b':"':  # (the usual compact form: no regex)
        j = ev.find(b'"', i + 2)
        if j >= 0 and ev[j - 1:j] != b"\\":
            return ev[i + 2:j]
    m = _STRING.match(ev, i)
    return m.group(1) if m is not None else None


def cached_of(obj: Any) -> int | None:
    """Prompt tokens the runtime says it took from its cache, in any API's usage shape: chat's
    ``prompt_tokens_details.cached_tokens``, Responses' ``input_tokens_details.cached_tokens``,
    Anthropic's ``cache_read_input_tokens``; else llama-server's ``timings.cache_n``; None when it
    says nothing."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else obj.get("message")
        usage = resp.get("usage") if isinstance(resp, dict) else None
    if isinstance(usage, dict):
        for details in ("prompt_tokens_details", "input_tokens_details"):
            d = usage.get(details)
            if isinstance(d, dict) and (n := token_count(d.get("cached_tokens"))) is not None:
                return n
        if (n := token_count(usage.get("cache_read_input_tokens"))) is not None:
            return n
    timings = obj.get("timings")
    return token_count(timings.get("cache_n")) if isinstance(timings, dict) else None


class Grammar:
    """The generic grammar; subclasses know one API. ``scan`` returns CONTENT | END | ERROR flags
    and keeps the usage it read in ``prompt_tokens`` / ``completion_tokens``. A grammar may also
    complete an event that lacks a field its API defines (AMENDED: the event to relay instead is
    ``amended``); an event that has them all is never touched."""

    ends_at_close = True  # no end marker to miss: a clean close is a complete stream

    def __init__(self) -> None:
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.amended = b""
        self.cached_tokens: int | None = None

    def scan(self, ev: bytes) -> int:
        if ev.startswith(b":") or b"data:" not in ev:
            return 0
        if _DONE.search(ev):
            return END
        if _DATA_ERROR.search(ev):
            return ERROR
        return CONTENT

    def _take_usage(self, obj: Any) -> None:
        p, c = usage_of(obj)
        if p is not None:
            self.prompt_tokens = p
        if c is not None:
            self.completion_tokens = c
        if (n := cached_of(obj)) is not None:
            self.cached_tokens = n

    def error_event(self, err: GatewayError) -> bytes:
        """The event that tells this API's client the stream failed."""
        return err.sse_event()


class ResponsesGrammar(Grammar):
    """Responses events. Each one the API numbers or places and the runtime did not (llama-server
    sends ``item_id`` alone) gets its ``sequence_number`` (its place in the stream, from 0), its
    ``output_index`` (its item's place in the output, in the order items were added), its
    ``item_id`` and ``content_index`` (the item's latest content part), which the openai SDKs'
    stream helpers index with. Only the rare item and part events are searched for ids; a delta
    is checked for the fields with substring tests and, when one lacks, one regex and one splice."""

    ends_at_close = False

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0  # data events so far
        self._outputs: dict[bytes, int] = {}  # item id -> output_index
        self._parts: dict[int, int] = {}  # output_index -> content parts added
        self._n_outputs = 0
        self._item = b""  # the last item added, and its output_index
        self._out = 0
        # The runtime's deltas have every field: it sends them all so, and the rest are relayed
        # unchecked (a delta is the hot path; the rare other events are still checked).
        self._whole = False
        self._kind, self._kind_part = b"", False  # the last delta's type, and whether it has a content_index

    def scan(self, ev: bytes) -> int:
        seq = self._seq
        self._seq = seq + 1
        m = RESPONSES.search(ev)
        if m is not None:
            return CONTENT if self._whole else CONTENT | self._delta(ev, m.group(), seq)
        if ev.startswith(b":"):
            self._seq = seq  # a comment is no event
            return 0
        t = event_type(ev)
        flags = 0
        if t in (b"response.completed", b"response.incomplete", b"response.failed"):
            self._take_usage(data_json(ev))
            flags = END | (ERROR if t == b"response.failed" else 0)
        elif t == b"error" or (not t.startswith(b"response.") and _DATA_ERROR.search(ev)):
            return END | ERROR
        if not t.startswith(b"response."):
            return flags
        return flags | self._complete(ev, t, seq)

    def _delta(self, ev: bytes, kind: bytes, seq: int) -> int:
        """A delta (the hot path: one per token); ``kind`` is the text its type matched in."""
        if kind == self._kind:
            part = self._kind_part
        else:  # (a stream's deltas are of one kind or two: decided once per run of one kind)
            part = self._kind_part = b"output_text" in kind or b"reasoning_text" in kind or b"refusal" in kind
            self._kind = kind
        item = _string_at(ev, b'"item_id"')
        if part and item is not None and _NUMBERED.search(ev) is None:  # (llama-server's: one search)
            out = self._outputs.get(item, self._out)
            self.amended = with_fields(ev, b'"sequence_number":%d,"output_index":%d,"content_index":%d' % (
                seq, out, max(self._parts.get(out, 1) - 1, 0)))
            return AMENDED
        has_seq = b'"sequence_number"' in ev
        has_out = b'"output_index"' in ev
        has_part = not part or b'"content_index"' in ev
        if has_seq and has_out and item is not None and has_part:
            self._whole = part  # a runtime that sends its deltas whole sends them all so: see __init__
            return 0
        add = b"" if has_seq else b',"sequence_number":%d' % seq
        if item is None:
            item = self._item
            if item:
                add += b',"item_id":"' + item + b'"'
        out = self._outputs.get(item, self._out)
        if not has_out:
            add += b',"output_index":%d' % out
        if not has_part:
            add += b',"content_index":%d' % max(self._parts.get(out, 1) - 1, 0)
        if not add:
            return 0
        self.amended = with_fields(ev, add[1:])
        return AMENDED

    def _complete(self, ev: bytes, t: bytes, seq: int) -> int:
        """Supply what ``ev`` (of type ``t``, ``seq``-th in the stream, not a delta) lacks:
        AMENDED, or 0."""
        add = b"" if b'"sequence_number"' in ev else b',"sequence_number":%d' % seq
        if t in _WHOLE:
            pass
        elif t == b"response.output_item.added" or t == b"response.output_item.done":
            item = _string_at(ev, b'"id"') or b""  # the item's id: the event's own fields have none
            m = _OUTPUT_INDEX.search(ev)
            if m is not None:
                out = int(m.group(1))
            else:
                out = self._outputs.get(item, -1) if t == b"response.output_item.done" else -1
                if out < 0:
                    out = self._n_outputs
                add += b',"output_index":%d' % out
            if t == b"response.output_item.added" or out >= self._n_outputs:
                self._n_outputs = max(self._n_outputs, out + 1)
                if item:
                    self._outputs[item] = out
                self._item, self._out = item, out
        else:  # about one item (and one of its content parts)
            found = _string_at(ev, b'"item_id"')
            item = self._item if found is None else found
            out = self._outputs.get(item, self._out)
            if found is None and item:
                add += b',"item_id":"' + item + b'"'
            if b'"output_index"' not in ev:
                add += b',"output_index":%d' % out
            if _PART.match(t):
                if t == b"response.content_part.added":
                    m = _CONTENT_INDEX.search(ev)
                    part = int(m.group(1)) if m is not None else self._parts.get(out, 0)
                    self._parts[out] = max(self._parts.get(out, 0), part + 1)
                else:
                    part = max(self._parts.get(out, 1) - 1, 0)
                if b'"content_index"' not in ev:
                    add += b',"content_index":%d' % part
        if not add:
            return 0
        self.amended = with_fields(ev, add[1:])
        return AMENDED

    def error_event(self, err: GatewayError) -> bytes:
        # Responses' `error` event (type, code, message, param); the `error` object is there too
        # so that the openai SDKs, which raise on a streamed event carrying one, raise.
        body = {"type": "error", "code": err.code, "message": err.message, "param": None,
                "error": {"type": err.type, "code": err.code, "message": err.message}}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"


class MessagesGrammar(Grammar):
    """Messages events. A content block event without its ``index`` (the Anthropic SDKs' stream
    helpers index the message's content with it) gets its block's: a start, the number of blocks
    started before it; a delta or a stop, that of the last block started."""

    ends_at_close = False

    def __init__(self) -> None:
        super().__init__()
        self._blocks = 0  # content blocks started
        self._block = 0  # the index of the last one
        self._whole = False  # the runtime's deltas have their index

    def scan(self, ev: bytes) -> int:
        t = event_type(ev)
        if t == b"content_block_delta":
            flags = CONTENT if MESSAGES.search(ev) else 0
            if self._whole:
                return flags
            if b'"index"' in ev:
                self._whole = True  # (as in Responses: a runtime that sends a delta whole sends all so)
                return flags
            self.amended = with_fields(ev, b'"index":%d' % self._block)
            return flags | AMENDED
        if t == b"content_block_start":
            m = _INDEX.search(ev)
            self._block = int(m.group(1)) if m is not None else self._blocks
            self._blocks = max(self._blocks, self._block + 1)
            if m is not None:
                return 0
            self.amended = with_fields(ev, b'"index":%d' % self._block)
            return AMENDED
        if t == b"content_block_stop":
            if b'"index"' in ev:
                return 0
            self.amended = with_fields(ev, b'"index":%d' % self._block)
            return AMENDED
        if t == b"message_start":
            # its output_tokens is a start (0 or 1), not a count: a stream cut before message_delta
            # is counted by its content events
            p, _ = usage_of(data_json(ev))
            if p is not None:
                self.prompt_tokens = p
            return 0
        if t == b"message_delta":
            p, c = usage_of(data_json(ev))
            if c is not None:
                self.completion_tokens = c
            if p and not self.prompt_tokens:  # (newer servers repeat the input count here)
                self.prompt_tokens = p
            return 0
        if t == b"message_stop":
            return END
        if t == b"error" or _DATA_ERROR.search(ev):
            return END | ERROR
        return 0

    def error_event(self, err: GatewayError) -> bytes:
        return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"


class LlamaGrammar(Grammar):
    """llama-server's own chunks (``/infill``, ``/completion``)."""

    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        if _DATA_ERROR.search(ev):
            return END | ERROR
        flags = CONTENT if LLAMA.search(ev) else 0
        if _LLAMA_STOP.search(ev):
            self._take_usage(data_json(ev))
            flags |= END
        elif _DONE.search(ev):
            flags |= END
        return flags


class TranscriptionGrammar(Grammar):
    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        if TRANSCRIPTION.search(ev):
            return CONTENT
        t = event_type(ev)
        if t == b"transcript.text.done":
            self._take_usage(data_json(ev))
            return END
        if _DONE.search(ev):
            return END
        if t == b"error" or _DATA_ERROR.search(ev):
            return END | ERROR
        return 0


_GRAMMARS: dict[str, type[Grammar]] = {"generic": Grammar, "responses": ResponsesGrammar,
                                       "messages": MessagesGrammar, "llama": LlamaGrammar,
                                       "transcription": TranscriptionGrammar}


def make(name: str) -> Grammar | None:
    """A fresh grammar for one stream; None for OpenAI chat/completions (the relay's own scan)."""
    cls = _GRAMMARS.get(name)
    return cls() if cls is not None else None


def error_event(name: str, err: GatewayError) -> bytes:
    g = make(name)
    return g.error_event(err) if g is not None else err.sse_event()
