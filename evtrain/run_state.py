"""What is known about a run from its events: the state a late-joining hook needs.

Both the broker's state service (which answers late joiners) and every hook
runner keep one, fed by the same events.

The state is bounded by the run's shape, whatever arrives: one entry per
pipeline stage of the run (stage numbers are checked against the run's
``num_stages``, at most the schema's `MAX_STAGES`) and per hook process (the
latest `MAX_HOOKS`), plus the latest eval, checkpoint and end. Events that name
a stage the run does not have are ignored and counted in `RunState.ignored`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evtrain.events import (
    MAX_STAGES,
    CheckpointCommitted,
    EvalEnded,
    HookStarted,
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
    "hook.started",
)
"""Topics whose latest events make up a run's state."""

MAX_HOOKS = 64
"""Most hook processes the state remembers; the one attached longest ago goes first."""


@dataclass
class RunState:
    """The latest run, stage, step, eval, checkpoint and hook events seen."""

    run: RunStarted | None = None
    ended: RunEnded | None = None
    stages: dict[int, StageStarted] = field(default_factory=dict)
    last_step: dict[int, StepEnded] = field(default_factory=dict)
    last_eval: EvalEnded | None = None
    last_checkpoint: CheckpointCommitted | None = None
    hooks: dict[str, HookStarted] = field(default_factory=dict)
    """The latest `HookStarted` of each hook process, by source, oldest first."""
    ignored: int = 0
    """Events not folded in: stage numbers or stage counts outside the run's shape."""

    def update(self, msg: Message) -> None:
        """Fold one message into the state (messages of other types are ignored).

        Decoded messages are in the schema's ranges already; the checks here also
        hold for messages built in-process.
        """
        if isinstance(msg, StepEnded):  # by far the most frequent: first
            if self._stage_known(msg.stage):
                self.last_step[msg.stage] = msg
            else:
                self.ignored += 1
        elif isinstance(msg, RunStarted):
            self._start(msg)
        elif isinstance(msg, RunEnded):
            self.ended = msg
        elif isinstance(msg, StageStarted):
            if _shape_valid(msg.num_stages) and self._stage_known(msg.stage, msg.num_stages):
                self.stages[msg.stage] = msg
            else:
                self.ignored += 1
        elif isinstance(msg, EvalEnded):
            self.last_eval = msg
        elif isinstance(msg, CheckpointCommitted):
            self.last_checkpoint = msg
        elif isinstance(msg, HookStarted):
            self.hooks.pop(msg.source, None)  # re-inserted: the newest goes last
            self.hooks[msg.source] = msg
            while len(self.hooks) > MAX_HOOKS:
                del self.hooks[next(iter(self.hooks))]

    def _start(self, msg: RunStarted) -> None:
        if not _shape_valid(msg.num_stages):
            self.ignored += 1
            return
        if self.run is None or self.run.run_id != msg.run_id:
            self.stages = {s: st for s, st in self.stages.items() if st.run_id == msg.run_id}
            self.last_step.clear()
            self.last_eval = None
            self.ended = None
        self.run = msg
        # Entries learnt before the run's shape was known, outside it.
        for entries in (self.stages, self.last_step):
            for stage in [s for s in entries if s >= msg.num_stages]:
                del entries[stage]
                self.ignored += 1
        for stage in [s for s, st in self.stages.items() if st.num_stages != msg.num_stages]:
            del self.stages[stage]
            self.ignored += 1

    def _stage_known(self, stage: int, num_stages: int | None = None) -> bool:
        """Whether ``stage`` is a stage of the run (of ``num_stages`` before it is known)."""
        if self.run is not None:
            if num_stages is not None and num_stages != self.run.num_stages:
                return False
            num_stages = self.run.num_stages
        elif num_stages is None:
            num_stages = self.num_stages or MAX_STAGES
        return 0 <= stage < num_stages

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
        out.extend(self.hooks.values())
        for extra in (self.last_eval, self.last_checkpoint, self.ended):
            if extra is not None:
                out.append(extra)
        return out


def _shape_valid(num_stages: int) -> bool:
    return 1 <= num_stages <= MAX_STAGES
