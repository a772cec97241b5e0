"""What a launch tells: header, summary, an evaluation's result, the failure, ``run.json``.

The exit status (`exit_status`): 0 when the run completed or was stopped
cleanly (by a hook's stop command, or by SIGTERM/Ctrl-C when the stages
ended the run at a step boundary); 1 when a stage failed; 2 for a usage
mistake (nothing started); 3 when the training completed or stopped cleanly
but the bus was lost on the way (`evtrain.launcher.watch.BusWatch`); 4 when
the run hung and the launcher ended it (`evtrain.launcher.hang`); 128 + N
when signal N arrived before the stages could stop cleanly.

A failure is printed once (the root cause, the user's frames, one line per
consequence) and written in full to ``RUN_DIR/launches/RUN_ID/failure.txt``.
An evaluation's metrics come from the last stage's report, not from the
bus: exactly the floats the stage computed; they are printed and written
as JSON (`evtrain.launcher.plan.Evaluation`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import structlog

from evtrain.checkpoint import read_manifest
from evtrain.events import RunEnded
from evtrain.failures import RootCause
from evtrain.launcher.bus import RunBus, curve_dir
from evtrain.launcher.hang import HANG_FILE, Hang
from evtrain.launcher.options import (
    EXIT_BUS_LOST,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    LaunchOptions,
)
from evtrain.launcher.plan import LaunchPlan, world
from evtrain.launcher.progress import RunConsole
from evtrain.launcher.run_record import process_start_ticks, write_run_record
from evtrain.launcher.watch import BusWatch, FailureWatch
from evtrain.stages.worker import rank_at

if TYPE_CHECKING:
    from evtrain.launcher.plan import Evaluation

__all__ = ["Report", "closing_event", "ending_word", "exit_status", "record_status"]

log = structlog.get_logger(__name__)


def _number(value: float | None) -> str:
    return "nan" if value is None else f"{value:.6g}"


def exit_status(
    agent_status: int,
    *,
    stop_signal: int | None,
    ended: RunEnded | None,
    root: RootCause | None,
    bus_lost: bool,
    hung: bool = False,
) -> int:
    """The launch's exit status (module docstring) from how the agent and the stages ended.

    ``ended``: the stages' own ``RunEnded``; ``root``: the root cause of a failure;
    ``hung``: the launcher ended the run because it hung.
    """
    if hung:
        return EXIT_HUNG

    def degraded(status: int) -> int:
        return EXIT_BUS_LOST if status == EXIT_OK and bus_lost else status

    if stop_signal is not None:
        if agent_status == 0 or (ended is not None and ended.status != "failed"):
            return degraded(EXIT_OK)  # the workers ended the run at a step boundary
        if agent_status == EXIT_FAILED and root is not None:
            return EXIT_FAILED
        return 128 + stop_signal
    if agent_status != 0:
        return EXIT_FAILED
    if ended is not None and ended.status == "failed":
        return EXIT_FAILED
    return degraded(EXIT_OK)


def closing_event(agent_status: int, *, stop_signal: int | None, step: int) -> RunEnded:
    """The ``RunEnded`` the launcher publishes when the stages could not, and no stage failed."""
    status: Literal["completed", "stopped", "failed"]
    if stop_signal is not None and agent_status != EXIT_FAILED:
        status, reason = "stopped", f"launcher got {signal.Signals(stop_signal).name}"
    elif agent_status == 0:
        status, reason = "completed", ""
    else:
        status, reason = "failed", "stage workers failed"
    return RunEnded(status=status, reason=reason, step=step)


def ending_word(status: int, *, stop_signal: int | None, ended_status: str) -> str:
    """The summary's word for how the run ended."""
    if status in (EXIT_OK, EXIT_BUS_LOST):
        return ended_status
    if status == EXIT_HUNG:
        return "hung"
    if stop_signal is not None and status != EXIT_FAILED:
        return f"interrupted ({signal.Signals(stop_signal).name})"
    return "failed"


def record_status(status: int, *, ended_status: str) -> str:
    """``run.json``'s final status for exit status ``status``."""
    if status in (EXIT_OK, EXIT_BUS_LOST):
        return ended_status
    if status == EXIT_FAILED:
        return "failed"
    if status == EXIT_HUNG:
        return "hung"
    return "interrupted"


