"""Merging the per-stage `StepEnded` events of one optimizer step into one record.

Every stage publishes its own ``step.ended``: the loss comes only from the last
stage, times and memory from each. Writers and loggers want one record per
step, so `StepMerger` collects a step's events and hands the step out once
every stage reported it — or, if an event was lost on the bus, once a later
step completed (a lost event must not hold every later line back).

Step numbers are 1-based (see `evtrain.stages.actor`): ``StepEnded.step`` k is
the k-th optimizer step, so k steps are done when it ends; boundary events
(`EvalEnded`, checkpoints, `RunEnded`) carry the steps done at that boundary.

A step event is checked against the run before it counts (`step_problem`):
once the run's `RunStarted` is known, an event of another run, of a stage the
run does not have or of a step past its ``max_steps`` is none of its steps.
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

from evtrain.events import StepEnded
from evtrain.hooks.formatting import safe_text
from evtrain.hooks.hook import of_run
from evtrain.ratelimit import RateLimitedLog
from evtrain.run_state import RunState

log = structlog.get_logger("evtrain.hooks.step_merge")

MAX_STEP_JUMP = 1000
"""Most steps one event may advance a step count by."""


def step_problem(ev: StepEnded, state: RunState) -> str | None:
    """Why ``ev`` cannot be a step of the run ``state`` knows; None if it can be."""
    run = state.run
    if run is None:
        return None
    if not of_run(ev, state):
        return "step of another run"
    if ev.stage >= run.num_stages:
        return "stage beyond the run's num_stages"
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


@dataclass
class MergedStep:
    """One optimizer step as reported by the stages (``stages``: stage -> its event)."""

    step: int
    stages: dict[int, StepEnded] = field(default_factory=dict)

    def _first(self, attr: str) -> float | None:
        # The last stage holds the loss; for the other fields any stage will do,
        # the last one first so every field comes from one place when it can.
        for stage in sorted(self.stages, reverse=True):
            value = getattr(self.stages[stage], attr)
            if value is not None:
                return float(value)
        return None

    @property
    def loss(self) -> float | None:
        """The step's loss (last stage)."""
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
        """Samples the step trained on (every stage sees the same batch)."""
        return max((ev.samples for ev in self.stages.values()), default=0)

    @property
    def epoch(self) -> int:
        """The epoch of the step."""
        return max((ev.epoch for ev in self.stages.values()), default=0)

    @property
    def duration_s(self) -> float:
        """The step's duration: the slowest stage's."""
        return max((ev.duration_s for ev in self.stages.values()), default=0.0)

    @property
    def ts(self) -> float:
        """Wall-clock time the last stage to finish published its event."""
        return max((ev.ts for ev in self.stages.values()), default=0.0)

    @property
    def metrics(self) -> dict[str, float]:
        """Values reported with `evtrain.report` on any stage (later stages win)."""
        out: dict[str, float] = {}
        for stage in sorted(self.stages):
            out.update(self.stages[stage].metrics)
        return out


class StepMerger:
    """Collects `StepEnded` events and returns each step once it is complete.

    ``state`` gives the run as the hook knows it, asked on every event (the
    run's stage count may become known only after the first events); without
    a stage count a step is complete once the event carrying the loss arrived.
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
            self.ignored(problem, step=ev.step, stage=ev.stage, source=safe_text(ev.source, 100))
            return []
        if ev.step <= self._done_below:
            if self._done_below - ev.step <= MAX_STEP_JUMP:
                return []  # a late duplicate (e.g. from a state snapshot)
            self.reset()  # far behind what was handed out: start over from here
        merged = self._pending.setdefault(ev.step, MergedStep(ev.step))
        merged.stages[ev.stage] = ev
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
        expected = self._state().num_stages
        if expected is None:
            return any(ev.loss is not None for ev in merged.stages.values())
        return len(merged.stages) >= expected

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
