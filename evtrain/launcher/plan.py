"""What a launch will do, decided before anything starts: `LaunchPlan` and its `Purpose`.

`make_plan` loads the spec with its overrides, checks the split and every
hook the spec names, and resolves ``--resume`` / ``--load-weights`` (or the
checkpoint to evaluate) to one committed checkpoint or weights file, so
that a mistake is one line and exit status 2 (`evtrain.errors.UsageError`,
`evtrain.errors.SpecError`) before any process, file or socket exists.

The purpose of a launch is decided once, from the options (`purpose_of`):

* `Training` (``evtrain launch``, `evtrain.tools.api.launch`): the spec's hooks,
  the run directory of the job, and a summary at the end;
* `Evaluation` (``evtrain eval``, `evtrain.tools.api.evaluate`): the same broker
  and stage workers, no hook (the spec's checkpoint hook would plan saves
  and its log writers would write into the training run's files); the
  stages load the committed checkpoint and evaluate once at its step
  (`evtrain.stages.actor`), and the launcher prints the last stage's
  metrics from its report and writes them as JSON. Its own files go to
  ``evals/RUN_ID`` in the checkpoint's run directory, never among that
  run's checkpoints and logs.

Everything that differs between the two asks the plan's purpose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from evtrain.checkpoint import (
    CHECKPOINTS_DIR,
    CheckpointError,
    find_resume,
    list_checkpoints,
    read_manifest,
)
from evtrain.errors import SpecError, UsageError
from evtrain.hooks.hook import Hook
from evtrain.hooks.registry import build_hook_from_spec
from evtrain.launcher.options import (
    EVAL_FILE,
    EXIT_OK,
    RESUME_AUTO,
    RESUME_LATEST,
    JobSource,
    LaunchOptions,
    check_options,
    is_bus_owner,
)
from evtrain.launcher.run_record import EVALS_DIR, describe_run

if TYPE_CHECKING:
    from evtrain.job import Job
    from evtrain.stages.partition import SplitPlan

__all__ = [
    "EndReport",
    "Evaluation",
    "LaunchPlan",
    "Purpose",
    "Training",
    "check_monitored_metric",
    "make_plan",
    "purpose_of",
    "world",
]


def world(job: Job) -> str:
    """``2 stages`` or ``2 stages x 2 replicas``: the processes of a run."""
    stages = f"{job.stages} stage{'s' if job.stages != 1 else ''}"
    text = stages if job.data_parallel == 1 else f"{stages} x {job.data_parallel} replicas"
    if job.tensor_parallel > 1:
        text += f" x {job.tensor_parallel} tensor ranks"
    return text


class EndReport(Protocol):
    """How a purpose tells its end (`evtrain.launcher.report.Report`)."""

    def summary(self, word: str) -> None:
        """Print the training's summary: the run ended ``word``."""
        ...

    def evaluation(self, purpose: Evaluation) -> int:
        """Print and write the evaluation's result; the exit status."""
        ...


class Purpose(ABC):
    """Why the stages run; what differs between training and evaluating (module docstring)."""

    evaluates = False
    """Told to the workers (evaluate only) and recorded in ``run.json``."""
    shows_eval_lines = True
    """The console prints a line per finished evaluation."""

    @abstractmethod
    def starts_hooks(self, options: LaunchOptions) -> bool:
        """Whether this launch starts the spec's hooks (only the bus owner ever does)."""

    def check_job(self, job: Job) -> None:  # noqa: B027 - most purposes run any job
        """`UsageError` for a job this purpose cannot run."""

    @abstractmethod
    def checkpoint_to_load(self, options: LaunchOptions, job: Job) -> tuple[str | Path | None, str]:
        """What the stages load (a checkpoint or a run directory, or None) and its flag."""

    @abstractmethod
    def own_dir(self, plan: LaunchPlan, run_id: str) -> Path:
        """The directory this launch writes to."""

    def done_already(self, plan: LaunchPlan, run_dir: Path) -> str | None:
        """Why nothing is left to do (then nothing starts), else None."""
        return None

    @abstractmethod
    def check_used_dir(self, run_dir: Path, options: LaunchOptions) -> None:
        """`UsageError` unless this launch may go on in ``run_dir``, which holds a run."""

    @abstractmethod
    def steps(self, job: Job) -> str:
        """How much the header says this launch does."""

    @abstractmethod
    def source_line(self, plan: LaunchPlan, options: LaunchOptions) -> str | None:
        """The header's line about what the stages load, if anything."""

    def worker_overrides(self, run_dir: Path) -> dict[str, str]:
        """Overrides of the stages' spec that follow from the purpose."""
        return {}

    @abstractmethod
    def conclude(self, report: EndReport, status: int, word: str) -> int:
        """Tell how the launch ended (``word``); the exit status, maybe revised."""


