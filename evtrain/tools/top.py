"""``evtrain top``: a live terminal dashboard of a running job, drawn from its bus.

Three parts, each testable alone:

* `TopModel`, a hook: it folds the run's events into numbers and `TopModel.view`
  returns them as a `TopView` (plain values, no terminal involved). It attaches
  like any hook, so it joins a run mid-way through the broker's state snapshot
  and knows the run, its stages' latest steps, the hooks attached and the last
  evaluation and checkpoint at once.
* `render`, which draws a `TopView` with rich. Every string that comes from an
  event goes through `safe_text` and into a rich `Text`, never into markup.
* `watch`, the live loop: a `HookRunner` with the model, a redraw every
  ``interval`` seconds, ``q`` on the terminal or a signal (SIGINT, SIGTERM,
  SIGHUP) to leave.

Per stage, the numbers are those the ``timer`` hook logs: steps merged across
stages (`StepMerger`), forward / backward / wait / other shares of step time
(`StageTimes`), over the last `WINDOW` steps. The wait share is the pipeline
bubble as that stage sees it (what the Prometheus exporter calls
``evtrain_bubble_ratio``); the pipeline line sets the share of all stages
together against what the schedule predicts (`bubble_fraction`: ``(P - 1) /
(M + P - 1)`` for GPipe and 1F1B).
With data parallelism every replica of a stage has its own row (its own step
times, shares, memory and heartbeat), and the run's figures count each step
once. With tensor parallelism every tensor rank above 0 has a row under its
replica's, from its own step times and memory (`TensorRankStepEnded`); it
shares its replica's status and heartbeat, which rank 0 publishes.

Hooks publish no heartbeats: a hook process is known from its `HookStarted`,
seen from whatever it publishes after (errors, gaps, checkpoints), and, on an
ipc bus (hooks on this machine), alive or gone by its pid.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from evtrain.bus.address import BusAddress
from evtrain.bus.security import CurveConfig
from evtrain.errors import UsageError
from evtrain.events import (
    BusDrops,
    BusGaps,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequested,
    EvalEnded,
    Event,
    Heartbeat,
    HookError,
    HookStarted,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStarted,
    StageStopped,
    StepEnded,
    StragglerReported,
    TensorRankStepEnded,
)
from evtrain.formatting import fmt_bytes, fmt_duration, safe_text
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.runner import HookRunner
from evtrain.hooks.timer import StageTimes
from evtrain.logs import LOG_STREAM
from evtrain.run_state import MAX_PLACES
from evtrain.schedule_names import Schedule, parse_schedule
from evtrain.stages.simulator import bubble_fraction
from evtrain.steps import MergedStep, StageReplica, StepMerger, StepWindow, step_problem

__all__ = ["TopModel", "TopView", "render", "watch"]

WINDOW = 20
"""Steps per stage that step time and time shares are computed over."""
SILENT_AFTER_S = 10.0
"""A running stage with no heartbeat for this long is shown as silent (they beat every 1 s)."""
MAX_SOURCES = 64
"""Publishers and observers tracked for drops, gaps and hook errors (the latest ones)."""
MAX_PENDING_CHECKPOINTS = 16
MIN_INTERVAL_S = 0.25
"""Shortest redraw interval: the screen redraws at most four times a second."""
_TEXT = 60
"""Characters of event text (names, errors) shown."""

K = TypeVar("K")
V = TypeVar("V")
P = TypeVar("P", tuple[int, int], tuple[int, int, int])
R = TypeVar("R")


def _put(bounded: MutableMapping[K, V], key: K, value: V, limit: int = MAX_SOURCES) -> None:
    """Set ``key`` as the newest entry; the oldest go beyond ``limit``."""
    bounded.pop(key, None)
    bounded[key] = value
    while len(bounded) > limit:
        del bounded[next(iter(bounded))]


# -- the numbers ---------------------------------------------------------------------


DOING_SHOWN_AFTER_S = 5.0
"""A stage in one instruction this long is shown under the table, with the instruction."""


@dataclass(frozen=True)
class StageView:
    """One stage process (a pipeline stage, or one replica of it) as the dashboard shows it."""

    stage: int
    status: str
    """``starting``/``running``/``evaluating``/``stopping`` (its heartbeat), ``stopped``,
    ``failed``, ``silent`` (no heartbeat for `SILENT_AFTER_S`) or ``-`` (not heard of)."""
    step: int | None
    step_time_s: float | None
    """Median step duration over the last `WINDOW` steps."""
    shares: dict[str, float]
    """``fwd``, ``bwd``, ``wait``, ``other``: fractions of the step time (`StageTimes`)."""
    memory_bytes: int | None
    """Peak memory of its latest step."""
    heartbeat_age_s: float | None
    error: str = ""
    replica: int = 0
    doing: str = ""
    """The instruction its last heartbeat was in (`evtrain.events.Heartbeat.doing`)."""
    doing_s: float = 0.0
    """How long it had been in it then, plus the heartbeat's age."""
    straggler: float | None = None
    """How many times slower than expected, while the launcher names it a straggler."""
    tp: int = 0
    """Its tensor rank: rows above 0 are a replica's other processes."""


