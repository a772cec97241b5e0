"""``evtrain eval``: evaluate a checkpoint once, on the stages, without training."""

from __future__ import annotations

import argparse

from evtrain.overrides import add_override_arguments, overrides_from_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    parser = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on the job's eval data (no training)",
        description=(
            "Start the job's stage workers, load a committed checkpoint into them and run "
            "the job's evaluation once, at the checkpoint's step, exactly as training "
            "evaluates there: the metrics equal the ones recorded for that step. Nothing is "
            "trained or saved and no hook is started; the evaluation's own files go to "
            "RUN_DIR/evals/RUN_ID (--eval-dir), the metrics are printed and written as JSON "
            "(--output). Exit 0 with metrics, 1 when a stage failed, 2 for a bad spec, "
            "override or checkpoint."
        ),
    )
    parser.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="job spec file (defines `job` or make_job()); default: the built-in demo",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a committed checkpoint directory, or a run directory (its latest committed one)",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="write the result as JSON here (default: EVAL_DIR/eval.json)",
    )
    parser.add_argument(
        "--eval-dir",
        metavar="DIR",
        help="the evaluation's own directory: record, stage reports, JSON (default: "
        "RUN_DIR/evals/RUN_ID of the checkpoint's run, beside that run's files, which stay "
        "untouched)",
    )
    parser.add_argument(
        "--start-method",
        choices=("spawn", "forkserver", "fork"),
        default="forkserver",
        help="how elastic starts the workers (default forkserver)",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    add_override_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate; returns the exit status."""
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.launcher import Launcher, LaunchOptions

    spec = args.spec
    if spec is None:
        # lazy: torch loads when the command runs, not when the CLI is built
        from evtrain.tools.demo import SPEC_PATH

        spec = SPEC_PATH
    options = LaunchOptions(
        spec=spec,
        overrides=overrides_from_args(args),
        evaluate=args.checkpoint,
        eval_dir=args.eval_dir,
        eval_output=args.output,
        hooks=False,
        quiet=args.quiet,
        start_method=args.start_method,
        log_format=args.log_format,
        log_level=args.log_level,
    )
    return Launcher(options).run()