class Training(Purpose):
    """Train the job in its run directory, with its hooks."""

    def starts_hooks(self, options: LaunchOptions) -> bool:
        return options.hooks and is_bus_owner(options)

    def checkpoint_to_load(self, options: LaunchOptions, job: Job) -> tuple[str | Path | None, str]:
        if options.resume == RESUME_AUTO:
            run_dir = Path(job.run_dir).expanduser()
            # Only a run directory without any committed (or damaged) checkpoint
            # starts at step 0; a damaged one is the user's to decide about.
            found = run_dir.is_dir() and any(
                info.committed or info.corrupt for info in list_checkpoints(run_dir)
            )
            return (run_dir if found else None), "--resume"
        if options.resume == RESUME_LATEST:
            if not Path(job.run_dir).expanduser().is_dir():
                raise UsageError(
                    f"--resume: the run directory {job.run_dir} does not exist: "
                    "no checkpoint to resume"
                )
            return job.run_dir, "--resume"
        return options.resume, "--resume"

    def own_dir(self, plan: LaunchPlan, run_id: str) -> Path:
        return Path(plan.job.run_dir)

    def done_already(self, plan: LaunchPlan, run_dir: Path) -> str | None:
        job = plan.job
        if (
            plan.resume_path is None
            or job.max_steps is None
            or job.epochs is not None  # how many steps those are, the stages find out
            or plan.start_step < job.max_steps
        ):
            return None
        return (
            f"evtrain launch: the run in {run_dir} has trained its {job.max_steps} steps "
            f"({plan.resume_path.name}): nothing left to train"
        )

    def check_used_dir(self, run_dir: Path, options: LaunchOptions) -> None:
        if options.resume is None and not options.overwrite:
            raise UsageError(
                f"run directory {run_dir} holds {describe_run(run_dir)}: "
                f"--resume {RESUME_AUTO} continues it, --overwrite starts it over, "
                "--run-dir DIR starts a new run elsewhere"
            )

    def steps(self, job: Job) -> str:
        return f"{job.max_steps} steps" if job.max_steps is not None else f"{job.epochs} epochs"

    def source_line(self, plan: LaunchPlan, options: LaunchOptions) -> str | None:
        if plan.resume_path is not None:
            return f"  resume: {plan.resume_path}"
        if options.resume == RESUME_AUTO:
            return "  resume: no committed checkpoint yet, starting at step 0"
        return None

    def conclude(self, report: EndReport, status: int, word: str) -> int:
        report.summary(word)
        return status


@dataclass(frozen=True)
class Evaluation(Purpose):
    """Evaluate one committed checkpoint once, in a directory of its own, without hooks."""

    checkpoint: str
    """The checkpoint, or a run directory whose latest committed one it is."""
    eval_dir: str | None = None
    output: str | None = None

    evaluates = True
    # It prints its result itself, from the last stage's own numbers; its
    # console shows only how far the evaluation got.
    shows_eval_lines = False

    def starts_hooks(self, options: LaunchOptions) -> bool:
        # The spec's checkpoint hook would plan saves and its log writers would
        # write into the training run's files.
        return False

    def check_job(self, job: Job) -> None:
        if job.eval_data is None:
            raise UsageError(f"job {job.name} has no eval_data to evaluate a checkpoint on")

    def checkpoint_to_load(self, options: LaunchOptions, job: Job) -> tuple[str | Path | None, str]:
        return self.checkpoint, "--checkpoint"

    def own_dir(self, plan: LaunchPlan, run_id: str) -> Path:
        if self.eval_dir is not None:
            return Path(self.eval_dir)
        assert plan.resume_path is not None
        checkpoints = plan.resume_path.parent
        run_dir = (
            checkpoints.parent if checkpoints.name == CHECKPOINTS_DIR else Path(plan.job.run_dir)
        )
        # Beside the checkpoint's run, away from its checkpoints and logs.
        return run_dir / EVALS_DIR / run_id

    def check_used_dir(self, run_dir: Path, options: LaunchOptions) -> None:
        raise UsageError(f"--eval-dir {run_dir} holds {describe_run(run_dir)}")

    def steps(self, job: Job) -> str:
        return "evaluation only"

    def source_line(self, plan: LaunchPlan, options: LaunchOptions) -> str | None:
        return f"  evaluate: {plan.resume_path} (step {plan.start_step}), no training"

    def worker_overrides(self, run_dir: Path) -> dict[str, str]:
        return {"run_dir": str(run_dir)}  # its events name the evaluation's own

    def output_path(self, run_dir: Path) -> Path:
        """The JSON file of the result."""
        return Path(self.output or run_dir / EVAL_FILE).expanduser()

    def conclude(self, report: EndReport, status: int, word: str) -> int:
        return report.evaluation(self) if status == EXIT_OK else status


def purpose_of(options: LaunchOptions) -> Purpose:
    """`Evaluation` with ``options.evaluate``, else `Training`."""
    if options.evaluate is not None:
        return Evaluation(options.evaluate, options.eval_dir, options.eval_output)
    return Training()


