"""``--find-max``: the highest load a target holds within the SLOs, searched rather than guessed.

Doubling from the first load given (1 by default) until a level misses an SLO, then bisecting
between the highest level that held and the lowest that failed: concurrency down to adjacent
integers, a rate until the two are within ``precision`` (10 %) of each other. ``limit`` caps the
doubling; reaching it without a failure means the limit was not found (the verdict then says
"≥"). A first level that already fails is bisected down towards zero. Example, with a runtime
that holds 6::

    find_max(measure, start=1, limit=256)    # measures 1, 2, 4, 8 (fails), 6, 7 (fails) → held 6

``measure(load)`` runs one level at that load and returns True when it met every SLO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Search:
    held: float | None = None  # highest load that met the SLOs
    failed: float | None = None  # lowest load above it that did not
    tried: list[tuple[float, bool]] = field(default_factory=list)  # in the order measured


def find_max(measure: Callable[[float], bool], *, start: float = 1, limit: float = 256, integer: bool = True,
             precision: float = 0.1, max_steps: int = 24) -> Search:
    """Search as described in the module docstring; at most ``max_steps`` levels."""
    s = Search()

    def run(load: float) -> bool:
        ok = measure(load)
        s.tried.append((load, ok))
        if ok:
            s.held = load if s.held is None else max(s.held, load)
        else:
            s.failed = load if s.failed is None else min(s.failed, load)
        return ok

    load = start
    while len(s.tried) < max_steps:
        if not run(load):
            break
        if load >= limit:
            return s  # held up to the cap: no limit found
        load = min(load * 2, limit)
    while s.failed is not None and len(s.tried) < max_steps:
        lo = s.held or 0
        hi = s.failed
        if integer:
            if hi - lo <= 1:
                break
            mid: float = (lo + hi) // 2
        else:
            if lo > 0 and hi <= lo * (1 + precision):
                break
            if lo == 0 and hi <= start * precision:
                break  # fails even at a tenth of the first rate
            mid = round((lo + hi) / 2, 6)
        run(mid)
    return s