class Report:
    """The launch's account of itself, on the console and in its run directory."""

    def __init__(
        self,
        options: LaunchOptions,
        plan: LaunchPlan,
        console: RunConsole,
        err: TextIO,
        *,
        run_id: str,
        run_dir: Path,
        report_dir: Path,
        bus: RunBus,
        failures: FailureWatch,
        bus_watch: BusWatch,
        started: float,
        started_at: str,
    ) -> None:
        self.options = options
        self.plan = plan
        self.console = console
        self.err = err
        self.run_id = run_id
        self.run_dir = run_dir
        self.report_dir = report_dir
        self.bus = bus
        self.failures = failures
        self.bus_watch = bus_watch
        self.started = started
        """When the launch began (monotonic; the summary's wall time counts from it)."""
        self.started_at = started_at
        self.previous_run: dict[str, Any] | None = None
        """The run this launch continues in its directory (``run.json``)."""
        self.result: dict[str, Any] | None = None
        """An evaluation's result, as written to its JSON file."""

    def header(self) -> None:
        """The run's header lines and the warnings of preparing it; progress shows from now."""
        job, address, plan = self.plan.job, self.bus.address, self.plan
        chunks = f" x {job.virtual_stages} chunks" if job.virtual_stages > 1 else ""
        say = self.console.say
        say(
            f"evtrain launch: run {self.run_id} | {job.name} | {world(job)} "
            f"({job.schedule}{chunks}, {job.num_microbatches} microbatches) "
            f"| {plan.purpose.steps(job)}"
        )
        if job.num_chunks > 1 and plan.split is not None:
            say(f"  split: {plan.split.describe()}")
        attach = f"evtrain hook MODULE:CLASS --bus {address}"
        secured = ""
        if self.options.curve_dir is not None:
            attach += f" --curve-dir {curve_dir(self.options)}"
            secured = " with CURVE"
        say(f"  bus: {address}{secured}  (attach: {attach})")
        say(f"  run dir: {self.run_dir}")
        source = plan.purpose.source_line(plan, self.options)
        if source is not None:
            say(source)
        for note in plan.warnings:
            self.console.warn(note)
        self.console.start()

    def conclude(
        self,
        agent_status: int,
        *,
        stop_signal: int | None,
        ended: RunEnded | None,
        root: RootCause | None,
        hang: Hang | None = None,
    ) -> int:
        """Print the summary (or the evaluation) and the failure; return the exit status.

        ``ended``: the stages' own ``RunEnded``; ``root``: the root cause of a failure;
        ``hang``: the hang that ended the run (already reported).
        """
        bus_lost = self.bus_watch.loss is not None
        status = exit_status(
            agent_status,
            stop_signal=stop_signal,
            ended=ended,
            root=root,
            bus_lost=bus_lost,
            hung=hang is not None,
        )
        said = self.failures.ended_status(ended)
        word = ending_word(status, stop_signal=stop_signal, ended_status=said)
        status = self.plan.purpose.conclude(self, status, word)
        if status == EXIT_FAILED:
            self.failure(root, agent_status)
        loss = self.bus_watch.loss_line(checkpointing=self.plan.checkpointing, run_dir=self.run_dir)
        if loss is not None:
            self.console.warn(loss)
        return status

    def summary(self, word: str) -> None:
        """The training's summary line(s)."""
        progress = self.console.progress
        self.console.say(progress.summary(status=word, wall_s=time.monotonic() - self.started))

    def evaluation(self, purpose: Evaluation) -> int:
        """Print the evaluation's metrics, write them as JSON; `EXIT_FAILED` without them.

        They come from the last stage's report, not from the bus: exactly the
        floats the stage computed.
        """
        job, plan, say = self.plan.job, self.plan, self.console.say
        assert plan.resume_path is not None
        # Replica 0 of the last stage evaluates (stage reports are by global rank).
        last = rank_at(
            job.stages - 1, 0, 0, replicas=job.data_parallel, tp_size=job.tensor_parallel
        )
        report = self.failures.stage_reports.get(last)
        if report is None or report.eval_metrics is None:
            self.console.error("the evaluation ended without metrics")
            return EXIT_FAILED
        manifest = read_manifest(plan.resume_path)
        recorded = (
            {manifest.metric_name: manifest.metric} if manifest.metric_name is not None else {}
        )
        output = purpose.output_path(self.run_dir)
        self.result = {
            "checkpoint": str(plan.resume_path),
            "step": plan.start_step,
            "metrics": dict(report.eval_metrics),
            "samples": report.eval_samples,
            "sets": dict(report.eval_sets),
            "recorded": recorded,
            "name": job.name,
            "stages": job.stages,
            "run_id": self.run_id,
            "eval_dir": str(self.run_dir),
            "output": str(output),
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(self.result, indent=2) + "\n")
        if report.eval_sets:
            say(f"eval of step {plan.start_step}: {report.eval_samples} samples")
            for name, samples in report.eval_sets.items():
                prefix = f"{name}/"
                shown = " ".join(
                    f"{k.removeprefix(prefix)}={_number(v)}"
                    for k, v in report.eval_metrics.items()
                    if k.startswith(prefix)
                )
                say(f"  {name}: {shown} ({samples} samples)")
        else:
            shown = " ".join(f"{k}={_number(v)}" for k, v in report.eval_metrics.items())
            say(f"eval of step {plan.start_step}: {shown} ({report.eval_samples} samples)")
        for name, value in recorded.items():
            say(f"  recorded with the checkpoint: {name}={_number(value)}")
        say(f"  result: {output}")
        return EXIT_OK

    def failure(self, root: RootCause | None, agent_status: int) -> None:
        """The root cause and its consequences on stderr; everything in ``failure.txt``."""
        if root is None:
            self.err.write(
                f"evtrain launch: error: stage workers failed (elastic agent exit status "
                f"{agent_status}); no stage reported why\n"
            )
            self.err.flush()
            return
        lines = [f"evtrain launch: error: {root.headline()}"]
        if len(root.first.user_frames) > 1 or (
            root.first.user_frames and ": " in root.first.user_frames[-1]
        ):
            lines.append("  user code (innermost last):")
            lines += [f"    {frame}" for frame in root.first.user_frames]
        lines += [f"  consequence: {f.headline(brief=True)}" for f in root.consequences]
        path = self.report_dir / "failure.txt"
        try:
            path.write_text(root.report())
            lines.append(f"  full report: {path}")
        except OSError as exc:
            log.warning("cannot write the failure report", error=str(exc))
        self.err.write("\n".join(lines) + "\n")
        self.err.flush()

    def write_record(
        self, *, root: RootCause | None, hang: Hang | None = None, **extra: Any
    ) -> None:
        """Write ``run.json`` (the bus owner only): the launch as it stands, and ``extra``."""
        if not self.bus.is_owner:
            return
        opts, plan, job = self.options, self.plan, self.plan.job
        stats = self.console.progress.stats
        data: dict[str, Any] = {
            "run_id": self.run_id,
            "name": job.name,
            "spec": str(Path(opts.spec).expanduser().resolve()),
            "overrides": dict(opts.overrides),
            "bus": str(self.bus.address),
            "owned_bus_dir": self.bus.owned_dir,
            "run_dir": str(self.run_dir),
            "reports": str(self.report_dir),
            "stages": job.stages,
            "data_parallel": job.data_parallel,
            "schedule": job.schedule,
            "nnodes": opts.nnodes,
            "curve_dir": curve_dir(opts),
            "max_restarts": opts.max_restarts,
            "resume": str(plan.resume_path) if plan.resume_path is not None else None,
            "start_step": plan.start_step,
            "evaluate": plan.purpose.evaluates,
            "load_weights": str(plan.load_weights_path) if plan.load_weights_path else None,
            "host": socket.gethostname(),
            "launcher_pid": os.getpid(),
            "launcher_start": process_start_ticks(os.getpid()),
            "started": self.started_at,
            "steps": stats.steps_done,
            "final_loss": stats.last_loss,
            "last_eval": stats.last_eval.metrics if stats.last_eval is not None else None,
            "last_eval_step": stats.last_eval.step if stats.last_eval is not None else None,
            "previous_run": self.previous_run,
        }
        if root is not None:
            data["root_cause"] = root.headline()
        if hang is not None:
            culprit = hang.culprit.report
            data["root_cause"] = hang.headline()
            data["hang"] = {
                "step": hang.step,
                "stage": culprit.stage,
                "replica": culprit.replica,
                "doing": culprit.doing,
                "location": hang.culprit.location(),
                "report": str(self.report_dir / HANG_FILE),
            }
        bus_lost = self.bus_watch.record(checkpointing=plan.checkpointing, run_dir=self.run_dir)
        if bus_lost is not None:
            data["bus_lost"] = bus_lost
        data.update(extra)
        write_run_record(self.run_dir, data)
