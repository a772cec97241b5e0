"""The torch.distributed.elastic agent process that the launcher starts.

``evtrain launch`` does not spawn stage workers itself: it starts this module
as a child process (``python -m evtrain.launcher.elastic_agent``), which runs
``elastic_launch(LaunchConfig(...), worker_main)(worker_config_json)`` — the
same agent torchrun uses — to rendezvous, spawn the P stage workers, watch
them and restart the group on failure (``max_restarts``).

Why a separate process rather than a thread of the launcher: elastic installs
its SIGTERM/SIGINT handlers only when it runs in the main thread (in another
thread it warns that workers may be orphaned), and its handlers raise
``SignalException`` wherever the main thread happens to be. In a process of
its own it owns its main thread, and the launcher keeps its own main thread
for signals, the progress line and hook supervision. Stopping is then one
signal: the launcher sends SIGTERM to the agent, elastic forwards SIGTERM to
every worker (they finish the current step and end the run cleanly) and
sends SIGKILL after ``shutdown_timeout`` seconds.

The agent reads JSON lines on stdin: optionally a `LauncherCleanup` first
(sent as soon as the launcher has a run directory and a bus), then the
`AgentConfig`. The launcher starts the process early (importing torch takes a
second) and writes the config once the hooks are attached; an empty stdin
makes the agent exit without starting anything.

Worker exits (`AgentReport`, in ``AgentConfig.report_path``): elastic tells
only about the first worker it saw fail, and when two have ended by its next
poll it names the lower rank — often a survivor whose gloo receive failed
because the real culprit was killed. So the agent keeps its own record of
every worker of every attempt: pid, when it died (watched on each process's
sentinel, which is only waited on, never read, so elastic's own bookkeeping
is untouched), its exit status or signal (read in elastic's thread, right
after each of its polls of the workers), and whether the agent killed it.
The record is rewritten whenever one of these changes. The processes come
from ``torch.multiprocessing.start_processes``, the public call elastic
starts its workers with, which `WorkerWatch` wraps in this process (and the
``join`` of the process context it returns). When a worker dies without its
stage report saying it
finished, the survivors get ``failure_grace_s`` to end by themselves (they
usually fail at once on the dead peer's connections), then SIGKILL: elastic
itself would wait 30 s for a survivor stuck in a collective.

When the launcher dies (SIGKILL: nothing of it runs any more), the agent
notices that its stdin ended — the launcher holds the pipe's only write end
and never closes it once the config is sent — sends itself one SIGTERM, so
that elastic stops the workers (SIGTERM, then SIGKILL after
``shutdown_timeout``), then does what the launcher would have done at the
end (`LauncherCleanup`): marks the run record interrupted and removes the
launcher's private ipc directory. Not ``PR_SET_PDEATHSIG``: the launcher is
multi-threaded, and its death delivers that signal once per thread it goes
through, and a second SIGTERM breaks elastic's own shutdown, orphaning the
workers.

Exit status: 0 when every worker returned, 1 when workers failed, 128 + N
when the agent was stopped by signal N. Elastic's own log of each worker
failure, and torch's warning for every process it terminates after one, are
silenced unless ``EVTRAIN_LOG_LEVEL`` is ``debug``: the launcher names the
failure itself (`evtrain.failures`).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from evtrain.launcher.forking import start_fork_server
from evtrain.launcher.run_record import mark_interrupted
from evtrain.stages.entry import worker_main
from evtrain.stages.worker import read_stage_reports

__all__ = [
    "AgentConfig",
    "AgentReport",
    "AttemptReport",
    "LauncherCleanup",
    "WorkerExit",
    "WorkerWatch",
    "main",
    "run_agent",
]

EXIT_FAILED = 1
LAUNCHER_PID_ENV = "EVTRAIN_LAUNCHER_PID"
"""The launcher's pid, so that the agent knows whether it outlived it."""
_FINISHED_STATUSES = ("completed", "stopped")
FORK_SERVER_PRELOAD = ("torch._dynamo", "evtrain.stages.actor")
"""What the fork server imports for the workers (torch._dynamo: every optimizer's
first use imports it, 1-3 s per process)."""


