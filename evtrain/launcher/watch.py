"""What the launcher learns of the run without the bus, and how it notices the bus is gone.

`FailureWatch`: the truth about every stage comes from files that do not
depend on the bus — each stage's `evtrain.stages.worker.StageReport` and the
agent's `evtrain.launcher.elastic_agent.AgentReport`, in ``RUN_DIR/launches/RUN_ID/``
— and, for another node's stages, from ``StageFailed`` events.

Failures: the first stage that failed is the root cause, not the first one
that said so (`evtrain.failures`): the others usually fail on its closed
connections moments later, and a stage killed by a signal says nothing at
all. The launcher prints it once (``evtrain launch: error: stage 1 was
killed by SIGKILL after step 62``, or the exception with the user's
``FILE:LINE``), then one line per consequence, and writes everything, full
tracebacks included, to ``RUN_DIR/launches/RUN_ID/failure.txt``
(`evtrain.launcher.report`). It publishes ``RunEnded(status="failed")`` with
``root_cause`` itself, as soon as the cause is known (an exception that is
not a symptom names it outright; a death needs its exit status, and after
`FAILURE_SETTLE_S` the cause is published anyway, or `REMOTE_FAILURE_SETTLE_S`
when only consequences are seen here and other nodes run stages); the agent kills
survivors that do not end within a second, and hooks get a second to finish
(`evtrain.launcher.hooks.FAILED_HOOK_GRACE_S`), so a failed launch ends a few
seconds after the failure. With ``--max-restarts`` a failure before the last
restart is a warning naming its root cause, and elastic restarts the
workers. A failure on another node leaves this node's workers waiting on
the dead peer: they are killed `FAILED_WORKERS_GRACE_S` after the run ended
(`workers_outstay_failure`).

`BusWatch`: the broker and its death. The broker the launcher hosts lives
as long as the launcher; with ``--external-bus`` it is another process,
which may die on its own, and the launcher does not depend on it for
anything but events. Training goes on, the stage reports keep the launcher
informed, and when no event arrived for `BUS_QUIET_S` seconds and the
broker does not answer, the launcher warns that the bus was lost at step N.
At the end the launcher verifies and commits the complete checkpoints
written after the loss, which the coordinator never heard of
(`evtrain.checkpoint.commit_complete`), and the summary and ``run.json`` say
so with the consequence (`BusWatch.loss_line`: hooks saw nothing after step
N); the exit status is 3 instead of 0: hooks missed part of the run. A broker that
comes back (a restarted compose service) is used again; the loss is still
reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from evtrain.checkpoint import commit_complete, latest_committed
from evtrain.events import RunEnded, StageFailed
from evtrain.failures import (
    Failure,
    RootCause,
    failure_from_exit,
    find_root_cause,
    is_communication_error,
)
from evtrain.launcher.bus import RunBus
from evtrain.launcher.elastic_agent import AgentReport, AttemptReport
from evtrain.launcher.ending import RunEnding
from evtrain.launcher.progress import Progress
from evtrain.launcher.stop import StopMachine
from evtrain.stages.worker import StageReport, rank_at, rank_coordinates, read_stage_reports

if TYPE_CHECKING:
    from evtrain.job import Job

__all__ = [
    "BUS_QUIET_S",
    "FAILED_WORKERS_GRACE_S",
    "FAILURE_SETTLE_S",
    "BusLoss",
    "BusWatch",
    "FailureResponse",
    "FailureWatch",
    "workers_outstay_failure",
]

log = structlog.get_logger(__name__)

FAILURE_SETTLE_S = 1.5
"""Seconds after the first sign of a failure by which the root cause is published anyway."""
REMOTE_FAILURE_SETTLE_S = 15.0
"""The same when every failure seen is a consequence and other nodes run stages: the
cause is likely theirs, and their launcher's word travels over the bus, late on a
loaded machine."""
FAILED_WORKERS_GRACE_S = 5.0
"""Seconds this node's workers get to end after the run failed before they are killed."""
BUS_QUIET_S = 3.0
"""No event for this long while stages run (they send heartbeats every second): ask the broker."""
_FINISHED = ("completed", "stopped")