@dataclass(frozen=True)
class HookView:
    """One hook process attached to the bus."""

    source: str
    hooks: tuple[str, ...]
    pid: int
    alive: bool | None
    """Whether its pid runs (ipc bus only; None when that cannot be told)."""
    attached_age_s: float | None
    last_event_age_s: float | None
    errors: int
    last_error: str = ""


@dataclass(frozen=True)
class CheckpointView:
    """Checkpoints of the run: the last committed one, commits and failures."""

    last_step: int | None = None
    last_path: str = ""
    last_bytes: int = 0
    last_age_s: float | None = None
    commits: int = 0
    """Commits seen since the dashboard joined."""
    failures: int = 0
    last_failure: str = ""
    saving: tuple[int, ...] = ()
    """Steps of requested checkpoints not committed (nor failed) yet."""


@dataclass(frozen=True)
class RunView:
    """The run as a whole."""

    status: str
    """``waiting`` (no run.started yet), ``running``, ``completed``, ``stopped``, ``failed``."""
    name: str = ""
    run_id: str = ""
    schedule: str = ""
    num_stages: int | None = None
    num_microbatches: int | None = None
    data_parallel: int = 1
    """Replicas of every stage."""
    tensor_parallel: int = 1
    """Tensor ranks of every replica (each has a row)."""
    max_steps: int | None = None
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    elapsed_s: float | None = None
    bubble: float | None = None
    """Measured: every stage's waits over every stage's step time, last `WINDOW` steps."""
    bubble_theory: float | None = None
    """The schedule's ``(P - 1) / (M + P - 1)``."""
    reason: str = ""
    eval_step: int | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TopView:
    """Everything the dashboard shows at one moment."""

    run: RunView
    stages: tuple[StageView, ...]
    hooks: tuple[HookView, ...]
    drops: dict[str, int]
    """Publisher -> events it dropped (queue full), in total."""
    gaps: dict[str, int]
    """Subscriber -> events it never received, in total."""
    checkpoints: CheckpointView


@dataclass
class _Stage:
    recent: deque[StepEnded] = field(default_factory=lambda: deque(maxlen=WINDOW))
    heartbeat: Heartbeat | None = None
    heartbeat_at: float | None = None
    ended: str = ""
    error: str = ""
    started: bool = False
    last: StepEnded | None = None
    """The latest step event of a replica > 0 (replica 0's is in the run's state)."""
    straggler: float | None = None


@dataclass
class _TensorRank:
    recent: deque[TensorRankStepEnded] = field(default_factory=lambda: deque(maxlen=WINDOW))
    straggler: float | None = None


