"""The ``evtrain`` command line: one subcommand per module in `evtrain.commands`.

Command modules import heavy dependencies (torch) inside their handlers so that
``evtrain bus`` and ``--help`` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from evtrain.errors import UsageError
from evtrain.logs import configure_logging

COMMANDS: tuple[str, ...] = (
    "bus",
    "ckpt",
    "demo",
    "events",
    "hook",
    "launch",
    "replay",
    "timeline",
    "top",
)
"""Modules of `evtrain.commands`, each with ``register(subparsers)``."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (used by ``main`` and by the docs tests)."""
    parser = argparse.ArgumentParser(
        prog="evtrain",
        description=(
            "Event-driven pipeline-parallel training: stage actors publish on a ZeroMQ "
            "bus, hooks are subscriber processes."
        ),
    )
    parser.add_argument(
        "--log-format",
        choices=("console", "json"),
        default="console",
        help="format of log lines on stderr (default: console)",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="lowest level logged (default: info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"evtrain.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        status = args.func(args)
    except UsageError as exc:
        print(f"evtrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
