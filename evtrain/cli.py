"""The ``evtrain`` command line: one subcommand per module in `evtrain.commands`.

Command modules import heavy dependencies (torch) inside their handlers so that
``evtrain bus`` and ``--help`` start fast. The console options (``-q``,
``-v``, ``--log-level``, ``--log-format``) are accepted before and after the
subcommand alike.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from evtrain.errors import UsageError
from evtrain.logs import LOG_FORMATS, LOG_LEVELS, configure_logging

COMMANDS: tuple[str, ...] = (
    "bus",
    "ckpt",
    "demo",
    "eval",
    "events",
    "hook",
    "launch",
    "replay",
    "timeline",
    "top",
)
"""Modules of `evtrain.commands`, each with ``register(subparsers)``."""


def add_console_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-q``, ``-v``, ``--log-level``, ``--log-format`` on ``parser``.

    On a subcommand (``top=False``) they default to nothing at all, so that
    a value given before the subcommand is not replaced by the default.
    An option string the subcommand defines itself stays the subcommand's.
    """
    group = parser.add_argument_group("console")
    taken = set(parser._option_string_actions)

    def add(flags: tuple[str, ...], default: Any, **kwargs: Any) -> None:
        free = [flag for flag in flags if flag not in taken]
        if free:
            group.add_argument(*free, default=default if top else argparse.SUPPRESS, **kwargs)

    add(
        ("-q", "--quiet"),
        False,
        dest="quiet",
        action="store_true",
        help="warnings and errors only, no progress display (the summary stays)",
    )
    add(("-v", "--verbose"), False, dest="verbose", action="store_true", help="debug lines too")
    add(
        ("--log-level",),
        None,
        dest="log_level",
        choices=LOG_LEVELS,
        help="lowest level logged (default: info; with -q warning, with -v debug)",
    )
    add(
        ("--log-format",),
        "console",
        dest="log_format",
        choices=LOG_FORMATS,
        help="format of log lines on stderr: console or json (default: console)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (used by ``main`` and by the docs tests)."""
    parser = argparse.ArgumentParser(
        prog="evtrain",
        description=(
            "Event-driven pipeline-parallel training: stage actors publish on a ZeroMQ "
            "bus, hooks are subscriber processes."
        ),
    )
    add_console_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"evtrain.commands.{name}").register(sub)
    for command in sub.choices.values():
        add_console_options(command, top=False)
    return parser


def resolve_log_level(args: argparse.Namespace) -> str:
    """``--log-level`` if given, else what ``-q`` / ``-v`` imply; also set on ``args``."""
    if args.quiet and args.verbose:
        raise UsageError("-q and -v contradict each other")
    if args.log_level is None:
        args.log_level = "debug" if args.verbose else "warning" if args.quiet else "info"
    return str(args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_format, resolve_log_level(args))
        status = args.func(args)
    except UsageError as exc:
        print(f"evtrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
