"""The broker: two XSUB/XPUB proxies, events (stages -> hooks) and commands (hooks -> stages).

It binds every socket before it returns from `start`, so publishers and subscribers
that connect afterwards never race it. Its XSUB sides subscribe to everything
themselves: every publisher always has the broker as a subscriber, so the first
events of a run are never filtered away while no hook listens yet, and a
publisher can confirm the link is up before it sends (see `Publisher`).
Publishers therefore never need the hooks' subscriptions, and nothing a
subscriber sends ever travels on to a publisher.

Each proxy is a loop of ours, not libzmq's: downstream it forwards bursts of
``[topic, payload]`` messages without decoding them (a message of another
shape, or with a topic that is not an evtrain topic, is dropped and counted);
upstream it reads what subscribers send and drops it, counting what is not a
subscription to the grammar in `evtrain.bus.limits`. libzmq's XPUB applies
subscriptions to its matching trie by itself; since only evtrain topics are
ever forwarded, a subscription outside the grammar can never select anything,
and its length is bounded by the frame limit below. (``ZMQ_XPUB_MANUAL``, which
would let the loop apply only valid ones, attributes a subscription to the
wrong subscriber once a non-subscription frame arrived upstream in libzmq 4.3.5,
so a rogue client could steal a hook's subscription.) `Broker.stats` returns
the counts (`fetch_stats` asks a broker in another process); the proxies log
them, at most every ``REPORT_INTERVAL`` seconds while hostile input keeps
coming.

What one forwarded event costs (figures: docs/benchmarks.md, "Measurements
behind design choices"): the loop's pyzmq calls (two receives, two sends; the
payload is received as a Frame because its ``more`` flag is the cheap way to
see a third frame, asking ``ZMQ_RCVMORE`` through pyzmq costs more), plus the
I/O thread's work and, at wakeups of few messages, their syscalls; the state
service samples steps at a fixed CPU cost per second. Holding messages back
to forward larger bursts (which does cut the wakeups), or receiving a whole
burst before sending any of it, showed no CPU saving above the noise, so the
loop forwards each message as it reads it. In bench/fanin.py the hook, not
the broker, falls behind first: its queue here overflows while publishers
drop nothing (see `evtrain.bus.subscriber` for its costs).

The loops run in Python threads and release the interpreter lock at every
libzmq call: in a process whose other Python threads mostly wait (``evtrain
bus``, the launcher) they forward at full speed, but a thread that computes
without pause would slow them down.

Memory, per peer and whatever the peer does (the sizes are in
`evtrain.bus.limits`):

* frames: every socket facing outside has ``ZMQ_MAXMSGSIZE``: ``MAX_FRAME_BYTES``
  on the inputs, ``MAX_SUBSCRIPTION_BYTES`` on the outputs (all a subscriber may
  send is a subscription), ``MAX_REQUEST_BYTES`` on the state endpoint, each
  plus what the handshake needs (less without CURVE). libzmq disconnects a peer
  that sends a larger frame before queueing any of it, so libzmq 4.3.5's
  subscription tries, which recurse once per topic byte, never see a long topic
  (a 200 KB one crashed the broker when its subscriber left).
* queues: ``hwm`` messages (default ``QUEUE_MESSAGES``) towards each subscriber,
  so at most ``hwm * MAX_MESSAGE_BYTES`` (``PEER_BYTES``, 160 MiB at the
  default) for one that stops reading, plus the kernel's socket buffer;
  as many (``INPUT_QUEUE_MESSAGES``) from each publisher and upstream from
  each subscriber, which fill only while the loop falls behind.
* subscriptions: libzmq keeps every distinct subscription a subscriber sent
  until it leaves, however many (see `evtrain.bus.limits`); each is short.
* state requests: see `evtrain.bus.state_service`.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from evtrain.bus.address import ROLES, BusAddress, Role
from evtrain.bus.limits import (
    INPUT_QUEUE_MESSAGES,
    MAX_FRAME_BYTES,
    MAX_SUBSCRIPTION_BYTES,
    QUEUE_MESSAGES,
    TOPICS,
    socket_limit,
    valid_subscription,
)
from evtrain.bus.security import CurveConfig, CurveServer
from evtrain.bus.state_service import StateService, StateStats, request
from evtrain.errors import UsageError

log = structlog.get_logger("evtrain.bus.broker")

DEFAULT_HWM = QUEUE_MESSAGES
REPORT_INTERVAL = 10.0
"""Seconds between two log lines about hostile input of one proxy."""

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_BURST = 1000  # messages one direction forwards before the loop looks at the other
# Plain ints: pyzmq converts its enum flags on every call (measurably slower).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
# pyzmq's Python-level Socket.send adds about half a microsecond per frame, a third
# of the forwarding loop: the loop calls the compiled backend method directly.
_send = zmq.backend.Socket.send


@dataclass(frozen=True)
class ProxyStats:
    """What one proxy did so far."""

    forwarded: int = 0
    """Messages passed downstream."""
    malformed: int = 0
    """Downstream messages dropped: not two frames, not an evtrain topic, or too long."""
    subscriptions: int = 0
    """Distinct valid subscriptions and cancellations seen."""
    rejected_subscriptions: int = 0
    """Distinct (un)subscriptions to a prefix of no evtrain topic (they select nothing)."""
    upstream_garbage: int = 0
    """Upstream messages dropped that were no subscription at all."""


@dataclass(frozen=True)
class BrokerStats:
    """Counters of a running broker (see `Broker.stats`)."""

    events: ProxyStats
    commands: ProxyStats
    state: StateStats


class _Proxy:
    """One XSUB -> XPUB proxy loop; runs in its own thread until TERMINATE arrives."""

    def __init__(
        self,
        name: str,
        inbound: zmq.Socket,
        outbound: zmq.Socket,
        control: zmq.Socket,
    ) -> None:
        self.name = name
        self.forwarded = 0
        self.malformed = 0
        self.subscriptions = 0
        self.rejected = 0
        self.garbage = 0
        self._in = inbound
        self._out = outbound
        self._control = control
        self._reported = (0, 0, 0)
        self._last_report = -math.inf

    def stats(self) -> ProxyStats:
        return ProxyStats(
            forwarded=self.forwarded,
            malformed=self.malformed,
            subscriptions=self.subscriptions,
            rejected_subscriptions=self.rejected,
            upstream_garbage=self.garbage,
        )

    def run(self) -> None:
        inbound, outbound, control = self._in, self._out, self._control
        items = [(inbound, _POLLIN), (outbound, _POLLIN), (control, _POLLIN)]
        poll = zmq.zmq_poll  # zmq.Poller adds a microsecond per wakeup
        timeout = int(REPORT_INTERVAL * 1000)
        try:
            while True:
                ready = poll(items, timeout)
                for sock, _ in ready:
                    if sock is inbound:
                        self._forward()
                    elif sock is outbound:
                        self._upstream()
                    else:
                        return  # TERMINATE
                self._report()
        finally:
            self._report(force=True)

    def _forward(self) -> None:
        """Pass up to a burst of ready messages downstream; drop the malformed ones.

        Malformed: not two frames, a topic that is no evtrain topic, or a payload
        above ``MAX_FRAME_BYTES``.

        The topic frame is read as bytes without asking whether more frames follow
        (that query costs as much as the receive); the framing is checked on the
        payload frame instead, and a topic-only message cannot swallow the
        message after it: a second frame that continues is taken as a possible
        start of the next message.
        """
        inbound = self._in
        recv = inbound.recv
        out = self._out
        topics = TOPICS
        max_frame = MAX_FRAME_BYTES
        start: bytes | None = None  # a frame already read that may start a message
        forwarded = 0
        count = 0
        try:
            while count < _BURST or start is not None:  # never stop inside a message
                count += 1
                if start is None:
                    topic = recv(_NOBLOCK)
                else:
                    topic, start = start, None
                if topic not in topics:
                    self._skip_rest(inbound)
                    self.malformed += 1
                    continue
                try:
                    payload = recv(_NOBLOCK, copy=False)
                except zmq.Again:  # a topic alone, the last message for now
                    self.malformed += 1
                    break
                if payload.more:
                    candidate = payload.bytes
                    if candidate in topics:
                        start = candidate
                    else:
                        self._skip_rest(inbound)
                    self.malformed += 1
                    continue
                if len(payload) > max_frame:  # within the socket's slack for the handshake
                    self.malformed += 1
                    continue
                _send(out, topic, _NOBLOCK_MORE)
                _send(out, payload, _NOBLOCK, False)
                forwarded += 1
        except zmq.Again:
            pass
        finally:
            self.forwarded += forwarded

    def _upstream(self) -> None:
        """Read and drop what subscribers sent; count what is no valid subscription.

        libzmq surfaces a subscription when its topic is new to the XPUB and a
        cancellation when its last subscriber goes; anything else is garbage.
        """
        out = self._out
        recv = out.recv
        try:
            for _ in range(_BURST):
                frame = recv(_NOBLOCK, copy=False)
                if frame.more:
                    self._skip_rest(out)
                    self.garbage += 1
                    continue
                data = frame.bytes
                if valid_subscription(data):
                    self.subscriptions += 1
                elif data[:1] in (b"\x00", b"\x01"):
                    self.rejected += 1
                else:
                    self.garbage += 1
        except zmq.Again:
            pass

    @staticmethod
    def _skip_rest(sock: zmq.Socket) -> None:
        while sock.rcvmore:
            sock.recv(_NOBLOCK, copy=False)

    def _report(self, force: bool = False) -> None:
        counts = (self.malformed, self.rejected, self.garbage)
        if counts == self._reported:
            return
        now = time.monotonic()
        if not force and now - self._last_report < REPORT_INTERVAL:
            return
        before = self._reported
        self._reported = counts
        self._last_report = now
        log.warning(
            "broker dropped hostile input",
            proxy=self.name,
            malformed=counts[0] - before[0],
            rejected_subscriptions=counts[1] - before[1],
            upstream_garbage=counts[2] - before[2],
            total=sum(counts),
        )


class Broker:
    """Runs the event and command proxies of one bus in background threads.

    ``with Broker(address): ...`` binds, proxies, and unbinds on exit.

    ``curve`` turns on CURVE encryption and client authentication. ``remove_dir``
    says whether `stop` removes the ipc run directory; by default it does when
    `start` created the directory. Without an explicit ``context`` the broker
    uses a private ZeroMQ context (a ZAP authenticator is one per context) and
    terminates it on `stop`, so no thread of the broker outlives it.
    """

    def __init__(
        self,
        address: BusAddress,
        *,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
        curve: CurveServer | None = None,
        remove_dir: bool | None = None,
    ) -> None:
        self.address = address
        self.hwm = hwm
        self.curve = curve
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._remove_dir = remove_dir
        self._threads: list[threading.Thread] = []
        self._controls: list[zmq.Socket] = []
        self._errors: list[BaseException] = []
        self._owned: list[zmq.Socket] = []
        self._state: StateService | None = None
        self._service: StateService | None = None  # kept after `stop`, for `stats`
        self._proxies: dict[str, _Proxy] = {}
        self._auth: ThreadAuthenticator | None = None
        self._state_source = f"inproc://evtrain-state-{uuid.uuid4().hex}"
        self._started = False
        self._stopped = False
        self._bound_ipc = False  # whether the socket files are ours to remove
        self._running = False
        self._lock = threading.Lock()

    @property
    def state(self) -> StateService | None:
        """The state service answering late joiners (None when not running)."""
        return self._state

    def start(self) -> None:
        """Bind all sockets and start proxying; raises `UsageError` if binding fails."""
        if self._started:
            raise RuntimeError("a Broker starts once")
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self._running = True
        log.debug("broker started", address=str(self.address), curve=self.curve is not None)

    def _start(self) -> None:
        if self.address.scheme == "ipc":
            self._prepare_ipc()
        elif self.curve is None and self.address.location not in _LOOPBACK:
            log.warning(
                "tcp bus without CURVE: anyone who reaches these ports can read and publish",
                address=str(self.address),
            )
        if self.curve is not None:
            self._auth = self.curve.start_authenticator(self._context)
        planes: tuple[tuple[str, Role, Role], ...] = (
            ("events", "events_in", "events_out"),
            ("commands", "commands_in", "commands_out"),
        )
        for name, inbound, outbound in planes:
            xsub = self._bind(
                zmq.XSUB, inbound, max_frame=MAX_FRAME_BYTES, hwm=INPUT_QUEUE_MESSAGES
            )
            xpub = self._bind(zmq.XPUB, outbound, max_frame=MAX_SUBSCRIPTION_BYTES, hwm=self.hwm)
            if inbound == "events_in":
                # The state service listens in-process, beside the external subscribers.
                xpub.bind(self._state_source)
            # Subscribe upstream to everything ourselves (see the module docstring).
            xsub.send(b"\x01")
            # Both ends of the control pair are made here, so TERMINATE can always be
            # queued even if the proxy thread has not run yet.
            control_address = f"inproc://evtrain-broker-{uuid.uuid4().hex}"
            control = self._context.socket(zmq.PAIR)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(control_address)
            steer = self._context.socket(zmq.PAIR)
            steer.setsockopt(zmq.LINGER, 0)
            steer.connect(control_address)
            self._controls.append(control)
            self._owned.append(steer)
            proxy = _Proxy(name, xsub, xpub, steer)
            self._proxies[name] = proxy
            thread = threading.Thread(
                target=self._proxy, args=(proxy,), name=f"evtrain-broker-{inbound}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._state = StateService(
            self._context,
            self._state_source,
            self.address.endpoint("state", bind=True),
            stats=lambda: msgspec.json.encode(self.stats()),
            curve=self.curve,
        )
        self._state.start()
        self._service = self._state

    def _prepare_ipc(self) -> None:
        directory = Path(self.address.location)
        existed = directory.exists()
        self.address.prepare()
        if self._remove_dir is None:
            self._remove_dir = not existed
        # Binding a live ipc path silently steals it from the broker there: refuse.
        for role in ROLES:
            path = self.address.endpoint(role)[len("ipc://") :]
            if _unix_socket_alive(path):
                self._remove_dir = False  # it is someone else's bus
                raise UsageError(f"a bus is already running at {self.address} ({path} is live)")
        self._bound_ipc = True

    def _bind(self, kind: int, role: Role, *, max_frame: int, hwm: int) -> zmq.Socket:
        """A socket bound at ``role``: ``hwm`` messages out, few in, frames of ``max_frame``."""
        sock = self._context.socket(kind)
        self._owned.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, INPUT_QUEUE_MESSAGES)
        sock.setsockopt(zmq.MAXMSGSIZE, socket_limit(max_frame, curve=self.curve is not None))
        if self.curve is not None:
            self.curve.apply(sock)
        endpoint = self.address.endpoint(role, bind=True)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise UsageError(f"cannot bind the bus at {endpoint}: {exc}") from None
        return sock

    def _proxy(self, proxy: _Proxy) -> None:
        try:
            proxy.run()
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # surfaced by `check`
            self._errors.append(exc)
            log.error("broker proxy stopped", error=repr(exc))

    def stats(self) -> BrokerStats:
        """What the proxies and the state service did so far (zeros before `start`).

        Safe to call from any thread, also after `stop`.
        """
        empty = ProxyStats()
        events = self._proxies.get("events")
        commands = self._proxies.get("commands")
        state = self._service
        return BrokerStats(
            events=events.stats() if events is not None else empty,
            commands=commands.stats() if commands is not None else empty,
            state=state.stats() if state is not None else StateStats(),
        )

    def check(self) -> None:
        """Raise if a proxy thread died."""
        if self._errors:
            raise RuntimeError(f"broker proxy failed: {self._errors[0]!r}")
        for thread in self._threads:
            if not thread.is_alive():
                raise RuntimeError(f"broker thread {thread.name} ended")

    def stop(self) -> None:
        """Stop the proxies, close every socket, end every thread; safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        stuck = False
        if self._state is not None:
            self._state.stop()
            stuck = self._state.running
            self._state = None
        for control in self._controls:
            with contextlib.suppress(zmq.ZMQError):
                control.send(b"TERMINATE", zmq.NOBLOCK)
        for thread in self._threads:
            thread.join(timeout=5)
            if thread.is_alive():
                stuck = True
                log.error("broker thread did not stop", thread=thread.name)
        if not stuck:  # never close a socket under a thread that still uses it
            for sock in (*self._controls, *self._owned):
                sock.close(linger=0)
        self._controls.clear()
        self._threads.clear()
        self._owned.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context and not stuck:  # term() would wait for the stuck sockets
            self._context.term()
        if self.address.scheme == "ipc" and self._bound_ipc:
            self._remove_ipc_files()
        if self._running:
            log.debug("broker stopped", address=str(self.address))

    def _remove_ipc_files(self) -> None:
        # Our socket files (libzmq leaves them), then the directory if it is ours and
        # nothing else is in it.
        for role in ROLES:
            with contextlib.suppress(OSError):
                os.unlink(self.address.endpoint(role)[len("ipc://") :])
        if self._remove_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.address.location)

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fetch_stats(
    address: BusAddress,
    timeout: float = 2.0,
    context: zmq.Context | None = None,
    *,
    curve: CurveConfig | None = None,
) -> BrokerStats | None:
    """The counters of the broker at ``address`` (`Broker.stats`); None if it does not answer."""
    frames = request(address, b"stats", timeout, context, curve)
    if frames is None or len(frames) != 2:
        return None
    try:
        return msgspec.json.decode(frames[1], type=BrokerStats)
    except msgspec.DecodeError:
        return None


def _unix_socket_alive(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