class TopModel(Hook):
    """The dashboard's numbers, kept up to date from the bus (`view` reads them).

    ``local``: the bus is an ipc one, so hook processes run on this machine and
    their pids tell whether they are alive.
    """

    name = "top"

    def __init__(self, *, local: bool = False, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.local = local
        self._merger = StepMerger(lambda: self.state)
        self._hook_errors: dict[str, tuple[int, str]] = {}
        self._last_event: dict[str, float] = {}
        self._new_run("")

    def _new_run(self, run_id: str) -> None:
        self._run_id = run_id
        self._merger.reset()
        self._window = StepWindow(WINDOW)
        self._stages: dict[StageReplica, _Stage] = {}
        self._tensor_ranks: dict[tuple[int, int, int], _TensorRank] = {}
        self._drops: dict[str, int] = {}
        self._gaps: dict[str, int] = {}
        self._commits = 0
        self._failures = 0
        self._last_failure = ""
        self._saving: dict[str, int] = {}

    def _stage(self, stage: int, replica: int) -> _Stage | None:
        return self._row(self._stages, (stage, replica), _Stage)

    def _tensor_rank(self, stage: int, replica: int, tp: int) -> _TensorRank | None:
        return self._row(self._tensor_ranks, (stage, replica, tp), _TensorRank)

    def _row(self, rows: dict[P, R], place: P, make: Callable[[], R]) -> R | None:
        """The row of process ``place`` (stage, replica[, tensor rank]) in ``rows``: None
        for one the run cannot have, or past `MAX_PLACES` rows."""
        state = self.state
        expected = state.num_stages
        if (expected is not None and place[0] >= expected) or state.place_problem(*place):
            return None  # not a stage process of this run: nothing to show for it
        if place not in rows and len(rows) >= MAX_PLACES:
            return None
        return rows.setdefault(place, make())

    def _seen(self, ev: Event) -> None:
        if ev.source.startswith("hook/"):
            _put(self._last_event, ev.source, time.time())

    # -- run -------------------------------------------------------------------

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run starts every count over."""
        if ev.run_id != self._run_id:
            self._new_run(ev.run_id)

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """The last steps still waiting for a stage count now."""
        if self.of_this_run(ev):
            for merged in self._merger.flush():
                self._window.add(merged)

    # -- stages ------------------------------------------------------------------

    @on(StageStarted)
    def stage_started(self, ev: StageStarted) -> None:
        """A stage process (re)joined: it is no longer stopped or failed."""
        stage = self._stage(ev.stage, ev.replica) if self.of_this_run(ev) else None
        if stage is not None:
            stage.ended = stage.error = ""
            stage.started = True

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Steps complete across stages enter the run's and each stage process's window."""
        if ev.replica and step_problem(ev, self.state) is None:
            stage = self._stage(ev.stage, ev.replica)
            if stage is not None:
                stage.last = ev
        for merged in self._merger.add(ev):
            self._window.add(merged)
            for place, sev in merged.events.items():
                stage = self._stage(*place)
                if stage is not None:
                    stage.recent.append(sev)

    @on(TensorRankStepEnded)
    def tensor_rank_step_ended(self, ev: TensorRankStepEnded) -> None:
        """A tensor rank's own step times and memory, for its row."""
        if step_problem(ev, self.state) is None:
            rank = self._tensor_rank(ev.stage, ev.replica, ev.tp)
            if rank is not None:
                rank.recent.append(ev)

    @on(Heartbeat)
    def heartbeat(self, ev: Heartbeat) -> None:
        """A stage's heartbeat (others only count as a sign of their publisher)."""
        self._seen(ev)
        if ev.stage is None or not self.of_this_run(ev):
            return
        stage = self._stage(ev.stage, ev.replica)
        if stage is not None:
            stage.heartbeat, stage.heartbeat_at = ev, time.time()

    @on(StragglerReported)
    def straggler(self, ev: StragglerReported) -> None:
        """The launcher named a straggler, or one recovered: a whole stage (each replica),
        a replica, or one tensor rank of it."""
        if not self.of_this_run(ev):
            return
        slowdown = ev.slowdown if ev.straggling else None
        if ev.tensor_rank:  # rank 0's row is its replica's
            rank = self._tensor_rank(ev.stage, ev.replica, ev.tensor_rank)
            if rank is not None:
                rank.straggler = slowdown
            return
        for replica in ev.replicas(self.state.data_parallel or 1):
            stage = self._stage(ev.stage, replica)
            if stage is not None:
                stage.straggler = slowdown

    @on(StageStopped)
    def stage_stopped(self, ev: StageStopped) -> None:
        """The stage process left the run."""
        stage = self._stage(ev.stage, ev.replica) if self.of_this_run(ev) else None
        if stage is not None:
            stage.ended = "stopped"

    @on(StageFailed)
    def stage_failed(self, ev: StageFailed) -> None:
        """The stage process raised."""
        stage = self._stage(ev.stage, ev.replica) if self.of_this_run(ev) else None
        if stage is not None:
            stage.ended, stage.error = "failed", ev.error

    # -- hooks and the bus ---------------------------------------------------------

    @on(HookStarted)
    def hook_started(self, ev: HookStarted) -> None:
        """A hook process attached (the runner's state keeps its announcement)."""
        self._seen(ev)

    @on(HookError)
    def hook_error(self, ev: HookError) -> None:
        """A hook's handler raised ``count`` times."""
        self._seen(ev)
        count, _ = self._hook_errors.get(ev.source, (0, ""))
        error = f"{ev.hook}.{ev.handler}: {ev.error}"
        _put(self._hook_errors, ev.source, (count + ev.count, error))

    @on(BusDrops)
    def bus_drops(self, ev: BusDrops) -> None:
        """A publisher's running total of dropped events."""
        self._seen(ev)
        _put(self._drops, ev.source, max(ev.total_dropped, self._drops.get(ev.source, 0)))

    @on(BusGaps)
    def bus_gaps(self, ev: BusGaps) -> None:
        """A subscriber's running total of events it never received."""
        self._seen(ev)
        _put(self._gaps, ev.source, max(ev.total_missing, self._gaps.get(ev.source, 0)))

    # -- evaluations and checkpoints ---------------------------------------------------

    @on(EvalEnded)
    def eval_ended(self, ev: EvalEnded) -> None:
        """The runner's state keeps the latest evaluation; subscribing is enough."""

    @on(CheckpointRequested)
    def checkpoint_requested(self, ev: CheckpointRequested) -> None:
        """The stages began saving."""
        if self.of_this_run(ev):
            _put(self._saving, ev.checkpoint_id, ev.step, MAX_PENDING_CHECKPOINTS)

    @on(CheckpointCommitted)
    def checkpoint_committed(self, ev: CheckpointCommitted) -> None:
        """A checkpoint became resumable."""
        self._seen(ev)
        if self.of_this_run(ev):
            self._commits += 1
            self._saving.pop(ev.checkpoint_id, None)

    @on(CheckpointFailed)
    def checkpoint_failed(self, ev: CheckpointFailed) -> None:
        """A checkpoint will never be committed."""
        self._seen(ev)
        if self.of_this_run(ev):
            self._failures += 1
            where = "" if ev.stage is None else f"stage {ev.stage}: "
            self._last_failure = f"step {ev.step}: {where}{ev.error}"
            self._saving.pop(ev.checkpoint_id, None)

    # -- the view ------------------------------------------------------------------

    def view(self, now: float | None = None) -> TopView:
        """The numbers as of ``now`` (wall-clock seconds; default: the current time)."""
        now = time.time() if now is None else now
        return TopView(
            run=self._run_view(now),
            stages=self._stage_views(now),
            hooks=self._hook_views(now),
            drops=dict(self._drops),
            gaps=dict(self._gaps),
            checkpoints=self._checkpoint_view(now),
        )

    def _run_view(self, now: float) -> RunView:
        state = self.state
        run, ended = state.run, state.ended
        if run is None:
            return RunView(status="waiting")
        last = self._window_last()
        waits = sum(ev.comm_wait_s for s in self._stages.values() for ev in s.recent)
        busy = sum(ev.duration_s for s in self._stages.values() for ev in s.recent)
        end_ts = ended.ts if ended is not None and ended.ts else now
        return RunView(
            status=ended.status if ended is not None else "running",
            name=run.name,
            run_id=run.run_id,
            schedule=run.schedule,
            num_stages=run.num_stages,
            num_microbatches=run.num_microbatches,
            data_parallel=run.data_parallel,
            tensor_parallel=run.tensor_parallel,
            max_steps=run.max_steps or None,
            step=state.step,
            loss=last.loss if last is not None else None,
            samples_per_s=self._window.samples_per_s(),
            step_time_s=self._window.step_time_s(),
            eta_s=None if ended is not None else self._window.eta_s(run.max_steps),
            elapsed_s=max(0.0, end_ts - run.ts) if run.ts else None,
            bubble=waits / busy if busy > 0 else None,
            bubble_theory=_theory(run),
            reason=(ended.root_cause or ended.reason) if ended is not None else "",
            eval_step=state.last_eval.step if state.last_eval is not None else None,
            eval_metrics=dict(state.last_eval.metrics) if state.last_eval is not None else {},
        )

    def _window_last(self) -> MergedStep | None:
        steps = list(self._window)
        return steps[-1] if steps else None

    def _stage_views(self, now: float) -> tuple[StageView, ...]:
        state = self.state
        count, replicas = state.num_stages or 0, state.data_parallel or 1
        run_places = {(s, d) for s in range(count) for d in range(replicas)}
        places = sorted(run_places | set(self._stages) | {(s, 0) for s in state.last_step})
        running = state.run is not None and state.ended is None
        views = []
        for index, replica in places:
            stage = self._stages.get((index, replica), _Stage())
            last = stage.last if replica else state.last_step.get(index)
            beat_age = None if stage.heartbeat_at is None else max(0.0, now - stage.heartbeat_at)
            started = stage.started or (replica == 0 and index in state.stages)
            views.append(
                StageView(
                    stage=index,
                    replica=replica,
                    status=self._stage_status(stage, beat_age, started, running),
                    **_figures(stage.recent, last),
                    heartbeat_age_s=beat_age,
                    error=stage.error,
                    doing=stage.heartbeat.doing if stage.heartbeat is not None else "",
                    doing_s=(
                        stage.heartbeat.doing_s + (beat_age or 0.0)
                        if stage.heartbeat is not None
                        else 0.0
                    ),
                    straggler=stage.straggler,
                )
            )
            views.extend(self._tensor_rank_views(views[-1], state.run))
        return tuple(views)

    def _tensor_rank_views(self, replica: StageView, run: RunStarted | None) -> list[StageView]:
        """The rows of ``replica``'s tensor ranks above 0: its status, their own times."""
        size = run.tensor_parallel if run is not None else 1
        views = []
        for tp in range(1, size):
            rank = self._tensor_ranks.get((replica.stage, replica.replica, tp), _TensorRank())
            last = rank.recent[-1] if rank.recent else None
            views.append(
                StageView(
                    stage=replica.stage,
                    replica=replica.replica,
                    tp=tp,
                    status=replica.status,
                    **_figures(rank.recent, last),
                    heartbeat_age_s=None,
                    straggler=rank.straggler,
                )
            )
        return views

    @staticmethod
    def _stage_status(stage: _Stage, beat_age: float | None, started: bool, running: bool) -> str:
        if stage.ended:
            return stage.ended
        if not running and started:
            return "stopped"  # the run ended: its stages left, whether or not we saw it
        if running and beat_age is not None and beat_age > SILENT_AFTER_S:
            return "silent"
        if stage.heartbeat is not None:
            return stage.heartbeat.state
        return "running" if started and running else "-"

    def _hook_views(self, now: float) -> tuple[HookView, ...]:
        own = f"hook/{self._runner.name}" if self._runner is not None else None
        views = []
        for source, started in self.state.hooks.items():
            if source == own:
                continue
            errors, last_error = self._hook_errors.get(source, (0, ""))
            seen = self._last_event.get(source)
            views.append(
                HookView(
                    source=source,
                    hooks=tuple(started.hooks),
                    pid=started.pid,
                    alive=_pid_alive(started.pid) if self.local else None,
                    attached_age_s=max(0.0, now - started.ts) if started.ts else None,
                    last_event_age_s=None if seen is None else max(0.0, now - seen),
                    errors=errors,
                    last_error=last_error,
                )
            )
        return tuple(views)

    def _checkpoint_view(self, now: float) -> CheckpointView:
        last = self.state.last_checkpoint
        if last is not None and not self.of_this_run(last):
            last = None
        return CheckpointView(
            last_step=last.step if last is not None else None,
            last_path=last.path if last is not None else "",
            last_bytes=last.bytes if last is not None else 0,
            last_age_s=max(0.0, now - last.ts) if last is not None and last.ts else None,
            commits=self._commits,
            failures=self._failures,
            last_failure=self._last_failure,
            saving=tuple(sorted(set(self._saving.values()))),
        )


def _figures(
    recent: Iterable[StepEnded | TensorRankStepEnded], last: StepEnded | TensorRankStepEnded | None
) -> dict[str, Any]:
    """A row's own numbers: its ``last`` step and memory, the median step time and the
    shares of the ``recent`` ones."""
    times = StageTimes()
    durations = []
    for ev in recent:
        times.add(ev.duration_s, ev.forward_s, ev.backward_s, ev.comm_wait_s)
        durations.append(ev.duration_s)
    return {
        "step": last.step if last is not None else None,
        "step_time_s": statistics.median(durations) if durations else None,
        "shares": times.fractions(),
        "memory_bytes": last.peak_memory_bytes if last is not None else None,
    }


def _theory(run: RunStarted) -> float | None:
    try:
        schedule = parse_schedule(run.schedule)  # formulas exist for evtrain's schedules only
    except UsageError:
        return None
    later = (Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED)
    if schedule in later and run.num_microbatches < run.num_stages:
        return None  # their formulas need M >= P
    try:
        return bubble_fraction(run.num_stages, run.num_microbatches, schedule, run.virtual_stages)
    except UsageError:  # a chunk count the schedule refuses: no theory for it
        return None


def _pid_alive(pid: int) -> bool | None:
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    return True


# -- the drawing -----------------------------------------------------------------------

_STATUS_STYLE = {
    "running": "green",
    "completed": "green",
    "evaluating": "cyan",
    "starting": "cyan",
    "stopping": "yellow",
    "stopped": "yellow",
    "silent": "bold yellow",
    "failed": "bold red",
    "waiting": "dim",
}


def _text(value: object, limit: int = _TEXT, style: str = "") -> Text:
    # Event text is the publisher's: shown literally, never parsed as markup.
    return Text(safe_text(value, limit), style=style)


def _status(status: str) -> Text:
    return _text(status, 20, _STATUS_STYLE.get(status, ""))


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f}ms"
    return f"{value:.2f}s" if value < 60 else fmt_duration(value)


