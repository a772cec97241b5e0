"""Hooks: event subscribers that observe and steer a run.

Write one by subclassing `Hook` and decorating methods with `@on(EventType)`;
run it with ``evtrain hook pkg.mod:Class --bus ENDPOINT`` or in-process with
`HookRunner`.
"""

from evtrain.hooks.hook import EventFilter, Hook, on
from evtrain.hooks.runner import CommandTimeout, HookRunner

__all__ = ["CommandTimeout", "EventFilter", "Hook", "HookRunner", "on"]

# Built-in hooks (the exporters live in evtrain.exporters).
from evtrain.hooks.console_log import ConsoleLog
from evtrain.hooks.early_stopping import EarlyStopping
from evtrain.hooks.eval_trigger import EvalTrigger
from evtrain.hooks.lr_monitor import LRMonitor
from evtrain.hooks.memory_monitor import MemoryMonitor
from evtrain.hooks.timer import Timer

__all__ += [
    "ConsoleLog",
    "EarlyStopping",
    "EvalTrigger",
    "LRMonitor",
    "MemoryMonitor",
    "Timer",
]
