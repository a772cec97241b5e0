"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os

from evtrain.bus.address import BusAddress

BUS_ENV = "EVTRAIN_BUS"


def add_bus_argument(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--bus ADDRESS``, defaulting to $EVTRAIN_BUS."""
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


def bus_address(args: argparse.Namespace) -> BusAddress:
    """The parsed ``--bus`` value (`UsageError` if malformed)."""
    return BusAddress.parse(args.bus)
