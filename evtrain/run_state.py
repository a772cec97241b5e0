"""What is known about a run from its events: the state a late-joining hook needs.

Both the broker's state service (which answers late joiners) and every hook
runner keep one, fed by the same events.

The state is bounded by the run's shape, whatever arrives: one entry per
pipeline stage of the run (stage numbers are checked against the run's
``num_stages``, at most the schema's `MAX_STAGES`) and per hook process (the
latest `MAX_HOOKS`), plus the latest eval, checkpoint and end. Events that name
a stage the run does not have are ignored and counted in `RunState.ignored`.

With data parallelism every stage runs on ``data_parallel`` replicas. Replica
0 publishes what a run without replicas publishes, so the state is replica 0's:
the stage and step entries of replicas > 0 describe the same stages and steps
and are not folded in (a state stays one entry per stage however many replicas
run). An event of a replica the run does not have is ignored and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evtrain.events import (
    MAX_REPLICAS,
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
MAX_PLACES = 1024
"""Most stage processes, (stage, replica) pairs, a consumer keeps figures of each for."""


@dataclass
class RunState:
    """The latest run, stage, step, eval, checkpoint and hook events seen."""

    run: RunStarted | None = None
    ended: RunEnded | None = None
    stages: dict[int, StageStarted] = field(default_factory=dict)
    """Replica 0's `StageStarted` of each stage."""
    last_step: dict[int, StepEnded] = field(default_factory=dict)
    """Replica 0's latest `StepEnded` of each stage."""
    last_eval: EvalEnded | None = None
    last_checkpoint: CheckpointCommitted | None = None
    hooks: dict[str, HookStarted] = field(default_factory=dict)
    """The latest `HookStarted` of each hook process, by source, oldest first."""
    ignored: int = 0
    """Events not folded in: stage or replica numbers, or stage counts, outside the run's shape."""

    def update(self, msg: Message) -> None:
        """Fold one message into the state (messages of other types are ignored).

        Decoded messages are in the schema's ranges already; the checks here also
        hold for messages built in-process.
        """
        if isinstance(msg, StepEnded):  # by far the most frequent: first
            if not (self._stage_known(msg.stage) and self._replica_known(msg.replica)):
                self.ignored += 1
            elif msg.replica == 0:
                self.last_step[msg.stage] = msg
        elif isinstance(msg, RunStarted):
            self._start(msg)
        elif isinstance(msg, RunEnded):
            self.ended = msg
        elif isinstance(msg, StageStarted):
            known = _shape_valid(msg.num_stages) and self._stage_known(msg.stage, msg.num_stages)
            if not (known and self._replica_known(msg.replica)):
                self.ignored += 1
            elif msg.replica == 0:
                self.stages[msg.stage] = msg
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
        if not (_shape_valid(msg.num_stages) and 1 <= msg.data_parallel <= MAX_REPLICAS):
            self.ignored += 1
            return
        if self.run is None or self.run.run_id != msg.run_id:
            # What arrived before its run's start (the broker reads steps on a socket
            # of their own, so they may overtake it) is kept; older runs' is dropped.
            self.stages = {s: st for s, st in self.stages.items() if st.run_id == msg.run_id}
            self.last_step = {s: st for s, st in self.last_step.items() if st.run_id == msg.run_id}
            if self.last_eval is not None and self.last_eval.run_id != msg.run_id:
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

    def _replica_known(self, replica: int) -> bool:
        """Whether ``replica`` may be a replica of the run (any in the schema's range before
        the run is known)."""
        limit = self.run.data_parallel if self.run is not None else MAX_REPLICAS
        return 0 <= replica < limit

    def place_problem(self, stage: int, replica: int, tp: int = 0) -> str | None:
        """Why (``stage``, ``replica``, tensor rank ``tp``) is no process of the known run;
        None if it may be one."""
        run = self.run
        if run is None:
            return None
        if stage >= run.num_stages:
            return "stage beyond the run's num_stages"
        if replica >= run.data_parallel:
            return "replica beyond the run's data_parallel"
        if tp >= run.tensor_parallel:
            return "tensor rank beyond the run's tensor_parallel"
        return None

    @property
    def data_parallel(self) -> int | None:
        """Replicas of every stage, if the run is known."""
        return self.run.data_parallel if self.run is not None else None

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


def of_run(msg: Message, state: RunState) -> bool:
    """Whether ``msg`` belongs to the run ``state`` knows.

    Events of another run (late ones of the previous run, or made up) must not
    end, count towards or otherwise change the current one. Before a run is
    known every event may be of it, and so is one without a run id (hooks
    publish theirs without).
    """
    return state.run is None or not msg.run_id or msg.run_id == state.run.run_id


def _shape_valid(num_stages: int) -> bool:
    return 1 <= num_stages <= MAX_STAGES


def stage_source(stage: int, replica: int = 0, tp: int = 0) -> str:
    """The publisher source of a stage process: ``stage/1``, ``stage/1/2`` for replica 2,
    ``stage/1/2/1`` for its tensor rank 1."""
    if tp:
        return f"stage/{stage}/{replica}/{tp}"
    return f"stage/{stage}/{replica}" if replica else f"stage/{stage}"
