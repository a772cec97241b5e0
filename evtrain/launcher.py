"""The launcher behind ``evtrain launch``: broker, supervised hooks, elastic stage workers.

One `Launcher` runs one job on this node:

1. It loads and validates the spec with its overrides, every hook the spec
   names, and the ``--resume`` / ``--load-weights`` paths (resolved to one
   committed checkpoint or weights file) *before* starting anything, so a
   mistake is one line and exit status 2. It picks a run id, creates the run
   directory and writes ``run.json`` there (`evtrain.run_record`: run id,
   spec, overrides, bus address; completed with the outcome at the end). A
   ``run.json`` left ``running`` by a launcher that is gone is marked
   ``interrupted`` first. A directory that holds a run is never started in
   afresh (`evtrain.run_record` says why): without ``--resume`` or
   ``--overwrite`` that is a usage mistake too. A resume of a run that has
   trained all its ``max_steps`` says so and starts nothing (exit status 0).
2. It starts the broker in threads of its own process (``ipc://`` in a fresh
   private directory by default; ``--bus tcp://HOST:PORT`` for several
   machines) and prints the bus address, so anyone can attach
   ``evtrain hook ... --bus ADDR`` or ``evtrain events --bus ADDR``. With
   ``--external-bus`` it binds nothing: ``--bus`` names a broker that is
   already running (``evtrain bus``, e.g. its own docker-compose service),
   and the launcher waits until it answers.
3. It starts the spec's hooks as supervised processes
   (`evtrain.hook_supervisor`) and waits until each has attached: the
   built-in hooks together in one host process (``priority`` orders them
   there), every other hook, and a built-in whose spec entry says
   ``isolate=True``, in a process of its own.
4. It starts the stage workers through torch.distributed.elastic, run by a
   child process (`evtrain.elastic_agent`; that module says why a process
   and not a thread), and follows the run: progress line (`evtrain.progress`)
   from the bus; the truth about every stage from files that do not depend on
   the bus — each stage's `evtrain.stages.worker.StageReport` and the
   agent's `evtrain.elastic_agent.AgentReport`, in
   ``RUN_DIR/launches/RUN_ID/``.
5. At the end hooks get time to finish (they exit on `RunEnded`), then it
   prints a summary and returns the exit status (below).

Evaluation only (``LaunchOptions.evaluate``: ``evtrain eval``,
`evtrain.api.evaluate`): the same broker and stage workers, no hook; the
stages load the committed checkpoint and evaluate once at its step
(`evtrain.stages.actor`), and the launcher prints the last stage's metrics
from its report and writes them as JSON. Its own files go to
``evals/RUN_ID`` in the checkpoint's run directory, never among that run's
checkpoints and logs.

Exit status: 0 when the run completed or was stopped cleanly (by a hook's
stop command, or by SIGTERM/Ctrl-C when the stages ended the run at a step
boundary); 1 when a stage failed; 2 for a usage mistake (nothing started);
3 when the training completed or stopped cleanly but the bus was lost on the
way (below); 128 + N when signal N arrived before the stages could stop
cleanly.

Failures: the first stage that failed is the root cause, not the first one
that said so (`evtrain.failures`): the others usually fail on its closed
connections moments later, and a stage killed by a signal says nothing at
all. The launcher prints it once (``evtrain launch: error: stage 1 was
killed by SIGKILL after step 62``, or the exception with the user's
``FILE:LINE``), then one line per consequence, and writes everything, full
tracebacks included, to ``RUN_DIR/launches/RUN_ID/failure.txt``. It
publishes ``RunEnded(status="failed")`` with ``root_cause`` itself, as soon
as the cause is known; the agent kills survivors that do not end within a
second, and hooks get a second to finish, so a failed launch ends a few
seconds after the failure. With ``--max-restarts`` a failure before the
last restart is a warning naming its root cause, and elastic restarts the
workers.

The broker and its death: by default the broker runs inside the launcher.
It cannot be crashed by what clients send it (`evtrain.bus.broker`), so it
lives exactly as long as the launcher. With ``--external-bus`` it is another
process, which may die on its own; the launcher does not depend on it for
anything but events. Training goes on, the stage reports keep the launcher
informed, and when no event arrived for a few seconds and the broker does
not answer, the launcher warns that the bus was lost at step N. At the end
the summary and ``run.json`` say so with the consequence (hooks saw nothing
after step N; checkpoints after it were not committed), and the exit
status is 3 instead of 0: the weights trained after step N exist only in
the stages that are gone. A broker that comes back (a restarted compose
service) is used again; the loss is still reported.

Signals: the agent and every hook run in their own session, so a Ctrl-C at
the terminal reaches only the launcher, which orders the shutdown in phases
(see `Launcher._escalate`): the first SIGINT/SIGTERM publishes a `StopRun`
command, so every stage ends the run at the same step boundary and returns
normally (``RunEnded(status="stopped")``, exit status 0); if the workers have
not ended after ``grace_s``, or on a second signal, the agent gets SIGTERM
and elastic sends SIGTERM to each worker, then SIGKILL after
``ELASTIC_SHUTDOWN_S``; after that, or on a third signal, the agent's whole
process group (the workers are in it) gets SIGKILL. If the launcher itself
is killed, the hooks receive SIGTERM (``PR_SET_PDEATHSIG``) and the agent
sees its stdin end: it stops the workers the same way, marks ``run.json``
interrupted and removes the launcher's ipc directory.

CURVE (``--curve-dir DIR``, `evtrain.bus.security`): the broker and its
state service admit only the client keys in ``DIR/authorized``, and every
process of the run connects with DIR's client keys: the launcher's own
clients, and the stage workers and the hooks through ``$EVTRAIN_CURVE_DIR``,
which the launcher sets for every process it starts (and removes on a launch
without CURVE, where an inherited one would make them attempt handshakes that
the broker never answers). The launch that runs the broker creates the keys
when DIR is missing; node r > 0 and ``--external-bus`` need that broker's
directory, copied (``client.key``, ``client.key_secret``, ``server.key``).
ipc buses take it as well: their private directory already keeps other users
out, CURVE adds encryption and keys for what shares the machine.

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
the ranks its workers got (`evtrain.elastic_agent`). Each node takes part as
``--local-addr`` (default: its address on the route to the rendezvous
endpoint, since the host name often resolves to a loopback address), and the
node that gets rank 0 serves the workers' store there. Gloo picks its own
interface from the host name: where that resolves to a loopback address, set
``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME`` for NCCL) on each node. Node
r > 0 waits for node 0's broker before it touches the run directory: node 0
binds it only after taking the directory over, which a shared file system
makes one directory for all nodes. Checkpoints need such a shared run
directory (each stage writes its shard there, node 0's coordinator commits
them). A failure that ended the run elsewhere reaches this node on the bus;
its workers, still waiting on the dead peer, are killed
`FAILED_WORKERS_GRACE_S` later. ``tests/test_multinode.py`` runs two nodes as
network namespaces joined by a veth pair.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import anyio
import anyio.to_thread
import structlog

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import (
    CURVE_DIR_ENV,
    CurveConfig,
    CurveServer,
    ensure_curve_dir,
    load_client,
    load_server,
)
from evtrain.bus.subscriber import Subscriber
from evtrain.elastic_agent import (
    LAUNCHER_PID_ENV,
    AgentConfig,
    AgentReport,
    AttemptReport,
    LauncherCleanup,
)
from evtrain.errors import SpecError, UsageError
from evtrain.events import (
    CommandAcked,
    EvalEnded,
    EvalProgress,
    EvalStarted,
    Heartbeat,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
    StopRun,
)
from evtrain.failures import (
    Failure,
    RootCause,
    failure_from_exit,
    find_root_cause,
    is_communication_error,
)
from evtrain.hook_supervisor import HookSupervisor
from evtrain.progress import RunConsole
from evtrain.run_record import (
    EVALS_DIR,
    RUN_RECORD,
    clear_run,
    describe_run,
    mark_if_stale,
    process_start_ticks,
    read_run_record,
    rewind_metrics,
    used_by,
    write_run_record,
)
from evtrain.stages.worker import StageReport, read_stage_reports

if TYPE_CHECKING:
    from evtrain.api import JobPayload
    from evtrain.stages.partition import SplitPlan

__all__ = ["LaunchOptions", "Launcher", "new_run_id", "route_address"]

log = structlog.get_logger("evtrain.launcher")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BUS_LOST = 3
LAUNCHER_SOURCE = "launcher"
_TOPICS = (
    RunStarted.topic.decode(),
    RunEnded.topic.decode(),
    StepEnded.topic.decode(),
    EvalStarted.topic.decode(),
    EvalProgress.topic.decode(),
    EvalEnded.topic.decode(),
    StageFailed.topic.decode(),
    HookStarted.topic.decode(),
    CommandAcked.topic.decode(),
    Heartbeat.topic.decode(),
)
_POLL_S = 0.1
_STOP_RETRY_S = 1.0
ELASTIC_SHUTDOWN_S = 5
"""Seconds elastic gives workers between its SIGTERM and SIGKILL (second stop phase)."""
_KILL_AFTER_S = ELASTIC_SHUTDOWN_S + 10
WORKER_FAILURE_GRACE_S = 1.0
"""Seconds the other workers get to end by themselves after one failed (then SIGKILL)."""
FAILURE_SETTLE_S = 1.5
"""Seconds after the first sign of a failure by which the root cause is published anyway."""
FAILED_HOOK_GRACE_S = 1.0
"""Seconds hooks get after a failed run's `RunEnded` before they are terminated."""
FAILED_WORKERS_GRACE_S = 5.0
"""Seconds this node's workers get to end after the run failed before they are killed."""
BUS_QUIET_S = 3.0
"""No event for this long while stages run (they send heartbeats every second): ask the broker."""
_BUS_PING_TIMEOUT_S = 2.0
_SUBSCRIBE_TIMEOUT_S = 10.0
_FINISHED = ("completed", "stopped")
RESUME_LATEST = "latest"
"""``--resume`` without a path: the run directory's latest committed checkpoint (it must exist)."""
RESUME_AUTO = "auto"
"""``--resume auto``: the latest committed checkpoint if there is one, else step 0 — one
command for the first start and every restart."""
EVAL_FILE = "eval.json"


