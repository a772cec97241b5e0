"""The elastic agent's process, seen from the launcher: start it, tell it, end it.

The stage workers are started by torch.distributed.elastic, run by a child
process (`evtrain.launcher.elastic_agent`; that module says why a process and not a
thread). `AgentProcess.start` starts it first thing, idle until it is told
what to run: a fork of the launcher once torch is imported, or a fresh
interpreter whose torch import overlaps the spec loading
(`evtrain.launcher.forking` says when each). It reads two messages on its stdin: a
`evtrain.launcher.elastic_agent.LauncherCleanup` as soon as the launcher has a run
directory and a bus (what to undo should the launcher die), then the
`evtrain.launcher.elastic_agent.AgentConfig` of this node's worker group
(`agent_config`). From then on stdin stays open: its end tells the agent
that the launcher is gone. The agent leads its own session, and its
workers are in its process group, so that a Ctrl-C at the terminal reaches
only the launcher (`evtrain.launcher.stop`).

Several machines: run ``evtrain launch`` on each with the same ``--nnodes``,
``--rdzv-endpoint HOST0:PORT``, ``--run-id`` and ``--bus tcp://HOST0:PORT2``
(addresses of node 0 that every node reaches) and its own ``--node-rank``.
Node 0 binds the bus, runs the hooks (the Prometheus exporter among them)
and hosts the rendezvous store; every node runs P*D/N of the stage workers.
The rendezvous is elastic's ``c10d`` backend, not ``static``: when a worker
on any node fails, its agent opens a new rendezvous round, the agents of the
other nodes see a node waiting and restart their workers too, and with
``--max-restarts`` the whole run resumes from its last commit; the static
backend has no rounds, so the other nodes would wait on the dead peer. The
price: c10d orders the nodes itself (by each agent's address and pid), not
by ``--node-rank``, so which block of consecutive global ranks (stages) a
node runs is the rendezvous's choice. Nothing depends on it: ``--node-rank``
says which node runs the bus, the hooks and the store (``is_host``, set
explicitly: node 0 would not take an address its host name does not resolve
to for its own), the stages find the bus by its address, and the agent reads
the ranks its workers got (`evtrain.launcher.elastic_agent`). Each node takes part as
``--local-addr`` (default: its address on the route to the rendezvous
endpoint, `evtrain.launcher.options.route_address`, since the host name often
resolves to a loopback address), and the node that gets rank 0 serves the
workers' store there. Gloo would bind the interface its host name resolves
to, often a loopback address: each stage names the interface of its route to
the store instead (`evtrain.stages.mesh.pin_socket_interface`), unless
``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) is set. Node r > 0 waits for node
0's broker before it touches the run directory (`evtrain.launcher.bus`).
Checkpoints need a shared run directory (each stage writes its shard there,
node 0's coordinator commits them). A failure that ended the run elsewhere
reaches this node on the bus; its workers, still waiting on the dead peer,
are killed `evtrain.launcher.watch.FAILED_WORKERS_GRACE_S` later.
``tests/integration/test_multinode.py`` runs two nodes as network namespaces joined by a
veth pair.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from evtrain.launcher.bus import curve_env
from evtrain.launcher.elastic_agent import LAUNCHER_PID_ENV, AgentConfig, LauncherCleanup
from evtrain.launcher.elastic_agent import main as agent_main
from evtrain.launcher.forking import ForkedChild, can_fork_here, fork_agent
from evtrain.launcher.options import LaunchOptions
from evtrain.launcher.plan import LaunchPlan
from evtrain.launcher.progress import RunConsole
from evtrain.launcher.run_record import RUN_RECORD
from evtrain.launcher.stop import ELASTIC_SHUTDOWN_S
from evtrain.stages.worker import WorkerConfig

__all__ = [
    "WORKER_FAILURE_GRACE_S",
    "AgentProcess",
    "agent_config",
    "agent_report_path",
    "cleanup_message",
]

log = structlog.get_logger(__name__)

WORKER_FAILURE_GRACE_S = 1.0
"""Seconds the other workers get to end by themselves after one failed (then SIGKILL)."""
_POLL_S = 0.1


class AgentProcess:
    """The running ``python -m evtrain.launcher.elastic_agent`` (module docstring)."""

    def __init__(self, process: subprocess.Popen[bytes] | ForkedChild) -> None:
        self.process = process

    @classmethod
    def start(cls, options: LaunchOptions, console: RunConsole) -> AgentProcess:
        """Start the agent, idle until `send` tells it what to run.

        The ``evtrain`` command forks it once torch is imported, so that the
        agent and its fork server import nothing more (`evtrain.launcher.forking`);
        inside an application it is a fresh interpreter.
        """
        fork = can_fork_here()
        env = dict(os.environ)
        # The stage actor configures its logging from these (stages/actor.py).
        env["EVTRAIN_LOG_FORMAT"] = options.log_format
        env["EVTRAIN_LOG_LEVEL"] = options.log_level
        # With the rendezvous TCPStore shared into the workers (torch's default)
        # a restarted worker group reads the previous attempt's gloo/NCCL
        # addresses from the same store keys and fails to connect
        # (pytorch/pytorch#135712; seen here with --max-restarts). A fresh
        # store per attempt avoids it.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        env.update(console.child_env())
        # The agent learns of our death from the end of its stdin (see
        # evtrain.launcher.elastic_agent), and then tells it from a deliberate close by
        # whether we are still its parent.
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env = curve_env(env, options)
        if fork:
            # lazy: the launcher needs torch for the spec, and torch._dynamo for
            # the split's survey (meta kernels import it); the agent and its
            # fork server inherit both instead of importing them again.
            import torch._dynamo  # noqa: F401

            return cls(
                fork_agent(
                    partial(agent_main, [options.start_method]),
                    env=env,
                    output_fd=console.child_output,
                )
            )
        return cls(
            subprocess.Popen(
                [sys.executable, "-m", "evtrain.launcher.elastic_agent", options.start_method],
                env=env,
                stdin=subprocess.PIPE,
                stdout=console.child_output,
                stderr=console.child_output,
                start_new_session=True,
            )
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self.process.poll()

    def send(self, message: AgentConfig | LauncherCleanup) -> bool:
        """Write one message to its stdin; False when it is gone."""
        import msgspec

        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(msgspec.json.encode(message) + b"\n")
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def close_stdin(self) -> None:
        """End its stdin before it was configured: it exits without starting anything."""
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for it to exit, then kill what is left."""
        with anyio.move_on_after(timeout):
            while self.process.poll() is None:
                await anyio.sleep(_POLL_S)
        self.kill()

    def terminate(self) -> None:
        """SIGTERM to the agent only: elastic forwards it to each worker itself."""
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to its whole process group (the workers are in it), and reap it."""
        try:
            # The agent leads its session; its workers are in its process group.
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            # A fork killed before it made its session has no group yet.
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("the elastic agent did not die", pid=self.process.pid)


def agent_report_path(report_dir: Path, options: LaunchOptions) -> Path:
    """Where this node's agent writes its `evtrain.launcher.elastic_agent.AgentReport`."""
    node = f"-node{options.node_rank}" if options.nnodes > 1 else ""
    return report_dir / f"agent{node}.json"