class FailureWatch:
    """The stages' and the agent's reports of the current attempt, and what failed in it."""

    def __init__(
        self, job: Job, progress: Progress, *, report_dir: Path, agent_report: Path, restarts: int
    ) -> None:
        self.job = job
        self.progress = progress
        self.report_dir = report_dir
        self.agent_report_path = agent_report
        self.restarts = restarts
        self.agent_report: AgentReport | None = None
        self.stage_reports: dict[int, StageReport] = {}
        """The current attempt's reports, by global rank."""
        self._failure_seen_at: float | None = None
        self.hung_attempts: dict[int, str] = {}
        """Attempts the launcher ended because they hung, with the hang's headline."""
        self._announced_attempts: set[int] = set()
        self._told: RootCause | None = None

    def refresh(self) -> None:
        """Read the reports again."""
        report = AgentReport.read(self.agent_report_path)
        if report is not None:
            self.agent_report = report
        attempt = self.current_attempt()
        number = attempt.attempt if attempt is not None else 0
        self.stage_reports = read_stage_reports(self.report_dir, number)

    def current_attempt(self) -> AttemptReport | None:
        report = self.agent_report
        return report.attempts[-1] if report is not None and report.attempts else None

    def steps_known(self) -> int:
        """The most steps anyone reported: the bus or a stage."""
        reports = [r.step for r in self.stage_reports.values()]
        return max([self.progress.stats.steps_done, *reports])

    def failures(self, attempt: AttemptReport | None) -> list[Failure]:
        """Every stage failure of ``attempt`` (None: what the bus said, if anything)."""
        number = attempt.attempt if attempt is not None else 0
        started = attempt.started_at if attempt is not None else 0.0
        if attempt is self.current_attempt():
            reports = self.stage_reports
        else:
            reports = read_stage_reports(self.report_dir, number)
        exits = {w.rank: w for w in attempt.workers} if attempt is not None else {}
        replicas, tensor = self.job.data_parallel, self.job.tensor_parallel
        published: dict[int, StageFailed] = {}
        for failed in sorted(self.progress.stats.failures, key=lambda e: e.ts):
            if failed.ts >= started:
                # Tensor rank 0 publishes for its stage and replica.
                rank = rank_at(failed.stage, failed.replica, 0, replicas=replicas, tp_size=tensor)
                published.setdefault(rank, failed)
        failures = []
        for rank in range(self.job.world_size):
            report, worker, event = reports.get(rank), exits.get(rank), published.get(rank)
            # Pipeline-major ranks, as on a (pp, dp, tp) mesh (`evtrain.stages.mesh`).
            stage, replica, tp = rank_coordinates(rank, replicas=replicas, tp_size=tensor)
            which = replica if replicas > 1 else None
            which_tp = tp if tensor > 1 else None
            if report is not None and report.status == "failed":
                failures.append(
                    Failure(
                        stage=stage,
                        replica=which,
                        tp=which_tp,
                        at=report.failed_at or report.updated,
                        what=report.error,
                        consequence=report.consequence,
                        location=report.location,
                        step=report.failed_step,
                        user_frames=tuple(report.user_frames),
                        traceback=report.traceback,
                    )
                )
            elif (
                worker is not None
                and worker.died_at is not None
                and worker.exit_code != 0
                and not (report is not None and report.status in _FINISHED)
            ):
                steps = max(report.step if report is not None else 0, self.steps_known())
                failures.append(
                    failure_from_exit(
                        stage,
                        worker.exit_code,
                        worker.died_at,
                        killed_by_agent=worker.killed_by_agent,
                        step=steps,
                        replica=which,
                        tp=which_tp,
                    )
                )
            elif event is not None and rank not in exits:
                # Another node's stage: the bus is all this launcher hears of it.
                failures.append(
                    Failure(
                        stage=stage,
                        replica=which,
                        tp=which_tp,
                        at=event.ts,
                        what=event.error,
                        consequence=is_communication_error(event.error),
                        step=event.step,
                        traceback=event.traceback,
                    )
                )
        return failures

    def root_cause(self, attempt: AttemptReport | None, *, ended_by_us: bool) -> RootCause | None:
        """The root cause of ``attempt``'s failures; deaths we caused are none."""
        failures = self.failures(attempt)
        if ended_by_us:
            # We had elastic (or ourselves) end the workers: their deaths say nothing.
            failures = [f for f in failures if not f.died]
        return find_root_cause(failures)

    def restart_pending(self, attempt: AttemptReport | None) -> bool:
        number = attempt.attempt if attempt is not None else 0
        return number < self.restarts

    def announce_restarts(self, *, ended_by_us: bool) -> list[str]:
        """A warning for each failed attempt that elastic restarted, once."""
        report = self.agent_report
        lines = []
        for attempt in report.attempts[:-1] if report is not None else []:
            if attempt.attempt in self._announced_attempts:
                continue
            self._announced_attempts.add(attempt.attempt)
            hang = self.hung_attempts.get(attempt.attempt)
            root = self.root_cause(attempt, ended_by_us=ended_by_us) if hang is None else None
            what = hang or (root.headline() if root is not None else "the stage workers failed")
            lines.append(
                f"{what}; elastic restarts the workers "
                f"(restart {attempt.attempt + 1} of {self.restarts})"
            )
        return lines

    def settled_root(self, now: float) -> RootCause | None:
        """The root cause of the last attempt's failure once it is known, else None.

        Call it while the run has not ended and the workers were not ended by
        us: an exception that is not a symptom names the cause outright; a
        death needs its exit status, which the agent has once elastic reaped it.
        """
        attempt = self.current_attempt()
        if self.restart_pending(attempt):
            return None
        failures = self.failures(attempt)
        if not failures:
            return None
        if self._failure_seen_at is None:
            self._failure_seen_at = now
        known = any(not f.consequence and f.certain for f in failures)
        remote = attempt is not None and len(attempt.workers) < self.job.world_size
        settle = (
            REMOTE_FAILURE_SETTLE_S
            if remote and all(f.consequence for f in failures)
            else FAILURE_SETTLE_S
        )
        if known or now - self._failure_seen_at > settle:
            return find_root_cause(failures)
        return None

    def last_attempt_failed(self) -> bool:
        """Whether the last attempt failed with no restart left: its cause is to be named."""
        attempt = self.current_attempt()
        return not self.restart_pending(attempt) and bool(self.failures(attempt))

    def settled_end(
        self, now: float, *, bus_owner: bool
    ) -> tuple[RunEnded, StageFailed | None] | None:
        """How this node ends the run for the hooks once `settled_root` knows the cause:
        the `RunEnded`, and on a node other than node 0 the `StageFailed` it sends
        instead, since a death says nothing on the bus by itself. None until then."""
        root = self.settled_root(now)
        if root is None:
            return None
        return self.failed(root), None if bus_owner else self.stage_failed(root)

    def failed(self, root: RootCause) -> RunEnded:
        """The ``RunEnded`` that tells the hooks ``root`` ended the run (remembered)."""
        self._told = root
        headline = root.headline()
        return RunEnded(
            status="failed", reason=headline, root_cause=headline, step=self.steps_known()
        )

    def stage_failed(self, root: RootCause) -> StageFailed:
        """``root`` as a failure of its stage, for node 0 to learn it from the bus."""
        first = root.first
        return StageFailed(
            stage=first.stage,
            replica=first.replica or 0,
            error=first.what,
            traceback=first.traceback,
            step=first.step,
        )

    def final_root_cause(self, *, ended_by_us: bool) -> RootCause | None:
        """The root cause with all evidence in; what the hooks were told, if it agrees."""
        root = self.root_cause(self.current_attempt(), ended_by_us=ended_by_us)
        told = self._told
        if (
            root is not None
            and told is not None
            and (root.first.stage, root.first.replica, root.first.what)
            == (told.first.stage, told.first.replica, told.first.what)
        ):
            # The same failure, maybe a step count later: keep one wording.
            return RootCause(first=told.first, consequences=root.consequences)
        return root

    def settle_progress(self) -> None:
        """The stages' own count and last loss, where the bus fell behind."""
        reports = list(self.stage_reports.values())
        if not reports:
            return
        last = max(reports, key=lambda r: r.stage)
        self.progress.settle(max(r.step for r in reports), last.loss)

    def any_running(self) -> bool:
        """Whether a stage reports that it starts or runs."""
        return any(r.status in ("starting", "running") for r in self.stage_reports.values())

    def ended_status(self, ended: RunEnded | None) -> str:
        """How a run that did not fail ended: stage 0's word, else the stages' own reports."""
        if ended is not None:
            return ended.status
        stopped = any(r.status == "stopped" for r in self.stage_reports.values())
        return "stopped" if stopped else "completed"


