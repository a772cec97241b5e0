"""Sequence tracking: how subscribers notice messages they never got.

Publishers number each topic of a source separately, so a subscriber that
filters by topic sees contiguous numbers for what it receives; gaps are tracked
per (source, topic) and reported per source.

The numbers come from the wire: whatever they are, the counts stay in
``0..MAX_INT`` (a sum that would pass it saturates), so a `BusGaps` built from
them always encodes; a jump ahead of more than `MAX_GAP` is not counted as
lost messages but, like a number lower than expected, starts tracking over
(no queue holds that many: the numbering itself changed); and the table of
tracked (source, topic) pairs stays bounded however many sources a sender
makes up.
"""

from __future__ import annotations

from evtrain.events import MAX_INT

MAX_GAP = 10_000_000
"""Most messages one gap may count as lost."""
MAX_TRACKED = 4096
"""(source, topic) pairs tracked at once; past that, the earliest tracked is forgotten."""


class SequenceTracker:
    """Counts gaps in the per-(source, topic) sequence numbers of received messages.

    A sequence number lower than expected means the source restarted (a restarted
    stage worker counts from 0 again), not a gap: tracking starts over for it, as
    after a jump past `MAX_GAP`; ``restarts`` counts both.
    """

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self.expected: dict[tuple[str, bytes], int] = {}
        """The next sequence number per (source, topic) (hot loops update it inline)."""
        self.missing: dict[str, int] = {}
        self.total_missing = 0
        self.restarts = 0
        self.max_tracked = max_tracked

    def observe(self, source: str, topic: bytes, seq: int) -> int:
        """Record one message; returns how many messages of its topic were skipped."""
        key = (source, topic)
        expected = self.expected.get(key)
        self.expected[key] = seq + 1
        if expected is None:
            self.trim()
            return 0
        if seq == expected:
            return 0
        return self.irregular(key, seq, expected)

    def irregular(self, key: tuple[str, bytes], seq: int, expected: int) -> int:
        """Account for ``seq`` arriving when ``expected`` was due (a gap or a restart)."""
        gap = seq - expected
        if gap < 0 or gap > MAX_GAP:
            self.restarts = min(self.restarts + 1, MAX_INT)
            return 0
        source = key[0]
        self.missing[source] = min(self.missing.get(source, 0) + gap, MAX_INT)
        self.total_missing = min(self.total_missing + gap, MAX_INT)
        return gap

    def trim(self) -> None:
        """Forget the oldest pairs beyond ``max_tracked`` (call after adding a new pair)."""
        expected = self.expected
        while len(expected) > self.max_tracked:
            del expected[next(iter(expected))]
        # Reported and cleared regularly by its owner; bounded here for owners that never do.
        while len(self.missing) > self.max_tracked:
            del self.missing[next(iter(self.missing))]
