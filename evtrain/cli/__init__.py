"""The ``evtrain`` command line: one subcommand per module in `evtrain.cli`.

Command modules import heavy dependencies (torch) inside their handlers so that
``evtrain bus`` and ``--help`` start fast. The console options (``-q``,
``-v``, ``--log-level``, ``--log-format``) are accepted before and after the
subcommand alike.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
"""Modules of `evtrain.cli`, each with ``register(subparsers)``."""

FAST_EXIT_COMMANDS = frozenset({"demo", "eval", "launch"})
"""Commands whose process runs only our code: the console script ends them with
``os._exit`` once their output is flushed (`run`)."""


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
        importlib.import_module(f"evtrain.cli.{name}").register(sub)
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
    return _dispatch(argv)[1]


def _dispatch(argv: Sequence[str] | None) -> tuple[str, int]:
    """Run the CLI; the subcommand that ran and its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_format, resolve_log_level(args))
        status = args.func(args)
    except UsageError as exc:
        print(f"evtrain {args.command}: error: {exc}", file=sys.stderr)
        return args.command, 2
    except KeyboardInterrupt:
        return args.command, 130
    return args.command, int(status or 0)


def run() -> None:
    """The ``evtrain`` console script: `main`, then the exit.

    Tearing down an interpreter that imported torch (and, through the
    optimizers, torch._dynamo) takes 1-3 s, a sixth of a short launch. A
    command of `FAST_EXIT_COMMANDS` has closed its sockets and files and
    waited for its processes when `main` returns, so it flushes what is
    buffered and ends with ``os._exit``. Other commands (``evtrain hook`` runs
    user code, which may rely on interpreter exit) exit normally.
    """
    command, status = _dispatch(None)
    if command in FAST_EXIT_COMMANDS and "torch" in sys.modules:
        if "zmq" in sys.modules:
            import zmq

            # Hands anything still queued to the peers (bounded), as term() would.
            zmq.Context.instance().destroy(linger=2000)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