def _number(value: float | None) -> str:
    return "nan" if value is None else f"{value:.6g}"


def _check_monitored_metric(job: Any, hook: Any) -> None:
    """A hook that watches an eval metric by a name that named eval sets never report.

    With named sets every name carries its set's prefix: ``accuracy`` would
    never arrive (a checkpoint hook would save no best checkpoint, early
    stopping would never stop), so it is a mistake in the spec.
    """
    from evtrain.hooks.checkpoint import CheckpointHook
    from evtrain.hooks.early_stopping import EarlyStopping

    if isinstance(hook, CheckpointHook):
        option, name = "best_metric", hook.best_metric
    elif isinstance(hook, EarlyStopping):
        option, name = "metric", hook.metric
    else:
        return
    sets = [s for s in job.eval_sets if s]
    if name is None or not sets or name not in ("loss", *job.metrics):
        return
    choices = " or ".join(repr(f"{s}/{name}") for s in sets)
    raise SpecError(
        "hooks",
        f"hook {hook.hook_name()}: {option} {name!r} is reported per eval set; name {choices}",
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def new_run_id() -> str:
    """A sortable, unique run id: ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def route_address(endpoint: str) -> str:
    """This machine's address on the route to ``endpoint`` (``HOST:PORT``); `UsageError`.

    The address the rendezvous host sees us by, unlike the host name, which
    often resolves to a loopback address (Debian's 127.0.1.1) that other
    machines cannot reach. Connecting a UDP socket sends nothing; it only
    makes the kernel pick the route.
    """
    host, sep, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise UsageError(f"--rdzv-endpoint {endpoint}: no route to it: {exc}") from None


def _world(job: Any) -> str:
    """``2 stages`` or ``2 stages x 2 replicas``: the processes of a run."""
    stages = f"{job.stages} stage{'s' if job.stages != 1 else ''}"
    if job.data_parallel == 1:
        return stages
    return f"{stages} x {job.data_parallel} replicas"


@dataclass(kw_only=True)
class LaunchOptions:
    """Everything ``evtrain launch`` was asked to do (the CLI fills it in)."""

    spec: str
    """Path of the job spec file (with `job`: where the workers rebuild that Job from)."""
    job: Any = None
    """A `evtrain.job.Job` to check before anything starts instead of loading ``spec``
    (`evtrain.api` writes ``spec`` so that the workers rebuild the same Job)."""
    overrides: dict[str, str] = field(default_factory=dict)
    """Override strings (`evtrain.spec.apply_overrides`), passed on to every worker."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure."""
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    """Rendezvous ``HOST:PORT`` on node 0 (required with ``nnodes > 1``)."""
    local_addr: str | None = None
    """This node's address as the others reach it (``nnodes > 1``); default: the local
    address of the route to ``rdzv_endpoint`` (`route_address`)."""
    bus: str | None = None
    """Bus address to bind (node 0) or join (other nodes); default: a private ipc dir."""
    external_bus: bool = False
    """``bus`` is a broker someone else runs (``evtrain bus``): connect, never bind."""
    curve_dir: str | None = None
    """CURVE key directory (`evtrain.bus.security`): the broker admits only its authorized
    keys and every process of the run connects with its client keys. The bus owner
    creates it when missing; other nodes and an external bus need it to exist."""
    bus_wait_s: float = 30.0
    """With ``external_bus``: seconds to wait for that broker to answer."""
    hooks: bool = True
    """Start the spec's hooks (``--no-hooks``: don't)."""
    hook_restarts: int = 5
    """Restarts of one crashing hook before the launcher gives up on it."""
    resume: str | None = None
    """Checkpoint to resume: a path; ``"latest"``: the run directory's latest committed
    one; ``"auto"``: that one if there is one, else start at step 0 (`RESUME_AUTO`)."""
    overwrite: bool = False
    """Start over in a run directory that holds a run (`evtrain.run_record.clear_run`)."""
    evaluate: str | None = None
    """Evaluate this checkpoint (or a run directory's latest committed one) once instead
    of training."""
    eval_dir: str | None = None
    """With ``evaluate``: the evaluation run's own directory (default ``evals/RUN_ID`` in
    the checkpoint's run directory, `evtrain.run_record.EVALS_DIR`)."""
    eval_output: str | None = None
    """With ``evaluate``: the JSON file of the result (default ``EVAL_DIR/eval.json``)."""
    load_weights: str | None = None
    dump_weights: str | None = None
    """Directory where every stage writes its final parameters (testing/export aid)."""
    run_id: str | None = None
    quiet: bool = False
    grace_s: float = 30.0
    """Seconds the workers get to end the run after the stop command, before signals."""
    hook_attach_timeout: float = 60.0
    hook_finish_timeout: float = 10.0
    start_method: str = "forkserver"
    """How elastic starts workers: ``forkserver`` (default: forks of one process that
    imported torch once), ``spawn`` (a fresh interpreter each) or ``fork``."""
    log_format: str = "console"
    """Log format of every process started (hooks: ``--log-format``, workers: env)."""
    log_level: str = "info"
    handle_signals: bool = True
    """Take SIGINT/SIGTERM (main thread only); without, `Launcher.request_stop` stops."""


@dataclass
class BusLoss:
    """When the bus stopped answering, and whether it came back."""

    step: int
    at: float
    back_at_step: int | None = None


class Launcher:
    """Runs one job on this node; see the module docstring. Use `run` (once)."""

    def __init__(
        self, options: LaunchOptions, *, out: TextIO | None = None, err: TextIO | None = None
    ) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.job: Any = None
        self.run_id = options.run_id or new_run_id()
        self.run_dir: Path | None = None
        self.address: BusAddress | None = None
        # An evaluation prints its result itself, from the last stage's own numbers;
        # its console shows only how far the evaluation got.
        self.console = RunConsole(
            self.out, self.err, quiet=options.quiet, eval_lines=options.evaluate is None
        )
        self.progress = self.console.progress
        self.resume_path: Path | None = None
        """The committed checkpoint ``--resume`` resolved to (before anything started)."""
        self.start_step = 0
        """The step the run continues after (that checkpoint's; 0 for a fresh start)."""
        self.load_weights_path: Path | None = None
        self.warnings: list[str] = []
        self.split: SplitPlan | None = None
        self.curve: CurveConfig | None = None
        """The client keys of every connection to the bus (``curve_dir``), else None."""
        self._curve_server: CurveServer | None = None
        self._local_addr: str | None = None
        # Overrides the launcher adds for the stages (a resolved balance).
        self.stage_overrides: dict[str, str] = {}
        self.evaluation: dict[str, Any] | None = None
        """An evaluation's result (``evaluate``), as written to its JSON file."""
        self._job_payload: JobPayload | None = None
        """Problems found while preparing that do not stop the launch (printed with the header)."""
        self._checkpointing = False
        self._broker: Broker | None = None
        self._owns_ipc_dir = False
        self._agent: subprocess.Popen[bytes] | None = None
        self._supervisor: HookSupervisor | None = None
        self._ended: RunEnded | None = None
        self._ended_event: anyio.Event | None = None
        self._stop_signal: int | None = None
        self._stop_phase = 0
        self._phase_deadline: float | None = None
        self._stop_id = secrets.token_hex(8)
        self._stop_requests: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._stop_acks: set[int] = set()
        self._stop_sent_at = 0.0
        self._publisher: Publisher | None = None
        self._command_publisher: Publisher | None = None
        self._config_sent = False
        self._started = time.monotonic()
        self._started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())
        self._previous_run: dict[str, Any] | None = None
        self._agent_report: AgentReport | None = None
        self._stage_reports: dict[int, StageReport] = {}
        """The current attempt's reports, by global rank."""
        self._failure_seen_at: float | None = None
        self._run_end_published: RunEnded | None = None
        self._run_end_published_at = 0.0
        self._announced_attempts: set[int] = set()
        self._root: RootCause | None = None
        self._told_root: RootCause | None = None
        self._last_bus_event = time.monotonic()
        self._bus_loss: BusLoss | None = None

    # ------------------------------------------------------------------ checks

    @property
    def is_bus_owner(self) -> bool:
        """Whether this node binds the bus and runs the hooks (node 0)."""
        return self.options.nnodes == 1 or self.options.node_rank == 0

    @property
    def _starts_hooks(self) -> bool:
        # An evaluation starts none: the spec's checkpoint hook would plan saves and
        # its log writers would write into the training run's files.
        opts = self.options
        return opts.hooks and self.is_bus_owner and opts.evaluate is None

    @property
    def report_dir(self) -> Path:
        """Where this launch's stage and agent reports (and ``failure.txt``) go."""
        assert self.run_dir is not None
        return self.run_dir / "launches" / self.run_id

    def prepare(self) -> None:
        """Load and validate everything; raise `UsageError` before anything starts."""
        from evtrain.hooks.checkpoint import CheckpointHook
        from evtrain.hooks.loader import build_hook_from_spec
        from evtrain.spec import apply_overrides, load_job

        opts = self.options
        if opts.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
        if opts.hook_restarts < 0:
            raise UsageError(f"--hook-restarts must be >= 0, got {opts.hook_restarts}")
        if opts.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1, got {opts.nnodes}")
        if opts.node_rank is not None and not 0 <= opts.node_rank < opts.nnodes:
            raise UsageError(f"--node-rank must be in 0..{opts.nnodes - 1}, got {opts.node_rank}")
        if opts.nnodes > 1:
            if opts.node_rank is None:
                raise UsageError("--nnodes > 1 needs --node-rank (0 on the node that runs the bus)")
            if not opts.run_id:
                raise UsageError("--nnodes > 1 needs the same --run-id on every node")
            if not opts.rdzv_endpoint:
                raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
            if not opts.bus or not opts.bus.startswith("tcp://"):
                raise UsageError(
                    "--nnodes > 1 needs --bus tcp://HOST:PORT on node 0 that every node reaches"
                )
            self._local_addr = opts.local_addr or route_address(opts.rdzv_endpoint)
        elif opts.local_addr is not None:
            raise UsageError("--local-addr is for --nnodes > 1")
        if opts.external_bus and not opts.bus:
            raise UsageError("--external-bus needs --bus ADDRESS of a running `evtrain bus`")
        if not opts.bus_wait_s > 0:
            raise UsageError(f"--connect-timeout must be positive, got {opts.bus_wait_s:g}")
        if opts.start_method not in ("spawn", "forkserver", "fork"):
            raise UsageError(f"unknown start method {opts.start_method!r}")
        if opts.overwrite and opts.resume is not None:
            raise UsageError("--overwrite starts the run over: it cannot --resume it as well")
        if opts.evaluate is not None and (opts.resume or opts.load_weights or opts.overwrite):
            raise UsageError(
                "an evaluation loads its checkpoint only: no --resume, --load-weights or "
                "--overwrite"
            )
        if opts.job is not None:
            from evtrain.api import JobPayload

            self._job_payload = JobPayload.of(opts.job)
        job = apply_overrides(
            opts.job if opts.job is not None else load_job(opts.spec), opts.overrides
        )
        if opts.evaluate is not None and job.eval_data is None:
            raise UsageError(f"job {job.name} has no eval_data to evaluate a checkpoint on")
        if job.world_size % opts.nnodes:
            what = _world(job)
            if job.data_parallel > 1:
                what = f"{job.world_size} processes ({what})"
            raise UsageError(f"{what} do not split evenly over --nnodes {opts.nnodes}")
        if job.device == "cuda":
            # SpecError when this node has fewer GPUs than workers (one per local rank).
            job.stage_device(job.world_size // opts.nnodes - 1)
        from evtrain.stages.partition import plan_split

        self.split = plan_split(job)  # SpecError for a model the stages could not run
        if job.balance == "compute":
            # The stages take the estimate's split instead of each repeating it.
            self.stage_overrides["balance"] = ",".join(map(str, self.split.sizes))
        if self._starts_hooks:
            for spec in job.hook_specs:
                hook = build_hook_from_spec(spec)  # UsageError naming the hook and option
                self._checkpointing = self._checkpointing or isinstance(hook, CheckpointHook)
                _check_monitored_metric(job, hook)
        self._resolve_paths(job)
        self.address = BusAddress.parse(opts.bus) if opts.bus else None
        self._load_keys()
        self.job = job

    def _load_keys(self) -> None:
        """The CURVE keys of ``curve_dir``, created (0700) where this launch runs the broker.

        Anywhere else (node r > 0, an external broker) the keys must be that
        broker's: fresh ones would never be admitted.
        """
        directory = self.options.curve_dir
        if directory is None:
            return
        if self.is_bus_owner and not self.options.external_bus:
            self._curve_server = load_server(ensure_curve_dir(directory))
        elif not Path(directory).expanduser().is_dir():
            owner = "node 0" if not self.is_bus_owner else "the broker"
            raise UsageError(
                f"curve directory {directory} does not exist: copy {owner}'s there "
                "(client.key, client.key_secret, server.key; chmod 700)"
            )
        self.curve = load_client(directory)

    def _resolve_paths(self, job: Any) -> None:
        """``--resume``, ``--load-weights`` and the checkpoint to evaluate to what the
        stages will load, or `UsageError`."""
        from evtrain.checkpoint import (
            CheckpointError,
            find_resume,
            list_checkpoints,
            read_manifest,
        )

        opts = self.options
        target: str | Path | None = opts.resume
        flag = "--resume"
        if opts.resume == RESUME_AUTO:
            run_dir = Path(job.run_dir).expanduser()
            # Only a run directory without any committed (or damaged) checkpoint
            # starts at step 0; a damaged one is the user's to decide about.
            found = run_dir.is_dir() and any(
                info.committed or info.corrupt for info in list_checkpoints(run_dir)
            )
            target = run_dir if found else None
        elif opts.resume == RESUME_LATEST:
            target = job.run_dir
            if not Path(target).expanduser().is_dir():
                raise UsageError(
                    f"--resume: the run directory {target} does not exist: no checkpoint to resume"
                )
        if opts.evaluate is not None:
            target, flag = opts.evaluate, "--checkpoint"
        if target is not None:
            try:
                choice = find_resume(target)
                self.start_step = read_manifest(choice.path).step
            except CheckpointError as exc:
                raise UsageError(f"{flag}: {exc}") from None
            self.resume_path = choice.path.expanduser().resolve()
            self.warnings += choice.warnings()
        if opts.load_weights is not None:
            path = Path(opts.load_weights).expanduser().resolve()
            if path.is_dir() and (path / "model.safetensors").is_file():
                path = path / "model.safetensors"  # a save_pretrained directory
            if path.is_file() and path.suffix == ".safetensors":
                self.load_weights_path = path
            elif path.is_file():
                raise UsageError(
                    f"--load-weights: {path} is neither a .safetensors file nor a checkpoint"
                )
            else:
                try:
                    choice = find_resume(path)
                except CheckpointError as exc:
                    raise UsageError(f"--load-weights: {exc}") from None
                self.load_weights_path = choice.path
                self.warnings += choice.warnings()

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Launch the job and follow it to the end; returns the exit status."""
        # Until the event loop takes over the signals, SIGTERM unwinds through
        # the cleanup below instead of killing this process on the spot.
        previous = (
            signal.signal(signal.SIGTERM, _exit_on_signal) if self.options.handle_signals else None
        )
        # The agent process starts first, idle until it is told what to run:
        # its torch import (and the fork server's) overlaps ours and the spec
        # loading. If validation fails it is killed before it did anything.
        self._agent = self._start_agent()
        try:
            self.prepare()
            if self.options.external_bus or not self.is_bus_owner:
                # Before anything is created or started. Node r > 0 waits for node 0's
                # broker, which node 0 binds only after it has taken over the run
                # directory: on a shared file system ours would be in it before.
                self._wait_for_broker()
            job = self.job
            self.run_dir = self._own_dir(job).expanduser().resolve()
            if self._trained_already():
                return EXIT_OK
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.is_bus_owner:
                self._take_over_run_dir()
            self.report_dir.mkdir(parents=True, exist_ok=True)
            if self._job_payload is not None:
                from evtrain.api import write_job_spec

                # The workers load a spec by path: this one rebuilds the given Job.
                spec = write_job_spec(self._job_payload, self.report_dir / "job")
                self.options.spec = str(spec)
            if self.is_bus_owner and not self.options.external_bus:
                if self.address is None:
                    self.address = BusAddress.new_ipc()
                    self._owns_ipc_dir = True
                # Before anything it would have to undo exists: should we die
                # from here on, the agent removes the directory and marks the record.
                self._send_agent(self._cleanup_message())
                self._broker = Broker(self.address, curve=self._curve_server)
                self._broker.start()
            else:
                self._send_agent(self._cleanup_message())
            assert self.address is not None
            self._write_run_json(status="running")
            self._print_header()
            status = anyio.run(self._main)
            self._write_run_json(status=self._final_status(status), exit_status=status)
            return status
        finally:
            self._cleanup()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _own_dir(self, job: Any) -> Path:
        """The directory this launch writes to: the run's, or an evaluation's own."""
        from evtrain.checkpoint import CHECKPOINTS_DIR

        opts = self.options
        if opts.evaluate is None:
            return Path(job.run_dir)
        if opts.eval_dir is not None:
            return Path(opts.eval_dir)
        assert self.resume_path is not None
        checkpoints = self.resume_path.parent
        run_dir = checkpoints.parent if checkpoints.name == CHECKPOINTS_DIR else Path(job.run_dir)
        # Beside the checkpoint's run, away from its checkpoints and logs.
        return run_dir / EVALS_DIR / self.run_id

    def _trained_already(self) -> bool:
        """Whether this resumes a run that trained all its steps (then it says so)."""
        job = self.job
        if (
            self.options.evaluate is not None
            or self.resume_path is None
            or job.epochs is not None  # how many steps those are, the stages find out
            or self.start_step < job.max_steps
        ):
            return False
        self._say(
            f"evtrain launch: the run in {self.run_dir} has trained its {job.max_steps} steps "
            f"({self.resume_path.name}): nothing left to train"
        )
        return True

    def _take_over_run_dir(self) -> None:
        """Refuse a run directory in use or holding another run; continue or clear it.

        A record its dead launcher left ``running`` is marked interrupted first.
        A directory that holds a run (`evtrain.run_record.used_by`) is refused
        unless the launch resumes that run (its metrics log is rewound to the
        resumed step) or starts it over (``--overwrite``: the run's files go).
        """
        assert self.run_dir is not None
        opts = self.options
        stale = mark_if_stale(self.run_dir)
        previous = stale or read_run_record(self.run_dir)
        if previous is not None and previous.get("status") == "running":
            raise UsageError(
                f"run directory {self.run_dir} is in use by run {previous.get('run_id')} "
                f"(launcher pid {previous.get('launcher_pid')})"
            )
        used = used_by(self.run_dir)
        if used and opts.evaluate is not None:
            raise UsageError(f"--eval-dir {self.run_dir} holds {describe_run(self.run_dir)}")
        if used and opts.resume is None and not opts.overwrite:
            raise UsageError(
                f"run directory {self.run_dir} holds {describe_run(self.run_dir)}: "
                f"--resume {RESUME_AUTO} continues it, --overwrite starts it over, "
                "--run-dir DIR starts a new run elsewhere"
            )
        if stale is not None:
            self._warn(
                f"the previous run {stale.get('run_id')} in {self.run_dir} was interrupted "
                f"(its launcher, pid {stale.get('launcher_pid')}, is gone); marked interrupted"
            )
        if used and opts.overwrite:
            clear_run(self.run_dir)
            log.info("run directory cleared", run_dir=str(self.run_dir), removed=used)
            return
        if used:
            # The same run goes on: the steps after the resumed one are trained again.
            dropped = rewind_metrics(self.run_dir, self.start_step)
            if dropped:
                log.info("metrics log rewound", to_step=self.start_step, lines_dropped=dropped)
        if previous is not None:
            self._previous_run = {
                key: previous.get(key) for key in ("run_id", "status", "steps", "exit_status")
            }

    def _wait_for_broker(self) -> None:
        """Block until the external (or node 0's) broker answers; `UsageError` after
        ``bus_wait_s``."""
        from evtrain.bus.state_service import ping_broker

        assert self.address is not None
        # One request: ZeroMQ keeps reconnecting until the broker is up, so a
        # broker that starts a little later (compose, node 0) still answers in time.
        if ping_broker(self.address, self.options.bus_wait_s, curve=self.curve):
            return
        wait = f"{self.options.bus_wait_s:g} s"
        if self.options.external_bus:
            hint = "is `evtrain bus --bus ...` running there"
        else:
            hint = "is the launch of node 0 running"
        if self.curve is not None:
            hint += ", and does its curve directory authorize our client key"
        flag = "--external-bus" if self.options.external_bus else f"node {self.options.node_rank}"
        raise UsageError(
            f"{flag}: no evtrain broker answered at {self.address} within {wait} ({hint}?)"
        )

    def _print_header(self) -> None:
        job, address = self.job, self.address
        steps = f"{job.max_steps} steps" if job.max_steps is not None else f"{job.epochs} epochs"
        chunks = f" x {job.virtual_stages} chunks" if job.virtual_stages > 1 else ""
        if self.options.evaluate is not None:
            steps = "evaluation only"
        self._say(
            f"evtrain launch: run {self.run_id} | {job.name} | {_world(job)} "
            f"({job.schedule}{chunks}, {job.num_microbatches} microbatches) | {steps}"
        )
        if job.num_chunks > 1 and self.split is not None:
            self._say(f"  split: {self.split.describe()}")
        attach = f"evtrain hook MODULE:CLASS --bus {address}"
        secured = ""
        if self.options.curve_dir is not None:
            attach += f" --curve-dir {self._curve_dir()}"
            secured = " with CURVE"
        self._say(f"  bus: {address}{secured}  (attach: {attach})")
        self._say(f"  run dir: {self.run_dir}")
        if self.options.evaluate is not None:
            self._say(f"  evaluate: {self.resume_path} (step {self.start_step}), no training")
        elif self.resume_path is not None:
            self._say(f"  resume: {self.resume_path}")
        elif self.options.resume == RESUME_AUTO:
            self._say("  resume: no committed checkpoint yet, starting at step 0")
        for note in self.warnings:
            self._warn(note)
        self.console.start()

    def _say(self, text: str) -> None:
        self.console.say(text)

    def _warn(self, text: str) -> None:
        self.console.warn(text)

    async def _main(self) -> int:
        self._ended_event = anyio.Event()
        assert self.address is not None
        subscriber = Subscriber(self.address.endpoint("events_out"), _TOPICS, curve=self.curve)
        self._publisher = Publisher(
            self.address.endpoint("events_in"),
            source=LAUNCHER_SOURCE,
            run_id=self.run_id,
            connect_timeout=self.options.bus_wait_s,
            curve=self.curve,
        )
        signals: AbstractContextManager[AsyncIterator[int]] = (
            anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
            if self.options.handle_signals
            else nullcontext(self._requested_stops())
        )
        with subscriber, signals as received:
            # Before any hook starts, so that no hook's HookStarted is missed.
            await self._prove_subscription(subscriber)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_signals, received)
                if self.options.handle_signals:
                    tg.start_soon(self._watch_signals, self._requested_stops())
                tg.start_soon(self._read_bus, subscriber)
                tg.start_soon(self._watch_bus)
                try:
                    status = await self._drive()
                finally:
                    tg.cancel_scope.cancel()
        return status

    async def _prove_subscription(self, subscriber: Subscriber) -> None:
        """Wait until our own heartbeat comes back: from then on we see what hooks publish.

        A hook stops announcing itself once *its* subscription works, which
        says nothing about ours: a subscription still on its way to the broker
        would miss the announcement for good.
        """
        assert self._publisher is not None
        deadline = time.monotonic() + _SUBSCRIBE_TIMEOUT_S
        while time.monotonic() < deadline:
            self._publisher.publish(Heartbeat(state="starting"))
            for msg in await subscriber.receive(timeout=0.05):
                if isinstance(msg, Heartbeat) and msg.source == LAUNCHER_SOURCE:
                    return
                self._on_event(msg)
        raise UsageError(f"the bus at {self.address} does not deliver our own events")

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Act as if ``signum`` had arrived (callable from any thread; see `_escalate`).

        What a caller that keeps the signals to itself (``handle_signals`` off:
        `evtrain.api` in a thread) uses to pass on a Ctrl-C.
        """
        self._stop_requests.put(int(signum))

    async def _requested_stops(self) -> AsyncIterator[int]:
        while True:
            try:
                yield self._stop_requests.get_nowait()
            except queue.Empty:
                await anyio.sleep(_POLL_S)

    async def _watch_signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if self._stop_signal is None:
                self._stop_signal = int(signum)
            log.warning(
                "signal received", signal=signal.Signals(signum).name, phase=self._stop_phase + 1
            )
            self._escalate()

    def _escalate(self) -> None:
        """Move to the next stop phase (a signal arrived, or the current phase timed out).

        1. a `StopRun` command on the bus: every stage stops at the same step
           boundary and returns normally, so elastic sees success;
        2. SIGTERM to the agent: elastic sends SIGTERM to every worker (which
           also stop at a step boundary if they can) and SIGKILL after
           ``ELASTIC_SHUTDOWN_S``;
        3. SIGKILL to the agent's whole process group.

        Why not begin with 2: after a worker returns, elastic's worker wrapper
        waits for the agent to collect its result, which an agent that was
        signalled never does, so every clean stop would last the whole
        shutdown timeout and end with SIGKILL. With the bus lost, though, no
        command reaches the stages: then 2 comes first.
        """
        self._stop_phase += 1
        now = time.monotonic()
        if self._stop_phase == 1 and not self._config_sent:
            self._stop_phase = 3  # no workers yet: nothing to stop gently
        elif self._stop_phase == 1 and self._bus_down():
            self._stop_phase = 2
        if self._stop_phase == 1:
            log.warning("stopping the run at the next step boundary")
            self._phase_deadline = now + self.options.grace_s
            self._send_stop()
        elif self._stop_phase == 2:
            log.warning("escalating: elastic terminates the workers")
            self._phase_deadline = now + _KILL_AFTER_S
            self._term_agent()
        else:
            log.warning("killing every process of the run")
            self._phase_deadline = None
            self._kill_agent()

    def _send_stop(self) -> None:
        """(Re)publish the launcher's `StopRun`; stages apply one id once."""
        assert self.address is not None
        if self._command_publisher is None:
            try:
                self._command_publisher = Publisher(
                    self.address.endpoint("commands_in"),
                    source=LAUNCHER_SOURCE,
                    run_id=self.run_id,
                    connect_timeout=2.0,
                    curve=self.curve,
                )
            except UsageError as exc:
                log.warning("cannot send the stop command", error=str(exc))
                return
        reason = f"launcher got {signal.Signals(self._stop_signal or signal.SIGTERM).name}"
        self._command_publisher.publish(StopRun(command_id=self._stop_id, reason=reason))
        self._stop_sent_at = time.monotonic()

    def _stop_tick(self) -> None:
        """Retry the stop command until every stage acknowledged it; escalate on timeout."""
        if self._stop_phase == 0:
            return
        now = time.monotonic()
        if self._phase_deadline is not None and now > self._phase_deadline:
            self._escalate()
            return
        if (
            self._stop_phase == 1
            and len(self._stop_acks) < self.job.stages
            and now - self._stop_sent_at > _STOP_RETRY_S
        ):
            self._send_stop()

    async def _read_bus(self, subscriber: Subscriber) -> None:
        while True:
            for msg in await subscriber.receive(timeout=0.5):
                self._on_event(msg)

    def _on_event(self, msg: Message) -> None:
        self._last_bus_event = time.monotonic()
        if msg.run_id and msg.run_id != self.run_id:
            return  # another run sharing this bus
        self.console.update(msg)
        if isinstance(msg, HookStarted):
            if self._supervisor is not None:
                self._supervisor.attached(msg.pid)
        elif isinstance(msg, RunStarted):
            log.debug("run started", after_s=round(time.monotonic() - self._started, 2))
        elif isinstance(msg, CommandAcked):
            if msg.command_id == self._stop_id:
                self._stop_acks.add(msg.stage)
        elif isinstance(msg, RunEnded) and msg.source != LAUNCHER_SOURCE:
            self._ended = msg
            if self._supervisor is not None:
                self._supervisor.mark_run_ended()
            if self._ended_event is not None:
                self._ended_event.set()

    async def _drive(self) -> int:
        opts = self.options
        specs = self.job.hook_specs if self._starts_hooks else ()
        self._supervisor = HookSupervisor(
            specs,
            self.address,  # type: ignore[arg-type]
            max_restarts=opts.hook_restarts,
            env=self._hook_env(),
            log_args=("--log-format", opts.log_format, "--log-level", opts.log_level),
            output=self.console.child_output,
        )
        self._supervisor.start_all()
        problem = await self._wait_hooks_attached()
        if problem is not None or self._stop_signal is not None:
            if problem is not None:
                self.console.error(problem)
            self._close_agent_stdin()
            await self._wait_agent(timeout=10)
            self._supervisor.terminate()
            if self._stop_signal is not None:
                return 128 + self._stop_signal
            return EXIT_FAILED
        log.debug("hooks attached", after_s=round(time.monotonic() - self._started, 2))
        # stdin stays open from here on: its end tells the agent we are gone.
        self._config_sent = self._send_agent(self.agent_config())
        if not self._config_sent:
            self.console.error("the elastic agent process died at startup")
            self._supervisor.terminate()
            return EXIT_FAILED
        agent_status = await self._follow()
        self._refresh_reports()
        seen_on_bus = self.progress.stats.steps_done
        self._settle_progress()
        self._root = self._final_root_cause()
        if agent_status == 0 and self._ended is None and not self._bus_down():
            await self._wait_run_ended(timeout=1.0)
            if self._ended is None:
                await self._check_bus(seen_on_bus)
        self._kill_agent()  # anything left in the agent's process group
        if self._ended is None and self._run_end_published is None and self.is_bus_owner:
            self._publish_run_ended(agent_status)
        await self._finish_hooks()
        self.console.close()
        return self._report(agent_status)

    # -- the agent --------------------------------------------------------------

    def _start_agent(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # The stage actor configures its logging from these (stages/actor.py).
        env["EVTRAIN_LOG_FORMAT"] = self.options.log_format
        env["EVTRAIN_LOG_LEVEL"] = self.options.log_level
        # With the rendezvous TCPStore shared into the workers (torch's default)
        # a restarted worker group reads the previous attempt's gloo/NCCL
        # addresses from the same store keys and fails to connect
        # (pytorch/pytorch#135712; seen here with --max-restarts). A fresh
        # store per attempt avoids it.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        env.update(self.console.child_env())
        # The agent learns of our death from the end of its stdin (see
        # evtrain.elastic_agent), and then tells it from a deliberate close by
        # whether we are still its parent.
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        return subprocess.Popen(
            [sys.executable, "-m", "evtrain.elastic_agent", self.options.start_method],
            env=self._curve_env(env),
            stdin=subprocess.PIPE,
            stdout=self.console.child_output,
            stderr=self.console.child_output,
            start_new_session=True,
        )

    def _cleanup_message(self) -> LauncherCleanup:
        assert self.run_dir is not None
        owned = [self.address.location] if self._owns_ipc_dir and self.address else []
        return LauncherCleanup(
            run_record=str(self.run_dir / RUN_RECORD) if self.is_bus_owner else None,
            remove_dirs=owned,
        )

    def agent_config(self) -> AgentConfig:
        """The elastic configuration of this node's worker group."""
        from evtrain.stages.worker import WorkerConfig

        opts, job = self.options, self.job
        overrides = {**opts.overrides, **self.stage_overrides}
        if opts.evaluate is not None:
            assert self.run_dir is not None
            overrides["run_dir"] = str(self.run_dir)  # its events name the evaluation's own
        worker = WorkerConfig(
            spec_path=str(Path(opts.spec).expanduser().resolve()),
            overrides=overrides,
            bus=str(self.address),
            run_id=self.run_id,
            evaluate_only=opts.evaluate is not None,
            await_plan=self._checkpointing and opts.evaluate is None,
            resume=str(self.resume_path) if self.resume_path is not None else None,
            load_weights=str(self.load_weights_path) if self.load_weights_path else None,
            dump_weights_dir=(
                str(Path(opts.dump_weights).expanduser().resolve()) if opts.dump_weights else None
            ),
            report_dir=str(self.report_dir),
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
        assert self.run_dir is not None
        return AgentConfig(
            worker_config=worker.encode(),
            nproc_per_node=job.world_size // opts.nnodes,
            min_nodes=opts.nnodes,
            max_nodes=opts.nnodes,
            node_rank=opts.node_rank or 0,
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            rdzv_configs=rdzv_configs,
            local_addr=self._local_addr,
            run_id=self.run_id,  # --run-id, the same on every node
            max_restarts=opts.max_restarts,
            shutdown_timeout=ELASTIC_SHUTDOWN_S,
            start_method=opts.start_method,
            log_dir=str(self.run_dir / "elastic"),
            report_path=str(self._agent_report_path()),
            stage_reports=str(self.report_dir),
            failure_grace_s=WORKER_FAILURE_GRACE_S,
        )

    def _agent_report_path(self) -> Path:
        node = f"-node{self.options.node_rank}" if self.options.nnodes > 1 else ""
        return self.report_dir / f"agent{node}.json"

    def _send_agent(self, message: AgentConfig | LauncherCleanup) -> bool:
        assert self._agent is not None and self._agent.stdin is not None
        import msgspec

        try:
            self._agent.stdin.write(msgspec.json.encode(message) + b"\n")
            self._agent.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def _close_agent_stdin(self) -> None:
        if self._agent is not None and self._agent.stdin is not None:
            try:
                self._agent.stdin.close()
            except OSError:
                pass

    async def _follow(self) -> int:
        """Supervise hooks and stages, show progress, until the agent exits; its exit status."""
        assert self._agent is not None and self._supervisor is not None
        while (code := self._agent.poll()) is None:
            self._supervisor.poll()
            self._refresh_reports()
            self._watch_failure()
            self._end_failed_workers()
            self.console.tick()
            self._stop_tick()
            await anyio.sleep(_POLL_S)
        return code

    def _end_failed_workers(self) -> None:
        """Kill this node's workers once the run failed and they stay on.

        The agent ends the survivors of a failure among its own workers. A
        failure on another node, heard of on the bus, leaves ours waiting for a
        peer that is gone (in a collective, or a gloo connect) until a timeout
        half an hour later. Blocked in a native call, they could not act on
        elastic's SIGTERM either, and a failed run saves nothing at its end:
        SIGKILL at once.
        """
        ended = self._run_end_published
        if ended is None or ended.status != "failed" or self._stop_phase >= 2:
            return
        if time.monotonic() - self._run_end_published_at < FAILED_WORKERS_GRACE_S:
            return
        log.warning("the run failed; killing the stage workers of this node that wait on it")
        self._stop_phase = 3  # their deaths are ours, not a failure
        self._kill_agent()

    async def _wait_agent(self, timeout: float) -> None:
        assert self._agent is not None
        with anyio.move_on_after(timeout):
            while self._agent.poll() is None:
                await anyio.sleep(_POLL_S)
        self._kill_agent()

    def _term_agent(self) -> None:
        if self._agent is not None and self._agent.poll() is None:
            try:
                # Only the agent: elastic forwards SIGTERM to each worker itself.
                os.kill(self._agent.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _kill_agent(self) -> None:
        if self._agent is None:
            return
        try:
            # The agent leads its session; its workers are in its process group.
            os.killpg(self._agent.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self._agent.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("the elastic agent did not die", pid=self._agent.pid)

    # -- what the stages say, without the bus -------------------------------------

    def _refresh_reports(self) -> None:
        report = AgentReport.read(self._agent_report_path())
        if report is not None:
            self._agent_report = report
        attempt = self._current_attempt()
        number = attempt.attempt if attempt is not None else 0
        self._stage_reports = read_stage_reports(self.report_dir, number)

    def _current_attempt(self) -> AttemptReport | None:
        report = self._agent_report
        return report.attempts[-1] if report is not None and report.attempts else None

    def _failures(self, attempt: AttemptReport | None) -> list[Failure]:
        """Every stage failure of ``attempt`` (None: what the bus said, if anything)."""
        number = attempt.attempt if attempt is not None else 0
        started = attempt.started_at if attempt is not None else 0.0
        if attempt is self._current_attempt():
            reports = self._stage_reports
        else:
            reports = read_stage_reports(self.report_dir, number)
        exits = {w.rank: w for w in attempt.workers} if attempt is not None else {}
        replicas = self.job.data_parallel
        published: dict[int, StageFailed] = {}
        for failed in sorted(self.progress.stats.failures, key=lambda e: e.ts):
            if failed.ts >= started:
                published.setdefault(failed.stage * replicas + failed.replica, failed)
        failures = []
        for rank in range(self.job.world_size):
            report, worker, event = reports.get(rank), exits.get(rank), published.get(rank)
            # Pipeline-major ranks, as on a (pp, dp) mesh: stage r // D, replica r % D.
            stage, replica = divmod(rank, replicas)
            which = replica if replicas > 1 else None
            if report is not None and report.status == "failed":
                failures.append(
                    Failure(
                        stage=stage,
                        replica=which,
                        at=report.failed_at or report.updated,
                        what=report.error,
                        consequence=report.consequence,
                        location=report.location,
                        step=report.failed_step,
                        user_frames=tuple(report.user_frames),
                        traceback=report.traceback,
                    )
                )
            elif (
                worker is not None
                and worker.died_at is not None
                and worker.exit_code != 0
                and not (report is not None and report.status in _FINISHED)
            ):
                steps = max(report.step if report is not None else 0, self._steps_known())
                failures.append(
                    failure_from_exit(
                        stage,
                        worker.exit_code,
                        worker.died_at,
                        killed_by_agent=worker.killed_by_agent,
                        step=steps,
                        replica=which,
                    )
                )
            elif event is not None and rank not in exits:
                # Another node's stage: the bus is all this launcher hears of it.
                failures.append(
                    Failure(
                        stage=stage,
                        replica=which,
                        at=event.ts,
                        what=event.error,
                        consequence=is_communication_error(event.error),
                        step=event.step,
                        traceback=event.traceback,
                    )
                )
        return failures

    def _find_root_cause(self, attempt: AttemptReport | None) -> RootCause | None:
        failures = self._failures(attempt)
        if self._stop_phase >= 2:
            # We had elastic (or ourselves) end the workers: their deaths say nothing.
            failures = [f for f in failures if not f.died]
        return find_root_cause(failures)

    def _steps_known(self) -> int:
        reports = [r.step for r in self._stage_reports.values()]
        return max([self.progress.stats.steps_done, *reports])

    def _restart_pending(self, attempt: AttemptReport | None) -> bool:
        number = attempt.attempt if attempt is not None else 0
        return number < self.options.max_restarts

    def _watch_failure(self) -> None:
        """Announce failed attempts; once the last one failed, end the run for the hooks."""
        report = self._agent_report
        if report is not None:
            for earlier in report.attempts[:-1]:
                self._announce_restart(earlier)
        attempt = self._current_attempt()
        if (
            self._restart_pending(attempt)
            or self._run_end_published is not None
            or self._stop_phase >= 2
        ):
            return
        failures = self._failures(attempt)
        if not failures:
            return
        now = time.monotonic()
        if self._failure_seen_at is None:
            self._failure_seen_at = now
        # An exception that is not a symptom names the cause outright; a death
        # needs its exit status, which the agent has once elastic reaped it.
        known = any(not f.consequence and f.certain for f in failures)
        if known or now - self._failure_seen_at > FAILURE_SETTLE_S:
            root = find_root_cause(failures)
            assert root is not None
            self._publish_failed(root)

    def _announce_restart(self, attempt: AttemptReport) -> None:
        if attempt.attempt in self._announced_attempts:
            return
        self._announced_attempts.add(attempt.attempt)
        root = self._find_root_cause(attempt)
        what = root.headline() if root is not None else "the stage workers failed"
        self._warn(
            f"{what}; elastic restarts the workers "
            f"(restart {attempt.attempt + 1} of {self.options.max_restarts})"
        )

    def _settle_progress(self) -> None:
        """The stages' own count and last loss, where the bus fell behind."""
        reports = list(self._stage_reports.values())
        if not reports:
            return
        last = max(reports, key=lambda r: r.stage)
        self.progress.settle(max(r.step for r in reports), last.loss)

    # -- the bus ---------------------------------------------------------------

    def _bus_down(self) -> bool:
        loss = self._bus_loss
        return loss is not None and loss.back_at_step is None

    async def _watch_bus(self) -> None:
        """Notice a bus that stopped delivering while the stages publish (heartbeats)."""
        while True:
            await anyio.sleep(1.0)
            quiet = time.monotonic() - self._last_bus_event
            loss = self._bus_loss
            if loss is not None:
                if loss.back_at_step is None and quiet < BUS_QUIET_S:
                    loss.back_at_step = self._steps_known()
                    self._warn(
                        f"the bus at {self.address} answers again (step {loss.back_at_step})"
                    )
                continue
            if quiet >= BUS_QUIET_S and self._stages_running():
                await self._check_bus(self.progress.stats.steps_done)

    async def _check_bus(self, step: int) -> None:
        """Ask the broker; if it does not answer, the bus was lost at ``step``."""
        from evtrain.bus.state_service import ping_broker

        if self._broker is not None:
            # Ours: nothing a client sends can stop it; only a dead proxy thread would.
            alive = self._broker_healthy()
        else:
            address = self.address
            assert address is not None
            alive = await anyio.to_thread.run_sync(
                functools.partial(ping_broker, address, _BUS_PING_TIMEOUT_S, curve=self.curve)
            )
        if alive or self._bus_loss is not None:
            return
        self._bus_loss = BusLoss(step=step, at=time.time())
        if self._agent is not None and self._agent.poll() is None:
            self._warn(
                f"the bus at {self.address} stopped answering at step {step}; training goes "
                "on, but hooks get no events and no checkpoint is committed until it is back"
            )

    def _broker_healthy(self) -> bool:
        assert self._broker is not None
        try:
            self._broker.check()
        except RuntimeError:
            return False
        return True

    def _stages_running(self) -> bool:
        if not self._config_sent or self._ended is not None:
            return False
        if self._run_end_published is not None:
            return False
        return any(r.status in ("starting", "running") for r in self._stage_reports.values())

    def _bus_loss_line(self) -> str | None:
        loss = self._bus_loss
        if loss is None:
            return None
        back = f" (back at step {loss.back_at_step})" if loss.back_at_step is not None else ""
        line = f"the bus was lost at step {loss.step}{back}: hooks got no events after it"
        if self._checkpointing:
            from evtrain.checkpoint import latest_committed

            assert self.run_dir is not None
            latest = latest_committed(self.run_dir)
            committed = f"latest committed: step {latest.step}" if latest else "none committed"
            line += f"; checkpoints after step {loss.step} were not committed ({committed})"
        return line

    # -- hooks ------------------------------------------------------------------

    def _hook_env(self) -> dict[str, str]:
        # Hook modules that sit next to the spec are importable, as they are for
        # the spec itself (evtrain.spec.load_job appends its directory).
        env = dict(os.environ)
        spec_dirs = [str(Path(self.options.spec).expanduser().resolve().parent)]
        if self._job_payload is not None:
            spec_dirs += self._job_payload.directories()
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [d for d in spec_dirs if d not in paths]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(self.console.child_env())
        return self._curve_env(env)

    def _curve_dir(self) -> str | None:
        directory = self.options.curve_dir
        return str(Path(directory).expanduser().absolute()) if directory is not None else None

    def _curve_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` naming our CURVE key directory, or none at all.

        The stage workers and ``evtrain hook`` take the directory from
        ``$EVTRAIN_CURVE_DIR`` (`evtrain.bus.security.curve_from_env`); one
        inherited from our own environment on a launch without CURVE would make
        them attempt CURVE handshakes that our broker never answers.
        """
        directory = self._curve_dir()
        if directory is None:
            env.pop(CURVE_DIR_ENV, None)
        else:
            env[CURVE_DIR_ENV] = directory
        return env

    async def _wait_hooks_attached(self) -> str | None:
        """None once every hook attached; else why not (timeout, crash loop, signal)."""
        assert self._supervisor is not None
        deadline = time.monotonic() + self.options.hook_attach_timeout
        while not self._supervisor.all_attached():
            if self._stop_signal is not None:
                return None
            problem = self._supervisor.startup_problem()
            if problem is not None:
                return problem
            if time.monotonic() > deadline:
                waiting = ", ".join(self._supervisor.waiting_for())
                return (
                    f"hooks did not attach to the bus within "
                    f"{self.options.hook_attach_timeout:g} s: {waiting}"
                )
            self._supervisor.poll()
            await anyio.sleep(_POLL_S / 2)
        return None

    async def _finish_hooks(self) -> None:
        """Give hooks time to exit on `RunEnded`, then terminate the rest."""
        assert self._supervisor is not None
        self._supervisor.mark_run_ended()
        failed = self._run_end_published is not None and self._run_end_published.status == "failed"
        if self._bus_down():
            timeout, term = 0.0, 2.0  # they cannot hear the end of the run
        elif failed:
            spent = time.monotonic() - self._run_end_published_at
            timeout, term = max(0.2, FAILED_HOOK_GRACE_S - spent), 1.0
        else:
            timeout, term = self.options.hook_finish_timeout, 5.0
        with anyio.move_on_after(timeout):
            while self._supervisor.running():
                self._supervisor.poll()
                await anyio.sleep(0.05)
        for hook in self._supervisor.running():
            log.warning("hook still running after the run; terminating it", hook=hook.label)
        await anyio.to_thread.run_sync(self._supervisor.terminate, term)

    # -- the end ----------------------------------------------------------------

    async def _wait_run_ended(self, timeout: float) -> None:
        # The stages' RunEnded may still be on its way when the agent exits.
        if self._ended is None and self._ended_event is not None:
            with anyio.move_on_after(timeout):
                await self._ended_event.wait()

    def _publish(self, event: RunEnded) -> None:
        if self._publisher is not None and not self._bus_down():
            self._publisher.publish(event)
        self._run_end_published = event
        self._run_end_published_at = time.monotonic()
        if self._supervisor is not None:
            self._supervisor.mark_run_ended()

    def _final_root_cause(self) -> RootCause | None:
        """The root cause with all evidence in; what the hooks were told, if it agrees."""
        root = self._find_root_cause(self._current_attempt())
        told = self._told_root
        same = (
            root is not None
            and told is not None
            and (root.first.stage, root.first.replica, root.first.what)
            == (told.first.stage, told.first.replica, told.first.what)
        )
        if same:
            # The same failure, maybe a step count later: keep one wording.
            assert root is not None and told is not None
            return RootCause(first=told.first, consequences=root.consequences)
        return root

    def _publish_failed(self, root: RootCause) -> None:
        self._told_root = root
        headline = root.headline()
        self._publish(
            RunEnded(
                status="failed", reason=headline, root_cause=headline, step=self._steps_known()
            )
        )

    def _publish_run_ended(self, agent_status: int) -> None:
        """Tell hooks the run is over when the stages could not (they failed or were killed)."""
        if self._root is not None:
            self._publish_failed(self._root)
            return
        status: Literal["completed", "stopped", "failed"]
        if self._stop_signal is not None and agent_status != EXIT_FAILED:
            status, reason = "stopped", f"launcher got {signal.Signals(self._stop_signal).name}"
        elif agent_status == 0:
            status, reason = "completed", ""
        else:
            status, reason = "failed", "stage workers failed"
        self._publish(RunEnded(status=status, reason=reason, step=self._steps_known()))

    def _report(self, agent_status: int) -> int:
        """Print the summary (and the failure), return the exit status."""
        status = self._exit_status(agent_status)
        if status in (EXIT_OK, EXIT_BUS_LOST):
            word = self._ended_status()
        elif self._stop_signal is not None and status != EXIT_FAILED:
            word = f"interrupted ({signal.Signals(self._stop_signal).name})"
        else:
            word = "failed"
        if self.options.evaluate is None:
            self._say(self.progress.summary(status=word, wall_s=time.monotonic() - self._started))
        elif status == EXIT_OK:
            status = self._report_evaluation()
        if status == EXIT_FAILED:
            self._print_failure(agent_status)
        loss = self._bus_loss_line()
        if loss is not None:
            self._warn(loss)
        return status

    def _report_evaluation(self) -> int:
        """Print the evaluation's metrics, write them as JSON; `EXIT_FAILED` without them.

        They come from the last stage's report, not from the bus: exactly the
        floats the stage computed.
        """
        from evtrain.checkpoint import read_manifest

        assert self.run_dir is not None and self.resume_path is not None
        # Replica 0 of the last stage evaluates (stage reports are by global rank).
        report = self._stage_reports.get((self.job.stages - 1) * self.job.data_parallel)
        if report is None or report.eval_metrics is None:
            self.console.error("the evaluation ended without metrics")
            return EXIT_FAILED
        manifest = read_manifest(self.resume_path)
        recorded = (
            {manifest.metric_name: manifest.metric} if manifest.metric_name is not None else {}
        )
        output = Path(self.options.eval_output or self.run_dir / EVAL_FILE).expanduser()
        self.evaluation = {
            "checkpoint": str(self.resume_path),
            "step": self.start_step,
            "metrics": dict(report.eval_metrics),
            "samples": report.eval_samples,
            "sets": dict(report.eval_sets),
            "recorded": recorded,
            "name": self.job.name,
            "stages": self.job.stages,
            "run_id": self.run_id,
            "eval_dir": str(self.run_dir),
            "output": str(output),
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(self.evaluation, indent=2) + "\n")
        if report.eval_sets:
            self._say(f"eval of step {self.start_step}: {report.eval_samples} samples")
            for name, samples in report.eval_sets.items():
                prefix = f"{name}/"
                shown = " ".join(
                    f"{k.removeprefix(prefix)}={_number(v)}"
                    for k, v in report.eval_metrics.items()
                    if k.startswith(prefix)
                )
                self._say(f"  {name}: {shown} ({samples} samples)")
        else:
            shown = " ".join(f"{k}={_number(v)}" for k, v in report.eval_metrics.items())
            self._say(f"eval of step {self.start_step}: {shown} ({report.eval_samples} samples)")
        for name, value in recorded.items():
            self._say(f"  recorded with the checkpoint: {name}={_number(value)}")
        self._say(f"  result: {output}")
        return EXIT_OK

    def _ended_status(self) -> str:
        """How a run that did not fail ended: stage 0's word, else the stages' own reports."""
        if self._ended is not None:
            return self._ended.status
        stopped = any(r.status == "stopped" for r in self._stage_reports.values())
        return "stopped" if stopped else "completed"

    def _exit_status(self, agent_status: int) -> int:
        ended = self._ended
        if self._stop_signal is not None:
            if agent_status == 0 or (ended is not None and ended.status != "failed"):
                return self._degraded(EXIT_OK)  # the workers ended the run at a step boundary
            if agent_status == EXIT_FAILED and self._root is not None:
                return EXIT_FAILED
            return 128 + self._stop_signal
        if agent_status != 0:
            return EXIT_FAILED
        if ended is not None and ended.status == "failed":
            return EXIT_FAILED
        return self._degraded(EXIT_OK)

    def _degraded(self, status: int) -> int:
        return EXIT_BUS_LOST if status == EXIT_OK and self._bus_loss is not None else status

    def _print_failure(self, agent_status: int) -> None:
        root = self._root
        if root is None:
            self.err.write(
                f"evtrain launch: error: stage workers failed (elastic agent exit status "
                f"{agent_status}); no stage reported why\n"
            )
            self.err.flush()
            return
        lines = [f"evtrain launch: error: {root.headline()}"]
        if len(root.first.user_frames) > 1 or (
            root.first.user_frames and ": " in root.first.user_frames[-1]
        ):
            lines.append("  user code (innermost last):")
            lines += [f"    {frame}" for frame in root.first.user_frames]
        lines += [f"  consequence: {f.headline(brief=True)}" for f in root.consequences]
        path = self.report_dir / "failure.txt"
        try:
            path.write_text(root.report())
            lines.append(f"  full report: {path}")
        except OSError as exc:
            log.warning("cannot write the failure report", error=str(exc))
        self.err.write("\n".join(lines) + "\n")
        self.err.flush()

    def _final_status(self, status: int) -> str:
        if status in (EXIT_OK, EXIT_BUS_LOST):
            return self._ended_status()
        if status == EXIT_FAILED:
            return "failed"
        return "interrupted"

    def _write_run_json(self, **extra: Any) -> None:
        if self.run_dir is None or not self.is_bus_owner:
            return
        stats = self.progress.stats
        data: dict[str, Any] = {
            "run_id": self.run_id,
            "name": self.job.name,
            "spec": str(Path(self.options.spec).expanduser().resolve()),
            "overrides": dict(self.options.overrides),
            "bus": str(self.address),
            "owned_bus_dir": self.address.location if self._owns_ipc_dir and self.address else None,
            "run_dir": str(self.run_dir),
            "reports": str(self.report_dir),
            "stages": self.job.stages,
            "data_parallel": self.job.data_parallel,
            "schedule": self.job.schedule,
            "nnodes": self.options.nnodes,
            "curve_dir": self._curve_dir(),
            "max_restarts": self.options.max_restarts,
            "resume": str(self.resume_path) if self.resume_path is not None else None,
            "start_step": self.start_step,
            "evaluate": self.options.evaluate is not None,
            "load_weights": str(self.load_weights_path) if self.load_weights_path else None,
            "host": socket.gethostname(),
            "launcher_pid": os.getpid(),
            "launcher_start": process_start_ticks(os.getpid()),
            "started": self._started_at,
            "steps": stats.steps_done,
            "final_loss": stats.last_loss,
            "last_eval": stats.last_eval.metrics if stats.last_eval is not None else None,
            "last_eval_step": stats.last_eval.step if stats.last_eval is not None else None,
            "previous_run": self._previous_run,
        }
        if self._root is not None:
            data["root_cause"] = self._root.headline()
        if self._bus_loss is not None:
            data["bus_lost"] = {
                "step": self._bus_loss.step,
                "at": self._bus_loss.at,
                "back_at_step": self._bus_loss.back_at_step,
                "consequence": self._bus_loss_line(),
            }
        data.update(extra)
        write_run_record(self.run_dir, data)

    def _cleanup(self) -> None:
        """Whatever happened: no process of ours left, broker stopped, ipc dir removed."""
        self._kill_agent()
        for publisher in (self._publisher, self._command_publisher):
            if publisher is not None:
                publisher.close(linger=0 if self._bus_down() else 1.0)
        if self._supervisor is not None:
            self._supervisor.kill()
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._owns_ipc_dir and self.address is not None:
            shutil.rmtree(self.address.location, ignore_errors=True)
        self.console.close()
