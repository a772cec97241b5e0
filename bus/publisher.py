"""Publisher: stamps the envelope and sends without ever blocking the caller.

The socket is an XPUB with ``XPUB_NODROP``: when its queue (``hwm`` messages) is
full, a non-blocking send fails with EAGAIN instead of dropping silently as a PUB
would, so every drop is counted here. Each dropped message still consumed a
sequence number, so subscribers see the gap too, and the drop count is itself
published as a `BusDrops` event once the queue has room again.

Its only peer is the broker, so NODROP cannot let one slow hook stall anyone: the
broker's own XPUB towards the hooks keeps the default (drop) behaviour.

Not thread-safe: use one Publisher per thread.
"""

from __future__ import annotations

import time

import structlog
import zmq

from evtrain.errors import UsageError
from evtrain.events import BusDrops, Message, encode

log = structlog.get_logger("evtrain.bus.publisher")

DEFAULT_HWM = 10_000
_NOBLOCK_MORE = zmq.NOBLOCK | zmq.SNDMORE


class Publisher:
    """Publishes messages of one source (``stage/0``, ``hook/logging``) to a broker input.

    ``endpoint`` is the broker's ``events_in`` or ``commands_in``. The constructor
    waits up to ``connect_timeout`` seconds until the broker's subscription arrives,
    so nothing published afterwards is lost to a link still being set up.
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
    ) -> None:
        self.source = source
        self.run_id = run_id
        self.sent = 0
        self.dropped = 0
        self._seq = 0
        self._reported_drops = 0
        self._last_report = 0.0
        self._report_interval = drop_report_interval
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 2000)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise UsageError(f"cannot connect to the bus at {endpoint}: {exc}") from None
        if not self._sock.poll(int(connect_timeout * 1000), zmq.POLLIN):
            self._sock.close(linger=0)
            raise UsageError(
                f"no evtrain broker answered at {endpoint} within {connect_timeout:g} s "
                "(is `evtrain bus` running at that address?)"
            )
        self._drain_subscriptions()

    def _drain_subscriptions(self) -> None:
        # Subscription frames queue up here; reading them keeps that queue short.
        try:
            while True:
                self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def publish(self, msg: Message) -> bool:
        """Stamp and send ``msg``; returns False (and counts a drop) if the queue is full."""
        seq = self._seq
        self._seq = seq + 1
        msg.seq = seq
        msg.source = self.source
        msg.run_id = self.run_id
        msg.ts = time.time()
        try:
            self._sock.send(msg.topic, _NOBLOCK_MORE)
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        if self.dropped != self._reported_drops:
            self._report_drops()
        return True

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

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
