"""LR monitor (short name ``lr_monitor``): logs changes of the learning rate.

Each stage steps its own optimizer and scheduler, so each reports its own
``lr`` in `StepEnded`. A change is logged once per step and value (stages
that agree share one line); a stage whose LR differs from the others at the
same step gets one warning. With data parallelism every replica of a stage
steps its own scheduler too: replica 0's values are logged, and a replica
whose LR differs from the others gets the warning as well.
"""

from __future__ import annotations

import math
from collections import deque

from evtrain.events import RunStarted, StepEnded
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option
from evtrain.steps import StageReplica, place_fields, step_problem


class LRMonitor(Hook):
    """Log learning-rate changes.

    Options: ``rtol`` (default 0.01): a line is logged when a stage's LR moved
    by more than this fraction since the last logged value, so a step schedule
    logs each step change and a cosine schedule logs about every 1% of change
    instead of every step; ``rtol=0`` logs every change.
    """

    name = "lr_monitor"
    default_priority = 100

    def __init__(self, *, rtol: float = 0.01, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.rtol = float_option(self.name, "rtol", rtol)
        self.last_lr: dict[int, float] = {}
        self.changes: deque[tuple[int, float]] = deque(maxlen=1000)
        self._logged_lr: dict[int, float] = {}
        self._last_line: tuple[int, float] | None = None
        # step -> (stage, replica) -> lr, for the latest few steps: stages report
        # one step at different times, so only the same step's values can be compared.
        self._by_step: dict[int, dict[StageReplica, float]] = {}
        self._disagreed: set[StageReplica] = set()
        self._run_id: str | None = None

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run: forget the old LRs."""
        self._enter_run(ev.run_id)

    def _enter_run(self, run_id: str) -> None:
        # Whichever event of a run comes first: a stage's step can overtake the
        # run's start on the bus, and must not be forgotten when the start comes.
        if run_id != self._run_id:
            self._run_id = run_id
            self.last_lr.clear()
            self._logged_lr.clear()
            self._by_step.clear()
            self._last_line = None

    @on(StepEnded)
    def step_ended(self, ev: StepEnded) -> None:
        """Compare the stage's LR with its last logged one and with the other stages'."""
        if ev.lr is None or step_problem(ev, self.state) is not None:
            return
        self._enter_run(ev.run_id)
        self._check_agreement(ev, ev.lr)
        if ev.replica:
            return  # replica 0 speaks for its stage; the others are only compared with it
        self.last_lr[ev.stage] = ev.lr
        previous = self._logged_lr.get(ev.stage)
        if previous is not None and self._same(ev.lr, previous):
            return
        self._logged_lr[ev.stage] = ev.lr
        if (
            self._last_line is not None
            and self._last_line[0] == ev.step
            and self._same(self._last_line[1], ev.lr)
        ):
            return  # another stage already reported this very change
        self._last_line = (ev.step, ev.lr)
        self.changes.append((ev.step, ev.lr))
        message = "initial learning rate" if previous is None else "learning rate changed"
        self.log.info(message, step=ev.step, lr=ev.lr, previous=previous)

    def _same(self, a: float, b: float) -> bool:
        # NaN equals nothing, itself included: a broken schedule would log every step.
        both_nan = math.isnan(a) and math.isnan(b)
        return both_nan or a == b or math.isclose(a, b, rel_tol=self.rtol)

    def _check_agreement(self, ev: StepEnded, lr: float) -> None:
        place = (ev.stage, ev.replica)
        at_step = self._by_step.setdefault(ev.step, {})
        at_step[place] = lr
        while len(self._by_step) > 8:
            del self._by_step[min(self._by_step)]
        if place in self._disagreed:
            return
        # Agreement is exact up to float noise, whatever rtol says about logging.
        others = {
            # "1" for stage 1 (its replica 0), "1/2" for its replica 2.
            f"{s}/{d}" if d else str(s): v
            for (s, d), v in at_step.items()
            if (s, d) != place and not math.isclose(v, lr, rel_tol=1e-9)
        }
        if others:
            self._disagreed.add(place)
            self.log.warning(
                "stages report different learning rates",
                step=ev.step,
                **place_fields(*place),
                lr=lr,
                others=others,
            )
