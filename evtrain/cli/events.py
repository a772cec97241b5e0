"""``evtrain events``: tail the bus.

Lines show event text through `safe_text` (escape sequences as visible
escapes); ``--json`` lines are strict JSON (NaN and infinities become null,
non-ASCII is escaped). Malformed frames are skipped and counted by the
subscriber, whose log lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CurveConfig
from evtrain.bus.subscriber import Subscriber
from evtrain.cli.common import add_bus_argument, add_curve_argument, connect_bus, run_async
from evtrain.errors import UsageError
from evtrain.events import Message, to_builtins
from evtrain.formatting import safe_text

_ENVELOPE = ("v", "run_id", "source", "seq", "ts", "type")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        f"{safe_text(key)}={_short(value)}"
        for key, value in data.items()
        if key not in _ENVELOPE and value not in (None, {}, [], "")
    )
    source = safe_text(msg.source, 40)
    return f"{_clock(msg.ts)} {source:<16} {msg.topic.decode():<22} {fields}"


def format_json(msg: Message) -> str:
    """One strict JSON line (``type`` tag and envelope included)."""
    return json.dumps(_strict(to_builtins(msg)), allow_nan=False)


def _strict(value: Any) -> Any:
    # JSON has no NaN or infinity: a diverging loss shows as null, as in metrics.jsonl.
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_strict(item) for item in value]
    return value


def _clock(ts: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return safe_text(value, 80)


def run(args: argparse.Namespace) -> int:
    """Print events until --count, --timeout or Ctrl-C."""
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    address, curve = connect_bus(args)
    # Whatever the terminal's encoding, a character it lacks must not end the tail.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
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
                line = format_json(msg) if args.json else format_human(msg)
                sys.stdout.write(line + "\n")
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
            sys.stdout.flush()
    finally:
        subscriber.close()
    return 0
