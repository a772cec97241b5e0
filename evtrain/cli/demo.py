"""``evtrain demo``: the built-in demo (digits MLP on 2 pipeline stages)."""

from __future__ import annotations

import argparse

from evtrain.cli.launch import add_launch_arguments, run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = sub.add_parser(
        "demo",
        help="train the built-in demo: an MLP on scikit-learn's digits, 2 stages",
        description=(
            "Launch the built-in demo (evtrain/tools/demo.py): an MLP on scikit-learn's bundled "
            "handwritten digits across 2 pipeline stages, with the logging hook, the "
            "Prometheus exporter, evaluation and checkpoints. Same options as "
            "`evtrain launch`."
        ),
    )
    add_launch_arguments(parser)
    parser.set_defaults(func=run)
