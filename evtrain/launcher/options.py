"""What ``evtrain launch`` was asked to do: `LaunchOptions`, checked before anything starts.

`check_options` refuses contradictory or impossible options with one line
(`evtrain.errors.UsageError`, exit status 2), before the spec is even
loaded; what the options amount to once the spec is loaded is the launch
plan (`evtrain.launcher.plan`). The constants here are the launcher's exit
statuses and the special values of ``--resume``.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from evtrain.errors import UsageError

if TYPE_CHECKING:
    from evtrain.job import Job

__all__ = [
    "EVAL_FILE",
    "EXIT_BUS_LOST",
    "EXIT_FAILED",
    "EXIT_HUNG",
    "EXIT_OK",
    "LAUNCHER_SOURCE",
    "RESUME_AUTO",
    "RESUME_LATEST",
    "JobSource",
    "LaunchOptions",
    "check_options",
    "is_bus_owner",
    "new_run_id",
    "route_address",
]

EXIT_OK = 0
"""The run completed, or was stopped cleanly (a hook's stop command, SIGTERM/Ctrl-C)."""
EXIT_FAILED = 1
"""A stage failed (or the launch itself could not go on)."""
EXIT_BUS_LOST = 3
"""The run completed or stopped cleanly, but the bus was lost on the way."""
EXIT_HUNG = 4
"""No stage made progress for the hang timeout (`evtrain.launcher.hang`): the run was ended."""
LAUNCHER_SOURCE = "launcher"
"""The ``source`` of what the launcher publishes on the bus."""
RESUME_LATEST = "latest"
"""``--resume`` without a path: the run directory's latest committed checkpoint (it must exist)."""
RESUME_AUTO = "auto"
"""``--resume auto``: the latest committed checkpoint if there is one, else step 0 — one
command for the first start and every restart."""
EVAL_FILE = "eval.json"
"""An evaluation's result, in its own directory unless ``eval_output`` says otherwise."""
START_METHODS = ("spawn", "forkserver", "fork")


class JobSource(Protocol):
    """A `evtrain.job.Job` packed for the stage processes (`evtrain.tools.api.JobPayload`)."""

    def directories(self) -> list[str]:
        """Directories of the files that define its names (hooks import their neighbours)."""
        ...

    def write_spec(self, directory: Path) -> Path:
        """Write a spec file in ``directory`` that rebuilds the Job; its path."""
        ...


@dataclass(kw_only=True)
class LaunchOptions:
    """Everything ``evtrain launch`` was asked to do (the CLI fills it in)."""

    spec: str
    """Path of the job spec file (with `job`: where the workers rebuild that Job from)."""
    job: Job | None = None
    """A `evtrain.job.Job` to check before anything starts instead of loading ``spec``
    (`evtrain.tools.api` writes ``spec`` so that the workers rebuild the same Job)."""
    job_source: JobSource | None = None
    """With `job`: that Job packed for the workers (`evtrain.tools.api.JobPayload`); the
    launcher writes the spec that rebuilds it into the launch's report directory."""
    overrides: dict[str, str] = field(default_factory=dict)
    """Override strings (`evtrain.overrides.apply_overrides`), passed on to every worker."""
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
    """Start over in a run directory that holds a run (`evtrain.launcher.run_record.clear_run`)."""
    evaluate: str | None = None
    """Evaluate this checkpoint (or a run directory's latest committed one) once instead
    of training."""
    eval_dir: str | None = None
    """With ``evaluate``: the evaluation run's own directory (default ``evals/RUN_ID`` in
    the checkpoint's run directory, `evtrain.launcher.run_record.EVALS_DIR`)."""
    eval_output: str | None = None
    """With ``evaluate``: the JSON file of the result (default ``EVAL_DIR/eval.json``)."""
    load_weights: str | None = None
    dump_weights: str | None = None
    """Directory where every stage writes its final parameters (testing/export aid)."""
    run_id: str | None = None
    quiet: bool = False
    grace_s: float = 30.0
    """Seconds the workers get to end the run after the stop command, before signals."""
    hang_timeout: float | None = None
    """Seconds without progress of any stage after which the run is reported hung and
    ended (`evtrain.launcher.hang`); None: derived from the step time; 0: never."""
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


def is_bus_owner(options: LaunchOptions) -> bool:
    """Whether this node binds the bus and runs the hooks (node 0)."""
    return options.nnodes == 1 or options.node_rank == 0


def check_options(options: LaunchOptions) -> str | None:
    """Refuse what cannot be launched (`UsageError`); this node's address with ``nnodes > 1``.

    The address is ``local_addr``, or the local end of the route to the
    rendezvous endpoint (`route_address`).
    """
    opts = options
    local_addr = None
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if opts.hang_timeout is not None and not opts.hang_timeout >= 0:
        raise UsageError(f"--hang-timeout must be >= 0 seconds, got {opts.hang_timeout}")
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
        local_addr = opts.local_addr or route_address(opts.rdzv_endpoint)
    elif opts.local_addr is not None:
        raise UsageError("--local-addr is for --nnodes > 1")
    if opts.external_bus and not opts.bus:
        raise UsageError("--external-bus needs --bus ADDRESS of a running `evtrain bus`")
    if not opts.bus_wait_s > 0:
        raise UsageError(f"--connect-timeout must be positive, got {opts.bus_wait_s:g}")
    if opts.start_method not in START_METHODS:
        raise UsageError(f"unknown start method {opts.start_method!r}")
    if opts.overwrite and opts.resume is not None:
        raise UsageError("--overwrite starts the run over: it cannot --resume it as well")
    if opts.evaluate is not None and (opts.resume or opts.load_weights or opts.overwrite):
        raise UsageError(
            "an evaluation loads its checkpoint only: no --resume, --load-weights or --overwrite"
        )
    return local_addr


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
