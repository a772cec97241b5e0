"""evtrain.stages: schedules as data, partitioning, and the stage runtime.

Pure, cheap parts are imported eagerly: the instructions, `build_schedule`
and the `simulate` checker. The rest loads on first use (PEP 562), because
`evtrain.job` imports `evtrain.stages.schedules`, and the partitioning and
runtime modules import `evtrain.job` back.

* schedules: `build_schedule(schedule, stage, P, M, forward_only=False)`,
  `Schedule`, `parse_schedule`, `bubble_fraction`, `max_in_flight`,
  `format_instructions`, the instruction classes; `simulate` and
  `simulate_programs` run them without processes.
* partitioning: `partition`, `build_stage_module`, `build_full_model`,
  `StageModule`.
* runtime: `WorkerConfig` and `worker_main` (the elastic entrypoint the
  launcher starts once per stage), `StageActor`, `StageExecutor`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from evtrain.stages.instructions import (
    Backward,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    format_instructions,
)
from evtrain.stages.schedules import (
    Schedule,
    bubble_fraction,
    build_schedule,
    max_in_flight,
    parse_schedule,
)
from evtrain.stages.simulator import (
    DeadlockError,
    ScheduleError,
    SimulationResult,
    simulate,
    simulate_programs,
)

if TYPE_CHECKING:
    from evtrain.stages.actor import StageActor
    from evtrain.stages.executor import StageExecutor
    from evtrain.stages.partition import (
        StageModule,
        build_full_model,
        build_stage_module,
        partition,
    )
    from evtrain.stages.worker import WorkerConfig, worker_main

_LAZY = {
    "StageModule": "evtrain.stages.partition",
    "build_full_model": "evtrain.stages.partition",
    "build_stage_module": "evtrain.stages.partition",
    "partition": "evtrain.stages.partition",
    "WorkerConfig": "evtrain.stages.worker",
    "worker_main": "evtrain.stages.worker",
    "StageActor": "evtrain.stages.actor",
    "StageExecutor": "evtrain.stages.executor",
}

__all__ = [
    "Backward",
    "DeadlockError",
    "Forward",
    "Instruction",
    "LoadMicrobatch",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "Schedule",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "SimulationResult",
    "StageActor",
    "StageExecutor",
    "StageModule",
    "WorkerConfig",
    "bubble_fraction",
    "build_full_model",
    "build_schedule",
    "build_stage_module",
    "format_instructions",
    "max_in_flight",
    "parse_schedule",
    "partition",
    "simulate",
    "simulate_programs",
    "worker_main",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evtrain.stages' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
