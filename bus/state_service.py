"""The Clone-pattern state service: late joiners ask the broker for the run's state.

A subscriber that connects mid-run misses everything published before (ZeroMQ's
slow joiner), so the broker keeps a `RunState` fed by the event proxy and
answers requests on the ``state`` endpoint with the events that make it up.

``step.ended`` is by far the most frequent state event and only the latest one of
each stage counts, so it has its own subscription that the service samples: every
``STEP_PERIOD`` seconds it reads at most ``STEP_BUDGET`` of them (their ``stage``
and ``replica`` fields only; one full decode per stage; other replicas than 0
are skipped, as the run state holds one entry per stage). Beyond that rate the queue fills and the
broker drops step events for the service alone: the state may then be a fraction
of a second old, but the service costs the broker almost nothing even at 100k
events/s. Run, stage, eval, checkpoint and hook events are rare and read in
larger batches.

A request is one frame (a REQ socket adds its empty delimiter): ``snapshot``
is answered ``[b"snapshot", event, event...]`` (the header frame makes even an
empty state a valid reply; REQ sockets discard a reply without a body), and
``stats`` is answered ``[b"stats", JSON]`` with the broker's counters (see
`evtrain.bus.broker.fetch_stats`). Anything else is counted and not answered.

Memory stays bounded whatever a client does. The state holds one entry per stage
and hook of the run (see `RunState`), each at most ``MAX_FRAME_BYTES`` (the
broker's inputs admit nothing longer), so a reply is at most ``MAX_REPLY_BYTES``.
The encoded reply is built once per state change and every answer sends the
same frames, which libzmq shares by reference count, so queued answers to any
number of clients cost one copy of the state per version. A client that does
not read its answers has at most ``STATE_REPLIES_QUEUED`` of them queued (the
ROUTER reports a full queue, and that request goes unanswered); requests are
frames of at most ``MAX_REQUEST_BYTES``, and one with more frames than a
request has is discarded frame by frame. Requests are read at ``REQUEST_RATE``
at most; beyond it they wait in libzmq's small per-client queues.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import zmq

from evtrain.bus.address import BusAddress
from evtrain.bus.limits import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    QUEUE_MESSAGES,
    STATE_REPLIES_QUEUED,
    socket_limit,
)
from evtrain.bus.security import CurveConfig, CurveServer
from evtrain.errors import UsageError
from evtrain.events import MAX_STAGES, DecodeError, Message, StepEnded, decode, encode
from evtrain.run_state import MAX_HOOKS, STATE_TOPICS, RunState

log = structlog.get_logger("evtrain.bus.state")

_REQUEST = b"snapshot"
_STATS = b"stats"
_KINDS = (_REQUEST, _STATS)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_STEP_TOPIC = StepEnded.topic

MAX_REPLY_BYTES = (2 * MAX_STAGES + MAX_HOOKS + 4) * MAX_FRAME_BYTES
"""Largest reply (33 MiB): run, stages, steps, hooks, eval, checkpoint, end, a frame each.

Real ones are a few KiB per stage; a client that stops reading holds at most
``STATE_REPLIES_QUEUED`` (plus the one being written) of whatever versions it
asked for.
"""

STEP_PERIOD = 0.02
STEP_BUDGET = 256
EVENT_BUDGET = 4096  # rare state events folded per loop turn, so requests are answered too
REQUEST_RATE = 1000.0
"""Requests read per second at most (bursts of ``REQUEST_BURST``); more wait queued.

Every thread of the broker shares one interpreter lock, which the proxies give up
at each libzmq call: answering a flood as fast as it came kept them waiting for
seconds.
"""
REQUEST_BURST = 64


class _StepKey(msgspec.Struct):
    """The part of a `StepEnded` payload the service reads for every step."""

    stage: int
    replica: int = 0


_step_key = msgspec.msgpack.Decoder(_StepKey)


@dataclass(frozen=True)
class StateStats:
    """What the state service did so far."""

    requests: int = 0
    """Well-formed requests received."""
    unanswered: int = 0
    """Requests not answered: the client had unread answers queued, or left."""
    malformed_requests: int = 0
    malformed_events: int = 0
    """State events that did not decode."""
    ignored_events: int = 0
    """Events outside the run's shape (see `RunState.ignored`)."""
    entries: int = 0
    """Events the state holds now."""


