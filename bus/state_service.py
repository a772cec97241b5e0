"""The Clone-pattern state service: late joiners ask the broker for the run's state.

A subscriber that connects mid-run misses everything published before (ZeroMQ's
slow joiner), so the broker keeps a `RunState` fed by the event proxy and
answers requests on the ``state`` endpoint with the events that make it up.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog
import zmq

from evtrain.bus.address import BusAddress
from evtrain.events import DecodeError, Message, decode, encode
from evtrain.run_state import STATE_TOPICS, RunState

log = structlog.get_logger("evtrain.bus.state")

_REQUEST = b"snapshot"


class StateService:
    """Keeps the run state from ``events_source`` and serves it on ``bind_endpoint``."""

    def __init__(self, context: zmq.Context, events_source: str, bind_endpoint: str) -> None:
        self.state = RunState()
        self._context = context
        self._stop = threading.Event()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        for topic in STATE_TOPICS:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(events_source)
        self._rep = context.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(bind_endpoint)
        self._thread = threading.Thread(target=self._serve, name="evtrain-state", daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._rep, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._sub in ready:
                    self._drain_events()
                if self._rep in ready:
                    self._answer()
        finally:
            self._sub.close(linger=0)
            self._rep.close(linger=0)

    def _drain_events(self) -> None:
        while True:
            try:
                frames: list[Any] = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            try:
                self.state.update(decode(frames[1], frames[0]))
            except DecodeError:
                continue

    def _answer(self) -> None:
        while True:
            try:
                frames: list[Any] = self._rep.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # ROUTER frames: identity, empty delimiter (REQ peers), request.
            if len(frames) < 2 or frames[-1] != _REQUEST:
                continue
            envelope = frames[:-1]
            payload = [encode(msg) for msg in self.state.snapshot()]
            try:
                self._rep.send_multipart([*envelope, *payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                continue

    def stop(self) -> None:
        """Stop the thread (closes its sockets)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def fetch_snapshot(
    address: BusAddress, timeout: float = 2.0, context: zmq.Context | None = None
) -> list[Message]:
    """Ask the broker at ``address`` for the run state; empty if it does not answer."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address.endpoint("state"))
        sock.send(_REQUEST)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            log.warning("no state from broker", address=str(address))
            return []
        frames: list[Any] = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    out: list[Message] = []
    for frame in frames:
        try:
            out.append(decode(frame))
        except DecodeError:
            continue
    return out
