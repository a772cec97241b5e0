"""Throughput and per-stage compute-vs-wait timer (short name ``timer``).

Like detectron2's IterationTimer, plus what a pipeline needs: every ``every``
steps one summary line with steps/s and samples/s over those steps and, per
stage, the fraction of its step time spent in forward, backward, waiting on
point-to-point communication and the rest (optimizer, data, overhead). At the
end of the run, the overall figures.

With data parallelism a stage's fractions are over the step times of all its
replicas together (their waits include the gradient reduction), and a step
counts once towards steps/s and samples/s however many replicas report it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from evtrain.events import RunEnded, RunStarted, StepEnded
from evtrain.hooks.hook import EventFilter, Hook, on
from evtrain.hooks.options import int_option
from evtrain.steps import MergedStep, StepMerger


@dataclass
class StageTimes:
    """Summed seconds of one stage's steps (of all its replicas, for the timer)."""

    steps: int = 0
    duration_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_wait_s: float = 0.0

    def add(self, duration: float, forward: float, backward: float, wait: float) -> None:
        """Add one step's times."""
        self.steps += 1
        self.duration_s += duration
        self.forward_s += forward
        self.backward_s += backward
        self.comm_wait_s += wait

    def fractions(self) -> dict[str, float]:
        """forward/backward/wait/other as fractions of the step time."""
        if self.duration_s <= 0:
            return {}
        fwd = self.forward_s / self.duration_s
        bwd = self.backward_s / self.duration_s
        wait = self.comm_wait_s / self.duration_s
        return {"fwd": fwd, "bwd": bwd, "wait": wait, "other": max(0.0, 1 - fwd - bwd - wait)}

    def describe(self) -> str:
        """``"fwd 41% bwd 45% wait 9% other 5%"``."""
        return " ".join(f"{k} {v:.0%}" for k, v in self.fractions().items())


class Timer(Hook):
    """Periodic throughput and compute-vs-wait summary.

    Options: ``every`` (steps between summaries, default 50).
    """

    name = "timer"
    default_priority = 100

    def __init__(self, *, every: int = 50, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.every = int_option(self.name, "every", every)
        self._summary_steps = EventFilter(every=self.every)
        self._merger = StepMerger(lambda: self.state)
        self.summaries: deque[dict[str, object]] = deque(maxlen=1000)
        self._reset_run()

    def _reset_run(self) -> None:
        self._window: dict[int, StageTimes] = {}
        self._total: dict[int, StageTimes] = {}
        self._window_start: MergedStep | None = None
        self._window_steps: list[MergedStep] = []
        self._first: MergedStep | None = None
        self._last: MergedStep | None = None
        self._steps = 0
        self._samples = 0

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: start counting again."""
        self._merger.reset()
        self._reset_run()

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Sum the stage's times; every ``every`` steps log the window's summary."""
        for merged in self._merger.add(ev):
            self._account(merged)

    def _account(self, merged: MergedStep) -> None:
        for (stage, _), sev in merged.events.items():
            times = (sev.duration_s, sev.forward_s, sev.backward_s, sev.comm_wait_s)
            self._window.setdefault(stage, StageTimes()).add(*times)
            self._total.setdefault(stage, StageTimes()).add(*times)
        if self._first is None:
            self._first = merged
        else:  # throughput counts steps after the first: wall time is measured between ends
            self._steps += 1
            self._samples += merged.samples
        self._window_steps.append(merged)
        self._last = merged
        if self._summary_steps(merged):
            self._summarize("timing", self._window, self._window_start, self._window_steps)
            self._window = {}
            self._window_start = merged
            self._window_steps = []

    def _summarize(
        self,
        event: str,
        stages: dict[int, StageTimes],
        start: MergedStep | None,
        steps: list[MergedStep],
    ) -> None:
        if not steps:
            return
        end = steps[-1]
        counted = steps if start is not None else steps[1:]
        begin = start if start is not None else steps[0]
        elapsed = end.ts - begin.ts
        fields: dict[str, object] = {"step": end.step, "steps": len(steps)}
        if elapsed > 0 and counted:
            fields["steps_per_s"] = round(len(counted) / elapsed, 2)
            fields["samples_per_s"] = round(sum(s.samples for s in counted) / elapsed, 1)
        for stage in sorted(stages):
            fields[f"stage{stage}"] = stages[stage].describe()
        self.summaries.append(
            {
                **fields,
                "fractions": {s: t.fractions() for s, t in stages.items()},
            }
        )
        self.log.info(event, **fields)

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        """Overall throughput and per-stage fractions of the whole run."""
        if not self.of_this_run(ev):
            return
        for merged in self._merger.flush():
            self._account(merged)
        if self._first is None or self._last is None:
            return
        elapsed = self._last.ts - self._first.ts
        fields: dict[str, object] = {"steps": self._steps + 1}
        if elapsed > 0 and self._steps:
            fields["seconds_per_step"] = round(elapsed / self._steps, 4)
            fields["samples_per_s"] = round(self._samples / elapsed, 1)
        for stage in sorted(self._total):
            fields[f"stage{stage}"] = self._total[stage].describe()
        self.summaries.append(
            {**fields, "fractions": {s: t.fractions() for s, t in self._total.items()}}
        )
        self.log.info("overall training speed", **fields)
