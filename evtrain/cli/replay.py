"""``evtrain replay``: feed a recorded run through a hook, offline."""

from __future__ import annotations

import argparse

import anyio

from evtrain.hooks.registry import BUILTIN_HOOKS, build_hook, parse_options


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` subcommand."""
    parser = sub.add_parser(
        "replay",
        help="feed a recorded run through a hook",
        description=(
            "Read RUN_DIR/events.jsonl (written by the 'recorder' hook) and dispatch every "
            "event to a hook in-process, exactly as a live run would: same handlers, same "
            "order, same run state. Commands the hook sends are printed, not sent. Hooks "
            "that write into the run directory write into --out instead (default "
            "RUN_DIR/replay). Built-ins: " + ", ".join(sorted(BUILTIN_HOOKS))
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its events.jsonl)")
    parser.add_argument(
        "--hook", required=True, metavar="HOOK", help="built-in name or package.module:Class"
    )
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="constructor option of the hook; VALUE is JSON if it parses, else text",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="",
        help="run directory the hook sees, for its output files (default: RUN_DIR/replay)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Replay; exit 1 if a handler raised."""
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.tools.replay import replay

    hook = build_hook(args.hook, parse_options(args.option))
    result = anyio.run(lambda: replay(args.run_dir, [hook], out_dir=args.out))
    for command in result.commands:
        print(f"command (not sent): {command.topic.decode()} {command}")
    print(
        f"replayed {result.events} events through {hook.hook_name()}: "
        f"{result.errors} handler errors, {len(result.commands)} commands"
    )
    return 1 if result.errors else 0
