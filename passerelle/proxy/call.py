"""One request's intake, read once: what it asked and what it holds, on one object.

``Gateway.handle`` reads the body, and ``Gateway._intake`` parses the few fields the gateway acts
on and resolves the model into a :class:`Call`. From then on every step of the request's life
takes ``(ex, call[, backend])``:

* ``ex`` (exchange.py): what passed between the client and the gateway, and the record;
* ``call``: what the client asked (its API, whether it streams, the catalogue's route) and what the
  request holds (its scheduler job, its key's grant, its session's place, its one deadline, the
  splice that continues a cut stream, when the last cut happened);
* ``backend``: the replica of one attempt, whose own request is an
  :class:`~passerelle.proxy.upstream_request.UpstreamRequest` built once for that attempt.

``handle``'s ``finally`` gives back what the call holds (``Gateway._release``): the job's slot,
the grant and the session's place, whatever happened.

Example::

    call = self._intake(ex, api, key, body)      # 400s here: the fields, the model, the media
    call.grant = await self.keys.admit(key, rec, call.job.cls, call.estimate)
    call.session = self.sessions.enter(rec.tenant, rec.session)
    await self._dispatch(ex, call)               # _retrying(ex, call) → _attempt(ex, call, backend)
"""

from __future__ import annotations

from dataclasses import dataclass

from passerelle.proxy.deadline import Deadline
from passerelle.proxy.protocols import Api
from passerelle.proxy.repair import ToolRepair
from passerelle.proxy.resume import Splice
from passerelle.runtimes.catalogue import ModelRoute
from passerelle.scheduling.job import Job
from passerelle.tenants.policy import Ticket


@dataclass(slots=True, eq=False)
class Call:
    """One request after its intake (the module docstring); made once, never copied."""

    api: Api
    stream: bool  # the client asked for a stream
    content_type: str  # the client's (an upload's multipart boundary); "" when it sent none
    route: ModelRoute  # the catalogue's answer: public name, pool, served name, the body as edited
    job: Job  # its place in the scheduler: class, tenant, estimates, the replica and slot it got
    deadline: Deadline  # the request's one total deadline; each attempt's first-token clock
    splice: Splice | None = None  # a preemptible stream that may be cut and continued (resume.py)
    grant: Ticket | None = None  # its turn among its key's concurrent requests (tenants/policy.py)
    session: tuple[str, str] | None = None  # its place among its session's requests (tenants/sessions.py)
    suspended_at: float = 0.0  # when its stream was last cut (perf_counter); 0: never, or not since
    repair: ToolRepair | None = None  # tool calls left as text made the API's own (repair.py); None: off

    @property
    def estimate(self) -> int:
        """The tokens it may cost: the key's limits charge it before it runs."""
        return self.job.est_prompt_tokens + self.job.est_output_tokens
