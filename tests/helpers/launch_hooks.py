"""Hooks that the launch tests name in their job specs (run as ``evtrain hook`` processes).

Importable by the hook processes because the tests put this directory on
PYTHONPATH. Kept free of torch so that hook processes start fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio

from evtrain.events import (
    EvalEnded,
    EvalProgress,
    EvalStarted,
    RunEnded,
    RunStarted,
    StageStarted,
    StepEnded,
)
from evtrain.hooks.checkpoint import CheckpointHook
from evtrain.hooks.hook import Hook, on


def _append(path: Path, record: dict[str, object]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


class StepRecorder(Hook):
    """Appends `StageStarted` (stage, pid), every loss-carrying `StepEnded` and the
    `RunEnded` to a JSON-lines file.

    ``path`` is the file; without it ``$EVTRAIN_TEST_STEPS`` names it.
    """

    def __init__(self, *, path: str | None = None, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.path = Path(path or os.environ["EVTRAIN_TEST_STEPS"])

    @on(RunStarted)
    def started(self, ev: RunStarted) -> None:
        _append(self.path, {"started": ev.run_id, "num_stages": ev.num_stages, "pid": os.getpid()})

    @on(StageStarted)
    def stage_started(self, ev: StageStarted) -> None:
        _append(self.path, {"stage_started": ev.stage, "pid": ev.pid})

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        if ev.loss is not None:
            _append(self.path, {"step": ev.step, "loss": ev.loss, "stage": ev.stage})

    @on(RunEnded)
    def ended(self, ev: RunEnded) -> None:
        _append(
            self.path,
            {
                "end": ev.status,
                "reason": ev.reason,
                "root_cause": ev.root_cause,
                "source": ev.source,
            },
        )


class CrashOnce(Hook):
    """Exits with status 1 in its first `StepEnded` handler, unless ``marker`` exists.

    It creates ``marker`` before crashing, so the restarted process runs normally;
    on `RunEnded` it writes ``{"pid", "status"}`` to ``done`` to prove it saw the end.
    """

    def __init__(self, *, marker: str, done: str, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.marker = Path(marker)
        self.done = Path(done)

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            raise SystemExit(1)

    @on(RunEnded)
    def ended(self, ev: RunEnded) -> None:
        self.done.write_text(json.dumps({"pid": os.getpid(), "status": ev.status}))


class CrashAtSetup(Hook):
    """Attaches, then exits with status 3 in `setup`, every time."""

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        """Never reached."""

    async def setup(self) -> None:
        raise SystemExit(3)


class LaggingCheckpoint(CheckpointHook):
    """The checkpoint hook, reacting to every `StepEnded` ``lag_s`` late.

    Its runner dispatches one event at a time, so it falls further behind the
    stages with every step: whatever it would ask for on a step arrives late.
    """

    name = "checkpoint"

    def __init__(self, *, lag_s: float, **options: Any) -> None:
        super().__init__(**options)
        self.lag_s = float(lag_s)

    @on(StepEnded)
    async def step_ended(self, ev: StepEnded) -> None:
        await anyio.sleep(self.lag_s)
        await super().step_ended(ev)


class StageTimesRecorder(Hook):
    """Appends every stage's `StageStarted` (stage, layers) and every `StepEnded` of
    every stage, with its timings, to the JSON-lines file ``path``.

    `StepRecorder` keeps only the last stage's loss-carrying steps; a test that
    compares the stages' own compute needs the steps of all of them.
    """

    def __init__(self, *, path: str, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.path = Path(path)

    @on(StageStarted)
    def stage_started(self, ev: StageStarted) -> None:
        _append(
            self.path,
            {
                "stage_started": ev.stage,
                "replica": ev.replica,
                "layers": list(ev.layers),
                "num_params": ev.num_params,
            },
        )

    @on(StepEnded)
    def step(self, ev: StepEnded) -> None:
        _append(
            self.path,
            {
                "step": ev.step,
                "stage": ev.stage,
                "replica": ev.replica,
                "loss": ev.loss,
                "samples": ev.samples,
                "forward_s": ev.forward_s,
                "backward_s": ev.backward_s,
                "comm_wait_s": ev.comm_wait_s,
                "duration_s": ev.duration_s,
                "state_bytes": ev.state_bytes,
            },
        )


class EvalRecorder(Hook):
    """Appends every `EvalStarted`, `EvalProgress` and `EvalEnded`, and the `RunEnded`,
    to the JSON-lines file ``path``."""

    def __init__(self, *, path: str, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.path = Path(path)

    @on(EvalStarted)
    def started(self, ev: EvalStarted) -> None:
        _append(self.path, {"eval_started": ev.step, "num_batches": ev.num_batches})

    @on(EvalProgress)
    def progress(self, ev: EvalProgress) -> None:
        _append(
            self.path,
            {"progress": ev.batches_done, "of": ev.num_batches, "set": ev.set, "step": ev.step},
        )

    @on(EvalEnded)
    def ended(self, ev: EvalEnded) -> None:
        _append(
            self.path,
            {"eval_ended": ev.step, "metrics": ev.metrics, "sets": ev.sets, "samples": ev.samples},
        )

    @on(RunEnded)
    def run_ended(self, ev: RunEnded) -> None:
        _append(self.path, {"end": ev.status})
