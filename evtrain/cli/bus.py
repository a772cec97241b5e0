"""``evtrain bus``: run a broker until interrupted."""

from __future__ import annotations

import argparse
import signal

import structlog

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import DEFAULT_HWM, Broker
from evtrain.bus.security import ensure_curve_dir, load_server
from evtrain.cli.common import add_curve_argument
from evtrain.errors import UsageError

log = structlog.get_logger("evtrain.cli.bus")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bus`` subcommand."""
    parser = sub.add_parser(
        "bus",
        help="run an event/command broker",
        description=(
            "Run the evtrain broker: an event proxy (stages -> hooks), a command proxy "
            "(hooks -> stages) and the state service for late joiners. Prints its "
            "address on the first line of stdout and runs until SIGINT/SIGTERM. "
            "A private ipc directory it creates is removed when it exits."
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
    add_curve_argument(parser, server=True)
    parser.add_argument(
        "--hwm",
        type=int,
        default=DEFAULT_HWM,
        metavar="N",
        help=f"messages queued per peer before the broker drops (default: {DEFAULT_HWM})",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Bind, print the address, proxy until a signal arrives."""
    if args.hwm < 1:
        raise UsageError(f"--hwm must be at least 1, got {args.hwm}")
    curve = None
    if args.curve_dir:
        curve = load_server(ensure_curve_dir(args.curve_dir))
        log.info("curve keys", directory=args.curve_dir)
    fresh = not args.bus
    if args.bus:
        address = BusAddress.parse(args.bus)
    elif args.tcp:
        try:
            address = BusAddress.new_tcp(args.tcp)
        except OSError as exc:  # an unknown host name, an address not on this machine
            raise UsageError(f"--tcp {args.tcp}: cannot bind there: {exc}") from None
    else:
        address = BusAddress.new_ipc()
    # sigwait only sees signals blocked in every thread, and the proxy threads
    # inherit the mask of the thread that starts them: block before starting.
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    # A directory we just made is ours to remove; one the user named is removed
    # only if the broker had to create it.
    broker = Broker(address, hwm=args.hwm, curve=curve, remove_dir=True if fresh else None)
    broker.start()
    try:
        print(address, flush=True)
        signal.sigwait(signals)
    finally:
        broker.stop()
    return 0
