"""Publisher: stamps the envelope and sends without ever blocking the caller.

The socket is an XPUB with ``XPUB_NODROP``: when its queue (``hwm`` messages) is
full, a non-blocking send fails with EAGAIN instead of dropping silently as a PUB
would, so every drop is counted here. Each dropped message still consumed a
sequence number, so subscribers see the gap too, and the drop count is itself
published as a `BusDrops` event once the queue has room again.

Its only peer is the broker, so NODROP cannot let one slow hook stall anyone: the
broker's own XPUB towards the hooks keeps the default (drop) behaviour.

The XPUB also queues what comes upstream: from an evtrain broker that is only
its own subscription to everything, once per connection (the broker never
passes on what subscribers send), so reading it once after connecting suffices.

A message whose payload exceeds the bus's frame limit (``MAX_FRAME_BYTES``) would
be dropped by the broker, or cost the connection, so it never leaves as it is:
its longest texts (a traceback, an error) are cut in the middle until it fits,
and a message that is long for another reason is dropped and counted like a
full queue.

Not thread-safe: use one Publisher per thread.
"""

from __future__ import annotations

import time

import msgspec
import structlog
import zmq

from evtrain.bus.limits import MAX_FRAME_BYTES
from evtrain.bus.security import CurveConfig
from evtrain.errors import UsageError
from evtrain.events import BusDrops, Message, encode

log = structlog.get_logger("evtrain.bus.publisher")

DEFAULT_HWM = 10_000
# Plain ints: pyzmq converts its enum flags on every call, which doubles a send's cost.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# pyzmq's Python-level Socket.send adds about half a microsecond per frame, a
# quarter of a publish: call the compiled backend method directly.
_send = zmq.backend.Socket.send
_MIN_KEPT = 256  # bytes a shortened text keeps at least
_MARKER_ROOM = 64  # more than the "[... N characters cut ...]" marker takes


class Publisher:
    """Publishes messages of one source (``stage/0``, ``hook/logging``) to a broker input.

    ``endpoint`` is the broker's ``events_in`` or ``commands_in``. The constructor
    waits up to ``connect_timeout`` seconds until the broker's subscription arrives,
    so nothing published afterwards is lost to a link still being set up. ``curve``
    is needed when the broker uses CURVE (see `evtrain.bus.security`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        source: str,
        run_id: str = "",
        hwm: int = DEFAULT_HWM,
        connect_timeout: float = 10.0,
        drop_report_interval: float = 1.0,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self.source = source
        self.run_id = run_id
        self.sent = 0
        self.dropped = 0
        self.oversized = 0
        """Messages dropped because they did not fit a frame, even shortened (in `dropped` too)."""
        self._oversized_types: set[str] = set()
        # One sequence per topic: a subscriber filtering by topic prefix still sees
        # every number of the topics it gets, so only real losses look like gaps.
        self._seqs: dict[bytes, int] = {}
        self._reported_drops = 0
        self._last_report = 0.0
        self._report_interval = drop_report_interval
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 2000)
        if curve is not None:
            curve.apply(self._sock)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise UsageError(f"cannot connect to the bus at {endpoint}: {exc}") from None
        if not self._sock.poll(int(connect_timeout * 1000), zmq.POLLIN):
            self._sock.close(linger=0)
            hint = (
                "check that the bus's curve directory holds an authorized key for us"
                if curve is not None
                else "is `evtrain bus` running there? a CURVE bus also needs --curve-dir"
            )
            raise UsageError(
                f"no evtrain broker answered at {endpoint} within {connect_timeout:g} s ({hint})"
            )
        recv = self._sock.recv
        try:
            while True:
                recv(_NOBLOCK)
        except zmq.Again:
            pass

    def publish(self, msg: Message) -> bool:
        """Stamp and send ``msg``; returns False (and counts a drop) if the queue is full.

        Never blocks: a full queue drops ``msg``; the drop still uses a sequence
        number (subscribers see the gap) and is reported as a `BusDrops` event.
        """
        topic = msg.topic
        sock = self._sock
        seqs = self._seqs
        seq = seqs.get(topic, 0)
        seqs[topic] = seq + 1
        msg.seq = seq
        msg.source = self.source
        msg.run_id = self.run_id
        msg.ts = time.time()
        payload = encode(msg)
        if len(payload) > MAX_FRAME_BYTES:
            shortened = _shorten(msg, payload)
            if shortened is None:
                self._oversized(msg, len(payload))
                return False
            payload = shortened
        try:
            # The XPUB admits a whole message or nothing: HWM is checked per message.
            _send(sock, topic, _NOBLOCK_MORE)
            _send(sock, payload, _NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        if self.dropped != self._reported_drops:
            self._report_drops()
        return True

    def _oversized(self, msg: Message, size: int) -> None:
        self.dropped += 1
        self.oversized += 1
        kind = msg.topic.decode()
        if kind not in self._oversized_types:  # once per type: it may recur every step
            self._oversized_types.add(kind)
            log.error(
                "message too large for the bus: dropped",
                source=self.source,
                type=kind,
                bytes=size,
                limit=MAX_FRAME_BYTES,
            )

    def _report_drops(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < self._report_interval:
            return
        self._last_report = now
        newly = self.dropped - self._reported_drops
        self._reported_drops = self.dropped
        log.warning("bus events dropped", source=self.source, dropped=newly, total=self.dropped)
        self.publish(BusDrops(dropped=newly, total_dropped=self.dropped))

    def close(self, linger: float = 2.0) -> None:
        """Report outstanding drops, then close; waits up to ``linger`` s to flush."""
        if self._sock.closed:
            return
        if self.dropped != self._reported_drops:
            self._report_drops(force=True)
        self._sock.close(linger=int(linger * 1000))

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return bool(self._sock.closed)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flush_process(linger_s: float = 2.0) -> None:
    """Before a process ends with ``os._exit``: send what its ZeroMQ sockets still hold
    (``linger_s`` at most) and end its context; a socket left open is closed with that
    linger. Without it the last events of a process that exits that way are lost."""
    zmq.Context.instance().destroy(linger=int(linger_s * 1000))


def _shorten(msg: Message, payload: bytes) -> bytes | None:
    """``msg`` encoded within the frame limit by cutting its longest texts in the middle.

    The texts above a common length are cut down to it (so a long error and a
    long traceback both keep a fair share), keeping both ends: an error's first
    line and a traceback's last frames say the most. None if that is not enough
    (the size is in other fields).
    """
    while (excess := len(payload) - MAX_FRAME_BYTES) > 0:
        texts = sorted(
            (
                (len(encoded := value.encode()), name, encoded)
                for name in msg.__struct_fields__
                if isinstance(value := getattr(msg, name), str)
            ),
            reverse=True,
        )
        # The common length in bytes: cutting every longer text to it (plus a
        # marker each) removes ``excess`` bytes.
        level, total = 0, 0
        for k, (size, _, _) in enumerate(texts, start=1):
            total += size
            level = (total - excess - k * _MARKER_ROOM) // k
            if k == len(texts) or level >= texts[k][0]:
                break
        level = max(level, _MIN_KEPT)
        changes = {}
        for size, name, encoded in texts:
            if size > level + _MARKER_ROOM:
                head = level // 4
                marker = f"\n[... {size - level} bytes cut ...]\n"
                # A cut inside a UTF-8 sequence drops that character's remains.
                changes[name] = (
                    encoded[:head].decode(errors="ignore")
                    + marker
                    + encoded[size - (level - head) :].decode(errors="ignore")
                )
        if not changes:
            return None
        msg = msgspec.structs.replace(msg, **changes)
        payload = encode(msg)
    return payload
