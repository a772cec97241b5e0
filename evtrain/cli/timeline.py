"""``evtrain timeline``: a recorded run's microbatch spans as a Perfetto trace and a picture."""

from __future__ import annotations

import argparse
from pathlib import Path

from evtrain.errors import UsageError

PNG_DEFAULT_STEPS = 3
"""Steps drawn by ``--png`` when ``--steps`` is not given (the last ones recorded)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``timeline`` subcommand."""
    parser = sub.add_parser(
        "timeline",
        help="turn a run's microbatch spans into a Chrome/Perfetto trace (and a PNG)",
        description=(
            "Read RUN_DIR/events.jsonl (written by the recorder hook; the run needs "
            "microbatch_spans='all' or 'sampled') and write a Chrome trace with one track "
            "per stage: forward F<m>, backward B<m> and waits. Open it in "
            "https://ui.perfetto.dev or chrome://tracing. --png draws the same; the "
            "pipeline bubble is what stays white."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or an events .jsonl)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="trace file to write (default: RUN_DIR/timeline.json)",
    )
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline into this PNG")
    parser.add_argument(
        "--steps",
        metavar="FIRST:LAST",
        help=(
            "only these steps, inclusive (10:12, 10:, :12 or 10); default: all in the trace "
            f"and the last {PNG_DEFAULT_STEPS} recorded in the PNG"
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the trace (and the PNG); print what was written and each stage's time shares."""
    # lazy: torch loads when the command runs, not when the CLI is built
    from evtrain.tools.timeline import (
        StepRange,
        filter_steps,
        load_run,
        parse_steps,
        render_png,
        stage_busy_fractions,
        write_chrome_trace,
    )

    steps = parse_steps(args.steps) if args.steps is not None else None
    run_dir = Path(args.run_dir)
    recorded = load_run(run_dir)
    spans = recorded.spans
    shown = filter_steps(spans, steps)
    if not shown:
        have = sorted({s.step for s in spans})
        raise UsageError(f"no spans in steps {steps}; recorded steps: {have[0]}..{have[-1]}")
    base = run_dir.parent if run_dir.is_file() else run_dir
    output = Path(args.output) if args.output else base / "timeline.json"
    title = recorded.title
    write_chrome_trace(shown, output, title=title)
    step_ids = sorted({s.step for s in shown})
    print(
        f"trace: {output} ({len(shown)} spans, steps {step_ids[0]}..{step_ids[-1]}; "
        "open in https://ui.perfetto.dev)"
    )
    if args.png:
        picture = shown
        if steps is None and len(step_ids) > PNG_DEFAULT_STEPS:
            last = StepRange(step_ids[-PNG_DEFAULT_STEPS], step_ids[-1])
            picture = filter_steps(shown, last)
        drawn = sorted({s.step for s in picture})
        png = render_png(picture, args.png, title=f"{title}; steps {drawn[0]}..{drawn[-1]}")
        print(f"png: {png} (steps {drawn[0]}..{drawn[-1]})")
    for stage, shares in stage_busy_fractions(shown).items():
        parts = ", ".join(f"{kind} {share:.0%}" for kind, share in shares.items())
        print(f"stage {stage}: {parts}")
    return 0
