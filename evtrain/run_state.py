"""What is known about a run from its events: the state a late-joining hook needs.

Both the broker's state service (which answers late joiners) and every hook
runner keep one, fed by the same events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evtrain.events import (
    CheckpointCommitted,
    EvalEnded,
    Message,
    RunEnded,
    RunStarted,
    StageStarted,
    StepEnded,
)

STATE_TOPICS: tuple[str, ...] = (
    "run.",
    "stage.started",
    "step.ended",
    "eval.ended",
    "checkpoint.committed",
)
"""Topics whose latest events make up a run's state."""


@dataclass
class RunState:
    """The latest run, stage, step, eval and checkpoint events seen."""

    run: RunStarted | None = None
    ended: RunEnded | None = None
    stages: dict[int, StageStarted] = field(default_factory=dict)
    last_step: dict[int, StepEnded] = field(default_factory=dict)
    last_eval: EvalEnded | None = None
    last_checkpoint: CheckpointCommitted | None = None

    def update(self, msg: Message) -> None:
        """Fold one message into the state (messages of other types are ignored)."""
        if isinstance(msg, RunStarted):
            if self.run is None or self.run.run_id != msg.run_id:
                self.stages = {s: st for s, st in self.stages.items() if st.run_id == msg.run_id}
                self.last_step.clear()
                self.last_eval = None
                self.ended = None
            self.run = msg
        elif isinstance(msg, RunEnded):
            self.ended = msg
        elif isinstance(msg, StageStarted):
            self.stages[msg.stage] = msg
        elif isinstance(msg, StepEnded):
            self.last_step[msg.stage] = msg
        elif isinstance(msg, EvalEnded):
            self.last_eval = msg
        elif isinstance(msg, CheckpointCommitted):
            self.last_checkpoint = msg

    @property
    def num_stages(self) -> int | None:
        """Number of pipeline stages, if known."""
        if self.run is not None:
            return self.run.num_stages
        if self.stages:
            return next(iter(self.stages.values())).num_stages
        return None

    @property
    def step(self) -> int | None:
        """The latest step any stage finished."""
        return max((ev.step for ev in self.last_step.values()), default=None)

    def snapshot(self) -> list[Message]:
        """The state as the events that built it, oldest kind first."""
        out: list[Message] = []
        if self.run is not None:
            out.append(self.run)
        out.extend(self.stages[s] for s in sorted(self.stages))
        out.extend(self.last_step[s] for s in sorted(self.last_step))
        for extra in (self.last_eval, self.last_checkpoint, self.ended):
            if extra is not None:
                out.append(extra)
        return out
