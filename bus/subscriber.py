"""Subscriber: receives messages by topic prefix inside an anyio (asyncio) task.

It awaits readiness once and then drains every ready message without awaiting
again: one await per message would cap a subscriber well below the broker's
rate, draining reaches it (figures: docs/benchmarks.md, "Measurements behind
design choices"). A drain returns at most
`DRAIN_LIMIT` messages: decoded messages are objects the garbage collector
tracks, and a batch of thousands alive at once made its passes (and the full
collections its survivors trigger) cost more than decoding them.

Malformed frames (garbage, and messages with out-of-range values: see
`evtrain.events`) are skipped, counted per kind and logged with a rate limit;
gaps in each source's sequence numbers are counted (see `SequenceTracker`).
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import anyio.lowlevel
import structlog
import zmq

from evtrain.bus.security import CurveConfig
from evtrain.bus.sequence import SequenceTracker
from evtrain.errors import UsageError
from evtrain.events import (
    BY_TAG,
    SCHEMA_VERSION,
    DecodeError,
    Message,
    decode,
    decode_unchecked,
)
from evtrain.ratelimit import RateLimitedLog

log = structlog.get_logger("evtrain.bus.subscriber")

DEFAULT_HWM = 10_000
DRAIN_LIMIT = 256
"""Messages one drain returns at most (see the module docstring).

Per message, in a process with a hook's heap, far larger batches cost more and
smaller ones gain nothing more (figures: docs/benchmarks.md, "Measurements
behind design choices").
"""
# Plain ints: pyzmq converts its enum flags on every call (measurably slower).
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_TOPICS: frozenset[bytes] = frozenset(tag.encode() for tag in BY_TAG)


class Subscriber:
    """A SUB socket on the broker's ``events_out`` (or ``commands_out``).

    ``topics`` are prefixes (``"step."``, ``"checkpoint.committed"``); the empty
    prefix receives everything. ``curve`` is needed when the broker uses CURVE.
    """

    def __init__(
        self,
        endpoint: str,
        topics: Iterable[str] = ("",),
        *,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self.received = 0
        self.malformed_log = RateLimitedLog(log, "malformed bus frames skipped")
        """Skipped frames, counted per kind (``malformed_log.counts``)."""
        self.gaps = SequenceTracker()
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self.topics = sorted(set(topics))
        for topic in self.topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise UsageError(f"cannot connect to the bus at {endpoint}: {exc}") from None
        self._fd = self._sock.getsockopt(zmq.FD)
        self._empty = False  # whether the last drain found the socket empty

    @property
    def malformed(self) -> int:
        """Frames skipped because they were not valid messages."""
        return self.malformed_log.total

    def subscribe(self, topic: str) -> None:
        """Add a topic prefix."""
        if topic not in self.topics:
            self.topics.append(topic)
            self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())

    def drain(self, limit: int = DRAIN_LIMIT) -> list[Message]:
        """Every message ready now (up to ``limit``), without waiting.

        The fast path reads two frames and decodes, without asking ZeroMQ whether
        a frame has more parts (that query costs as much as the receive itself).
        Framing is checked by content instead: the first frame must be one of our
        topics and the payload must decode as that topic's type. On a mismatch,
        the RCVMORE flag of the frame at hand tells where the next message starts,
        so garbage (one frame, three frames, unknown topics, bad payloads) costs
        at most itself: the valid message after it is never lost.
        """
        out: list[Message] = []
        append = out.append
        recv = self._sock.recv
        expected = self.gaps.expected
        irregular = self.gaps.irregular
        max_tracked = self.gaps.max_tracked
        topics = _TOPICS
        fast_decode = decode_unchecked
        version = SCHEMA_VERSION
        start: bytes | None = None  # a frame already read that starts a message
        self._empty = False
        received = 0
        count = 0
        while count < limit or start is not None:  # never stop inside a message
            count += 1
            if start is None:
                try:
                    topic = recv(_NOBLOCK)
                except zmq.Again:
                    self._empty = True
                    break
            else:
                topic, start = start, None
            if topic not in topics:
                self._skip_rest()
                self.malformed_log("unknown topic frame")
                continue
            try:
                # All frames of a message arrive together: EAGAIN here means the
                # topic frame was a message on its own.
                payload = recv(_NOBLOCK)
            except zmq.Again:
                self.malformed_log("one frame instead of [topic, payload]")
                self._empty = True
                break
            try:
                msg = fast_decode(payload)
                valid = msg.v == version and msg.topic == topic
            except Exception:  # whatever msgspec raises: `decode` classifies it below
                valid = False
            if not valid:
                try:
                    msg = decode(payload, topic)
                except DecodeError as exc:
                    # A bad payload, or the topic was a one-frame message and this
                    # frame starts the next message.
                    if payload in topics and self._more():
                        start = payload
                    else:
                        self._skip_rest()
                    self.malformed_log(exc.kind, error=str(exc)[:200])
                    continue
            received += 1
            # SequenceTracker.observe, inlined: this loop runs for every event.
            key = (msg.source, topic)
            seq = msg.seq
            due = expected.get(key)
            expected[key] = seq + 1
            if due is None:
                if len(expected) > max_tracked:
                    self.gaps.trim()
            elif seq != due:
                irregular(key, seq, due)
            append(msg)
        self.received += received
        return out

    def _more(self) -> bool:
        return bool(self._sock.get(_RCVMORE))

    def _skip_rest(self) -> None:
        """Discard the remaining frames of the message whose frame was just read."""
        recv = self._sock.recv
        while self._more():
            recv(_NOBLOCK)

    async def receive(
        self, limit: int = DRAIN_LIMIT, timeout: float | None = None
    ) -> list[Message]:
        """Wait until at least one message is ready, then return all ready ones.

        Returns an empty list when ``timeout`` seconds pass with nothing.
        """
        if timeout is None:  # a cancel scope per call costs more than a small batch
            return await self._receive(limit)
        with anyio.move_on_after(timeout):
            return await self._receive(limit)
        return []

    async def _receive(self, limit: int) -> list[Message]:
        sock = self._sock
        while True:
            # After a drain that emptied the socket, ask EVENTS (cheap) before trying
            # a receive (a failed receive raises, which costs several times more).
            # EVENTS also re-arms the edge-triggered fd before we sleep on it.
            if not self._empty or sock.get(_EVENTS) & _POLLIN:
                batch = self.drain(limit)
                if batch:
                    return batch
                if not self._empty:  # a full drain of malformed frames: let others run
                    await anyio.lowlevel.checkpoint()
                continue
            await anyio.wait_readable(self._fd)
            self._empty = False

    def close(self) -> None:
        """Close the socket; log the malformed-frame counts not logged yet."""
        self.malformed_log.flush()
        self._sock.close(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
