"""Merging the per-stage `StepEnded` events of one optimizer step into one record.

Every stage publishes its own ``step.ended``: the loss comes only from the last
stage, times and memory from each. Writers and loggers want one record per
step, so `StepMerger` collects a step's events and hands the step out once
every stage reported it — or, if an event was lost on the bus, once a later
step completed (a lost event must not hold every later line back).

With data parallelism each of the D replicas of every stage reports the step
too, with its own times and memory; ``loss`` (the mean over the replicas) and
``samples`` (the global batch) are the same on every replica, so a merged step
takes them once and never adds them up. A step is complete once all P x D
processes reported it: the gradient all-reduce ends every replica's step at
nearly the same time, so waiting for all of them costs little, and a record
then always holds the same events, live or replayed (completing on replica
0's events alone would keep whichever replica events happened to come first).
Before the run says how many replicas there are, replica 0's events decide.

Step numbers are 1-based (see `evtrain.stages.actor`): ``StepEnded.step`` k is
the k-th optimizer step, so k steps are done when it ends; boundary events
(`EvalEnded`, checkpoints, `RunEnded`) carry the steps done at that boundary.

A step event is checked against the run before it counts (`step_problem`):
once the run's `RunStarted` is known, an event of another run, of a stage or
replica the run does not have or of a step past its ``max_steps`` is none of
its steps.
A step number far below the latest one (more than `MAX_STEP_JUMP`) starts
the count over from there: either the latest number was absurd, or the run
went back, and neither may freeze the count. A jump ahead counts as at most
`MAX_STEP_JUMP` steps (`StepCount`).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog

from evtrain.events import StepEnded, TensorRankStepEnded
from evtrain.formatting import safe_text
from evtrain.ratelimit import RateLimitedLog
from evtrain.run_state import RunState, of_run

log = structlog.get_logger("evtrain.steps")

MAX_STEP_JUMP = 1000
"""Most steps one event may advance a step count by."""


def work_seconds(ev: StepEnded | TensorRankStepEnded) -> float:
    """A process's own work in a step, what its peers are compared by: its CPU time on
    the CPU (a thread waiting for a core or a collective accrues none), its forward
    time on a device."""
    return ev.cpu_s if ev.cpu_s > 0 else ev.forward_s


def step_problem(ev: StepEnded | TensorRankStepEnded, state: RunState) -> str | None:
    """Why ``ev`` cannot be a step of the run ``state`` knows; None if it can be."""
    run = state.run
    if run is None:
        return None
    if not of_run(ev, state):
        return "step of another run"
    tp = ev.tp if isinstance(ev, TensorRankStepEnded) else 0
    problem = state.place_problem(ev.stage, ev.replica, tp)
    if problem is not None:
        return problem
    if run.max_steps and ev.step > run.max_steps:
        return "step beyond the run's max_steps"
    return None


class StepCount:
    """The number of steps a run finished, from the step numbers of its events.

    Each event advances the count by how far its step is ahead of the latest
    one (bounded by `MAX_STEP_JUMP`: steps whose every event was lost still
    happened, an absurd number did not); the first event counts one, and so
    does a step far below the latest (the count goes on from there).
    """

    def __init__(self) -> None:
        self.latest: int | None = None

    def reset(self) -> None:
        """A new run: the next event counts one."""
        self.latest = None

    def advance(self, step: int) -> int:
        """How many new steps ``step`` finishes (0 for one already counted)."""
        latest = self.latest
        if latest is None or latest - step > MAX_STEP_JUMP:
            self.latest = step
            return 1
        if step <= latest:
            return 0
        self.latest = step
        return min(step - latest, MAX_STEP_JUMP)


StageReplica = tuple[int, int]
"""(stage, replica): one stage process of the run."""


def place_fields(stage: int, replica: int) -> dict[str, int]:
    """Log fields naming a stage process: ``stage``, and ``replica`` when it is not 0.

    Replica 0's lines read as those of a run without data parallelism.
    """
    return {"stage": stage, "replica": replica} if replica else {"stage": stage}


@dataclass
class MergedStep:
    """One optimizer step as reported by the stage processes.

    ``events`` holds each process's event by (stage, replica); `stages` gives
    replica 0's, the events a run without data parallelism has.
    """

    step: int
    events: dict[StageReplica, StepEnded] = field(default_factory=dict)

    @property
    def stages(self) -> dict[int, StepEnded]:
        """Replica 0's event of each stage that reported the step, by stage."""
        return {stage: ev for (stage, replica), ev in self.events.items() if replica == 0}

    def replicas(self) -> dict[int, dict[int, StepEnded]]:
        """The events of replicas > 0, by replica, then stage (empty without data parallelism)."""
        out: dict[int, dict[int, StepEnded]] = {}
        for (stage, replica), ev in sorted(self.events.items(), key=lambda kv: kv[0][::-1]):
            if replica:
                out.setdefault(replica, {})[stage] = ev
        return out

    def _first(self, attr: str) -> float | None:
        # The last stage holds the loss; for the other fields any stage will do,
        # the last one first so every field comes from one place when it can.
        # Replica 0 first: every replica reports the same loss and rate.
        for place in sorted(self.events, key=lambda p: (-p[0], p[1])):
            value = getattr(self.events[place], attr)
            if value is not None:
                return float(value)
        return None

    @property
    def loss(self) -> float | None:
        """The step's loss (last stage; with replicas, their mean, which each reports)."""
        return self._first("loss")

    @property
    def lr(self) -> float | None:
        """The learning rate (last stage's, else any stage's)."""
        return self._first("lr")

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm, if a stage reported one."""
        return self._first("grad_norm")

    @property
    def samples(self) -> int:
        """Samples the step trained on (every stage and replica reports the whole batch)."""
        return max((ev.samples for ev in self.events.values()), default=0)

    @property
    def epoch(self) -> int:
        """The epoch of the step."""
        return max((ev.epoch for ev in self.events.values()), default=0)

    @property
    def duration_s(self) -> float:
        """The step's duration: the slowest stage process's."""
        return max((ev.duration_s for ev in self.events.values()), default=0.0)

    @property
    def ts(self) -> float:
        """Wall-clock time the last stage process to finish published its event."""
        return max((ev.ts for ev in self.events.values()), default=0.0)

    @property
    def metrics(self) -> dict[str, float]:
        """Values reported with `evtrain.report` on any stage (later stages win).

        Replica 0's values are the step's; a name only other replicas reported
        comes from the lowest of them.
        """
        out: dict[str, float] = {}
        for _, ev in sorted(self.stages.items()):
            out.update(ev.metrics)
        for _, ev in sorted(self.events.items(), key=lambda kv: kv[0][::-1]):
            for key, value in ev.metrics.items():
                out.setdefault(key, value)
        return out


class StepMerger:
    """Collects `StepEnded` events and returns each step once it is complete.

    ``state`` gives the run as the hook knows it, asked on every event (the
    run's stage count may become known only after the first events). A step
    is complete once every stage of every replica reported it; before the run
    is known, once every stage of replica 0 did, and without a stage count
    once replica 0's event carrying the loss arrived.
    Events that are none of the run's steps (`step_problem`) are counted in
    ``ignored`` and logged with a rate limit.
    """

    def __init__(self, state: Callable[[], RunState], *, max_pending: int = 64) -> None:
        self._state = state
        self._pending: dict[int, MergedStep] = {}
        self._max_pending = max_pending
        self._done_below = -1  # every step <= this was handed out
        self.ignored = RateLimitedLog(log, "step events ignored")

    def reset(self) -> None:
        """Forget everything (a new run started)."""
        self._pending.clear()
        self._done_below = -1

    def add(self, ev: StepEnded) -> list[MergedStep]:
        """Fold in one event; returns the steps completed by it, oldest first."""
        problem = step_problem(ev, self._state())
        if problem is not None:
            self.ignored(
                problem,
                step=ev.step,
                stage=ev.stage,
                replica=ev.replica,
                source=safe_text(ev.source, 100),
            )
            return []
        if ev.step <= self._done_below:
            if self._done_below - ev.step <= MAX_STEP_JUMP:
                return []  # a late duplicate (e.g. from a state snapshot)
            self.reset()  # far behind what was handed out: start over from here
        merged = self._pending.setdefault(ev.step, MergedStep(ev.step))
        merged.events[(ev.stage, ev.replica)] = ev
        if not self._complete(merged):
            if len(self._pending) > self._max_pending:
                return self._release_through(min(self._pending))
            return []
        return self._release_through(ev.step)

    def flush(self) -> list[MergedStep]:
        """Every step still waiting for a stage (the run ended), oldest first."""
        if not self._pending:
            return []
        return self._release_through(max(self._pending))

    def _complete(self, merged: MergedStep) -> bool:
        state = self._state()
        stages = state.num_stages
        replicas = state.data_parallel or 1
        counted = [ev for (_, replica), ev in merged.events.items() if replica < replicas]
        if stages is None:
            return any(ev.loss is not None for ev in counted)
        return len(counted) >= stages * replicas

    def _release_through(self, step: int) -> list[MergedStep]:
        # Earlier steps still pending lost an event; they will not complete now.
        out = [self._pending.pop(s) for s in sorted(s for s in self._pending if s <= step)]
        self._done_below = max(self._done_below, step)
        return out


class StepWindow:
    """The last ``size`` merged steps: median step time, throughput, ETA."""

    def __init__(self, size: int = 20) -> None:
        self._steps: deque[MergedStep] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[MergedStep]:
        return iter(self._steps)

    def add(self, merged: MergedStep) -> None:
        """Append one step."""
        self._steps.append(merged)

    def clear(self) -> None:
        """Drop every step."""
        self._steps.clear()

    def _intervals(self) -> list[float]:
        steps = list(self._steps)
        return [
            (b.ts - a.ts) / (b.step - a.step)
            for a, b in itertools.pairwise(steps)
            if b.step > a.step and b.ts >= a.ts
        ]

    def step_time_s(self) -> float | None:
        """Median wall-clock seconds per step (falls back to the step durations)."""
        intervals = self._intervals()
        if intervals:
            return statistics.median(intervals)
        durations = [s.duration_s for s in self._steps if s.duration_s > 0]
        return statistics.median(durations) if durations else None

    def samples_per_s(self) -> float | None:
        """Samples per wall-clock second over the window."""
        steps = list(self._steps)
        if len(steps) >= 2 and steps[-1].ts > steps[0].ts:
            return sum(s.samples for s in steps[1:]) / (steps[-1].ts - steps[0].ts)
        if steps and steps[-1].duration_s > 0:
            return steps[-1].samples / steps[-1].duration_s
        return None

    def eta_s(self, max_steps: int | None) -> float | None:
        """Seconds left until ``max_steps`` steps are done, at the median step time."""
        step_time = self.step_time_s()
        if not self._steps or not max_steps or step_time is None:
            return None
        return max(0, max_steps - self._steps[-1].step) * step_time