def workers_outstay_failure(
    published: RunEnded | None, published_at: float, now: float, *, ended_by_us: bool
) -> bool:
    """Whether this node's workers should be killed: the run failed a while ago.

    The agent ends the survivors of a failure among its own workers. A
    failure on another node, heard of on the bus, leaves ours waiting for a
    peer that is gone (in a collective, or a gloo connect) until a timeout
    half an hour later. Blocked in a native call, they could not act on
    elastic's SIGTERM either, and a failed run saves nothing at its end.
    """
    if published is None or published.status != "failed" or ended_by_us:
        return False
    return now - published_at >= FAILED_WORKERS_GRACE_S


@dataclass
class BusLoss:
    """When the bus stopped answering, and whether it came back."""

    step: int
    at: float
    back_at_step: int | None = None


class BusWatch:
    """Notices a bus that stopped delivering while the stages publish (module docstring)."""

    def __init__(self, bus: RunBus, warn: Callable[[str], None], *, since: float) -> None:
        self.bus = bus
        self.warn = warn
        self.last_event = since
        """When the last event arrived (``since``: none yet)."""
        self.loss: BusLoss | None = None
        self.committed_after_loss = 0
        """Checkpoints written after the loss that the launcher committed at the end."""

    def heard(self) -> None:
        """An event arrived."""
        self.last_event = time.monotonic()

    @property
    def down(self) -> bool:
        """Whether the bus is lost and has not come back."""
        return self.loss is not None and self.loss.back_at_step is None

    def commit_after_loss(self, run_dir: Path, run_id: str) -> None:
        """At the end of a run that lost its bus, commit the checkpoints written since:
        the coordinator could not hear of their shards, and every hook is done now."""
        if self.loss is not None:
            self.committed_after_loss = len(commit_complete(run_dir, run_id=run_id))

    async def run(
        self,
        *,
        stages_running: Callable[[], bool],
        steps_known: Callable[[], int],
        steps_seen: Callable[[], int],
        agent_running: Callable[[], bool],
    ) -> None:
        """Every second: a quiet bus while stages run is asked; a lost one may come back."""
        while True:
            await anyio.sleep(1.0)
            quiet = time.monotonic() - self.last_event
            loss = self.loss
            if loss is not None:
                if loss.back_at_step is None and quiet < BUS_QUIET_S:
                    loss.back_at_step = steps_known()
                    self.warn(
                        f"the bus at {self.bus.address} answers again (step {loss.back_at_step})"
                    )
                continue
            if quiet >= BUS_QUIET_S and stages_running():
                await self.check(steps_seen(), agent_running=agent_running)

    async def check(self, step: int, *, agent_running: Callable[[], bool]) -> None:
        """Ask the broker; if it does not answer, the bus was lost at ``step``."""
        alive = await self.bus.answers()
        if alive or self.loss is not None:
            return
        self.loss = BusLoss(step=step, at=time.time())
        if agent_running():
            self.warn(
                f"the bus at {self.bus.address} stopped answering at step {step}; training goes "
                "on, but hooks get no events and no checkpoint is committed until it is back"
            )

    def loss_line(self, *, checkpointing: bool, run_dir: Path | None) -> str | None:
        """What the loss cost, for the summary and ``run.json`` (None: no loss)."""
        loss = self.loss
        if loss is None:
            return None
        back = f" (back at step {loss.back_at_step})" if loss.back_at_step is not None else ""
        line = f"the bus was lost at step {loss.step}{back}: hooks got no events after it"
        if checkpointing:
            assert run_dir is not None
            latest = latest_committed(run_dir)
            committed = f"latest committed: step {latest.step}" if latest else "none committed"
            if self.committed_after_loss:
                line += (
                    f"; {self.committed_after_loss} complete checkpoint(s) written after it "
                    f"were verified and committed at the end ({committed})"
                )
            else:
                line += f"; checkpoints after step {loss.step} were not committed ({committed})"
        return line

    def record(self, *, checkpointing: bool, run_dir: Path | None) -> dict[str, Any] | None:
        """The loss as ``run.json`` records it (None: no loss)."""
        loss = self.loss
        if loss is None:
            return None
        return {
            "step": loss.step,
            "at": loss.at,
            "back_at_step": loss.back_at_step,
            "consequence": self.loss_line(checkpointing=checkpointing, run_dir=run_dir),
        }