class LauncherCleanup(msgspec.Struct, kw_only=True, tag="cleanup"):
    """What the agent does in the launcher's place if the launcher (its parent) dies first."""

    run_record: str | None = None
    """The run's ``run.json``: marked ``interrupted``."""
    remove_dirs: list[str] = []
    """The launcher's private ipc directory: removed."""


class AgentConfig(msgspec.Struct, kw_only=True, tag="config"):
    """What the agent needs: the worker config plus elastic's LaunchConfig fields."""

    worker_config: str
    """`evtrain.stages.worker.WorkerConfig` JSON, handed unchanged to every worker."""
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_configs: dict[str, Any] = {}
    local_addr: str | None = None
    """This node's address for the rendezvous and, on the node that gets rank 0, the
    workers' store (None: elastic's default, the host name)."""
    run_id: str
    max_restarts: int = 0
    monitor_interval: float = 0.1
    shutdown_timeout: int = 30
    start_method: str = "spawn"
    log_dir: str | None = None
    report_path: str | None = None
    """Where the `AgentReport` goes (None: no report, no early kill of survivors)."""
    stage_reports: str | None = None
    """The workers' `StageReport` directory: tells a finished worker from a dead one."""
    failure_grace_s: float = 1.0
    """Seconds survivors get after a worker died before they are killed."""

    def encode(self) -> str:
        """One JSON line (no newline)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> AgentConfig:
        """Inverse of `encode`."""
        return msgspec.json.decode(text, type=cls)


class WorkerExit(msgspec.Struct, kw_only=True):
    """One worker process of one attempt."""

    rank: int
    pid: int
    died_at: float | None = None
    """Wall-clock time its end was seen (None while it runs)."""
    exit_code: int | None = None
    """Its exit status, negative for a signal; known once elastic joined it."""
    killed_by_agent: bool = False


class AttemptReport(msgspec.Struct, kw_only=True):
    """One start of the worker group (elastic restarts make more)."""

    attempt: int
    started_at: float
    workers: list[WorkerExit]


class AgentReport(msgspec.Struct, kw_only=True):
    """Every worker the agent started, and how each ended."""

    node_rank: int = 0
    attempts: list[AttemptReport] = []
    finished: bool = False
    exit_status: int | None = None

    def write(self, path: str | os.PathLike[str]) -> None:
        """Replace the report at ``path`` atomically."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(msgspec.json.encode(self))
        os.replace(tmp, target)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> AgentReport | None:
        """The report at ``path``; None while there is none (or it cannot be read)."""
        try:
            return msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None


