"""Per-source sequence tracking: how subscribers notice messages they never got."""

from __future__ import annotations


class SequenceTracker:
    """Counts gaps in the per-source sequence numbers of received messages.

    A sequence number lower than expected means the source restarted (a restarted
    stage worker counts from 0 again), not a gap: tracking starts over for it.
    """

    def __init__(self) -> None:
        self._expected: dict[str, int] = {}
        self.missing: dict[str, int] = {}
        self.total_missing = 0
        self.restarts: dict[str, int] = {}

    def observe(self, source: str, seq: int) -> int:
        """Record one message; returns how many messages from ``source`` were skipped."""
        expected = self._expected.get(source)
        self._expected[source] = seq + 1
        if expected is None or seq == expected:
            return 0
        if seq < expected:
            self.restarts[source] = self.restarts.get(source, 0) + 1
            return 0
        gap = seq - expected
        self.missing[source] = self.missing.get(source, 0) + gap
        self.total_missing += gap
        return gap
