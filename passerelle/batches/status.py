"""A batch's lifecycle: OpenAI's statuses and the only moves between them.

    validating ──► in_progress ──► finalizing ──► completed
        │               │              ├────────► expired    (the completion window ended)
        │               │              └────────► failed
        │               └──────────────────────► failed      (its input is gone, or a fault)
        └───────────────┴──► cancelling ──────► cancelled   (or failed, on a fault)

``validating`` is the batch being checked at its creation (``POST /v1/batches`` answers once it is
``in_progress``); ``in_progress`` runs its lines, paused ones included; ``finalizing`` assembles
the output and error files from the answered lines (again after a restart, until they are whole);
``cancelling`` ends the lines running and assembles the error file of those not run. A batch is
cancelled only while it is live (``validating`` or ``in_progress``): one that is finalizing has
already run every line.

The status is kept in the batch's document (``doc["status"]``) as OpenAI spells it, so the rows
of every version load as they are. One written before this table may be ``finalizing`` towards
``cancelled`` (``doc["_final"]``): that move is allowed too.
"""

from __future__ import annotations

import enum
from typing import Any


class BatchStatus(enum.Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    __hash__ = object.__hash__  # (members are singletons: hashed by identity, as JobState's)

    @property
    def live(self) -> bool:
        """Its lines may still run: it can be cancelled."""
        return self in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)

    @property
    def ended(self) -> bool:
        return not _ALLOWED[self]


_ALLOWED: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING}),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.FAILED, BatchStatus.CANCELLING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                                       BatchStatus.CANCELLED}),  # (cancelled: rows of before this table)
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED, BatchStatus.FAILED}),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}

# The statuses of a batch not ended: it holds its input file and counts as in progress.
ACTIVE = tuple(s.value for s in BatchStatus if not s.ended)
# The time each status is entered is kept under this field of the batch (OpenAI's names).
_STAMP = {s: f"{s.value}_at" for s in BatchStatus if s is not BatchStatus.VALIDATING}


def status_of(doc: dict[str, Any]) -> BatchStatus:
    return BatchStatus(doc["status"])


def move(doc: dict[str, Any], to: BatchStatus, at: float) -> None:
    """Move the batch ``doc`` to ``to`` at ``at`` (wall time); a move the diagram above does not
    have is a bug and raises."""
    now = status_of(doc)
    if to not in _ALLOWED[now]:
        raise RuntimeError(f"batch {doc.get('id')}: illegal transition {now.value} -> {to.value}")
    doc["status"] = to.value
    if to in _STAMP:
        doc[_STAMP[to]] = int(at)