class WorkerWatch:
    """Records every worker process elastic starts and how it ends (module docstring)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.report = AgentReport(node_rank=config.node_rank)
        self._lock = threading.Lock()
        self._contexts: list[tuple[Any, AttemptReport]] = []
        self._threads: list[threading.Thread] = []

    def install(self) -> None:
        """Wrap ``torch.multiprocessing.start_processes`` in this process."""
        import torch.multiprocessing as mp

        original = mp.start_processes

        def start_processes(*args: Any, **kwargs: Any) -> Any:
            context = original(*args, **kwargs)
            self._watch(context, _global_ranks(kwargs["args"], len(context.processes)))
            return context

        mp.start_processes = start_processes

    def _watch(self, context: Any, ranks: list[int]) -> None:
        attempt = AttemptReport(
            attempt=len(self.report.attempts),
            started_at=time.time(),
            workers=[
                WorkerExit(rank=rank, pid=int(p.pid))
                for rank, p in zip(ranks, context.processes, strict=True)
            ],
        )
        with self._lock:
            # Elastic stopped the previous attempt's workers before this one.
            self._record_exit_codes()
            self.report.attempts.append(attempt)
            self._contexts.append((context, attempt))
            self._write()
        join = context.join

        def join_and_record(*args: Any, **kwargs: Any) -> Any:
            # Elastic's own thread, every monitor interval: the one place where
            # reading an exit status cannot take it from under elastic.
            try:
                return join(*args, **kwargs)
            finally:
                with self._lock:
                    if self._record_exit_codes():
                        self._write()

        context.join = join_and_record
        thread = threading.Thread(
            target=self._follow, args=(context.processes, attempt), daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _follow(self, processes: list[Any], attempt: AttemptReport) -> None:
        pending = {p.sentinel: (p, w) for p, w in zip(processes, attempt.workers, strict=True)}
        kill_at: float | None = None
        killed = False
        while pending:
            timeout = None if kill_at is None or killed else max(0.0, kill_at - time.monotonic())
            try:
                ready = multiprocessing.connection.wait(list(pending), timeout=timeout)
            except (OSError, ValueError):  # a sentinel closed under us: elastic is done
                return
            now = time.time()
            failed = False
            with self._lock:
                for sentinel in ready:
                    _, worker = pending.pop(sentinel)
                    worker.died_at = now
                    failed = failed or not self._finished(worker, attempt.attempt)
                if kill_at is not None and not killed and time.monotonic() >= kill_at:
                    killed = True
                    for process, worker in pending.values():
                        try:
                            os.kill(process.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            continue
                        worker.killed_by_agent = True
                self._write()
            if failed and kill_at is None and pending:
                kill_at = time.monotonic() + self.config.failure_grace_s

    def _finished(self, worker: WorkerExit, attempt: int) -> bool:
        """Whether the worker's own report says it ended the run normally."""
        if self.config.stage_reports is None:
            return True  # no way to tell: leave the survivors to elastic
        report = read_stage_reports(self.config.stage_reports, attempt).get(worker.rank)
        return (
            report is not None and report.pid == worker.pid and report.status in _FINISHED_STATUSES
        )

    def _record_exit_codes(self) -> bool:
        """Note the exit status of every worker that has one; whether any was new.

        Only from elastic's own thread: reading an exit status consumes it
        from the process's pipe, which elastic reads too.
        """
        changed = False
        for context, attempt in self._contexts:
            for process, worker in zip(context.processes, attempt.workers, strict=True):
                if worker.exit_code is None and process.exitcode is not None:
                    worker.exit_code = int(process.exitcode)
                    if worker.died_at is None:
                        worker.died_at = time.time()
                    changed = True
        return changed

    def finish(self, exit_status: int) -> None:
        """Record every exit status (elastic has joined the processes) and the agent's own."""
        for thread in self._threads:
            thread.join(timeout=1.0)
        with self._lock:
            self._record_exit_codes()
            self.report.finished = True
            self.report.exit_status = exit_status
            self._write()

    def _write(self) -> None:
        if self.config.report_path is not None:
            try:
                self.report.write(self.config.report_path)
            except OSError:
                pass  # the launcher falls back on elastic's exit status


def _global_ranks(wrapper_args: tuple[Any, ...], count: int) -> list[int]:
    """The global rank of each of the ``count`` workers elastic starts, by local rank.

    Elastic starts them through a wrapper whose arguments are (entrypoint,
    args, envs, ...), envs mapping local rank to the worker's environment. The
    ranks are read there rather than computed from this node's rank: c10d
    picks the order of the nodes itself.
    """
    envs = wrapper_args[2]
    return [int(envs[local]["RANK"]) for local in range(count)]


