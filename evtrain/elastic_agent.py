"""The torch.distributed.elastic agent process that the launcher starts.

``evtrain launch`` does not spawn stage workers itself: it starts this module
as a child process (``python -m evtrain.elastic_agent``), which runs
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

The agent reads its `AgentConfig` as one JSON line on stdin. The launcher
starts the process early (importing torch takes a second) and writes the
line once the hooks are attached; an empty stdin (the launcher went away)
makes the agent exit without starting anything.

Exit status: 0 when every worker returned, 1 when workers failed
(elastic's ChildFailedError summary goes to ``failure_file``, or to stderr
without one), 128 + N when the agent was stopped by signal N. Elastic's own
log of each worker failure (a second copy of the traceback the stage
already published on the bus) is silenced unless ``EVTRAIN_LOG_LEVEL`` is
``debug``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["AgentConfig", "main", "run_agent"]

EXIT_FAILED = 1


class AgentConfig(msgspec.Struct, kw_only=True):
    """What the agent needs: the worker config plus elastic's LaunchConfig fields."""

    worker_config: str
    """`evtrain.stages.worker.WorkerConfig` JSON, handed unchanged to every worker."""
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_configs: dict[str, Any] = {}
    run_id: str
    max_restarts: int = 0
    monitor_interval: float = 0.1
    shutdown_timeout: int = 30
    start_method: str = "spawn"
    log_dir: str | None = None
    failure_file: str | None = None
    """Where elastic's failure summary goes (the launcher shows it when no stage
    reported its own failure on the bus, e.g. a worker killed by a signal)."""

    def encode(self) -> str:
        """One JSON line (no newline)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> AgentConfig:
        """Inverse of `encode`."""
        return msgspec.json.decode(text, type=cls)


def run_agent(config: AgentConfig) -> int:
    """Run the worker group under elastic to the end; returns the exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from evtrain.stages.worker import worker_main

    if config.start_method == "forkserver":
        prestart_forkserver()  # no-op when main() started it already
    launch_config = LaunchConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        run_id=config.run_id,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_configs=dict(config.rdzv_configs),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=config.log_dir),
    )
    try:
        elastic_launch(launch_config, worker_main)(config.worker_config)
    except ChildFailedError as exc:
        if config.failure_file:
            Path(config.failure_file).parent.mkdir(parents=True, exist_ok=True)
            Path(config.failure_file).write_text(exc.format_msg() + "\n")
        else:
            sys.stderr.write(exc.format_msg() + "\n")
            sys.stderr.flush()
        return EXIT_FAILED
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def prestart_forkserver() -> None:
    """Start the fork server now, preloading torch and the stage runtime.

    Every worker is then a fork of that server instead of a fresh interpreter
    importing torch (P imports at once on a small machine take seconds). The
    server is single-threaded, so forking it is safe, unlike forking this
    agent. Started before the config arrives, its imports overlap the
    launcher's hook startup.
    """
    import multiprocessing
    import multiprocessing.forkserver

    # torch._dynamo: the first optimizer a worker builds imports it (2-7 s each).
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "evtrain.stages.actor"])
    multiprocessing.forkserver.ensure_running()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m evtrain.elastic_agent [START_METHOD]``: read the config, run.

    With ``forkserver`` as the start method the fork server starts at once.
    """
    args = sys.argv[1:] if argv is None else argv
    # Until elastic installs its own handlers (once workers start), a signal
    # must simply end this process: nothing has been started yet.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if args and args[0] == "forkserver":
        prestart_forkserver()
    # Import torch's launcher while the launcher still starts the hooks.
    import torch.distributed.launcher.api  # noqa: F401

    if os.environ.get("EVTRAIN_LOG_LEVEL", "info") != "debug":
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
            logging.CRITICAL
        )

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    return run_agent(AgentConfig.decode(line))


if __name__ == "__main__":
    sys.exit(main())
