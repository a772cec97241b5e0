"""Shared fixtures: anyio on asyncio, private bus addresses, process cleanup."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT back to Python's default when the suite inherited it ignored.

    A suite started as a background job of a script (``pytest ... &``) has SIGINT
    ignored, and every process it starts would inherit that; the tests stop some
    of them with SIGINT, as Ctrl-C in a terminal would.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ipc_bus() -> Iterator[BusAddress]:
    """A fresh private ipc bus directory (short path; removed afterwards)."""
    address = BusAddress.new_ipc()
    yield address
    shutil.rmtree(address.location, ignore_errors=True)


@pytest.fixture
def bus() -> Iterator[BusAddress]:
    """A running broker on a fresh private ipc directory (test files may define their own)."""
    address = BusAddress.new_ipc()
    broker = Broker(address)
    broker.start()
    try:
        yield address
    finally:
        broker.stop()
        shutil.rmtree(address.location, ignore_errors=True)


@pytest.fixture
def tcp_bus() -> BusAddress:
    """A tcp bus address on free loopback ports."""
    return BusAddress.new_tcp("127.0.0.1")


class ProcessGroup:
    """Processes a test starts; all are killed (with their children) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        proc = subprocess.Popen(list(args), start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def python(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return self.start(sys.executable, *args, **kwargs)

    def evtrain(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return self.python("-m", "evtrain", *args, **kwargs)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs() -> Iterator[ProcessGroup]:
    """Start processes in their own session; every one is killed when the test ends."""
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture
def marker() -> Iterator[str]:
    """A launch marker; whatever still carries it at teardown is killed."""
    from helpers.launch_helpers import kill_marked, new_marker

    token = new_marker()
    try:
        yield token
    finally:
        kill_marked(token)


@pytest.fixture
def buses(procs: ProcessGroup) -> Iterator[object]:
    """Start ``evtrain bus`` processes; each is stopped (and its directory gone) after."""
    from helpers.bus_procs import Buses

    group = Buses(procs)
    try:
        yield group
    finally:
        group.stop_all()
