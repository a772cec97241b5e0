"""The Clone-pattern state service: late joiners ask the broker for the run's state.

A subscriber that connects mid-run misses everything published before (ZeroMQ's
slow joiner), so the broker keeps a `RunState` fed by the event proxy and
answers requests on the ``state`` endpoint with the events that make it up.

``step.ended`` is by far the most frequent state event and only the latest one of
each stage counts, so it has its own subscription that the service samples: every
``STEP_PERIOD`` seconds it reads at most ``STEP_BUDGET`` of them (their ``stage``
field only; one full decode per stage). Beyond that rate the queue fills and the
broker drops step events for the service alone: the state may then be a fraction
of a second old, but the service costs the broker almost nothing even at 100k
events/s. Run, stage, eval and checkpoint events are rare and all read at once.

A reply is ``[b"snapshot", event, event...]``: the header frame makes even an
empty state a valid reply (REQ sockets discard a reply without a body).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import msgspec
import structlog
import zmq

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CurveConfig, CurveServer
from evtrain.errors import UsageError
from evtrain.events import DecodeError, Message, StepEnded, decode, encode
from evtrain.run_state import STATE_TOPICS, RunState

log = structlog.get_logger("evtrain.bus.state")

_REQUEST = b"snapshot"
_NOBLOCK = int(zmq.NOBLOCK)
_STEP_TOPIC = StepEnded.topic


class _StepKey(msgspec.Struct):
    """The part of a `StepEnded` payload the service reads for every step."""

    stage: int


_step_key = msgspec.msgpack.Decoder(_StepKey)


STEP_PERIOD = 0.02
STEP_BUDGET = 256


class StateService:
    """Keeps the run state from ``events_source`` and serves it on ``bind_endpoint``."""

    def __init__(
        self,
        context: zmq.Context,
        events_source: str,
        bind_endpoint: str,
        *,
        curve: CurveServer | None = None,
    ) -> None:
        self.state = RunState()
        self.requests = 0
        self.malformed = 0
        self._steps: dict[int, tuple[bytes, bytes]] = {}  # stage -> latest (topic, payload)
        self._context = context
        self._stop = threading.Event()
        step_topic = _STEP_TOPIC.decode()
        self._sub = self._subscriber(events_source, [t for t in STATE_TOPICS if t != step_topic])
        self._step_sub = self._subscriber(
            events_source, [step_topic] if step_topic in STATE_TOPICS else [], hwm=1000
        )
        self._rep = context.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._rep)
        try:
            self._rep.bind(bind_endpoint)
        except zmq.ZMQError as exc:
            self._close()
            raise UsageError(f"cannot bind the bus at {bind_endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._serve, name="evtrain-state", daemon=True)

    def _subscriber(self, source: str, topics: list[str], hwm: int = 100_000) -> zmq.Socket:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        for topic in topics:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sock.connect(source)
        return sock

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._rep, zmq.POLLIN)
        next_steps = time.monotonic()
        try:
            while not self._stop.is_set():
                # Round up: polling 0 ms until the deadline would spin.
                wait_ms = max(0, math.ceil((next_steps - time.monotonic()) * 1000))
                ready = dict(poller.poll(min(wait_ms, 100)))
                if self._sub in ready:
                    self._read(self._sub, budget=None)
                if time.monotonic() >= next_steps:
                    self._read(self._step_sub, budget=STEP_BUDGET)
                    next_steps = time.monotonic() + STEP_PERIOD
                if self._rep in ready:
                    self._read(self._step_sub, budget=STEP_BUDGET)  # as fresh as we can
                    self._answer()
        finally:
            self._close()

    def _close(self) -> None:
        for sock in (self._sub, self._step_sub, getattr(self, "_rep", None)):
            if sock is not None:
                sock.close(linger=0)

    def _read(self, sock: zmq.Socket, budget: int | None) -> None:
        """Fold up to ``budget`` (None: all) ready messages of ``sock`` into the state."""
        recv = sock.recv
        steps = self._steps
        count = 0
        try:
            while budget is None or count < budget:
                count += 1
                topic = recv(_NOBLOCK, copy=False)
                if not topic.more:
                    self.malformed += 1
                    continue
                payload = recv(_NOBLOCK, copy=False)  # frames of a message arrive together
                if payload.more:
                    while recv(_NOBLOCK, copy=False).more:
                        pass
                    self.malformed += 1
                    continue
                if topic.bytes == _STEP_TOPIC:
                    try:
                        stage = _step_key.decode(payload).stage
                    except Exception:  # any garbage: skip it, never die
                        self.malformed += 1
                        continue
                    steps[stage] = (_STEP_TOPIC, payload.bytes)
                    continue
                try:
                    msg = decode(payload, topic.bytes)
                except DecodeError:
                    self.malformed += 1
                    continue
                self._fold_steps()  # keep the order: steps before this event first
                self.state.update(msg)
        except zmq.Again:
            pass
        self._fold_steps()

    def _fold_steps(self) -> None:
        if not self._steps:
            return
        run = self.state.run
        for topic, payload in self._steps.values():
            try:
                msg = decode(payload, topic)
            except DecodeError:
                self.malformed += 1
                continue
            if run is None or msg.run_id == run.run_id:  # a stale run's step is not state
                self.state.update(msg)
        self._steps.clear()

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
            self.requests += 1
            payload = [encode(msg) for msg in self.state.snapshot()]
            try:
                self._rep.send_multipart([*envelope, _REQUEST, *payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                continue

    @property
    def running(self) -> bool:
        """Whether the service thread is alive."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread (closes its sockets); safe to call twice, or before `start`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        elif self._thread.ident is None:  # never started: the thread's finally never runs
            self._close()


def fetch_snapshot(
    address: BusAddress,
    timeout: float = 2.0,
    context: zmq.Context | None = None,
    *,
    curve: CurveConfig | None = None,
) -> list[Message]:
    """Ask the broker at ``address`` for the run state; empty if it does not answer."""
    frames = _request(address, timeout, context, curve)
    if frames is None:
        log.warning("no state from broker", address=str(address))
        return []
    out: list[Message] = []
    for frame in frames[1:]:  # after the header
        try:
            out.append(decode(frame))
        except DecodeError:
            continue
    return out


def ping_broker(
    address: BusAddress,
    timeout: float = 2.0,
    context: zmq.Context | None = None,
    *,
    curve: CurveConfig | None = None,
) -> bool:
    """Whether a broker answers at ``address`` within ``timeout`` seconds."""
    return _request(address, timeout, context, curve) is not None


def _request(
    address: BusAddress,
    timeout: float,
    context: zmq.Context | None,
    curve: CurveConfig | None,
) -> list[Any] | None:
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(address.endpoint("state"))
        sock.send(_REQUEST)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        frames: list[Any] = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    return frames
