"""The broker: two XSUB/XPUB proxies, events (stages -> hooks) and commands (hooks -> stages).

It binds every socket before it returns from `start`, so publishers and subscribers
that connect afterwards never race it. Its XSUB sides subscribe to everything
themselves: every publisher always has the broker as a subscriber, so the first
events of a run are never filtered away while no hook listens yet, and a
publisher can confirm the link is up before it sends (see `Publisher`).
The proxies never decode a frame, so no frame can crash them.
"""

from __future__ import annotations

import threading
import uuid

import structlog
import zmq

from evtrain.bus.address import BusAddress
from evtrain.bus.state_service import StateService
from evtrain.errors import UsageError

log = structlog.get_logger("evtrain.bus.broker")

DEFAULT_HWM = 10_000


class Broker:
    """Runs the event and command proxies of one bus in background threads.

    ``with Broker(address): ...`` binds, proxies, and unbinds on exit.
    """

    def __init__(
        self,
        address: BusAddress,
        *,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.hwm = hwm
        self._context = context or zmq.Context.instance()
        self._threads: list[threading.Thread] = []
        self._controls: list[zmq.Socket] = []
        self._errors: list[BaseException] = []
        self._owned: list[zmq.Socket] = []
        self._state: StateService | None = None
        self._state_source = f"inproc://evtrain-state-{uuid.uuid4().hex}"

    def start(self) -> None:
        """Bind all sockets and start proxying; raises `UsageError` if binding fails."""
        self.address.prepare()
        for inbound, outbound in (("events_in", "events_out"), ("commands_in", "commands_out")):
            xsub = self._bind(zmq.XSUB, inbound)
            xpub = self._bind(zmq.XPUB, outbound)
            if inbound == "events_in":
                # The state service listens in-process, beside the external subscribers.
                xpub.bind(self._state_source)
            # Subscribe upstream to everything ourselves (see the module docstring).
            xsub.send(b"\x01")
            control_address = f"inproc://evtrain-broker-{uuid.uuid4().hex}"
            control = self._context.socket(zmq.PAIR)
            control.bind(control_address)
            thread = threading.Thread(
                target=self._proxy,
                args=(xsub, xpub, control_address),
                name=f"evtrain-broker-{inbound}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            self._controls.append(control)
        self._state = StateService(
            self._context, self._state_source, self.address.endpoint("state", bind=True)
        )
        self._state.start()
        log.info("broker started", address=str(self.address))

    def _bind(self, kind: int, role: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        endpoint = self.address.endpoint(role, bind=True)  # type: ignore[arg-type]
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self.stop()
            raise UsageError(f"cannot bind the bus at {endpoint}: {exc}") from None
        self._owned.append(sock)
        return sock

    def _proxy(self, frontend: zmq.Socket, backend: zmq.Socket, control_address: str) -> None:
        control = self._context.socket(zmq.PAIR)
        control.connect(control_address)
        try:
            zmq.proxy_steerable(frontend, backend, None, control)
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # surfaced by `check`
            self._errors.append(exc)
            log.error("broker proxy stopped", error=repr(exc))
        finally:
            control.close(linger=0)

    def check(self) -> None:
        """Raise if a proxy thread died."""
        if self._errors:
            raise RuntimeError(f"broker proxy failed: {self._errors[0]!r}")
        for thread in self._threads:
            if not thread.is_alive():
                raise RuntimeError(f"broker thread {thread.name} ended")

    def stop(self) -> None:
        """Stop the proxies and close every socket; safe to call twice."""
        if self._state is not None:
            self._state.stop()
            self._state = None
        for control in self._controls:
            try:
                control.send(b"TERMINATE")
            except zmq.ZMQError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)
        for control in self._controls:
            control.close(linger=0)
        for sock in self._owned:
            sock.close(linger=0)
        self._controls.clear()
        self._threads.clear()
        self._owned.clear()

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
