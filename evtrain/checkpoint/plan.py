"""The stage side of a `evtrain.events.CheckpointPlan`: which boundary saves, and why.

Every stage holds the same `PlanState` and feeds it the same facts (the
boundary, the evaluated metric that the last stage shares with all), so all
stages decide alike without another message. Torch-free.
"""

from __future__ import annotations

from evtrain.checkpoint.storage import is_better
from evtrain.events import CheckpointPlan

__all__ = ["ON_STOP", "PlanState"]

ON_STOP = "on stop"
"""The reason of the checkpoint a plan with ``on_stop`` saves when the run ends."""


class PlanState:
    """A plan and the best metric value seen under it."""

    def __init__(self, plan: CheckpointPlan) -> None:
        self.plan = plan
        self.best = plan.best

    @property
    def plan_id(self) -> str:
        """The plan's command id; checkpoint ids of its saves derive from it."""
        return self.plan.command_id

    @property
    def best_metric(self) -> str | None:
        """The metric best checkpoints are chosen by (None: no best checkpoints)."""
        return self.plan.best_metric

    def checkpoint_id(self, step: int) -> str:
        """The id of the plan's checkpoint of ``step`` (the same on every stage)."""
        return f"{self.plan_id[:16]}-{step:08d}"

    def carry_best(self, best: float | None) -> None:
        """Keep ``best`` (from a plan this one replaces) when it beats the plan's own."""
        if best is not None and is_better(best, self.best, self.plan.mode):
            self.best = best

    def periodic(self, step: int) -> str | None:
        """The reason to save at boundary ``step`` by the step cadence, if any."""
        every = self.plan.every_steps
        if every is not None and step > 0 and step % every == 0:
            return f"every {every} steps"
        return None

    def evaluated(self, value: float | None) -> str | None:
        """An evaluation gave ``value``: the reason to save it as the new best, if it is one."""
        name = self.plan.best_metric
        if name is None or value is None or not is_better(value, self.best, self.plan.mode):
            return None
        self.best = value
        return f"best {name}"
