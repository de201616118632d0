"""Live progress: a rich bar with requests done, live TTFT p50 and output tokens/s.

Only when stderr is a terminal; otherwise one line per finished level. That line gives the
report's own figures for the level (``summarize``: the cli passes ``stats.level_line``), so the
two never disagree; the bar's live figures are a running view (the last TTFTs, tokens over the
time so far). The runner updates a
:class:`Tally` (cheap, on the event loop); the bar reads it from rich's refresh thread.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Tally:
    """Running counts for one level; ``recent_ttft`` keeps the last TTFTs for a live median."""

    def __init__(self) -> None:
        self.done = 0
        self.ok = 0
        self.errors = 0
        self.tokens = 0
        self.recent_ttft: deque[float] = deque(maxlen=256)
        self.started = time.perf_counter()

    def add(self, ok: bool, ttft: float | None, tokens: int) -> None:
        self.done += 1
        if ok:
            self.ok += 1
            self.tokens += tokens
        else:
            self.errors += 1
        if ttft is not None:
            self.recent_ttft.append(ttft)

    def merge(self, done: int, ok: int, errors: int, tokens: int, ttfts: list[float]) -> None:
        self.done += done
        self.ok += ok
        self.errors += errors
        self.tokens += tokens
        self.recent_ttft.extend(ttfts)

    def ttft_p50_ms(self) -> float | None:
        if not self.recent_ttft:
            return None
        values = sorted(self.recent_ttft)
        return values[len(values) // 2] * 1000

    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0


class Progress:
    """One bar per level. ``total`` is the request count, or ``None`` for a timed level."""

    def __init__(self, enabled: bool | None = None, summarize: Callable[[Any], str] | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.summarize = summarize  # a finished level (runner.LevelResult) -> its line
        self._progress: Any = None
        self._task: Any = None
        self._tally: Tally | None = None
        self._label = ""

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[live]}"), TimeElapsedColumn(),
                console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start_level(self, label: str, total: int | None, tally: Tally) -> None:
        self._tally = tally
        self._label = label
        if self._progress is not None:
            self._task = self._progress.add_task(label, total=total, live="")

    def refresh(self) -> None:
        """Push the tally to the bar (call a few times a second)."""
        if self._progress is None or self._tally is None or self._task is None:
            return
        t = self._tally
        p50 = t.ttft_p50_ms()
        live = (f"TTFT p50 {p50:7.1f} ms  " if p50 is not None else "") + f"{t.tokens_per_s():8.1f} tok/s"
        if t.errors:
            live += f"  [red]{t.errors} errors[/red]"
        self._progress.update(self._task, completed=t.done, live=live)

    def end_level(self, result: Any, suffix: str = "") -> None:
        """The level is over: its line, with the figures the report gives it."""
        self.refresh()
        if self.summarize is not None:
            summary = self.summarize(result)
        else:
            ok = sum(1 for r in result.results if r.ok)
            summary = f"{ok} ok, {len(result.results) - ok} errors"
        if self._progress is None:
            print(f"{self._label}: {summary}{suffix}", file=sys.stderr, flush=True)
        else:
            self._progress.console.print(f"{self._label}: {summary}{suffix}")
        self._tally = None
        self._task = None

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)
