"""What a stage tells of itself while it lives: heartbeats, its report file, its failure.

* `Doing` — the instruction the executor is in and since when, set by the
  step's thread per instruction and read by the heartbeats' (one tuple,
  replaced, never mutated), in words: ``"RecvActivation m5 from stage 1"``,
  ``"Forward m5"`` (``" chunk v"`` with several chunks), ``"OptimizerStep"``.
* `StageLiveness` — the stage's state, completed steps and last loss, the
  phase it is in outside the executor's instructions (an evaluation, a
  checkpoint save, a wait for the checkpoint hook), published as a
  ``Heartbeat`` about once a second (also during setup and evaluation), and
  kept in its `evtrain.stages.worker.StageReport` when the launcher gave a
  report directory — at start, with every heartbeat, at the end, and on
  failure (exception, innermost user frame, whether it is a communication
  error) before ``StageFailed`` is published. The launcher's hang and
  straggler detection read exactly these (`evtrain.launcher.hang`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING

import anyio
import structlog

from evtrain.events import Event, Heartbeat, RunEnded, StageFailed
from evtrain.failures import frame_location, is_communication_error, user_frames
from evtrain.stages.mesh import ChunkRoutes, Place
from evtrain.stages.worker import (
    ReportStatus,
    StageReport,
    WorkerConfig,
    enable_stack_dumps,
    keep_flight_recorder,
    restart_count,
    this_host,
)

if TYPE_CHECKING:
    from evtrain.stages.evaluation import EvalResult
    from evtrain.stages.setup import StageRuntime

__all__ = ["HEARTBEAT_INTERVAL_S", "Doing", "StageLiveness"]

log = structlog.get_logger("evtrain.stages.liveness")

HEARTBEAT_INTERVAL_S = 1.0

_WITH_NEXT = ("SendActivation", "RecvGrad")
_WITH_PREV = ("RecvActivation", "SendGrad")
"""The instructions whose peer is the next chunk's stage, and the previous one's."""


class Doing:
    """The executor's instruction: ``at`` is (instruction, microbatch, chunk, since
    `time.monotonic`), microbatch -1 for one that is about no microbatch; None between
    steps."""

    __slots__ = ("_chunks", "_place", "_routes", "at")

    def __init__(self, routes: ChunkRoutes, chunks: int, place: Place) -> None:
        self.at: tuple[str, int, int, float] | None = None
        self._routes, self._chunks, self._place = routes, chunks, place

    def set(self, kind: str, microbatch: int = -1, chunk: int = 0) -> None:
        self.at = (kind, microbatch, chunk, time.monotonic())

    def now(self) -> tuple[str, float] | None:
        """The instruction in words and since when, or None between steps."""
        at = self.at
        if at is None:
            return None
        kind, microbatch, chunk, since = at
        if microbatch < 0:
            return kind, since
        text = f"{kind} m{microbatch}" + (f" chunk {chunk}" if self._chunks > 1 else "")
        routes = self._routes
        peer = (
            routes.next[chunk]
            if kind in _WITH_NEXT
            else routes.prev[chunk]
            if kind in _WITH_PREV
            else None
        )
        if peer is not None and not routes.local(peer):
            where = "to" if kind.startswith("Send") else "from"
            text += f" {where} stage {self._place.stage_of(peer[0])}"
        return text, since


class StageLiveness:
    """One stage's heartbeats, report and failure (module docstring). ``publish`` sends
    an event on the bus (a no-op without one); ``runtime`` is set once the stage is set
    up, and names the executor's instruction, the evaluation's progress and the shards
    written since the last heartbeat."""

    def __init__(self, config: WorkerConfig, rank: int, publish: Callable[[Event], None]) -> None:
        self.publish = publish
        self.stage, self.replica = rank, 0
        self.state = "starting"
        self.completed = 0
        """Optimizer steps completed (the resumed step once set up)."""
        self.last_loss: float | None = None
        self.in_step = False
        self.runtime: StageRuntime | None = None
        self._phase: tuple[str, float] | None = None
        self._directory = config.report_dir
        self.report: StageReport | None = None
        self._stacks: IO[str] | None = None
        if config.report_dir is not None:
            attempt = restart_count()
            self.report = StageReport(
                rank=rank,
                stage=rank,
                pid=os.getpid(),
                host=this_host(),
                attempt=attempt,
                status="starting",
                updated=time.time(),
            )
            # Before the first report: the launcher asks for stacks only of a
            # stage that reported, and the signal would otherwise end it.
            self._stacks = enable_stack_dumps(config.report_dir, attempt, rank)
            keep_flight_recorder(config.report_dir, config.run_id, attempt)

    def placed(self, stage: int, replica: int, tp: int = 0, tp_size: int = 1) -> None:
        """The job is loaded: this rank is ``stage``'s replica ``replica``, tensor rank ``tp``
        of ``tp_size``."""
        self.stage, self.replica = stage, replica
        if self.report is not None:
            self.report.stage, self.report.replica = stage, replica
            self.report.tp, self.report.tp_size = tp, tp_size

    def doing(self) -> tuple[str, float]:
        """The instruction the executor is in, within the phase it serves (an evaluation:
        ``"Evaluate step 40: Forward m3"``), and for how long (``""``: none)."""
        at = self.runtime.executor.doing.now() if self.runtime is not None else None
        phase = self._phase
        if at is None and phase is None:
            return "", 0.0
        if at is None:
            assert phase is not None
            text, since = phase
        elif phase is None:
            text, since = at
        else:
            text, since = f"{phase[0]}: {at[0]}", at[1]
        return text[:200], round(max(0.0, time.monotonic() - since), 3)

    @contextlib.contextmanager
    def in_phase(self, text: str) -> Iterator[None]:
        """What the stage does until the block ends, for `doing` (the executor's
        instruction, if any, is named within it)."""
        self._phase = (text, time.monotonic())
        try:
            yield
        finally:
            self._phase = None

    async def heartbeats(self) -> None:
        """Publish a heartbeat (and what goes with it) about once a second, forever."""
        while True:
            doing, doing_s = self.doing()
            self.publish(
                Heartbeat(
                    stage=self.stage,
                    replica=self.replica,
                    step=self.completed,
                    state=self.state,
                    doing=doing,
                    doing_s=doing_s,
                )
            )
            rt = self.runtime
            progress = rt.evaluator.progress() if rt is not None else None
            if progress is not None:
                self.publish(progress)
            self.write_report()
            if rt is not None:
                rt.checkpointing.publish_done()
            await anyio.sleep(HEARTBEAT_INTERVAL_S)

    def write_report(self, status: ReportStatus | None = None) -> None:
        """Bring this stage's `StageReport` up to date (the launcher's view without the bus)."""
        report, directory = self.report, self._directory
        if report is None or directory is None:
            return
        if status is not None:
            report.status = status
        elif report.status == "starting" and self.state == "running":
            report.status = "running"
        report.step = self.completed
        report.loss = self.last_loss
        report.doing, report.doing_s = self.doing()
        try:
            report.write(directory)
        except OSError as exc:
            log.warning("cannot write the stage report", stage=self.stage, error=str(exc))

    def evaluated(self, step: int, result: EvalResult) -> None:
        """Keep the last stage's evaluation after ``step`` steps, exactly as computed."""
        if self.report is None:
            return
        self.report.eval_metrics = {
            k: v if math.isfinite(v) else None for k, v in result.metrics.items()
        }
        self.report.eval_step, self.report.eval_samples = step, sum(result.samples.values())
        self.report.eval_sets = {k: v for k, v in result.samples.items() if k}
        self.write_report()

    def failed(self, exc: BaseException, *, first_rank: bool) -> None:
        """Report and publish the failure ``exc``; ``first_rank``: this is global rank 0."""
        text = "".join(traceback.format_exception(exc))
        error = f"{type(exc).__name__}: {exc}"
        step = self.completed + 1 if self.in_step else None
        if self.report is not None:
            # The file comes first: the launcher decides the root cause from it,
            # whatever becomes of the bus.
            frames = user_frames(exc.__traceback__)
            self.report.error = error
            self.report.traceback = text
            self.report.user_frames = frames
            self.report.location = frame_location(frames[-1]) if frames else ""
            self.report.consequence = is_communication_error(error)
            self.report.failed_at = time.time()
            self.report.failed_step = step
            self.write_report("failed")
            # The launcher prints the root cause once; a line per stage here
            # would repeat it and its consequences.
            log.debug("stage failed", stage=self.stage, error=error)
        else:
            log.error("stage failed", stage=self.stage, error=error)
        self.publish(
            StageFailed(
                stage=self.stage, replica=self.replica, error=error, traceback=text, step=step
            )
        )
        if self.report is None and first_rank and not _restart_pending():
            # Without a launcher nobody else ends the run for the hooks; a
            # launcher publishes RunEnded itself, naming the root cause.
            self.publish(RunEnded(status="failed", reason=error, step=self.completed))


def _restart_pending() -> bool:
    """Whether elastic will restart the workers after this failure."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return restart_count() < max_restarts
