"""``evtrain top``: a live dashboard of a running job (`evtrain.tools.top`)."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

from evtrain.cli.common import (
    BUS_ENV,
    add_bus_argument,
    add_curve_argument,
    connect_bus,
    run_async,
)
from evtrain.errors import UsageError
from evtrain.launcher.run_record import RUN_RECORD, launcher_alive, read_run_record

DEFAULT_INTERVAL = 0.5


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``top`` subcommand."""
    parser = sub.add_parser(
        "top",
        help="live dashboard of a running job",
        description=(
            "Show a running job on the terminal, from its bus: per stage its step, step "
            "time, forward/backward/wait shares, memory and last heartbeat; the run's "
            "progress and pipeline bubble; the hooks attached and their errors; events "
            "dropped or lost on the bus; checkpoints. Joins at any time. Give the bus "
            f"(--bus, or ${BUS_ENV}) or the run directory of `evtrain launch` (its "
            f"{RUN_RECORD} names the bus). q or Ctrl-C quits."
        ),
    )
    parser.add_argument(
        "run_dir", nargs="?", metavar="RUN_DIR", help="run directory of a running launch"
    )
    add_bus_argument(parser, required=False)
    add_curve_argument(parser)
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="S",
        help=f"seconds between redraws, at least 0.25 (default: {DEFAULT_INTERVAL:g})",
    )
    parser.add_argument("--exit-on-run-end", action="store_true", help="exit once the run ended")
    parser.set_defaults(func=run)


def bus_of_run_dir(run_dir: str) -> tuple[str, str | None]:
    """The bus address and the CURVE key directory (None: no CURVE) that
    ``RUN_DIR/run.json`` records for a launch still running there."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise UsageError(f"{run_dir}: no such directory")
    record = read_run_record(directory)
    if record is None:
        raise UsageError(
            f"{run_dir}: no {RUN_RECORD} there; is it the run directory of `evtrain launch`? "
            "(a launch onto an outside bus writes none: give that bus with --bus)"
        )
    bus = record.get("bus")
    if not isinstance(bus, str) or not bus:
        raise UsageError(f"{directory / RUN_RECORD} names no bus")
    status = record.get("status")
    if status != "running":
        raise UsageError(f"the run in {run_dir} is not running ({RUN_RECORD}: status {status})")
    if not launcher_alive(record):
        pid = record.get("launcher_pid")
        raise UsageError(f"the run in {run_dir} is not running: its launcher (pid {pid}) is gone")
    curve_dir = record.get("curve_dir")
    return bus, curve_dir if isinstance(curve_dir, str) and curve_dir else None


def run(args: argparse.Namespace) -> int:
    """Resolve the bus, check it answers, show the dashboard until told to stop."""
    # lazy: the console watcher loads when the command runs, not when the CLI is built
    from evtrain.tools.top import MIN_INTERVAL_S, watch

    if not args.interval >= MIN_INTERVAL_S:
        raise UsageError(f"--interval must be at least {MIN_INTERVAL_S:g} s, got {args.interval:g}")
    if args.run_dir is not None:
        if args.bus is not None and args.bus != os.environ.get(BUS_ENV):
            raise UsageError("give either RUN_DIR or --bus, not both")
        args.bus, recorded_curve = bus_of_run_dir(args.run_dir)
        if not getattr(args, "curve_dir", None):
            args.curve_dir = recorded_curve  # the launch's own keys, unless told otherwise
    elif args.bus is None:
        raise UsageError(f"give RUN_DIR or --bus ADDRESS (or set ${BUS_ENV})")
    address, curve = connect_bus(args)
    try:
        run_async(
            functools.partial(
                watch,
                address,
                curve=curve,
                interval=args.interval,
                exit_on_run_end=args.exit_on_run_end,
            )
        )
    except TimeoutError as exc:  # the broker answered but our events never came back
        raise UsageError(str(exc)) from None
    return 0
