"""Resolve hook references (``logging`` or ``pkg.module:Class``) and their options."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from evtrain.errors import UsageError
from evtrain.hooks.hook import Hook

BUILTIN_HOOKS: dict[str, str] = {
    "logging": "evtrain.hooks.console_log:ConsoleLog",
    "eval_every": "evtrain.hooks.eval_trigger:EvalTrigger",
    "early_stopping": "evtrain.hooks.early_stopping:EarlyStopping",
    "lr_monitor": "evtrain.hooks.lr_monitor:LRMonitor",
    "timer": "evtrain.hooks.timer:Timer",
    "memory": "evtrain.hooks.memory_monitor:MemoryMonitor",
    "prometheus": "evtrain.exporters.prometheus:PrometheusExporter",
    "metrics": "evtrain.exporters.metrics_log:MetricsLog",
    "tensorboard": "evtrain.exporters.tensorboard:TensorBoardWriter",
    "recorder": "evtrain.exporters.recorder:EventRecorder",
    "checkpoint": "evtrain.hooks.checkpoint:CheckpointHook",
}
"""Short names of the built-in hooks and exporters -> ``module:Class``."""


def resolve_hook_class(ref: str) -> type[Hook]:
    """The Hook subclass named by ``ref``; `UsageError` if it cannot be found."""
    target = BUILTIN_HOOKS.get(ref, ref)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(BUILTIN_HOOKS)) or "none"
        raise UsageError(
            f"unknown hook {ref!r}: use package.module:Class or a built-in name ({known})"
        )
    # Like `python -m`, find the user's own modules in the working directory
    # (`evtrain hook mypkg.mod:Cls` from a project root); appended, so nothing
    # installed is ever shadowed.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import hook module {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise UsageError(f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Hook)):
        raise UsageError(f"{target} is not an evtrain.hooks.Hook subclass")
    return cls


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``key=value`` strings to a dict; values are JSON when they parse, else text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise UsageError(f"bad hook option {pair!r}: expected key=value")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def build_hook(ref: str, options: Mapping[str, Any] | None = None) -> Hook:
    """Instantiate the hook ``ref`` with ``options``; bad options are a `UsageError`."""
    cls = resolve_hook_class(ref)
    options = dict(options or {})
    signature = inspect.signature(cls)
    try:
        signature.bind(**options)
    except TypeError as exc:
        accepted = ", ".join(
            name
            for name, p in signature.parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        raise UsageError(f"hook {ref}: {exc} (accepted options: {accepted})") from None
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"hook {ref}: bad option: {exc}") from None


def build_hook_from_spec(spec: Mapping[str, Any]) -> Hook:
    """A hook from a job-spec entry like ``dict(type="logging", every=10, priority=5)``."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise UsageError(f"hook spec {spec!r} needs a string 'type'")
    options = {k: v for k, v in spec.items() if k != "type"}
    return build_hook(spec["type"], options)
