"""Merging the per-stage `StepEnded` events of one optimizer step into one record.

Every stage publishes its own ``step.ended``: the loss comes only from the last
stage, times and memory from each. Writers and loggers want one record per
step, so `StepMerger` collects a step's events and hands the step out once
every stage reported it — or, if an event was lost on the bus, once a later
step completed (a lost event must not hold every later line back).

Step numbers are 1-based (see `evtrain.stages.actor`): ``StepEnded.step`` k is
the k-th optimizer step, so k steps are done when it ends; boundary events
(`EvalEnded`, checkpoints, `RunEnded`) carry the steps done at that boundary.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from evtrain.events import StepEnded


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

    ``num_stages`` is asked on every event (the run's stage count may become
    known only after the first events); None counts a step complete once the
    event carrying the loss arrived.
    """

    def __init__(self, num_stages: Callable[[], int | None], *, max_pending: int = 64) -> None:
        self._num_stages = num_stages
        self._pending: dict[int, MergedStep] = {}
        self._max_pending = max_pending
        self._done_below = -1  # every step <= this was handed out

    def reset(self) -> None:
        """Forget everything (a new run started)."""
        self._pending.clear()
        self._done_below = -1

    def add(self, ev: StepEnded) -> list[MergedStep]:
        """Fold in one event; returns the steps completed by it, oldest first."""
        if ev.step <= self._done_below:
            return []  # a late duplicate (e.g. from a state snapshot)
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
        expected = self._num_stages()
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
