"""Sequence tracking: how subscribers notice messages they never got.

Publishers number each topic of a source separately, so a subscriber that
filters by topic sees contiguous numbers for what it receives; gaps are tracked
per (source, topic) and reported per source.
"""

from __future__ import annotations


class SequenceTracker:
    """Counts gaps in the per-(source, topic) sequence numbers of received messages.

    A sequence number lower than expected means the source restarted (a restarted
    stage worker counts from 0 again), not a gap: tracking starts over for it.
    """

    def __init__(self) -> None:
        self.expected: dict[tuple[str, bytes], int] = {}
        """The next sequence number per (source, topic) (hot loops update it inline)."""
        self.missing: dict[str, int] = {}
        self.total_missing = 0
        self.restarts: dict[str, int] = {}

    def observe(self, source: str, topic: bytes, seq: int) -> int:
        """Record one message; returns how many messages of its topic were skipped."""
        key = (source, topic)
        expected = self.expected.get(key)
        self.expected[key] = seq + 1
        if expected is None or seq == expected:
            return 0
        return self.irregular(key, seq, expected)

    def irregular(self, key: tuple[str, bytes], seq: int, expected: int) -> int:
        """Account for ``seq`` arriving when ``expected`` was due (a gap or a restart)."""
        source = key[0]
        if seq < expected:
            self.restarts[source] = self.restarts.get(source, 0) + 1
            return 0
        gap = seq - expected
        self.missing[source] = self.missing.get(source, 0) + gap
        self.total_missing += gap
        return gap
