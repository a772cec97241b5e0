"""evtrain.stages: schedules as data, partitioning, and the stage runtime.

The package exports the torch-free part, schedules as data:
`build_schedule(schedule, stage, P, M, forward_only=False)`, `Schedule`,
`parse_schedule`, `bubble_fraction`, `max_in_flight`, `format_instructions`,
the instruction classes; `simulate` and `simulate_programs` run them without
processes. The rest is imported from its module, so that reading a schedule
does not load torch:

* partitioning: `evtrain.stages.partition` (`partition`,
  `build_stage_module`, `build_full_model`, `StageModule`);
* runtime: `evtrain.stages.worker` (`WorkerConfig`; `evtrain.stages.entry.worker_main`: the
  elastic entrypoint the launcher starts once per stage),
  `evtrain.stages.actor`, `evtrain.stages.executor`.
"""

from __future__ import annotations

from evtrain.schedule_names import Schedule, parse_schedule
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
from evtrain.stages.schedules import build_schedule, max_in_flight
from evtrain.stages.simulator import (
    DeadlockError,
    ScheduleError,
    SimulationResult,
    bubble_fraction,
    simulate,
    simulate_programs,
)

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
    "bubble_fraction",
    "build_schedule",
    "format_instructions",
    "max_in_flight",
    "parse_schedule",
    "simulate",
    "simulate_programs",
]
