"""What a stage has been told to do at which step boundary (the rules: `evtrain.bus.commands`).

`Orders` is the stage's calendar: it accepts each new command for a boundary
(now, a later one, or refused), hands back at each boundary the commands due
there, and holds the standing orders — recurring evaluations and the
checkpoint plan. Every stage keeps its own `Orders`; they stay identical
because every stage accepts the same commands at the same boundaries, in the
same order. Torch-free and bus-free, so its rules are testable on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evtrain.checkpoint.plan import PlanState
from evtrain.events import CheckpointPlan, Command, EvaluateNow

__all__ = ["Acceptance", "Orders"]


@dataclass(frozen=True)
class Acceptance:
    """How a stage takes a command: the boundary it applies at, or why it refuses it."""

    step: int
    ok: bool = True
    late: bool = False
    detail: str = ""


@dataclass
class _Recurring:
    every: int | None
    every_epochs: int | None
    since: int


@dataclass
class Orders:
    """The calendar of one stage.

    Args:
        last_step: the run's last boundary (``RunStarted.max_steps``).
        batches_per_step: data batches one optimizer step reads (gradient accumulation).
        batches_per_epoch: data batches in one epoch (0: epochs are unknown).
    """

    last_step: int
    batches_per_step: int = 1
    batches_per_epoch: int = 0
    plan: PlanState | None = None
    _scheduled: dict[int, list[Command]] = field(default_factory=dict)
    _evaluations: list[_Recurring] = field(default_factory=list)

    def accept(self, command: Command, boundary: int) -> Acceptance:
        """Decide where ``command``, received at ``boundary``, applies; keep it if ahead."""
        at = command.at_step
        if at is not None and at > self.last_step:
            return Acceptance(
                step=at,
                ok=False,
                detail=f"step {at} is past the run's last step ({self.last_step})",
            )
        if at is None or at == boundary:
            return Acceptance(step=boundary)
        if at < boundary:
            return Acceptance(step=boundary, late=True)
        self._scheduled.setdefault(at, []).append(command)
        return Acceptance(step=at)

    def due(self, boundary: int, accepted_now: list[Command]) -> list[Command]:
        """The commands to apply at ``boundary``: those kept for it, then ``accepted_now``."""
        return [*self._scheduled.pop(boundary, []), *accepted_now]

    def pending(self) -> int:
        """Commands kept for later boundaries."""
        return sum(len(v) for v in self._scheduled.values())

    def add_evaluation(self, command: EvaluateNow, boundary: int) -> bool:
        """Apply an `EvaluateNow` at ``boundary``; whether it asks for an evaluation right here.

        A recurring one (``every``/``every_epochs``) becomes a standing order
        from ``boundary`` on and evaluates here only when this boundary is one
        of its own.
        """
        if command.every is None and command.every_epochs is None:
            return True
        order = _Recurring(command.every, command.every_epochs, boundary)
        if order not in self._evaluations:
            self._evaluations.append(order)
        return self._evaluation_due(order, boundary)

    def evaluation_due(self, boundary: int) -> bool:
        """Whether a standing evaluation order falls on ``boundary``."""
        return any(self._evaluation_due(o, boundary) for o in self._evaluations)

    def set_plan(self, command: CheckpointPlan) -> None:
        """Replace the checkpoint plan; a best value this stage already saw better is kept."""
        previous = self.plan
        self.plan = PlanState(command)
        if previous is not None and command.best_metric == previous.best_metric:
            self.plan.carry_best(previous.best)

    def epochs_ended(self, boundary: int) -> list[int]:
        """Epochs (from 0) whose last batch was read by the step that ends at ``boundary``."""
        if self.batches_per_epoch <= 0 or boundary <= 0:
            return []
        before = (boundary - 1) * self.batches_per_step // self.batches_per_epoch
        after = boundary * self.batches_per_step // self.batches_per_epoch
        return list(range(before, after))

    def _evaluation_due(self, order: _Recurring, boundary: int) -> bool:
        if boundary < order.since or boundary <= 0:
            return False
        if order.every is not None and boundary % order.every == 0:
            return True
        if order.every_epochs is not None:
            return any((e + 1) % order.every_epochs == 0 for e in self.epochs_ended(boundary))
        return False
