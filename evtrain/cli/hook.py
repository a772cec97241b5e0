"""``evtrain hook``: run one hook, or several in one process, attached to a bus.

``evtrain hook REF --option k=v ...`` runs one hook. ``evtrain hook --hooks
JSON`` runs the hooks of a JSON list of job-spec entries (``[{"type":
"logging", "every": 10}, {"type": "metrics"}]``, each with its own options)
in one process and one `HookRunner`, which dispatches every event to them in
``priority`` order: how the launcher hosts a spec's built-in hooks
(`evtrain.launcher.hook_supervisor`).
"""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

import anyio

from evtrain.cli.common import add_bus_argument, add_curve_argument, connect_bus, run_async
from evtrain.errors import UsageError
from evtrain.hooks.hook import Hook
from evtrain.hooks.registry import BUILTIN_HOOKS, build_hook, build_hook_from_spec, parse_options
from evtrain.hooks.runner import HookRunner


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``hook`` subcommand."""
    parser = sub.add_parser(
        "hook",
        help="attach a hook to a bus",
        description=(
            "Run a hook (a built-in name or package.module:Class) as a subscriber of "
            "the bus; it may join a live run at any time. With --hooks, run several in "
            "one process, dispatched in priority order (how `evtrain launch` runs a "
            "spec's built-in hooks unless an entry says isolate=True). Built-ins: "
            + (", ".join(sorted(BUILTIN_HOOKS)) or "none")
        ),
    )
    parser.add_argument(
        "ref", metavar="HOOK", nargs="?", help="built-in name or package.module:Class"
    )
    add_bus_argument(parser)
    add_curve_argument(parser)
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="constructor option of HOOK; VALUE is JSON if it parses, else text",
    )
    parser.add_argument(
        "--hooks",
        metavar="JSON",
        help=(
            "instead of HOOK and --option: a JSON list of job-spec hook entries, "
            """e.g. '[{"type": "logging", "every": 10}, {"type": "metrics"}]', """
            "all run in this one process"
        ),
    )
    parser.add_argument("--exit-on-run-end", action="store_true", help="exit once the run ended")
    parser.set_defaults(func=run)


def build_hooks(args: argparse.Namespace) -> list[Hook]:
    """The hooks named by ``HOOK --option ...`` or by ``--hooks JSON``; `UsageError` if bad."""
    if args.hooks is None:
        if args.ref is None:
            raise UsageError("name a HOOK, or give --hooks JSON")
        return [build_hook(args.ref, parse_options(args.option))]
    if args.ref is not None or args.option:
        raise UsageError("--hooks names every hook and its options: no HOOK or --option with it")
    try:
        entries: Any = json.loads(args.hooks)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--hooks is not valid JSON: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--hooks must be a non-empty JSON list of hook entries, got {entries!r}")
    return [build_hook_from_spec(entry) for entry in entries]


def run(args: argparse.Namespace) -> int:
    """Build the hooks, attach them, run until interrupted (or the run ends)."""
    # Build first: a bad hook reference or option is reported without touching the bus.
    hooks = build_hooks(args)
    address, curve = connect_bus(args)
    runner = HookRunner(hooks, address, exit_on_run_end=args.exit_on_run_end, curve=curve)
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
                    runner.stop(signalled=True)
                    return

        tg.start_soon(watch_signals)
        await runner.run()
        tg.cancel_scope.cancel()
