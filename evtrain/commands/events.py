"""``evtrain events``: tail the bus."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CurveConfig
from evtrain.bus.subscriber import Subscriber
from evtrain.commands.common import add_bus_argument, add_curve_argument, connect_bus, run_async
from evtrain.errors import UsageError
from evtrain.events import Message, to_builtins

_ENVELOPE = ("v", "run_id", "source", "seq", "ts", "type")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``events`` subcommand."""
    parser = sub.add_parser(
        "events",
        help="print the events on a bus",
        description="Subscribe to a bus and print its events, one per line.",
    )
    add_bus_argument(parser)
    add_curve_argument(parser)
    parser.add_argument(
        "--topic",
        action="append",
        default=[],
        metavar="PREFIX",
        help="only topics starting with PREFIX, e.g. step. or checkpoint. (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument("--count", type=int, metavar="N", help="exit after N events")
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="exit after S seconds without an event"
    )
    parser.set_defaults(func=run)


def format_human(msg: Message) -> str:
    """One readable line: time, source, topic, payload fields."""
    data = to_builtins(msg)
    fields = " ".join(
        f"{key}={_short(value)}"
        for key, value in data.items()
        if key not in _ENVELOPE and value not in (None, {}, [], "")
    )
    clock = time.strftime("%H:%M:%S", time.localtime(msg.ts))
    return f"{clock} {msg.source:<16} {msg.topic.decode():<22} {fields}"


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def run(args: argparse.Namespace) -> int:
    """Print events until --count, --timeout or Ctrl-C."""
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    address, curve = connect_bus(args)
    try:
        return run_async(_tail, address, curve, args)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


async def _tail(address: BusAddress, curve: CurveConfig | None, args: argparse.Namespace) -> int:
    subscriber = Subscriber(address.endpoint("events_out"), args.topic or [""], curve=curve)
    seen = 0
    try:
        while args.count is None or seen < args.count:
            batch = await subscriber.receive(timeout=args.timeout)
            if not batch:
                return 0
            for msg in batch:
                line = json.dumps(to_builtins(msg)) if args.json else format_human(msg)
                sys.stdout.write(line + "\n")
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
            sys.stdout.flush()
    finally:
        subscriber.close()
    return 0