def run_agent(config: AgentConfig) -> int:
    """Run the worker group under elastic to the end; returns the exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if config.start_method == "forkserver":
        start_fork_server(FORK_SERVER_PRELOAD)  # no-op when main() started it already
    launch_config = LaunchConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        run_id=config.run_id,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_configs=dict(config.rdzv_configs),
        local_addr=config.local_addr,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=config.log_dir),
    )
    watch = WorkerWatch(config)
    watch.install()
    status = 0
    try:
        elastic_launch(launch_config, worker_main)(config.worker_config)
    except ChildFailedError:
        status = EXIT_FAILED
    except SignalException as exc:
        status = 128 + int(exc.sigval)
    watch.finish(status)
    return status


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _launcher_gone(pid: int, wait_s: float) -> bool:
    """Whether the launcher ``pid`` has died (this process was handed to another parent).

    A dying process closes its files (our stdin ends) a moment before its
    children are re-parented: give that moment before concluding it lives.
    """
    deadline = time.monotonic() + wait_s
    while os.getppid() == pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _clean_up_after(cleanup: LauncherCleanup) -> None:
    """What the launcher would have done at the end: mark the record, remove its ipc dir."""
    if cleanup.run_record is not None:
        mark_interrupted(cleanup.run_record, "the launcher was killed")
    for directory in cleanup.remove_dirs:
        shutil.rmtree(directory, ignore_errors=True)


def _stop_when_stdin_ends() -> None:
    """One SIGTERM to this process once stdin ends: the launcher is gone (module docstring)."""

    def watch() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="evtrain-launcher-watch", daemon=True).start()


def _read_cleanup(lines: str) -> LauncherCleanup | None:
    for line in lines.splitlines():
        if line.strip():
            message = msgspec.json.decode(line, type=LauncherCleanup | AgentConfig)
            if isinstance(message, LauncherCleanup):
                return message
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m evtrain.launcher.elastic_agent [START_METHOD]``: read, run, clean up.

    With ``forkserver`` as the start method the fork server starts at once, a
    fork of this process once torch is imported (`evtrain.launcher.forking`).
    """
    args = sys.argv[1:] if argv is None else argv
    launcher = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    # Until elastic installs its own handlers (once workers start), SIGTERM or
    # SIGINT ends this process, after the cleanup a dead launcher left undone.
    signal.signal(signal.SIGINT, _terminated)
    signal.signal(signal.SIGTERM, _terminated)
    cleanup: LauncherCleanup | None = None
    # Ended by elastic: the launcher that waits for us is there, unless a
    # signal (its death sends SIGTERM) or the end of stdin says otherwise.
    status: int | None = None
    try:
        if args and args[0] == "forkserver":
            # lazy: torch is imported once here (or was, in the launcher we are a
            # fork of) and the fork server inherits it.
            import torch

            start_fork_server(FORK_SERVER_PRELOAD)
        # Import torch's launcher while the launcher still starts the hooks.
        import torch.distributed.launcher.api  # noqa: F401

        if os.environ.get("EVTRAIN_LOG_LEVEL", "info") != "debug":
            for name in (
                "torch.distributed.elastic.multiprocessing.api",
                "torch.multiprocessing.spawn",
            ):
                logging.getLogger(name).setLevel(logging.CRITICAL)
        while line := sys.stdin.readline():
            if not line.strip():
                continue
            message = msgspec.json.decode(line, type=LauncherCleanup | AgentConfig)
            if isinstance(message, LauncherCleanup):
                cleanup = message
                continue
            _stop_when_stdin_ends()
            status = run_agent(message)
            return status
        return 0
    finally:
        # The launcher's death also sends SIGTERM: it must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if _launcher_gone(launcher, wait_s=0.0 if status in (0, EXIT_FAILED) else 0.5):
            # A launcher killed while we were still importing torch wrote its
            # message to a pipe we never read: it is there, then end of file.
            cleanup = cleanup or _read_cleanup(sys.stdin.read())
            if cleanup is not None:
                _clean_up_after(cleanup)


if __name__ == "__main__":
    code = main()
    # Every worker is gone and the report written: tearing down an
    # interpreter that imported torch would only delay the launcher by seconds.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
