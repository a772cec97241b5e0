"""Hooks: event subscribers that observe and steer a run.

Write one by subclassing `Hook` and decorating methods with `@on(EventType)`;
run it with ``evtrain hook pkg.mod:Class --bus ENDPOINT`` or in-process with
`HookRunner`.
"""

from evtrain.hooks.hook import Hook, on
from evtrain.hooks.runner import CommandTimeout, HookRunner

__all__ = ["CommandTimeout", "Hook", "HookRunner", "on"]
