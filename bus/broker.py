"""The broker: two XSUB/XPUB proxies, events (stages -> hooks) and commands (hooks -> stages).

It binds every socket before it returns from `start`, so publishers and subscribers
that connect afterwards never race it. Its XSUB sides subscribe to everything
themselves: every publisher always has the broker as a subscriber, so the first
events of a run are never filtered away while no hook listens yet, and a
publisher can confirm the link is up before it sends (see `Publisher`).
The proxies never decode a frame, so no frame can crash them.

With a `CurveServer` every socket is a CURVE server and a ZAP authenticator
admits only the authorized client keys: an unknown client never completes the
handshake and receives nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from pathlib import Path

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from evtrain.bus.address import ROLES, BusAddress, Role
from evtrain.bus.security import CurveServer
from evtrain.bus.state_service import StateService
from evtrain.errors import UsageError

log = structlog.get_logger("evtrain.bus.broker")

DEFAULT_HWM = 10_000
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
        log.info("broker started", address=str(self.address), curve=self.curve is not None)

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
        for inbound, outbound in (("events_in", "events_out"), ("commands_in", "commands_out")):
            xsub = self._bind(zmq.XSUB, inbound)
            xpub = self._bind(zmq.XPUB, outbound)
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
            thread = threading.Thread(
                target=self._proxy,
                args=(xsub, xpub, steer),
                name=f"evtrain-broker-{inbound}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._state = StateService(
            self._context,
            self._state_source,
            self.address.endpoint("state", bind=True),
            curve=self.curve,
        )
        self._state.start()

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

    def _bind(self, kind: int, role: Role) -> zmq.Socket:
        sock = self._context.socket(kind)
        self._owned.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        if self.curve is not None:
            self.curve.apply(sock)
        endpoint = self.address.endpoint(role, bind=True)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise UsageError(f"cannot bind the bus at {endpoint}: {exc}") from None
        return sock

    def _proxy(self, frontend: zmq.Socket, backend: zmq.Socket, control: zmq.Socket) -> None:
        try:
            zmq.proxy_steerable(frontend, backend, None, control)
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # surfaced by `check`
            self._errors.append(exc)
            log.error("broker proxy stopped", error=repr(exc))

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
            log.info("broker stopped", address=str(self.address))

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
