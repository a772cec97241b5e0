"""Starting and supervising the hook processes a job spec names.

Which hooks share a process (`hook_groups`): every built-in hook of the spec
(`evtrain.hooks.registry.is_builtin`: ``logging``, ``prometheus``, ... or a class
of ``evtrain.hooks`` / ``evtrain.exporters``) runs in ONE host process, an
``evtrain hook --hooks JSON --bus ADDR --exit-on-run-end`` whose `HookRunner`
dispatches each event to all of them in ``priority`` order; every other hook
(``mymod:MyHook``) runs as its own ``evtrain hook REF --bus ADDR --option k=v
... --exit-on-run-end`` process, so a user hook that crashes, lags or leaks
cannot touch the training loop or another hook. A built-in with
``isolate=True`` in its spec entry gets its own process as well.

Why share: the stages and the hooks compete for the same cores, and each hook
process spends its own wake-up, receive and decode on every event it wants.
One host for the built-ins spends far less CPU per step than one process
each, and slows the steps far less (``bench/hook_overhead.py``; figures:
docs/benchmarks.md, "Measurements behind design choices").

The price: in the host, built-ins run one after another. A handler that
raises is reported (`HookError`) and the others go on; one whose ``setup``
raises is left out and the others go on; but a built-in that blocks the
host's loop delays its siblings' events by as long (never the training:
events queue in the host, and beyond its buffer are dropped and reported as
gaps). The built-ins that act on the run await the stages: ``checkpoint``
awaits each command's acknowledgements and each commit's disk work,
``eval_every`` and ``early_stopping`` their commands' acknowledgements.
That is milliseconds while the stages run; a host restarted after the run
ended sends nothing (its hooks see the end in the snapshot they replay). A
host that crashes restarts with all its hooks.
``isolate=True`` is for a built-in that should neither wait for nor hold up
the others.

The `HookSupervisor` keeps one `HookProcess` per process (a host or one hook):

* starts them all and knows one has *attached* when its `HookStarted` event
  (published by the runner once its subscription is proven live, one per
  process, naming all its hooks) arrives with the process's pid — the
  launcher's bus reader calls `attached`;
* restarts a process that exits non-zero or dies by a signal before the run
  ended, after a backoff that doubles per crash, at most ``max_restarts``
  times (then it gives up on that process and the run goes on without its
  hooks); a restarted process learns the run's state from the broker's
  snapshot;
* at the end (`terminate`, once the launcher gave hooks time to exit by
  themselves on `RunEnded`) sends SIGTERM, then SIGKILL.

Every hook process runs in its own session (process group), so a Ctrl-C at
the terminal reaches only the launcher, which decides the order of shutdown,
and with ``PR_SET_PDEATHSIG`` so that hooks end even if the launcher is
killed with SIGKILL. Not thread-safe: call it from one thread (the launcher's
event loop thread — PDEATHSIG fires when the thread that started a child
exits).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from evtrain.bus.address import BusAddress
from evtrain.hooks.registry import ISOLATE, shares_host

__all__ = [
    "HookProcess",
    "HookStartError",
    "HookSupervisor",
    "hook_command",
    "hook_groups",
    "host_command",
    "set_pdeathsig",
]

log = structlog.get_logger("evtrain.launcher.hook_supervisor")

_PR_SET_PDEATHSIG = 1


class HookStartError(RuntimeError):
    """A hook process did not attach to the bus (crashed or timed out)."""


def set_pdeathsig(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # not Linux: nothing to set
        return lambda: None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def hook_command(
    spec: Mapping[str, Any],
    bus: BusAddress,
    *,
    python: str = sys.executable,
    log_args: Sequence[str] = (),
) -> list[str]:
    """The ``evtrain hook`` command line for one job-spec hook entry.

    Option values are JSON-encoded, which ``evtrain hook --option`` decodes
    back to the same value (a string stays a string). ``log_args`` are global
    flags such as ``--log-format json``.
    """
    cmd = [python, "-m", "evtrain", *log_args, "hook", str(spec["type"]), "--bus", str(bus)]
    for key, value in spec.items():
        if key in ("type", ISOLATE):
            continue
        cmd += ["--option", f"{key}={json.dumps(value)}"]
    cmd.append("--exit-on-run-end")
    return cmd


def host_command(
    specs: Sequence[Mapping[str, Any]],
    bus: BusAddress,
    *,
    python: str = sys.executable,
    log_args: Sequence[str] = (),
) -> list[str]:
    """The ``evtrain hook --hooks JSON`` command line of a process hosting ``specs``.

    One spec is the single-hook form of `hook_command`.
    """
    if len(specs) == 1:
        return hook_command(specs[0], bus, python=python, log_args=log_args)
    entries = [{k: v for k, v in spec.items() if k != ISOLATE} for spec in specs]
    hooks = json.dumps(entries, separators=(",", ":"))
    cmd = [python, "-m", "evtrain", *log_args, "hook", "--hooks", hooks, "--bus", str(bus)]
    cmd.append("--exit-on-run-end")
    return cmd


def hook_groups(specs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Indices of ``specs`` by process: the shared built-ins' host, and one per other hook.

    Processes come in the order of their first hook, hooks in spec order.
    """
    groups: list[list[int]] = []
    host: list[int] | None = None
    for i, spec in enumerate(specs):
        if not shares_host(spec):
            groups.append([i])
        elif host is None:
            host = [i]
            groups.append(host)
        else:
            host.append(i)
    return groups


