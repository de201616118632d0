"""Where a model runs over several boxes: replicas first, a split only when no box can hold it.

The team's gateway reads, for every box, the models its passerelle serves (``/v1/models``: each
model's state and the memory it needs, measured once it ran, estimated from its GGUF before) and
its memory budget (``/admin/runtimes``). From these alone:

* a model that fits the budget of a box runs there as a replica, on every box whose budget has
  room for it now (:func:`to_start`: the box's own admin API starts it; the box's supervisor and
  swapper keep it under its budget);
* a model bigger than the budget of every box that lists it is marked ``split``: one replica made
  of several boxes, llama.cpp's RPC backend (docs/rpc-split.md). Making that group is the RPC
  operator's: the head box's ``[[backends]]`` entry names its members (``rpc``) and their shares
  (``rpc_split``); the plan says which boxes and what shares their budgets allow (:func:`shares`),
  and once the head serves the model it is one replica here like any other.

Example::

    m = RemoteModel("qwen", state="unloaded", need_gib=20.0, runtimes=("qwen",))
    b = BoxMemory(max_gib=96.0, loaded_gib=60.0)
    decide("qwen", {"a": (m, b)})                  # Placement(model="qwen", mode="replicas", ...)
    to_start(m, b)                                 # "qwen": room for it, start it there
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BoxMemory:
    """A box's memory budget as its passerelle reports it (None: it has no budget)."""

    max_gib: float | None = None
    loaded_gib: float = 0.0

    def room_for(self, need_gib: float | None) -> bool:
        if self.max_gib is None or need_gib is None:
            return True
        return self.loaded_gib + need_gib <= self.max_gib + 1e-9

    def holds(self, need_gib: float | None) -> bool:
        """Could the model be loaded there at all, with nothing else loaded?"""
        return self.max_gib is None or need_gib is None or need_gib <= self.max_gib + 1e-9


@dataclass(frozen=True)
class RemoteModel:
    """One model as a box serves it: its catalogue state there (``loaded``, ``loading``,
    ``unloaded``: loads when asked, ``down``), what it needs, the box's runtimes serving it."""

    name: str
    state: str = "down"
    need_gib: float | None = None
    runtimes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    model: str
    mode: str  # "replicas" (fits one box), "split" (fits none alone)
    boxes: tuple[str, ...] = ()  # where it runs or may run as a replica
    need_gib: float | None = None
    why: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "mode": self.mode, "fits": self.mode == "replicas", "boxes": list(self.boxes),
                "need_gib": self.need_gib, "why": self.why, **self.extra}


def shares(memory: Mapping[str, BoxMemory]) -> dict[str, float]:
    """Each box's share of a split's layers, in proportion to its budget (``rpc_split``, rounded to
    0.01); boxes with no budget count as the largest budget seen."""
    known = [m.max_gib for m in memory.values() if m.max_gib]
    default = max(known) if known else 1.0
    gib = {box: (m.max_gib or default) for box, m in memory.items()}
    total = sum(gib.values()) or 1.0
    return {box: round(g / total, 2) for box, g in sorted(gib.items())}


def decide(model: str, seen: Mapping[str, tuple[RemoteModel, BoxMemory]]) -> Placement:
    """The placement of ``model`` from what each box (by name) says of it and of its memory."""
    needs = [m.need_gib for m, _ in seen.values() if m.need_gib is not None]
    need = max(needs) if needs else None
    fits = tuple(sorted(box for box, (m, mem) in seen.items() if mem.holds(m.need_gib)))
    if fits or not seen:
        running = [b for b in fits if seen[b][0].state in ("loaded", "loading")]
        return Placement(model, "replicas", fits, need,
                         f"fits one box; a replica on {len(fits)} box(es), {len(running)} loaded")
    biggest = max((mem.max_gib or 0.0) for _, mem in seen.values())
    split = shares({box: mem for box, (_, mem) in seen.items()})
    plan = ", ".join(f"{box} {share:.2f}" for box, share in split.items())
    return Placement(model, "split", tuple(sorted(seen)), need,
                     f"needs {need:.1f} GiB, more than the largest box's budget ({biggest:.1f} GiB): "
                     f"split it over boxes with llama.cpp's RPC backend, layers by budget ({plan}; "
                     "docs/rpc-split.md)", {"shares": split})


def to_start(model: RemoteModel, memory: BoxMemory) -> str | None:
    """The box's runtime to start for a replica of ``model`` there now: one not loaded whose
    memory fits the room left in the box's budget; None when it runs already or has no room."""
    if model.state != "unloaded" or not model.runtimes or not memory.room_for(model.need_gib):
        return None
    return model.runtimes[0]
