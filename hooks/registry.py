"""Resolve hook references (``logging`` or ``pkg.module:Class``) and their options.

A job spec's hook entry is a dict: ``type`` (the reference), the hook's
constructor options, and ``isolate``, which is the launcher's, not the hook's.
The launcher runs every *built-in* hook (`is_builtin`: a short name of
`BUILTIN_HOOKS`, or a class of ``evtrain.hooks`` / ``evtrain.exporters``) of a
spec in one shared host process, and every other hook in a process of its
own; ``isolate=True`` gives a built-in its own process too
(`evtrain.launcher.hook_supervisor` says what sharing costs and saves).
"""

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

ISOLATE = "isolate"
"""Spec key: ``True`` runs a built-in hook in its own process instead of the shared host."""

_BUILTIN_PACKAGES = ("evtrain.hooks", "evtrain.exporters")


def is_builtin(ref: str) -> bool:
    """Whether ``ref`` names a hook evtrain ships (a short name, or a class of its packages)."""
    module = BUILTIN_HOOKS.get(ref, ref).partition(":")[0]
    return any(module == pkg or module.startswith(f"{pkg}.") for pkg in _BUILTIN_PACKAGES)


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


def split_spec(spec: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """A job-spec hook entry's reference, constructor options and whether it is isolated.

    `UsageError` for an entry without a string ``type``, an ``isolate`` that is
    not a bool, and ``isolate=False`` on a hook that is not built in (those
    always run in a process of their own).
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise UsageError(f"hook spec {spec!r} needs a string 'type'")
    ref: str = spec["type"]
    options = {k: v for k, v in spec.items() if k not in ("type", ISOLATE)}
    builtin = is_builtin(ref)
    isolate = spec.get(ISOLATE, not builtin)
    if not isinstance(isolate, bool):
        raise UsageError(f"hook {ref}: '{ISOLATE}' must be true or false, got {isolate!r}")
    if not isolate and not builtin:
        raise UsageError(
            f"hook {ref}: {ISOLATE}=False shares a process among built-in hooks only; "
            "this hook always runs in its own"
        )
    return ref, options, isolate


def shares_host(spec: Mapping[str, Any]) -> bool:
    """Whether the launcher runs this (valid) hook entry in the shared host process."""
    return not split_spec(spec)[2]


def build_hook_from_spec(spec: Mapping[str, Any]) -> Hook:
    """A hook from a job-spec entry like ``dict(type="logging", every=10, priority=5)``."""
    ref, options, _ = split_spec(spec)
    return build_hook(ref, options)