@dataclass
class HookProcess:
    """One supervised process: its hooks' specs, the current process, its restart history.

    Several ``specs`` make it the built-ins' host; its ``label`` joins theirs with ``+``.
    """

    index: int
    specs: list[dict[str, Any]]
    label: str
    proc: subprocess.Popen[bytes] | None = None
    attached: bool = False
    restarts: int = 0
    next_start: float | None = None
    """When a crashed hook is due to be started again (monotonic seconds)."""
    done: bool = False
    """Exited for good: cleanly, after the run ended, or gave up after too many restarts."""
    gave_up: bool = False
    exit_codes: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        """The current process's pid (None between restarts)."""
        return self.proc.pid if self.proc is not None else None


class HookSupervisor:
    """Starts the hook processes of a run and keeps them alive until it ends."""

    def __init__(
        self,
        specs: Sequence[Mapping[str, Any]],
        bus: BusAddress,
        *,
        max_restarts: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        log_args: Sequence[str] = (),
        output: int | None = None,
    ) -> None:
        self.bus = bus
        self.output = output
        """File descriptor for the hooks' stdout and stderr (None: this process's)."""
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.env = dict(os.environ if env is None else env)
        self.python = python
        self.log_args = tuple(log_args)
        self.run_ended = False
        seen: dict[str, int] = {}
        labels: list[str] = []
        for spec in specs:
            name = str(spec["type"]).rpartition(":")[2] or str(spec["type"])
            seen[name] = seen.get(name, 0) + 1
            labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
        self.hooks: list[HookProcess] = [
            HookProcess(
                index=i,
                specs=[dict(specs[j]) for j in group],
                label="+".join(labels[j] for j in group),
            )
            for i, group in enumerate(hook_groups(specs))
        ]
        """One per process, in `hook_groups` order."""

    # -- starting ----------------------------------------------------------------

    def start_all(self) -> None:
        """Start every hook process (returns at once; see `wait_attached`)."""
        for hook in self.hooks:
            self._start(hook)

    def _start(self, hook: HookProcess) -> None:
        cmd = host_command(hook.specs, self.bus, python=self.python, log_args=self.log_args)
        hook.proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.output,
            stderr=self.output,
            start_new_session=True,
            preexec_fn=set_pdeathsig(),
        )
        hook.attached = False
        hook.next_start = None
        log.debug("hook started", hook=hook.label, pid=hook.proc.pid, restarts=hook.restarts)

    def attached(self, pid: int) -> HookProcess | None:
        """Record that the hook process ``pid`` is attached (its `HookStarted` arrived)."""
        for hook in self.hooks:
            if hook.pid == pid and not hook.attached:
                hook.attached = True
                if hook.restarts:
                    log.info("hook reattached", hook=hook.label, pid=pid, restarts=hook.restarts)
                return hook
        return None

    def all_attached(self) -> bool:
        """Every hook that is still supervised has attached."""
        return all(hook.attached or hook.done for hook in self.hooks)

    def startup_problem(self) -> str | None:
        """Why startup cannot succeed (a hook gave up before attaching), else None."""
        for hook in self.hooks:
            if hook.gave_up and not hook.attached:
                codes = ", ".join(str(c) for c in hook.exit_codes)
                return f"hook {hook.label} exited before attaching to the bus (exit codes {codes})"
        return None

    def waiting_for(self) -> list[str]:
        """Labels of the hooks that have not attached yet."""
        return [hook.label for hook in self.hooks if not (hook.attached or hook.done)]

    # -- supervision ---------------------------------------------------------------

    def poll(self, now: float | None = None) -> None:
        """Reap exited hooks, schedule restarts, start the ones that are due.

        Call it periodically (the launcher does, every ~100 ms).
        """
        now = time.monotonic() if now is None else now
        for hook in self.hooks:
            if hook.done:
                continue
            if hook.proc is not None:
                code = hook.proc.poll()
                if code is None:
                    continue
                self._exited(hook, code, now)
            elif hook.next_start is not None and now >= hook.next_start and not self.run_ended:
                self._start(hook)

    def _exited(self, hook: HookProcess, code: int, now: float) -> None:
        hook.proc = None
        hook.exit_codes.append(code)
        if code == 0 or self.run_ended:
            hook.done = True
            log.debug("hook exited", hook=hook.label, code=code)
            return
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if hook.restarts >= self.max_restarts:
            hook.done = hook.gave_up = True
            log.error(
                "hook crashed too often; continuing without it",
                hook=hook.label,
                status=how,
                restarts=hook.restarts,
            )
            return
        delay = min(self.max_backoff, self.backoff * 2**hook.restarts)
        hook.restarts += 1
        hook.next_start = now + delay
        log.warning(
            "hook crashed; restarting",
            hook=hook.label,
            status=how,
            restart=hook.restarts,
            max_restarts=self.max_restarts,
            in_s=round(delay, 2),
        )

    def mark_run_ended(self) -> None:
        """The run ended: hooks that exit from now on are not restarted."""
        self.run_ended = True

    # -- ending --------------------------------------------------------------------

    def running(self) -> list[HookProcess]:
        """Hooks whose process is alive."""
        return [h for h in self.hooks if h.proc is not None and h.proc.poll() is None]

    def terminate(self, timeout: float = 5.0) -> None:
        """SIGTERM every hook (its whole process group), SIGKILL what is left after ``timeout``."""
        self.mark_run_ended()
        alive = self.running()
        for hook in alive:
            _signal_group(hook, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(h.proc is not None and h.proc.poll() is None for h in alive):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every hook's process group and reap the processes."""
        for hook in self.hooks:
            if hook.proc is None:
                continue
            _signal_group(hook, signal.SIGKILL)
            try:
                hook.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("hook process did not die", hook=hook.label, pid=hook.proc.pid)
                continue
            hook.exit_codes.append(hook.proc.returncode)
            hook.proc = None
            hook.done = True


def _signal_group(hook: HookProcess, sig: int) -> None:
    assert hook.proc is not None
    try:
        # The hook leads its own session, so its pid is its process group id.
        os.killpg(hook.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