def cleanup_message(run_dir: Path, *, is_bus_owner: bool, owned_dir: str | None) -> LauncherCleanup:
    """What the agent undoes should the launcher die: the record, our ipc directory."""
    return LauncherCleanup(
        run_record=str(run_dir / RUN_RECORD) if is_bus_owner else None,
        remove_dirs=[owned_dir] if owned_dir is not None else [],
    )


def agent_config(
    options: LaunchOptions,
    plan: LaunchPlan,
    *,
    run_id: str,
    run_dir: Path,
    report_dir: Path,
    bus: str,
) -> AgentConfig:
    """The elastic configuration of this node's worker group."""
    opts, job = options, plan.job
    overrides = {**opts.overrides, **plan.stage_overrides, **plan.purpose.worker_overrides(run_dir)}
    worker = WorkerConfig(
        spec_path=str(Path(opts.spec).expanduser().resolve()),
        overrides=overrides,
        bus=bus,
        run_id=run_id,
        evaluate_only=plan.purpose.evaluates,
        # An evaluation starts no hook, so it never awaits a checkpoint plan.
        await_plan=plan.checkpointing,
        resume=str(plan.resume_path) if plan.resume_path is not None else None,
        load_weights=str(plan.load_weights_path) if plan.load_weights_path else None,
        dump_weights_dir=(
            str(Path(opts.dump_weights).expanduser().resolve()) if opts.dump_weights else None
        ),
        report_dir=str(report_dir),
    )
    rdzv_configs: dict[str, Any] = {}
    if opts.nnodes == 1:
        # As torchrun --standalone: a c10d store on a free loopback port.
        endpoint = "127.0.0.1:0"
    else:
        # c10d rendezvous with node 0 as its host (module docstring): node 0
        # would not recognise an endpoint address that its host name does not
        # resolve to as its own.
        endpoint = opts.rdzv_endpoint or ""
        rdzv_configs["is_host"] = opts.node_rank == 0
    return AgentConfig(
        worker_config=worker.encode(),
        nproc_per_node=job.world_size // opts.nnodes,
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        node_rank=opts.node_rank or 0,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        local_addr=plan.local_addr,
        run_id=run_id,  # --run-id, the same on every node
        max_restarts=opts.max_restarts,
        shutdown_timeout=ELASTIC_SHUTDOWN_S,
        start_method=opts.start_method,
        log_dir=str(run_dir / "elastic"),
        report_path=str(agent_report_path(report_dir, opts)),
        stage_reports=str(report_dir),
        failure_grace_s=WORKER_FAILURE_GRACE_S,
    )
