"""evtrain: async, event-driven pipeline-parallel training on PyTorch.

Every pipeline stage is an actor that runs 1F1B/GPipe microbatch instructions and
publishes lifecycle events on a ZeroMQ bus; hooks are subscriber processes.
`launch` and `evaluate` (`evtrain.tools.api`) run a job or evaluate a checkpoint from
Python with the same processes as the command line.

The public names below are imported lazily, so ``evtrain bus`` and ``--help``
start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Job": "evtrain.job",
    "layer": "evtrain.job",
    "accuracy": "evtrain.job",
    "metric": "evtrain.job",
    "load_job": "evtrain.spec",
    "apply_overrides": "evtrain.overrides",
    "UsageError": "evtrain.errors",
    "SpecError": "evtrain.errors",
    "Hook": "evtrain.hooks.hook",
    "on": "evtrain.hooks.hook",
    "HookRunner": "evtrain.hooks.runner",
    "BusAddress": "evtrain.bus.address",
    "Broker": "evtrain.bus.broker",
    "Publisher": "evtrain.bus.publisher",
    "Subscriber": "evtrain.bus.subscriber",
    "RunState": "evtrain.run_state",
    "report": "evtrain.reporting",
    "launch": "evtrain.tools.api",
    "evaluate": "evtrain.tools.api",
    "LaunchResult": "evtrain.tools.api",
    "EvalResult": "evtrain.tools.api",
    "EvaluationFailed": "evtrain.tools.api",
}

__all__ = [
    "Broker",
    "BusAddress",
    "EvalResult",
    "EvaluationFailed",
    "Hook",
    "HookRunner",
    "Job",
    "LaunchResult",
    "Publisher",
    "RunState",
    "SpecError",
    "Subscriber",
    "UsageError",
    "accuracy",
    "apply_overrides",
    "evaluate",
    "events",
    "launch",
    "layer",
    "load_job",
    "metric",
    "on",
    "report",
]

if TYPE_CHECKING:
    from evtrain import events
    from evtrain.bus.address import BusAddress
    from evtrain.bus.broker import Broker
    from evtrain.bus.publisher import Publisher
    from evtrain.bus.subscriber import Subscriber
    from evtrain.errors import SpecError, UsageError
    from evtrain.hooks.hook import Hook, on
    from evtrain.hooks.runner import HookRunner
    from evtrain.job import Job, accuracy, layer, metric
    from evtrain.overrides import apply_overrides
    from evtrain.reporting import report
    from evtrain.run_state import RunState
    from evtrain.spec import load_job
    from evtrain.tools.api import EvalResult, EvaluationFailed, LaunchResult, evaluate, launch


def __getattr__(name: str) -> Any:
    if name == "events":
        return importlib.import_module("evtrain.events")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'evtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
