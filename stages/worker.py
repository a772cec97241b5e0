"""The contract between the launcher and the stage workers it starts (one per stage).

* `WorkerConfig` — everything a worker needs besides the environment,
  JSON-encoded into one string (`WorkerConfig.encode`) so it passes through
  ``elastic_launch(config, worker_main)(cfg.encode())`` without pickling any
  object of ours. The entrypoint, `evtrain.stages.entry.worker_main`, reads
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` from the environment as torchrun / elastic set them; rank r
  runs pipeline stage ``r // D`` of replica ``r % D`` (world size PxD,
  `evtrain.stages.mesh`). It returns None when the run completed or was
  stopped (StopRun, SIGTERM/SIGINT) and raises when the stage failed, after
  reporting and publishing `StageFailed` — so elastic sees a non-zero exit
  and tears the others down.
* `StageReport` — what a worker tells the launcher without the bus: the
  actor keeps ``WorkerConfig.report_dir/attempt-{a}/rank-{r}.json`` up to date (at
  start, about once a second while training, at the end, and when it fails,
  before anything is published), so the launcher knows every stage's steps,
  status and failure even when the bus is lost. A worker killed by a signal
  leaves its last report behind; its exit status comes from the elastic agent
  (`evtrain.launcher.elastic_agent`).
* Stacks on request — a stage that hangs cannot say where. Every worker
  registers `faulthandler` for ``SIGUSR1`` (`enable_stack_dumps`): the
  launcher's signal (`request_stacks`) makes it write every thread's Python
  stack to ``attempt-{a}/stacks-rank-{r}.txt`` from the signal handler,
  whatever its threads are blocked in. Under NCCL, torch's Flight Recorder
  (the last collectives of each rank) is kept and dumped the same way: the
  worker sets torch's ``TORCH_FR_*`` and ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``
  variables unless the user did (`keep_flight_recorder`), and writing to its
  named pipe makes torch write ``attempt-{a}/flight-recorder-rank-{r}``
  (`request_flight_recorder`).

The module is torch-free: the launcher reads it without the stage runtime.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Literal

import msgspec

__all__ = [
    "STACK_SIGNAL",
    "ReportStatus",
    "StageReport",
    "WorkerConfig",
    "enable_stack_dumps",
    "flight_recorder_dumps",
    "keep_flight_recorder",
    "rank_at",
    "rank_coordinates",
    "read_stage_reports",
    "remove_flight_recorder_pipes",
    "request_flight_recorder",
    "request_stacks",
    "restart_count",
    "stacks_path",
    "this_host",
]

STACK_SIGNAL = signal.SIGUSR1
"""What makes a worker write its stacks (`enable_stack_dumps`)."""

ReportStatus = Literal["starting", "running", "completed", "stopped", "failed"]


class WorkerConfig(msgspec.Struct, kw_only=True):
    """What the launcher tells every stage worker (the same for all ranks)."""

    spec_path: str
    """The job spec file; every worker loads it itself (`evtrain.spec.load_job`)."""

    overrides: dict[str, str] = {}
    """Command-line overrides as strings (`evtrain.overrides.apply_overrides`)."""

    bus: str | None = None
    """Bus address (``ipc:///dir`` or ``tcp://host:port``); None publishes no events
    and receives no commands."""

    run_id: str
    """Stamped on every event."""

    device: str | None = None
    """Overrides the spec's ``device`` (``"cpu"`` / ``"cuda"``) when set."""

    resume: str | None = None
    """Checkpoint to resume: a checkpoint directory, a run directory (its latest
    committed checkpoint) or ``"latest"`` (the job's run directory). Rank 0 resolves
    it and all stages load the same one (`evtrain.checkpoint.loader.agree_on_resume`)."""

    await_plan: bool = False
    """A checkpoint coordinator is running: stage 0 holds boundary 0 for its plan."""
    evaluate_only: bool = False
    """Load ``resume``, evaluate once at its step's boundary and end: no training step,
    no command applied, nothing saved (``evtrain eval``)."""

    load_weights: str | None = None
    """Load model weights only (a committed checkpoint or a safetensors file) and
    start at step 0 with a fresh optimizer; ignored when ``resume`` is set."""

    dump_weights_dir: str | None = None
    """A testing/export aid: at the end of the run each stage writes its parameters
    (keys of the unsplit model, ``"3.weight"``) to ``DIR/stage-{r}.safetensors``."""

    report_dir: str | None = None
    """Where each stage keeps its `StageReport` (None: no reports)."""

    def encode(self) -> str:
        """The JSON string `worker_main` takes."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> WorkerConfig:
        """Inverse of `encode`."""
        return msgspec.json.decode(text, type=cls)


class StageReport(msgspec.Struct, kw_only=True):
    """One stage's own account of itself, in ``report_dir/attempt-{attempt}/rank-{rank}.json``.

    One directory per attempt: the reports of a failed attempt stay readable
    after elastic restarted the workers.
    """

    rank: int
    """Global rank: stage ``rank // (D T)``, replica ``rank // T % D``, tensor rank
    ``rank % T`` (`evtrain.stages.mesh`)."""
    stage: int
    replica: int = 0
    tp: int = 0
    """Its tensor-parallel rank (`evtrain.stages.mesh`)."""
    tp_size: int = 1
    pid: int
    host: str = ""
    """The machine the process runs on (its pid means something only there)."""
    attempt: int = 0
    """Elastic's restart count of the worker group this process belongs to."""
    status: ReportStatus
    step: int = 0
    """Optimizer steps this stage has completed (the resumed step at start)."""
    loss: float | None = None
    """The last completed step's loss (the last stage only)."""
    doing: str = ""
    """The instruction the stage executes or waits in (`evtrain.events.Heartbeat.doing`)."""
    doing_s: float = 0.0
    """Seconds it has been in it."""
    updated: float
    """Wall-clock time of this report."""
    error: str = ""
    """``"Type: message"`` of the exception that failed the stage."""
    location: str = ""
    """``FILE:LINE in FUNCTION``: the innermost frame of the failure in user code."""
    user_frames: list[str] = []
    """The failure's frames in user code, innermost last, with their source lines."""
    traceback: str = ""
    consequence: bool = False
    """The error is a communication failure: a symptom of another process failing."""
    failed_at: float | None = None
    """Wall-clock time the exception was caught."""
    failed_step: int | None = None
    """The step that was running when the stage failed (None: between steps)."""
    eval_metrics: dict[str, float | None] | None = None
    """The last stage's latest evaluation, exactly as computed (None: not evaluated yet;
    a value is None where it is not finite)."""
    eval_step: int | None = None
    eval_samples: int = 0
    eval_sets: dict[str, int] = {}
    """Samples of each named eval set of that evaluation (empty: one unnamed set)."""

    def write(self, directory: str | os.PathLike[str]) -> None:
        """Replace this stage's report under ``directory`` atomically."""
        self.updated = time.time()
        path = _attempt_dir(directory, self.attempt) / f"rank-{self.rank}.json"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(self))
        os.replace(tmp, path)


