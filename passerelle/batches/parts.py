"""What the Batch API uses of the gateway's long-lived parts.

The Batch API sits above the request path (a line is a request of the gateway's own path) and below
the server, which builds it: it is handed the server's :class:`~passerelle.server.service.Service`,
which has every one of these, and reads them from there at each use, so that a reload's settings
and parts are the ones it sees (never a copy taken at start).
"""

from __future__ import annotations

from typing import Protocol

from passerelle.config import Config
from passerelle.proxy.gateway import Gateway
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.registry import Registry
from passerelle.scheduling.scheduler import Scheduler
from passerelle.tenants.policy import KeyPolicy


class Parts(Protocol):
    @property
    def cfg(self) -> Config: ...  # the running configuration (a reload's once it applied)

    @property
    def keys(self) -> KeyPolicy: ...  # who calls

    @property
    def catalogue(self) -> Catalogue: ...  # which models are served, by which replicas

    @property
    def registry(self) -> Registry: ...  # the replicas

    @property
    def scheduler(self) -> Scheduler: ...  # what waits and runs (lines go only in the idle capacity)

    @property
    def gateway(self) -> Gateway: ...  # runs a line (``handle``) and tells its finished record (``listeners``)


def batch_class(parts: Parts) -> str:
    """The class batch lines run at: the least urgent one of the running configuration ([[classes]]
    apply at a reload: a class renamed or added there is the one the next line gets)."""
    return max(parts.cfg.classes, key=lambda c: c.rank).name
