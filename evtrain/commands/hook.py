"""``evtrain hook``: run one hook as its own process, attached to a bus."""

from __future__ import annotations

import argparse
import signal

import anyio

from evtrain.commands.common import add_bus_argument, add_curve_argument, connect_bus, run_async
from evtrain.errors import UsageError
from evtrain.hooks.loader import BUILTIN_HOOKS, build_hook, parse_options
from evtrain.hooks.runner import HookRunner


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``hook`` subcommand."""
    parser = sub.add_parser(
        "hook",
        help="attach a hook to a bus",
        description=(
            "Run a hook (a built-in name or package.module:Class) as a subscriber of "
            "the bus; it may join a live run at any time. Built-ins: "
            + (", ".join(sorted(BUILTIN_HOOKS)) or "none")
        ),
    )
    parser.add_argument("ref", metavar="HOOK", help="built-in name or package.module:Class")
    add_bus_argument(parser)
    add_curve_argument(parser)
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="constructor option of the hook; VALUE is JSON if it parses, else text",
    )
    parser.add_argument("--exit-on-run-end", action="store_true", help="exit once the run ended")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the hook, attach it, run until interrupted (or the run ends)."""
    # Build first: a bad hook reference or option is reported without touching the bus.
    hook = build_hook(args.ref, parse_options(args.option))
    address, curve = connect_bus(args)
    runner = HookRunner([hook], address, exit_on_run_end=args.exit_on_run_end, curve=curve)
    try:
        run_async(_serve, runner)
    except TimeoutError as exc:  # the broker answered but our events never came back
        raise UsageError(str(exc)) from None
    return 0


async def _serve(runner: HookRunner) -> None:
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    runner.stop()
                    return

        tg.start_soon(watch_signals)
        await runner.run()
        tg.cancel_scope.cancel()