def _age(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.1f}s ago"
    if value < 60:
        return f"{value:.0f}s ago"
    minutes = int(value // 60)
    if minutes < 60:
        return f"{minutes}m{int(value % 60):02d}s ago"
    return f"{minutes // 60}h{minutes % 60:02d}m ago"


def _share(shares: dict[str, float], key: str) -> str:
    return f"{shares[key]:.0%}" if key in shares else "-"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _joined(*parts: Text | str) -> Text:
    return Text("  ").join(Text(p) if isinstance(p, str) else p for p in parts if p)


def _grid(rows: list[tuple[str, Text]]) -> Table:
    """Labelled lines; a long one wraps within its column."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, line in rows:
        grid.add_row(label, line)
    return grid


def _run_part(run: RunView, bus: str) -> list[RenderableType]:
    title = Text("evtrain top", style="bold")
    if run.status == "waiting":
        waiting = _status("waiting").append(f" for a run on {safe_text(bus, 200)}", style="")
        return [_joined(title, waiting)]
    header = _joined(
        title,
        _text(run.name, 40, "bold"),
        f"run {safe_text(run.run_id, 40)}",
        _status(run.status),
        fmt_duration(run.elapsed_s),
    )
    step = "-" if run.step is None else str(run.step)
    if run.max_steps:
        step += f"/{run.max_steps}"
    progress = _joined(
        f"step {step}",
        f"loss {_number(run.loss)}",
        f"{run.samples_per_s:.1f} samples/s" if run.samples_per_s is not None else "",
        f"{_seconds(run.step_time_s)}/step",
        f"ETA {fmt_duration(run.eta_s)}" if run.eta_s is not None else "",
    )
    shape = f"{run.schedule}, {run.num_stages} stages x {run.num_microbatches} microbatches"
    if run.data_parallel > 1:
        shape += f", {run.data_parallel} replicas"
    if run.tensor_parallel > 1:
        shape += f", {run.tensor_parallel} tensor ranks"
    pipeline = _joined(
        _text(shape, 80),
        "bubble "
        + ("-" if run.bubble is None else f"{run.bubble:.0%}")
        + ("" if run.bubble_theory is None else f" (theory {run.bubble_theory:.0%})"),
    )
    rows = [("progress", progress), ("pipeline", pipeline)]
    if run.reason:
        rows.insert(0, ("why", _text(run.reason, 2 * _TEXT, _STATUS_STYLE.get(run.status, ""))))
    if run.eval_step is not None:
        ordered = sorted(run.eval_metrics.items(), key=lambda kv: (kv[0] != "loss", kv[0]))
        metrics = _text("  ".join(f"{k} {v:.4g}" for k, v in ordered[:6]), 2 * _TEXT)
        rows.append(("eval", Text(f"step {run.eval_step}: ").append_text(metrics)))
    return [header, _grid(rows)]


def _table() -> Table:
    # One space between columns: the dashboard fits an 80-column terminal.
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)


def _stage_part(stages: tuple[StageView, ...]) -> list[RenderableType]:
    table = _table()
    replicated = any(view.replica for view in stages)
    split = any(view.tp for view in stages)
    columns = ("stage", *(("replica",) if replicated else ()), *(("tp",) if split else ()))
    for name in (*columns, "status", "step", "step time", "fwd", "bwd", "wait", "other"):
        table.add_column(name, justify="left" if name == "status" else "right")
    table.add_column("memory", justify="right")
    table.add_column("heartbeat", justify="right")
    errors: list[RenderableType] = []
    for view in stages:
        place = (
            str(view.stage),
            *((str(view.replica),) if replicated else ()),
            *((str(view.tp),) if split else ()),
        )
        table.add_row(
            *place,
            _status(view.status),
            "-" if view.step is None else str(view.step),
            _seconds(view.step_time_s),
            _share(view.shares, "fwd"),
            _share(view.shares, "bwd"),
            _share(view.shares, "wait"),
            _share(view.shares, "other"),
            fmt_bytes(view.memory_bytes),
            _age(view.heartbeat_age_s),
        )
        where = f"stage {view.stage}" + (f" replica {view.replica}" if view.replica else "")
        where += f" tensor rank {view.tp}" if view.tp else ""
        if view.error:
            errors.append(_joined(Text(f"{where}:", "bold red"), _text(view.error, 2 * _TEXT)))
        elif view.doing and view.doing_s >= DOING_SHOWN_AFTER_S and view.status != "stopped":
            # Where a stage has been for a while: a wait that long is what to look at.
            line = f"in {view.doing} for {view.doing_s:.0f} s"
            errors.append(_joined(Text(f"{where}:", "bold yellow"), _text(line, 2 * _TEXT)))
        if view.straggler is not None and view.status != "stopped":
            line = f"straggler: {view.straggler:.1f}x as slow as expected"
            errors.append(_joined(Text(f"{where}:", "bold yellow"), Text(line)))
    return [table, *errors]


def _hook_part(hooks: tuple[HookView, ...]) -> list[RenderableType]:
    if not hooks:
        return [Text("no hooks attached", style="dim")]
    table = _table()
    table.add_column("hook process")
    table.add_column("hooks")
    for name in ("pid", "alive", "attached", "last event", "errors"):
        table.add_column(name, justify="left" if name == "alive" else "right")
    alive = {True: Text("yes", "green"), False: Text("gone", "bold red"), None: Text("?")}
    errors: list[RenderableType] = []
    for view in hooks:
        table.add_row(
            _text(view.source, 30),
            _text(", ".join(view.hooks), 30),
            str(view.pid or "-"),
            alive[view.alive],
            _age(view.attached_age_s),
            _age(view.last_event_age_s),
            Text(str(view.errors), "bold red" if view.errors else ""),
        )
        if view.last_error:
            errors.append(
                _joined(_text(f"{view.source}:", 30, "bold red"), _text(view.last_error, 2 * _TEXT))
            )
    return [table, *errors]


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{safe_text(s, 40)} {n}" for s, n in sorted(counts.items())) or "none"


def _bus_rows(view: TopView) -> list[tuple[str, Text]]:
    if not view.drops and not view.gaps:
        return [("bus", Text("no drops, no gaps", style="green"))]
    return [
        ("bus", Text(f"dropped by publisher: {_counts(view.drops)}", style="yellow")),
        ("", Text(f"missed by subscriber: {_counts(view.gaps)}", style="yellow")),
    ]


def _checkpoint_rows(ckpt: CheckpointView) -> list[tuple[str, Text]]:
    if ckpt.last_step is None:
        lines = [Text("none committed")]
    else:
        last = f"step {ckpt.last_step}, {fmt_bytes(ckpt.last_bytes)}, {_age(ckpt.last_age_s)}"
        lines = [
            Text(f"last committed: {last}"),
            _text(ckpt.last_path, 2 * _TEXT, "dim"),
            Text(f"{ckpt.commits} committed while watching"),
        ]
    if ckpt.saving:
        lines.append(Text(f"saving step {', '.join(map(str, ckpt.saving))}", style="cyan"))
    if ckpt.failures:
        failed = Text(f"{ckpt.failures} failed, last: ", style="bold red")
        lines.append(failed.append_text(_text(ckpt.last_failure, 2 * _TEXT, "red")))
    return [("checkpoints" if i == 0 else "", line) for i, line in enumerate(lines)]


def render(view: TopView, *, bus: str = "", keys: bool = True) -> RenderableType:
    """The dashboard of ``view`` (``bus``: the address, shown while no run is known)."""
    parts = _run_part(view.run, bus)
    if view.stages:
        parts += [Text(), *_stage_part(view.stages)]
    parts += [Text(), *_hook_part(view.hooks), Text()]
    parts.append(_grid([*_bus_rows(view), *_checkpoint_rows(view.checkpoints)]))
    if keys:
        parts.append(Text("q quits", style="dim"))
    return Group(*parts)


# -- the live loop -----------------------------------------------------------------------


@contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Keys arrive one by one, unechoed; Ctrl-C still interrupts."""
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextmanager
def _logs_above(live: Live) -> Iterator[None]:
    """This process's log lines print above the live display instead of across it."""

    def above(line: str) -> None:
        live.console.print(Text(line), soft_wrap=True)

    with LOG_STREAM.redirect(above):
        yield


async def _quit_on_key(fd: int, runner: HookRunner) -> None:
    while True:
        await anyio.wait_readable(fd)
        data = os.read(fd, 64)
        if not data:
            return  # the terminal went away; signals still end the view
        if b"q" in data.lower():
            runner.stop()
            return


async def _quit_on_signal(runner: HookRunner) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for _ in signals:
            runner.stop()
            return


async def _redraw(live: Live, model: TopModel, bus: str, keys: bool, interval: float) -> None:
    while True:
        live.update(render(model.view(), bus=bus, keys=keys), refresh=True)
        await anyio.sleep(interval)


async def watch(
    address: BusAddress,
    *,
    curve: CurveConfig | None = None,
    interval: float = 0.5,
    exit_on_run_end: bool = False,
    console: Console | None = None,
) -> TopView:
    """Show the dashboard of the run on ``address`` until ``q``, a signal or (option) its end.

    Redraws every ``interval`` seconds (at least `MIN_INTERVAL_S`); returns the
    last view shown. Raises `TimeoutError` if the bus never returns our events.
    """
    interval = max(interval, MIN_INTERVAL_S)
    console = console or Console()
    model = TopModel(local=address.scheme == "ipc")
    runner = HookRunner(
        [model], address, name=f"top-{os.getpid()}", exit_on_run_end=exit_on_run_end, curve=curve
    )
    keys = sys.stdin.isatty() and console.is_terminal
    bus = str(address)
    with (
        _cbreak(sys.stdin.fileno()) if keys else nullcontext(),
        Live(
            render(model.view(), bus=bus, keys=keys),
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=True,
        ) as live,
        _logs_above(live),
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_redraw, live, model, bus, keys, interval)
            tg.start_soon(_quit_on_signal, runner)
            if keys:
                tg.start_soon(_quit_on_key, sys.stdin.fileno(), runner)
            await runner.run()
            tg.cancel_scope.cancel()
        final = model.view()
        live.update(render(final, bus=bus, keys=False), refresh=True)
    return final
