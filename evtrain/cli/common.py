"""Argument helpers shared by the subcommands: bus address, CURVE keys, async entry."""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CURVE_DIR_ENV, CurveConfig, load_client
from evtrain.bus.state_service import ping_broker
from evtrain.errors import UsageError

BUS_ENV = "EVTRAIN_BUS"
CONNECT_TIMEOUT = 5.0
"""Seconds a client command waits for the broker to answer before giving up."""

T = TypeVar("T")


def add_bus_argument(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--bus ADDRESS`` (default $EVTRAIN_BUS) and ``--connect-timeout S``."""
    default = os.environ.get(BUS_ENV)
    parser.add_argument(
        "--bus",
        metavar="ADDRESS",
        default=default,
        required=required and default is None,
        help=(
            f"bus address: ipc:///DIR (a run directory) or tcp://HOST:PORT (default: ${BUS_ENV})"
        ),
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        metavar="S",
        help=f"give up if no broker answers within S seconds (default: {CONNECT_TIMEOUT:g})",
    )


def add_curve_argument(parser: argparse.ArgumentParser, *, server: bool = False) -> None:
    """``--curve-dir DIR``, defaulting to $EVTRAIN_CURVE_DIR."""
    what = (
        "create the server and client keys there on first use (mode 0700) and admit "
        "only clients whose public key is in DIR/authorized"
        if server
        else "connect with the client keys of the bus's curve directory"
    )
    parser.add_argument(
        "--curve-dir",
        metavar="DIR",
        default=os.environ.get(CURVE_DIR_ENV) or None,
        help=f"CURVE encryption and authentication: {what} (default: ${CURVE_DIR_ENV})",
    )


def bus_address(args: argparse.Namespace) -> BusAddress:
    """The parsed ``--bus`` value (`UsageError` if malformed)."""
    return BusAddress.parse(args.bus)


def curve_config(args: argparse.Namespace) -> CurveConfig | None:
    """The client CURVE keys named by ``--curve-dir`` (None without it)."""
    directory = getattr(args, "curve_dir", None)
    return load_client(directory) if directory else None


def connect_bus(args: argparse.Namespace) -> tuple[BusAddress, CurveConfig | None]:
    """The bus a client command talks to, checked to answer: `UsageError` otherwise."""
    timeout = getattr(args, "connect_timeout", CONNECT_TIMEOUT)
    if not timeout > 0:
        raise UsageError(f"--connect-timeout must be positive, got {timeout:g}")
    address = bus_address(args)
    curve = curve_config(args)
    if address.scheme == "ipc" and not Path(address.location).is_dir():
        raise UsageError(f"no bus at {address}: the directory does not exist")
    if not ping_broker(address, timeout, curve=curve):
        hint = (
            "check that its curve directory authorizes our key"
            if curve is not None
            else f"is `evtrain bus` running? a CURVE bus needs --curve-dir or ${CURVE_DIR_ENV}"
        )
        raise UsageError(f"no evtrain broker answered at {address} within {timeout:g} s ({hint})")
    return address, curve


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run`` that re-raises a `UsageError` out of task-group exception groups."""
    try:
        return anyio.run(fn, *args)
    except BaseExceptionGroup as group:
        usage = _first(group, UsageError)
        if usage is not None:
            raise usage from None
        raise


def _first(group: BaseExceptionGroup, kind: type[BaseException]) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None
