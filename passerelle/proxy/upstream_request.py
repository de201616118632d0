"""One attempt's request to one runtime: the body as it is sent, built in one place.

A client's body reaches a runtime changed in at most these ways, all made by
:func:`upstream_request`, once per attempt, in this order:

1. the model catalogue's edits (runtimes/catalogue.py: the served name, parameter defaults and
   overrides, applied to the route once per request; an upload's ``model`` field rewritten here);
2. a continuation, when the attempt resumes a suspended stream (resume.py: the partial answer
   continued, ``max_tokens`` less what was sent, the runtime's per-token counters asked for);
3. collect: a non-streamed request that the runtime answers as a stream (llama-server), assembled
   by the gateway (attempt.py), asked as a stream with its usage;
4. usage asked for on a chat stream that did not ask for it (``strip_usage``: the usage chunk is
   removed again before the client sees it);
5. the runtime's own fields (``Backend.prepare``: vLLM's ``priority``, llama-server's ``id_slot``).

The result also says how the answer is taken (streamed, collected) and carries the caps and
timeouts of the attempt, so that ``fetch(ex, req, backend, deadline)`` needs nothing else.

Example::

    req = upstream_request(call, backend, cfg)    # call.py: what the client asked, the job's slot
    answer = await fetch(ex, req, backend, call.deadline)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from passerelle.config import Config, LimitsConfig, TimeoutConfig
from passerelle.errors import encode_request
from passerelle.proxy.call import Call
from passerelle.proxy.intake import with_usage_requested
from passerelle.proxy.protocols import Api, replace_form_field
from passerelle.proxy.repair import ToolRepair
from passerelle.proxy.resume import Splice
from passerelle.runtimes.kinds import Backend

JSON = b"application/json"


@dataclass(slots=True)
class UpstreamRequest:
    """What one attempt sends to one runtime, and how its answer is taken. (Built on every attempt:
    not frozen, whose every field is set through ``object.__setattr__``.)"""

    api: Api
    body: bytes
    content_type: bytes
    stream: bool  # the client asked for a stream
    collect: bool  # the runtime streams an answer the client gets whole (assembled, attempt.py)
    strip_usage: bool  # the usage chunk was asked for by passerelle: removed before the client
    limits: LimitsConfig
    timeouts: TimeoutConfig
    splice: Splice | None = None  # a stream that may be cut and continued (resume.py)
    dialect: str = ""  # the runtime's continuation dialect, with a splice
    on_streaming: Callable[[], None] | None = None  # the attempt's first token went out (with a splice)
    repair: ToolRepair | None = None  # tool calls left as text repaired in the answer (repair.py); None: off

    @property
    def streamed(self) -> bool:
        """The runtime answers as a stream (to the client, or to be assembled)."""
        return self.stream or self.collect


def upstream_request(call: Call, backend: Backend, cfg: Config,
                     on_streaming: Callable[[], None] | None = None) -> UpstreamRequest:
    """The request of one attempt of ``call`` on ``backend`` (the module docstring's steps), with
    the class's rank and the runtime slot the scheduler gave the call's job."""
    api, route, splice, stream = call.api, call.route, call.splice, call.stream
    data, body = route.data, route.body
    if data is None and route.served != route.requested:  # a form (an upload): its model field alone,
        body = replace_form_field(body, call.content_type, "model", route.served)  # the file untouched
    dialect = backend.continuation if splice is not None else ""
    if dialect and splice is not None:
        data = splice.request_data(dialect)
        body = encode_request(data)
    collect = not stream and backend.stream_always and api.collect and data is not None
    chat_like = api.grammar == "chat"
    strip_usage = False
    if collect:
        assert data is not None
        extra = {"stream_options": {"include_usage": True}} if chat_like else {}
        body = encode_request({**data, "stream": True, **extra})
    elif stream and chat_like and data is not None and not (data.get("stream_options") or {}).get("include_usage"):
        body, strip_usage = with_usage_requested(body, data), True
    if api.scheduled and not api.form:  # (vLLM's priority, llama-server's slot: for requests that take one)
        job = call.job
        body = backend.prepare(body, job.cls.rank, job.slot)
    return UpstreamRequest(api=api, body=body, content_type=call.content_type.encode("latin-1") if api.form else JSON,
                           stream=stream, collect=collect, strip_usage=strip_usage, limits=cfg.limits,
                           timeouts=cfg.timeouts, splice=splice, dialect=dialect,
                           on_streaming=on_streaming if splice is not None else None, repair=call.repair)