class StateService:
    """Keeps the run state from ``events_source`` and serves it on ``bind_endpoint``.

    ``stats`` encodes the answer to a ``stats`` request; it runs in the service's
    thread.
    """

    def __init__(
        self,
        context: zmq.Context,
        events_source: str,
        bind_endpoint: str,
        *,
        stats: Callable[[], bytes],
        curve: CurveServer | None = None,
    ) -> None:
        self.state = RunState()
        self.requests = 0
        self.unanswered = 0
        self.malformed_requests = 0
        self.malformed = 0
        self._steps: dict[int, tuple[bytes, bytes]] = {}  # stage -> latest (topic, payload)
        self._reply: list[zmq.Frame] | None = None  # the encoded state, until it changes
        self._context = context
        self._stats = stats  # the broker's counters, encoded
        self._stop = threading.Event()
        step_topic = _STEP_TOPIC.decode()
        self._sub = self._subscriber(
            events_source, [t for t in STATE_TOPICS if t != step_topic], hwm=QUEUE_MESSAGES
        )
        self._step_sub = self._subscriber(
            events_source, [step_topic] if step_topic in STATE_TOPICS else [], hwm=1000
        )
        self._rep = context.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.setsockopt(zmq.MAXMSGSIZE, socket_limit(MAX_REQUEST_BYTES))
        self._rep.setsockopt(zmq.SNDHWM, STATE_REPLIES_QUEUED)
        self._rep.setsockopt(zmq.RCVHWM, 16)
        # A full or vanished client then fails the send instead of queueing or
        # silently dropping it: an unanswerable request costs one failed send.
        self._rep.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            curve.apply(self._rep)
        try:
            self._rep.bind(bind_endpoint)
        except zmq.ZMQError as exc:
            self._close()
            raise UsageError(f"cannot bind the bus at {bind_endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._serve, name="evtrain-state", daemon=True)

    def _subscriber(self, source: str, topics: list[str], hwm: int) -> zmq.Socket:
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

    def stats(self) -> StateStats:
        """Counters so far (safe to call from any thread)."""
        state = self.state
        return StateStats(
            requests=self.requests,
            unanswered=self.unanswered,
            malformed_requests=self.malformed_requests,
            malformed_events=self.malformed,
            ignored_events=state.ignored,
            entries=len(state.snapshot()),
        )

    def _serve(self) -> None:
        with_requests = zmq.Poller()
        with_requests.register(self._sub, zmq.POLLIN)
        with_requests.register(self._rep, zmq.POLLIN)
        events_only = zmq.Poller()
        events_only.register(self._sub, zmq.POLLIN)
        next_steps = time.monotonic()
        tokens, refilled = float(REQUEST_BURST), time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                tokens = min(REQUEST_BURST, tokens + (now - refilled) * REQUEST_RATE)
                refilled = now
                # Round up: polling 0 ms until the deadline would spin.
                wait_ms = max(0, math.ceil((next_steps - now) * 1000))
                poller = with_requests
                if tokens < 1:  # requests wait in their queues until one is due
                    poller = events_only
                    wait_ms = min(wait_ms, math.ceil((1 - tokens) / REQUEST_RATE * 1000))
                ready = dict(poller.poll(min(wait_ms, 100)))
                if self._sub in ready:
                    self._read(self._sub, budget=EVENT_BUDGET)
                if time.monotonic() >= next_steps:
                    self._read(self._step_sub, budget=STEP_BUDGET)
                    next_steps = time.monotonic() + STEP_PERIOD
                if self._rep in ready:
                    self._read(self._step_sub, budget=STEP_BUDGET)  # as fresh as we can
                    tokens -= self._answer(int(tokens))
        finally:
            self._close()

    def _close(self) -> None:
        for sock in (self._sub, self._step_sub, getattr(self, "_rep", None)):
            if sock is not None:
                sock.close(linger=0)

    def _read(self, sock: zmq.Socket, budget: int) -> None:
        """Fold up to ``budget`` ready messages of ``sock`` into the state."""
        recv = sock.recv
        steps = self._steps
        count = 0
        try:
            while count < budget:
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
                        key = _step_key.decode(payload.buffer)
                    except Exception:  # any garbage: skip it, never die
                        self.malformed += 1
                        continue
                    if key.replica == 0:  # the state holds replica 0's steps, one per stage
                        steps[key.stage] = (_STEP_TOPIC, payload.bytes)
                    continue
                try:
                    msg = decode(payload.buffer, topic.bytes)
                except DecodeError:
                    self.malformed += 1
                    continue
                self._fold_steps()  # keep the order: steps before this event first
                self.state.update(msg)
                self._reply = None
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
        self._reply = None

    def _answer(self, budget: int) -> int:
        """Answer up to ``budget`` ready requests; returns how many were read."""
        sock = self._rep
        count = 0
        while count < budget:
            try:
                request = self._request()
            except zmq.Again:
                break
            count += 1
            if request is None:
                self.malformed_requests += 1
                continue
            envelope, kind = request
            self.requests += 1
            if kind == _STATS:
                reply = [zmq.Frame(_STATS), zmq.Frame(self._stats())]
            else:
                if self._reply is None:
                    state = self.state.snapshot()
                    self._reply = [zmq.Frame(_REQUEST), *(zmq.Frame(encode(m)) for m in state)]
                reply = self._reply
            frames: list[bytes | zmq.Frame] = [*envelope, *reply]
            *head, last = frames
            try:
                for frame in head:
                    sock.send(frame, _NOBLOCK_MORE, copy=False)
                sock.send(last, _NOBLOCK, copy=False)
            except zmq.ZMQError:  # EAGAIN: its answers are unread; EHOSTUNREACH: it left
                self.unanswered += 1
        return count

    def _request(self) -> tuple[list[bytes], bytes] | None:
        """The routing envelope and kind of the next request; None if it is none.

        Reads frame by frame, keeping the first three: a message of many frames
        is discarded as it is read, never collected.
        """
        recv = self._rep.recv
        frames: list[bytes] = []
        count = 0
        more = True
        while more:
            frame = recv(_NOBLOCK, copy=False)
            more = frame.more
            count += 1
            if count <= 3:
                frames.append(frame.bytes)
        # [identity, request] from a DEALER, [identity, b"", request] from a REQ.
        if count == 2 and frames[1] in _KINDS:
            return frames[:1], frames[1]
        if count == 3 and frames[1] == b"" and frames[2] in _KINDS:
            return frames[:2], frames[2]
        return None

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
    frames = request(address, _REQUEST, timeout, context, curve)
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
    return request(address, _REQUEST, timeout, context, curve) is not None


def request(
    address: BusAddress,
    kind: bytes,
    timeout: float,
    context: zmq.Context | None = None,
    curve: CurveConfig | None = None,
) -> list[Any] | None:
    """Send the request ``kind`` to the state endpoint; its reply frames, None on timeout."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    # A REQ socket whose handshake failed (a key the broker refuses) has no peer
    # until it reconnects: its send would block for good.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
    if curve is not None:
        curve.apply(sock)
    deadline = time.monotonic() + timeout
    try:
        sock.connect(address.endpoint("state"))
        try:
            sock.send(kind)
        except zmq.Again:
            return None
        left = max(0.0, deadline - time.monotonic())
        if not sock.poll(int(left * 1000), zmq.POLLIN):
            return None
        frames: list[Any] = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    return frames
