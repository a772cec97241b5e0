"""The spec's hooks during a launch: started, attached, given time to finish.

The launcher starts the spec's hooks as supervised processes
(`evtrain.launcher.hook_supervisor`) and waits until each has attached before any
stage starts: the built-in hooks together in one host process
(``priority`` orders them there), every other hook, and a built-in whose
spec entry says ``isolate=True``, in a process of its own. At the end they
get time to finish (they exit on `evtrain.events.RunEnded`) before the rest
are terminated. An evaluation, and node r > 0 of a run on several machines,
start none (`evtrain.launcher.plan.Purpose.starts_hooks`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from evtrain.bus.address import BusAddress
from evtrain.launcher.bus import curve_env
from evtrain.launcher.hook_supervisor import HookSupervisor
from evtrain.launcher.options import LaunchOptions
from evtrain.launcher.plan import LaunchPlan
from evtrain.launcher.progress import RunConsole

__all__ = ["FAILED_HOOK_GRACE_S", "finish_hooks", "start_hooks", "wait_attached"]

log = structlog.get_logger(__name__)

FAILED_HOOK_GRACE_S = 1.0
"""Seconds hooks get after a failed run's `RunEnded` before they are terminated."""
_POLL_S = 0.05


def hook_env(options: LaunchOptions, plan: LaunchPlan, console: RunConsole) -> dict[str, str]:
    """The hook processes' environment: the spec's directory importable, our console, CURVE."""
    # Hook modules that sit next to the spec are importable, as they are for
    # the spec itself (evtrain.spec.load_job appends its directory).
    env = dict(os.environ)
    spec_dirs = [str(Path(options.spec).expanduser().resolve().parent)]
    if plan.job_source is not None:
        spec_dirs += plan.job_source.directories()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths += [d for d in spec_dirs if d not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(console.child_env())
    return curve_env(env, options)


def start_hooks(
    options: LaunchOptions, plan: LaunchPlan, address: BusAddress, console: RunConsole
) -> HookSupervisor:
    """Start the hooks this launch runs (maybe none) under a supervisor."""
    specs = plan.job.hook_specs if plan.purpose.starts_hooks(options) else ()
    supervisor = HookSupervisor(
        specs,
        address,
        max_restarts=options.hook_restarts,
        env=hook_env(options, plan, console),
        log_args=("--log-format", options.log_format, "--log-level", options.log_level),
        output=console.child_output,
    )
    supervisor.start_all()
    return supervisor


async def wait_attached(
    supervisor: HookSupervisor, timeout: float, stopping: Callable[[], bool]
) -> str | None:
    """None once every hook attached (or a stop began); else why not (timeout, crash loop)."""
    deadline = time.monotonic() + timeout
    while not supervisor.all_attached():
        if stopping():
            return None
        problem = supervisor.startup_problem()
        if problem is not None:
            return problem
        if time.monotonic() > deadline:
            waiting = ", ".join(supervisor.waiting_for())
            return f"hooks did not attach to the bus within {timeout:g} s: {waiting}"
        supervisor.poll()
        await anyio.sleep(_POLL_S)
    return None


async def finish_hooks(
    supervisor: HookSupervisor,
    *,
    bus_down: bool,
    failed_at: float | None,
    finish_timeout: float,
) -> None:
    """Give hooks time to exit on `RunEnded`, then terminate the rest.

    ``failed_at``: when the launcher published that the run failed (None: it
    did not); they get `FAILED_HOOK_GRACE_S` from then.
    """
    supervisor.mark_run_ended()
    if bus_down:
        timeout, term = 0.0, 2.0  # they cannot hear the end of the run
    elif failed_at is not None:
        spent = time.monotonic() - failed_at
        timeout, term = max(0.2, FAILED_HOOK_GRACE_S - spent), 1.0
    else:
        timeout, term = finish_timeout, 5.0
    with anyio.move_on_after(timeout):
        while supervisor.running():
            supervisor.poll()
            await anyio.sleep(0.05)
    for hook in supervisor.running():
        log.warning("hook still running after the run; terminating it", hook=hook.label)
    await anyio.to_thread.run_sync(supervisor.terminate, term)