class FailureResponse:
    """What the launcher does as stages fail: announce each failed attempt that elastic
    restarts, end the run for the hooks once the last attempt failed (node 0 names the
    root cause), and kill this node's workers that outstay a run failed elsewhere."""

    def __init__(
        self,
        failures: FailureWatch,
        ending: RunEnding,
        stop: StopMachine,
        *,
        warn: Callable[[str], None],
        kill_workers: Callable[[], None],
        bus_owner: bool,
    ) -> None:
        self._failures = failures
        self._ending = ending
        self._stop = stop
        self._warn = warn
        self._kill_workers = kill_workers
        self._bus_owner = bus_owner

    def tick(self) -> None:
        """One look while the agent runs."""
        failures, ending = self._failures, self._ending
        ended_by_us = self._stop.workers_ended_by_us
        for line in failures.announce_restarts(ended_by_us=ended_by_us):
            self._warn(line)
        if ending.published is None and not ended_by_us:
            end = failures.settled_end(time.monotonic(), bus_owner=self._bus_owner)
            if end is not None:
                ending.publish(end[0], on_bus=end[1])
        now, published = time.monotonic(), ending.published
        if workers_outstay_failure(published, ending.published_at, now, ended_by_us=ended_by_us):
            log.warning("the run failed; killing the stage workers of this node that wait on it")
            self._stop.killed_workers()  # their deaths are ours, not a failure
            self._kill_workers()

    async def settle(self, poll_s: float) -> None:
        """The agent ended: publish the root cause as `tick` does, waiting (bounded by
        `FailureWatch.settled_root`) where another node may still name it."""
        failures, ending = self._failures, self._ending
        if ending.published is not None or self._stop.workers_ended_by_us:
            return  # the hooks were told, or the deaths are ours
        if not failures.last_attempt_failed():
            return
        while (end := failures.settled_end(time.monotonic(), bus_owner=self._bus_owner)) is None:
            await anyio.sleep(poll_s)
            failures.refresh()
        ending.publish(end[0], on_bus=end[1])
