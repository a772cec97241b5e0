"""``evtrain launch``: run a job spec — broker, supervised hooks, elastic stage workers."""

from __future__ import annotations

import argparse
import os

from evtrain.bus.security import CURVE_DIR_ENV
from evtrain.overrides import add_override_arguments, overrides_from_args

_DESCRIPTION = (
    "start the event bus, the spec's hooks (as supervised processes: the built-ins "
    "together in one, unless a hook entry says isolate=True, every other hook in its own) "
    "and one stage "
    "worker per pipeline stage through torch.distributed.elastic; show progress; exit 0 "
    "when the run completed or stopped cleanly, 1 when a stage failed (the first stage "
    "that failed and why are shown, the full report is in RUN_DIR/launches/RUN_ID/"
    "failure.txt), 2 for a bad spec, override, hook or resume path or a run directory that "
    "holds another run (nothing is started), "
    "3 when the run completed but its --external-bus broker was lost on the way (hooks "
    "missed the rest; complete checkpoints written since are verified and committed at the "
    "end). Ctrl-C / SIGTERM stop the "
    "workers at a step boundary."
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``launch`` subcommand."""
    parser = sub.add_parser(
        "launch",
        help="train a job spec with pipeline-parallel stage workers",
        description="Validate the job spec (default: the built-in demo), " + _DESCRIPTION,
    )
    parser.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="job spec file (defines `job` or make_job()); default: the built-in demo",
    )
    add_launch_arguments(parser)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``launch`` option but the spec (``evtrain demo`` shares them)."""
    group = parser.add_argument_group("launcher")
    group.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart the stage workers up to K times after a failure (elastic; default 0)",
    )
    group.add_argument(
        "--bus",
        metavar="ADDRESS",
        help="bus to bind: ipc:///DIR or tcp://HOST:PORT (ports PORT..PORT+4); "
        "default: a new private ipc directory. Several machines need tcp://",
    )
    group.add_argument(
        "--external-bus",
        action="store_true",
        help="--bus names a broker that already runs (`evtrain bus`, e.g. a compose "
        "service): connect to it instead of binding one",
    )
    group.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="with --external-bus, and on node r > 0: wait up to S seconds for the broker "
        "to answer (default 30)",
    )
    group.add_argument(
        "--curve-dir",
        metavar="DIR",
        default=os.environ.get(CURVE_DIR_ENV) or None,
        help="CURVE encryption and authentication for every part of the run: the broker "
        "admits only the public keys in DIR/authorized, and the stages, the hooks and the "
        "launcher connect with DIR's client keys. Created with new keys (mode 0700) when "
        "missing where the launch runs the broker; node r > 0 and --external-bus need the "
        "broker's directory (copy client.key, client.key_secret and server.key). Works on "
        f"ipc and tcp buses (default: ${CURVE_DIR_ENV}). Attach with "
        "`evtrain hook/events/top --curve-dir DIR`",
    )
    group.add_argument("--no-hooks", action="store_true", help="do not start the spec's hooks")
    group.add_argument(
        "--hook-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart a crashing hook process (the built-ins' host with all its hooks) up to "
        "N times (default 5)",
    )
    group.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH|auto",
        help="continue the run from a checkpoint (no PATH: the run directory's latest "
        "committed one; 'auto': that one if there is one, else start at step 0, so one "
        "command serves the first start and every restart)",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds a run: its checkpoints, logs and "
        "records are removed first (without this or --resume such a directory is refused)",
    )
    group.add_argument(
        "--load-weights", metavar="PATH", help="load model weights only and start at step 0"
    )
    group.add_argument(
        "--dump-weights",
        metavar="DIR",
        help="at the end each stage writes its parameters to DIR/stage-R.safetensors",
    )
    group.add_argument("--run-id", metavar="ID", help="run id (default: time + random)")
    group.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on Ctrl-C/SIGTERM, seconds the workers get to stop at a step boundary before "
        "they are terminated (default 30)",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        metavar="S",
        help="report the run hung and end it (exit status 4) when no stage's step or "
        "instruction changed for S seconds: a report names where each stage is, what it "
        "waits on and its Python stack (default: 300, or 10 times the slowest step if "
        "longer; 0: never)",
    )
    group.add_argument(
        "--start-method",
        choices=("spawn", "forkserver", "fork"),
        default="forkserver",
        help="how elastic starts the workers (default forkserver: forks of a process that "
        "imported torch once; spawn: a fresh interpreter each)",
    )
    nodes = parser.add_argument_group(
        "several machines (run the same command on each, with its own --node-rank)"
    )
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of machines")
    nodes.add_argument(
        "--node-rank",
        type=int,
        metavar="R",
        help="this machine's rank, needed with --nnodes > 1: node 0 runs the bus, the hooks "
        "and the c10d rendezvous store; every node runs P*D/N of the stage workers, a "
        "block of consecutive stages chosen by the rendezvous",
    )
    nodes.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="c10d rendezvous address on node 0 that every machine reaches; pass the same "
        "--run-id and --bus tcp://HOST:PORT on every machine",
    )
    nodes.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="this machine's address as the others reach it (default: the local address "
        "of the route to --rdzv-endpoint)",
    )
    add_override_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Launch the job; returns the exit status."""
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.launcher import Launcher, LaunchOptions

    spec = getattr(args, "spec", None)
    if spec is None:
        # lazy: torch loads when the command runs, not when the CLI is built
        from evtrain.tools.demo import SPEC_PATH

        spec = SPEC_PATH
    options = LaunchOptions(
        spec=spec,
        overrides=overrides_from_args(args),
        max_restarts=args.max_restarts,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
        bus=args.bus,
        external_bus=args.external_bus,
        curve_dir=args.curve_dir,
        bus_wait_s=args.connect_timeout,
        hooks=not args.no_hooks,
        hook_restarts=args.hook_restarts,
        resume=args.resume,
        overwrite=args.overwrite,
        load_weights=args.load_weights,
        dump_weights=args.dump_weights,
        run_id=args.run_id,
        quiet=args.quiet,
        grace_s=args.grace,
        hang_timeout=args.hang_timeout,
        start_method=args.start_method,
        log_format=args.log_format,
        log_level=args.log_level,
    )
    return Launcher(options).run()
