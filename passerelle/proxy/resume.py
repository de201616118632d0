"""One client stream over several upstream attempts: a suspended stream's continuation, spliced.

When the scheduler suspends a batch stream for a better class (scheduling/preemption.py), the
upstream request is cut (its slot frees at once) while the client's stream stays open. Later the
request is sent again as a **continuation**: chat, the messages plus the partial assistant
message, continued (``continue_final_message``, with ``add_generation_prompt`` off; llama-server
also continues a final assistant message by itself); completions, the prompt plus the text so
far; ``max_tokens`` less what was already sent. The :class:`Splice` sits between the relay and the
client and makes the attempts one stream:

* it keeps the text the client received and counts the tokens (llama-server's per-token
  ``timings``, vLLM's continuous usage, else one per content event), and, once cut, lets nothing
  more of that attempt through (whatever the runtime sent after the cut is generated again);
* in a continuation it drops the role chunk, strips the partial message when the runtime
  repeats it (llama-server streams the continued message from its start), and gives every event
  the first attempt's ``id`` and ``created``;
* usage counts the original prompt once and every generated token once.

Only a request that can be continued exactly is ever suspended (:func:`suspendable`): no tools,
``response_format``, grammars, ``n`` > 1, log probabilities, echo or suffix, no history-dependent
penalties, a text prompt; nor a stream that produced tool calls or reasoning, or text with U+FFFD
(bytes that were no valid UTF-8: the continuation could not give them back), or is about to end.

Example::

    splice = Splice(data, "chat")
    body = orjson.dumps(splice.request_data("llama-server"))
    send = splice.watch(resp, ex.send, "llama-server")   # the relay sends through this
    splice.suspend()            # from the scheduler: cut now; True if it was
    splice.resumed()            # before the next attempt
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from passerelle.chunks import REASONING_FIELDS
from passerelle.proxy.grammars import token_count
from passerelle.upstream.client import Response

Send = Callable[[dict[str, Any]], Awaitable[None]]

# A request with any of these set (to anything but off) is never suspended: its output is
# constrained, several, or scored, and a continuation would not reproduce it.
_UNSAFE = ("tools", "functions", "response_format", "grammar", "json_schema", "logprobs", "top_logprobs",
           "n_probs", "best_of", "echo", "suffix", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "structured_outputs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
           "repeat_penalty", "dry_multiplier", "lora")


def _off(key: str, value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    return value in (0, "", [], {}) or (key == "repeat_penalty" and value == 1)

_EVENT = re.compile(rb"(.*?)(?:\r\n\r\n|\n\n)", re.DOTALL)
_MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")
MIN_LEFT = 4  # a stream this close to its max_tokens is not worth suspending: it ends by itself


def suspendable(data: dict[str, Any], endpoint: str) -> bool:
    """Can this request be cut and continued exactly?"""
    if endpoint not in ("chat", "completions") or data.get("n") not in (None, 1):
        return False
    if not all(_off(k, data.get(k)) for k in _UNSAFE):
        return False
    if endpoint == "completions":
        return isinstance(data.get("prompt"), str)
    last = data["messages"][-1]
    return last.get("role") != "assistant" or isinstance(last.get("content"), str)


class Splice:
    def __init__(self, data: dict[str, Any], endpoint: str) -> None:
        self.data = data
        self.chat = endpoint == "chat"
        self.text: list[str] = []  # what the client received, in pieces
        self.tokens_before = 0  # generated and received in the attempts before this one
        self.attempt_tokens = 0  # ... in this attempt, from the runtime's counters
        self.attempt_events = 0  # ... in this attempt, one per content event (when it counts none)
        self.prompt_tokens: int | None = None  # the original prompt's (the first attempt's count)
        self.cached_tokens: int | None = None
        self.attempts = 0
        self.suspended = False  # this attempt was cut
        self.suspensions = 0
        self.finished = False  # the end of the answer went through
        self.unsafe = False  # output that cannot be continued (tool calls, reasoning)
        self.resume_prompt_processed = 0  # prompt tokens the runtime computed again on resumes
        self.resume_prompt_cached = 0  # ... and took from its cache
        self.collector: Any = None  # for an answer assembled from a stream (attempt.py): kept across attempts
        self._first_id: Any = None
        self._first_created: Any = None
        self._echo = ""  # what the continuation's runtime may repeat before new text
        self._counted = False  # the runtime gives token counts (timings or usage) in this attempt
        self._prompt_seen = False
        self._continuing = False  # this attempt continues text the client already has
        self._dialect = ""
        self._resp: Response | None = None
        self._down: Send | None = None
        self._streaming: Callable[[], None] | None = None
        self._strip = ""  # per-event counters passerelle asked for and the client did not
        # this attempt's pace: when its first and latest content events came, and the tokens by then
        self._paced_from = self._paced_to = 0.0
        self._paced_tokens: tuple[int, int] | None = None

    # -- requests ------------------------------------------------------------------------------
    @property
    def partial(self) -> str:
        return "".join(self.text)

    @property
    def tokens(self) -> int:
        """Tokens generated and received so far, over all attempts."""
        return self.tokens_before + (self.attempt_tokens if self._counted else self.attempt_events)

    def request_data(self, dialect: str) -> dict[str, Any]:
        """The body of the next attempt on a runtime of ``dialect`` ("llama-server", "vllm")."""
        data = dict(self.data)
        self._strip = self._echo = ""
        self._continuing = bool(self.text)
        if dialect == "llama-server" and not data.get("timings_per_token"):
            data["timings_per_token"] = True  # token counts in every event; stripped again
            self._strip = "timings"
        elif dialect == "vllm":
            so = data.get("stream_options") or {}
            if not so.get("continuous_usage_stats"):
                data["stream_options"] = {**so, "continuous_usage_stats": True}
                self._strip = "usage"
        if not self.text:
            return data
        partial = self.partial
        if self.chat:
            messages = list(data["messages"])
            last = messages[-1]
            if last.get("role") == "assistant":  # the client's own prefill, continued
                messages[-1] = {**last, "content": last.get("content", "") + partial}
            else:
                messages.append({"role": "assistant", "content": partial})
            data["messages"] = messages
            data["continue_final_message"] = True
            data["add_generation_prompt"] = False
            self._echo = messages[-1]["content"] if dialect == "llama-server" else ""
        else:
            data["prompt"] = data["prompt"] + partial
        for key in _MAX_TOKENS_KEYS:
            if isinstance(data.get(key), int) and data[key] > 0:
                data[key] = max(1, data[key] - self.tokens)
        return data

    @property
    def left_s(self) -> float:
        """Seconds from now until the stream ends by itself: its tokens left at this attempt's pace
        so far, counted from its latest token (inf while the pace is unknown, under two tokens, or
        the request sets no max_tokens). The scheduler waits for a stream about to end rather than
        cut another (preemption.py); counted from the latest token, the estimate falls as time
        passes, not only as tokens come, so a check timed for it finds it due."""
        left = self.tokens_left()
        if left is None or self._paced_tokens is None or self._paced_tokens[1] <= self._paced_tokens[0]:
            return math.inf
        first, last = self._paced_tokens
        end = self._paced_to + max(0, left) * (self._paced_to - self._paced_from) / (last - first)
        return max(0.0, end - time.monotonic())

    def tokens_left(self) -> int | None:
        for key in _MAX_TOKENS_KEYS:
            if isinstance(self.data.get(key), int) and self.data[key] > 0:
                return int(self.data[key]) - self.tokens
        return None

    # -- an attempt ------------------------------------------------------------------------------
    def watch(self, resp: Response, send: Send, dialect: str,
              streaming: Callable[[], None] | None = None) -> Send:
        """Start an attempt on ``resp``; the relay sends through what this returns.
        ``streaming`` is called when the attempt's first token has gone to the client: from then
        on it may be cut. (Not before: llama-server notices a closed connection only when it
        writes to it, and a request cut during its prompt would hold its slot to the end.)"""
        self.attempts += 1
        self._resp, self._down, self._dialect = resp, send, dialect
        self._streaming = streaming
        self.suspended = False
        self.attempt_tokens = self.attempt_events = 0
        self._counted = self._prompt_seen = False
        self._paced_tokens = None
        return self._send

    def suspend(self) -> bool:
        """Cut this attempt now (the scheduler's call); False when it cannot be continued."""
        left = self.tokens_left()
        if self._resp is None or self.finished or self.unsafe or self.suspended or (
                left is not None and left < MIN_LEFT):
            return False
        self.suspended = True
        self._resp.close()  # the runtime sees the connection close and frees the slot
        return True

    def resumed(self) -> None:
        """The cut attempt is over; the next one continues it."""
        self.tokens_before = self.tokens
        self.attempt_tokens = self.attempt_events = 0
        self._counted = False
        self.suspensions += 1
        self._resp = None

    def done(self) -> None:
        self._resp = None

    def totals(self, final_prompt: int | None, final_completion: int | None) -> tuple[int | None, int | None]:
        """Usage over every attempt, from the last attempt's: the original prompt once, every
        generated token once."""
        if not self.suspensions:
            return final_prompt, final_completion
        completion = self.tokens_before + (final_completion if final_completion is not None else
                                           (self.attempt_tokens if self._counted else self.attempt_events))
        prompt = self.prompt_tokens
        if prompt is None and final_prompt is not None:  # no counts per event: the prompt grew by the partial
            prompt = max(0, final_prompt - self.tokens_before)
        return prompt, completion

    # -- the events ------------------------------------------------------------------------------
    async def _send(self, message: dict[str, Any]) -> None:
        if self.suspended:
            return  # after the cut: generated again by the continuation
        body = message.get("body", b"")
        assert self._down is not None
        if not body:
            await self._down(message)
            return
        out = []
        for m in _EVENT.finditer(body):
            ev = self._event(m.group(0))
            if ev:
                out.append(ev)
        rest = body[sum(len(m.group(0)) for m in _EVENT.finditer(body)):]
        if rest.strip():
            out.append(rest)
        if out:
            await self._down({**message, "body": b"".join(out)})

    def _event(self, ev: bytes) -> bytes | None:
        line = ev.strip()
        if not line.startswith(b"data:"):
            return ev
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.finished = True
            return ev
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return ev
        if not isinstance(obj, dict) or "error" in obj:
            return ev
        changed = self._identity(obj)
        self._count(obj)
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            keep, edited = self._choice(choices[0])
            if not keep:
                return None
            changed |= edited
            if self._strip and self._strip in obj:
                del obj[self._strip]
                changed = True
        elif isinstance(obj.get("usage"), dict) and self.suspensions:
            self._total_usage(obj["usage"])
            changed = True
        if not changed:
            return ev
        try:
            return b"data: " + orjson.dumps(obj) + b"\n\n"
        except TypeError:  # (a runtime's event nested deeper than orjson writes: passed on as it came)
            return ev

    def _identity(self, obj: dict[str, Any]) -> bool:
        """The first attempt's id and created on every event."""
        if self._first_id is None:
            self._first_id, self._first_created = obj.get("id"), obj.get("created")
            return False
        if obj.get("id") == self._first_id:
            return False
        obj["id"] = self._first_id
        if "created" in obj:
            obj["created"] = self._first_created
        return True

    def _count(self, obj: dict[str, Any]) -> None:
        t = obj.get("timings") if self._dialect == "llama-server" else obj.get("usage")
        if not isinstance(t, dict):
            return
        if self._dialect == "llama-server":
            generated, prompt, cached = (token_count(t.get(k)) for k in ("predicted_n", "prompt_n", "cache_n"))
        else:
            generated, prompt = token_count(t.get("completion_tokens")), token_count(t.get("prompt_tokens"))
            cached = None
        if isinstance(generated, int) and obj.get("choices"):
            self.attempt_tokens, self._counted = generated, True
        if not isinstance(prompt, int) or self._prompt_seen:
            return
        self._prompt_seen = True  # the same figures in every event of an attempt
        if not self._continuing:
            self.prompt_tokens = prompt + (cached if isinstance(cached, int) else 0)
            self.cached_tokens = cached if isinstance(cached, int) else None
        elif self._dialect == "llama-server":
            self.resume_prompt_processed += prompt
            self.resume_prompt_cached += cached if isinstance(cached, int) else 0

    def _choice(self, ch: dict[str, Any]) -> tuple[bool, bool]:
        """(keep the event, it was edited) for an event's first choice."""
        edited = False
        delta: dict[str, Any] = ch["delta"] if isinstance(ch.get("delta"), dict) else {}
        if self.chat:
            if delta.get("tool_calls") or any(delta.get(f) for f in REASONING_FIELDS):
                self.unsafe = True  # passed on as they are; this stream is no longer suspended
            content = delta.get("content")
        else:
            content = ch.get("text")
        if isinstance(content, str) and content:
            new = self._unecho(content)
            if new != content:
                edited = True
                if self.chat:
                    ch["delta"] = {**delta, "content": new}
                else:
                    ch["text"] = new
            if new:
                self.text.append(new)
                self.attempt_events += 1
                self._pace()
                if self._streaming is not None:
                    self._streaming()
                    self._streaming = None
                if "\ufffd" in new:  # bytes that are no text: what was sent cannot be given back as it was
                    self.unsafe = True
            content = new
        if ch.get("finish_reason"):
            self.finished = True
            return True, edited
        if self._continuing and not content and not delta.get("tool_calls"):
            return False, edited  # a continuation's role chunk, or what it only repeated
        return True, edited

    def _pace(self) -> None:
        now, tokens = time.monotonic(), self.tokens
        if self._paced_tokens is None:
            self._paced_from, self._paced_tokens = now, (tokens, tokens)
        else:
            self._paced_tokens = (self._paced_tokens[0], tokens)
        self._paced_to = now

    def _unecho(self, content: str) -> str:
        """``content`` less the continued message, when the runtime repeats it: llama-server
        sends it whole in the continuation's first delta, with the first new token. Anything
        else is new text (a runtime that does not repeat it, or a message that only happens to
        begin the same way)."""
        echo, self._echo = self._echo, ""  # only the first content delta may carry it
        return content[len(echo):] if echo and content.startswith(echo) else content

    def _total_usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = self.totals(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if prompt is not None:
            usage["prompt_tokens"] = prompt
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and self.cached_tokens is not None:
                details["cached_tokens"] = min(self.cached_tokens, prompt)
        if completion is not None:
            usage["completion_tokens"] = completion
        if prompt is not None and completion is not None:
            usage["total_tokens"] = prompt + completion