def _attempt_dir(directory: str | os.PathLike[str], attempt: int) -> Path:
    return Path(directory) / f"attempt-{attempt}"


def read_stage_reports(directory: str | os.PathLike[str], attempt: int) -> dict[int, StageReport]:
    """Every readable stage report of ``attempt`` under ``directory``, by global rank
    (the stage itself without data parallelism)."""
    reports: dict[int, StageReport] = {}
    try:
        paths = list(_attempt_dir(directory, attempt).glob("rank-*.json"))
    except OSError:
        return reports
    for path in paths:
        try:
            report = msgspec.json.decode(path.read_bytes(), type=StageReport)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        reports[report.rank] = report
    return reports


# ------------------------------------------------------------ stacks on request


def stacks_path(directory: str | os.PathLike[str], attempt: int, rank: int) -> Path:
    """Where rank ``rank`` of ``attempt`` writes its stacks when asked."""
    return _attempt_dir(directory, attempt) / f"stacks-rank-{rank}.txt"


def enable_stack_dumps(directory: str | os.PathLike[str], attempt: int, rank: int) -> IO[str]:
    """From now on `STACK_SIGNAL` writes every thread's stack to `stacks_path`.

    The file stays open for the life of the process (faulthandler writes to
    its descriptor from the signal handler); the caller keeps it.
    """
    path = stacks_path(directory, attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = path.open("w")
    faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True)
    return stream


def request_stacks(pids: list[int]) -> None:
    """Ask each process of ``pids`` (this machine's workers) for its stacks."""
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, STACK_SIGNAL)


def _flight_recorder_pipe_stem(run_id: str, attempt: int) -> str:
    # A named pipe wants a local file system: the report directory may be a network one.
    return os.path.join(tempfile.gettempdir(), f"evtrain-{run_id}-{attempt}-fr-")


def keep_flight_recorder(directory: str | os.PathLike[str], run_id: str, attempt: int) -> None:
    """Set what keeps torch's NCCL Flight Recorder and lets `request_flight_recorder`
    dump it, before the process group exists (without NCCL it does nothing). Each
    value goes under the first of the names torch reads for it, unless the user set
    any of them."""
    dumps = _attempt_dir(directory, attempt) / "flight-recorder-rank-"
    wanted = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): str(dumps),
        ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",): _flight_recorder_pipe_stem(run_id, attempt),
    }
    for names, value in wanted.items():
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = value


def request_flight_recorder(run_id: str, attempt: int) -> int:
    """Ask every NCCL rank of ``attempt`` on this machine to dump its Flight Recorder
    (torch reads its named pipe in a thread of its own); how many were asked."""
    stem = _flight_recorder_pipe_stem(run_id, attempt)
    asked = 0
    for pipe in Path(stem).parent.glob(Path(stem).name + "*.pipe"):
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader: the rank is gone
            continue
        try:
            os.write(fd, b"1")
            asked += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def flight_recorder_dumps(directory: str | os.PathLike[str], attempt: int) -> list[Path]:
    """The Flight Recorder dumps torch wrote for ``attempt``."""
    return sorted(_attempt_dir(directory, attempt).glob("flight-recorder-rank-*"))


def remove_flight_recorder_pipes(run_id: str) -> None:
    """The named pipes torch made for this run's ranks (it does not remove them)."""
    stem = Path(_flight_recorder_pipe_stem(run_id, 0))
    for pipe in stem.parent.glob(f"evtrain-{run_id}-*-fr-*.pipe"):
        pipe.unlink(missing_ok=True)


def rank_at(stage: int, replica: int, tp: int, *, replicas: int, tp_size: int) -> int:
    """Global rank of ``stage``'s replica ``replica`` at tensor rank ``tp``: the pipeline
    dimension outermost, the tensor dimension innermost (`evtrain.stages.mesh`)."""
    return (stage * replicas + replica) * tp_size + tp


def rank_coordinates(rank: int, *, replicas: int, tp_size: int) -> tuple[int, int, int]:
    """(stage, replica, tensor rank) of global rank ``rank`` (`rank_at`'s inverse)."""
    unit, tp = divmod(rank, tp_size)
    stage, replica = divmod(unit, replicas)
    return stage, replica, tp


def restart_count() -> int:
    """How many times elastic restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def this_host() -> str:
    """The name `StageReport.host` carries."""
    return socket.gethostname()