@dataclass(kw_only=True)
class LaunchPlan:
    """The launch as decided before anything starts (`make_plan`)."""

    purpose: Purpose
    job: Job
    """The `evtrain.job.Job` with the overrides applied."""
    split: SplitPlan
    local_addr: str | None = None
    """This node's address for the rendezvous (``nnodes > 1``)."""
    job_source: JobSource | None = None
    """The Job packed for the workers, when the launch was given a Job object."""
    stage_overrides: dict[str, str] = field(default_factory=dict)
    """Overrides the launcher adds for the stages (a resolved balance)."""
    checkpointing: bool = False
    """A checkpoint hook runs: the stages await its plan, the bus loss costs commits."""
    resume_path: Path | None = None
    """The committed checkpoint the stages load (``--resume``, or the one evaluated)."""
    start_step: int = 0
    """The step the run continues after (that checkpoint's; 0 for a fresh start)."""
    load_weights_path: Path | None = None
    warnings: list[str] = field(default_factory=list)
    """Problems found while preparing that do not stop the launch (printed with the header)."""


def check_monitored_metric(job: Job, hook: Hook) -> None:
    """A hook that watches an eval metric by a name that named eval sets never report.

    With named sets every name carries its set's prefix: ``accuracy`` would
    never arrive (a checkpoint hook would save no best checkpoint, early
    stopping would never stop), so it is a mistake in the spec.
    """
    watched = hook.watched_metric()
    if watched is None:
        return
    option, name = watched
    sets = [s for s in job.eval_sets if s]
    if name is None or not sets or name not in ("loss", *job.metrics):
        return
    choices = " or ".join(repr(f"{s}/{name}") for s in sets)
    raise SpecError(
        "hooks",
        f"hook {hook.hook_name()}: {option} {name!r} is reported per eval set; name {choices}",
    )


def make_plan(options: LaunchOptions, purpose: Purpose) -> LaunchPlan:
    """Load and validate everything; `UsageError` / `SpecError` before anything starts."""
    opts = options
    local_addr = check_options(opts)
    if opts.job is not None and opts.job_source is None:
        raise UsageError("a Job object needs its job_source (see evtrain.tools.api)")
    # lazy: torch comes with the job spec, once the agent process is already
    # starting (it imports torch too, at the same time).
    from evtrain.overrides import apply_overrides
    from evtrain.spec import load_job
    from evtrain.stages.partition import plan_split
    from evtrain.stages.tensor_parallel import check_plan

    job = apply_overrides(opts.job if opts.job is not None else load_job(opts.spec), opts.overrides)
    purpose.check_job(job)
    if job.world_size % opts.nnodes:
        what = world(job)
        if job.data_parallel > 1:
            what = f"{job.world_size} processes ({what})"
        raise UsageError(f"{what} do not split evenly over --nnodes {opts.nnodes}")
    if job.device == "cuda":
        # SpecError when this node has fewer GPUs than workers (one per local rank).
        job.stage_device(job.world_size // opts.nnodes - 1)
    plan = LaunchPlan(
        purpose=purpose,
        job=job,
        split=plan_split(job),  # SpecError for a model the stages could not run
        local_addr=local_addr,
        job_source=opts.job_source,
    )
    if job.balance == "compute":
        # The stages take the estimate's split instead of each repeating it.
        plan.stage_overrides["balance"] = ",".join(map(str, plan.split.sizes))
    if purpose.starts_hooks(opts):
        for spec in job.hook_specs:
            hook = build_hook_from_spec(spec)  # UsageError naming the hook and option
            plan.checkpointing = plan.checkpointing or hook.plans_checkpoints
            check_monitored_metric(job, hook)
    if job.tensor_parallel > 1:
        check_plan(job)
    _resolve_paths(plan, opts)
    return plan


def _resolve_paths(plan: LaunchPlan, options: LaunchOptions) -> None:
    """The checkpoint and the weights the stages will load, or `UsageError`."""
    target, flag = plan.purpose.checkpoint_to_load(options, plan.job)
    if target is not None:
        try:
            choice = find_resume(target)
            plan.start_step = read_manifest(choice.path).step
        except CheckpointError as exc:
            raise UsageError(f"{flag}: {exc}") from None
        plan.resume_path = choice.path.expanduser().resolve()
        plan.warnings += choice.warnings()
    if options.load_weights is not None:
        path = Path(options.load_weights).expanduser().resolve()
        if path.is_dir() and (path / "model.safetensors").is_file():
            path = path / "model.safetensors"  # a save_pretrained directory
        if path.is_file() and path.suffix == ".safetensors":
            plan.load_weights_path = path
        elif path.is_file():
            raise UsageError(
                f"--load-weights: {path} is neither a .safetensors file nor a checkpoint"
            )
        else:
            try:
                choice = find_resume(path)
            except CheckpointError as exc:
                raise UsageError(f"--load-weights: {exc}") from None
            plan.load_weights_path = choice.path
            plan.warnings += choice.warnings()
