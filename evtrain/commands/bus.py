"""``evtrain bus``: run a broker until interrupted."""

from __future__ import annotations

import argparse
import signal

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``bus`` subcommand."""
    parser = sub.add_parser(
        "bus",
        help="run an event/command broker",
        description=(
            "Run the evtrain broker: an event proxy (stages -> hooks), a command proxy "
            "(hooks -> stages) and the state service for late joiners. Prints its "
            "address on the first line of stdout and runs until SIGINT/SIGTERM."
        ),
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--bus",
        metavar="ADDRESS",
        help="address to bind: ipc:///DIR or tcp://HOST:PORT (PORT..PORT+4 are used); "
        "default: a new private ipc directory under /tmp",
    )
    where.add_argument(
        "--tcp",
        metavar="HOST",
        help="bind tcp on HOST at free ports (use --bus tcp://HOST:PORT for fixed ones)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Bind, print the address, proxy until a signal arrives."""
    if args.bus:
        address = BusAddress.parse(args.bus)
    elif args.tcp:
        address = BusAddress.new_tcp(args.tcp)
    else:
        address = BusAddress.new_ipc()
    # sigwait only sees signals blocked in every thread, and the proxy threads
    # inherit the mask of the thread that starts them: block before starting.
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    broker = Broker(address)
    broker.start()
    print(address, flush=True)
    try:
        signal.sigwait(signals)
    finally:
        broker.stop()
    return 0
