"""Taking over the run directory before anything is started in it.

The launch that runs the bus (node 0) takes the directory over: a
``run.json`` left ``running`` by a launcher that is gone is marked
``interrupted`` first (`evtrain.launcher.run_record.mark_if_stale`); one whose
launcher still runs makes the directory in use. A directory that holds a
run is never started in afresh (`evtrain.launcher.run_record` says why): without
``--resume`` or ``--overwrite`` that is a usage mistake, and an evaluation
never writes into one (`evtrain.launcher.plan.Purpose.check_used_dir`). A
resume of a run that has trained all its ``max_steps`` says so and starts
nothing (exit status 0; `evtrain.launcher.plan.Purpose.done_already`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from evtrain.errors import UsageError
from evtrain.launcher.options import LaunchOptions
from evtrain.launcher.plan import LaunchPlan
from evtrain.launcher.run_record import (
    LAUNCHES_DIR,
    clear_run,
    mark_if_stale,
    read_run_record,
    rewind_metrics,
    used_by,
)

__all__ = ["take_over"]

log = structlog.get_logger(__name__)


def take_over(
    run_dir: Path,
    options: LaunchOptions,
    plan: LaunchPlan,
    run_id: str,
    *,
    warn: Callable[[str], None],
) -> dict[str, Any] | None:
    """Refuse a run directory in use or holding another run; continue or clear it.

    A record its dead launcher left ``running`` is marked interrupted first
    (``warn`` says so). A directory that holds a run
    (`evtrain.launcher.run_record.used_by`) is refused unless the launch resumes that
    run (its metrics log is rewound to the resumed step) or starts it over
    (``--overwrite``: the run's files go). Reports an earlier launch with the
    same ``run_id`` left here are set aside (``launches/RUN_ID.1``...): this
    launch's watch would read them as its own. Returns what ``run.json``
    records of the run this launch continues (None: a fresh or cleared
    directory).
    """
    stale = mark_if_stale(run_dir)
    previous = stale or read_run_record(run_dir)
    if previous is not None and previous.get("status") == "running":
        raise UsageError(
            f"run directory {run_dir} is in use by run {previous.get('run_id')} "
            f"(launcher pid {previous.get('launcher_pid')})"
        )
    used = used_by(run_dir)
    if used:
        plan.purpose.check_used_dir(run_dir, options)
    if stale is not None:
        warn(
            f"the previous run {stale.get('run_id')} in {run_dir} was interrupted "
            f"(its launcher, pid {stale.get('launcher_pid')}, is gone); marked interrupted"
        )
    _set_aside_reports(run_dir / LAUNCHES_DIR / run_id, warn)
    if used and options.overwrite:
        clear_run(run_dir)
        log.info("run directory cleared", run_dir=str(run_dir), removed=used)
        return None
    if used:
        # The same run goes on: the steps after the resumed one are trained again.
        dropped = rewind_metrics(run_dir, plan.start_step)
        if dropped:
            log.info("metrics log rewound", to_step=plan.start_step, lines_dropped=dropped)
    if previous is None:
        return None
    return {key: previous.get(key) for key in ("run_id", "status", "steps", "exit_status")}


def _set_aside_reports(reports: Path, warn: Callable[[str], None]) -> None:
    """Move an earlier launch's reports under this run id out of the way."""
    if not reports.exists():
        return
    n = 1
    while reports.with_name(f"{reports.name}.{n}").exists():
        n += 1
    aside = reports.with_name(f"{reports.name}.{n}")
    reports.rename(aside)
    warn(f"run id {reports.name} was used here before: its launch reports moved to {aside}")
