"""The run's bus as the launcher sees it: address, CURVE keys, the broker it hosts.

By default the broker runs in threads of the launcher's own process
(``ipc://`` in a fresh private directory; ``--bus tcp://HOST:PORT`` for
several machines), and the launcher prints the bus address, so anyone can
attach ``evtrain hook ... --bus ADDR`` or ``evtrain events --bus ADDR``.
It cannot be crashed by what clients send it (`evtrain.bus.broker`), so it
lives exactly as long as the launcher. With ``--external-bus`` it binds
nothing: ``--bus`` names a broker that is already running (``evtrain bus``,
e.g. its own docker-compose service), and the launcher waits until it
answers; that broker may die on its own (`evtrain.launcher.watch.BusWatch`).
Node r > 0 of a run on several machines waits for node 0's broker the same
way, before it touches the run directory: node 0 binds it only after taking
the directory over, which a shared file system makes one directory for all
nodes.

CURVE (``--curve-dir DIR``, `evtrain.bus.security`): the broker and its
state service admit only the client keys in ``DIR/authorized``, and every
process of the run connects with DIR's client keys: the launcher's own
clients, and the stage workers and the hooks through ``$EVTRAIN_CURVE_DIR``,
which the launcher sets for every process it starts (and removes on a launch
without CURVE, where an inherited one would make them attempt handshakes that
the broker never answers: `curve_env`). The launch that runs the broker
creates the keys when DIR is missing; node r > 0 and ``--external-bus`` need
that broker's directory, copied (``client.key``, ``client.key_secret``,
``server.key``). ipc buses take it as well: their private directory already
keeps other users out, CURVE adds encryption and keys for what shares the
machine.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import anyio.to_thread
import structlog

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import (
    CURVE_DIR_ENV,
    CurveConfig,
    CurveServer,
    ensure_curve_dir,
    load_client,
    load_server,
)
from evtrain.bus.state_service import ping_broker
from evtrain.bus.subscriber import Subscriber
from evtrain.errors import UsageError
from evtrain.events import Heartbeat, Message, StopRun
from evtrain.launcher.options import LAUNCHER_SOURCE, LaunchOptions, is_bus_owner

__all__ = ["RunBus", "curve_dir", "curve_env"]

log = structlog.get_logger(__name__)

_BUS_PING_TIMEOUT_S = 2.0
_SUBSCRIBE_TIMEOUT_S = 10.0


def curve_dir(options: LaunchOptions) -> str | None:
    """The absolute path of the CURVE key directory, if the launch has one."""
    directory = options.curve_dir
    return str(Path(directory).expanduser().absolute()) if directory is not None else None


def curve_env(env: dict[str, str], options: LaunchOptions) -> dict[str, str]:
    """``env`` naming our CURVE key directory, or none at all.

    The stage workers and ``evtrain hook`` take the directory from
    ``$EVTRAIN_CURVE_DIR`` (`evtrain.bus.security.curve_from_env`); one
    inherited from our own environment on a launch without CURVE would make
    them attempt CURVE handshakes that our broker never answers.
    """
    directory = curve_dir(options)
    if directory is None:
        env.pop(CURVE_DIR_ENV, None)
    else:
        env[CURVE_DIR_ENV] = directory
    return env


class RunBus:
    """Address, keys and broker of the run's bus, and the launcher's own clients of it.

    Construction parses the address and loads the keys (`UsageError`);
    nothing is bound or connected before `host` or `wait_for_broker`.
    """

    def __init__(self, options: LaunchOptions, run_id: str) -> None:
        self.options = options
        self.run_id = run_id
        self.is_owner = is_bus_owner(options)
        self.hosts_broker = self.is_owner and not options.external_bus
        """Whether this launcher runs the broker (else it is node 0's or an external one)."""
        self.address = BusAddress.parse(options.bus) if options.bus else None
        self.owns_ipc_dir = False
        """Whether ``address`` is a private ipc directory of ours (removed at the end)."""
        self.curve: CurveConfig | None = None
        """The client keys of every connection to the bus (``curve_dir``), else None."""
        self._curve_server: CurveServer | None = None
        self._load_keys()
        self.broker: Broker | None = None
        self.publisher: Publisher | None = None
        self._command_publisher: Publisher | None = None

    def _load_keys(self) -> None:
        """The CURVE keys of ``curve_dir``, created (0700) where this launch runs the broker.

        Anywhere else (node r > 0, an external broker) the keys must be that
        broker's: fresh ones would never be admitted.
        """
        directory = self.options.curve_dir
        if directory is None:
            return
        if self.hosts_broker:
            self._curve_server = load_server(ensure_curve_dir(directory))
        elif not Path(directory).expanduser().is_dir():
            owner = "node 0" if not self.is_owner else "the broker"
            raise UsageError(
                f"curve directory {directory} does not exist: copy {owner}'s there "
                "(client.key, client.key_secret, server.key; chmod 700)"
            )
        self.curve = load_client(directory)

    def wait_for_broker(self) -> None:
        """Block until the external (or node 0's) broker answers; `UsageError` after
        ``bus_wait_s``."""
        assert self.address is not None
        opts = self.options
        # One request: ZeroMQ keeps reconnecting until the broker is up, so a
        # broker that starts a little later (compose, node 0) still answers in time.
        if ping_broker(self.address, opts.bus_wait_s, curve=self.curve):
            return
        wait = f"{opts.bus_wait_s:g} s"
        if opts.external_bus:
            hint = "is `evtrain bus --bus ...` running there"
        else:
            hint = "is the launch of node 0 running"
        if self.curve is not None:
            hint += ", and does its curve directory authorize our client key"
        flag = "--external-bus" if opts.external_bus else f"node {opts.node_rank}"
        raise UsageError(
            f"{flag}: no evtrain broker answered at {self.address} within {wait} ({hint}?)"
        )

    def choose_address(self) -> BusAddress:
        """The address; a fresh private ipc directory where we host it and none was given."""
        if self.address is None:
            assert self.hosts_broker
            self.address = BusAddress.new_ipc()
            self.owns_ipc_dir = True
        return self.address

    @property
    def owned_dir(self) -> str | None:
        """Our private ipc directory (None: not ours to remove)."""
        return self.address.location if self.owns_ipc_dir and self.address else None

    def host(self) -> None:
        """Bind the bus: start the broker in threads of this process."""
        assert self.address is not None
        self.broker = Broker(self.address, curve=self._curve_server)
        self.broker.start()

    def subscribe(self, topics: tuple[str, ...]) -> Subscriber:
        assert self.address is not None
        return Subscriber(self.address.endpoint("events_out"), topics, curve=self.curve)

    def open_publisher(self) -> Publisher:
        """The launcher's own publisher of events (`LAUNCHER_SOURCE`)."""
        assert self.address is not None
        self.publisher = Publisher(
            self.address.endpoint("events_in"),
            source=LAUNCHER_SOURCE,
            run_id=self.run_id,
            connect_timeout=self.options.bus_wait_s,
            curve=self.curve,
        )
        return self.publisher

    def send_command(self, command: StopRun) -> bool:
        """Publish ``command`` to the stages; False when the command socket cannot connect."""
        assert self.address is not None
        if self._command_publisher is None:
            try:
                self._command_publisher = Publisher(
                    self.address.endpoint("commands_in"),
                    source=LAUNCHER_SOURCE,
                    run_id=self.run_id,
                    connect_timeout=2.0,
                    curve=self.curve,
                )
            except UsageError as exc:
                log.warning("cannot send the stop command", error=str(exc))
                return False
        self._command_publisher.publish(command)
        return True

    async def prove_subscription(
        self, subscriber: Subscriber, on_event: Callable[[Message], None]
    ) -> None:
        """Wait until our own heartbeat comes back: from then on we see what hooks publish.

        A hook stops announcing itself once *its* subscription works, which
        says nothing about ours: a subscription still on its way to the broker
        would miss the announcement for good. What else arrives meanwhile goes
        to ``on_event``.
        """
        assert self.publisher is not None
        deadline = time.monotonic() + _SUBSCRIBE_TIMEOUT_S
        while time.monotonic() < deadline:
            self.publisher.publish(Heartbeat(state="starting"))
            for msg in await subscriber.receive(timeout=0.05):
                if isinstance(msg, Heartbeat) and msg.source == LAUNCHER_SOURCE:
                    return
                on_event(msg)
        raise UsageError(f"the bus at {self.address} does not deliver our own events")

    async def answers(self) -> bool:
        """Whether the broker is alive (ours: its threads; another: it answers a ping)."""
        if self.broker is not None:
            # Ours: nothing a client sends can stop it; only a dead proxy thread would.
            try:
                self.broker.check()
            except RuntimeError:
                return False
            return True
        address = self.address
        assert address is not None
        alive: bool = await anyio.to_thread.run_sync(
            functools.partial(ping_broker, address, _BUS_PING_TIMEOUT_S, curve=self.curve)
        )
        return alive

    def close_clients(self, *, bus_down: bool) -> None:
        """Close our publishers (without waiting for a bus that is gone)."""
        for publisher in (self.publisher, self._command_publisher):
            if publisher is not None:
                publisher.close(linger=0 if bus_down else 1.0)

    def stop(self) -> None:
        """Stop the broker we host and remove our private ipc directory."""
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.owns_ipc_dir and self.address is not None:
            shutil.rmtree(self.address.location, ignore_errors=True)
