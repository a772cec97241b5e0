"""Logging what repeats: the first few occurrences of each kind in full, then counts.

Malformed bus frames, unreadable event lines and a hook handler that raises on
every event all happen as often as a sender (or a bug) likes. Each consumer
keeps one `RateLimitedLog` per thing it counts: every occurrence is counted
per kind, the first ``first`` of a kind are logged with their details, and
after that one line per kind at most every ``interval`` seconds says how many
more there were. `flush` reports what was counted but not yet logged (call it
when the consumer stops), so no count is ever lost, only lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MAX_KINDS = 1000
"""Kinds tracked one by one; past that, further kinds are counted together as ``"other"``."""


class RateLimitedLog:
    """Counts occurrences per kind and logs them with a bounded number of lines.

    ``logger`` is a structlog logger, ``event`` the message of every line;
    ``level`` the method to call (``"warning"``, ``"error"``...).
    ``on_summary(kind, more)`` is called with every count line, for consumers
    that report the counts elsewhere too (an event, a metric).
    """

    def __init__(
        self,
        logger: Any,
        event: str,
        *,
        first: int = 1,
        interval: float = 60.0,
        level: str = "warning",
        on_summary: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.event = event
        self.first = first
        self.interval = interval
        self.total = 0
        self.counts: dict[str, int] = {}
        """Occurrences per kind, all of them (logged or not)."""
        self._emit = getattr(logger, level)
        self._on_summary = on_summary
        self._clock = clock
        self._unlogged: dict[str, int] = {}
        self._last_line: dict[str, float] = {}

    def __call__(self, kind: str, **fields: Any) -> bool:
        """Count one occurrence of ``kind``; True when it was logged in full.

        ``fields`` describe this occurrence (shown only when it is logged in full).
        """
        if kind not in self.counts and len(self.counts) >= MAX_KINDS:
            kind = "other"
        count = self.counts.get(kind, 0) + 1
        self.counts[kind] = count
        self.total += 1
        now = self._clock()
        if count <= self.first:
            self._last_line[kind] = now
            self._emit(self.event, kind=kind, occurrence=count, **fields)
            return True
        self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
        if now - self._last_line.get(kind, now) >= self.interval:
            self._summary(kind, now)
        return False

    def flush(self) -> None:
        """Log the counts not yet logged, one line per kind."""
        now = self._clock()
        for kind in list(self._unlogged):
            self._summary(kind, now)

    def _summary(self, kind: str, now: float) -> None:
        more = self._unlogged.pop(kind, 0)
        if not more:
            return
        self._last_line[kind] = now
        self._emit(f"{self.event} (repeated)", kind=kind, more=more, total=self.counts[kind])
        if self._on_summary is not None:
            self._on_summary(kind, more)
