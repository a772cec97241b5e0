"""The Python API: train a job or evaluate a checkpoint from a script or a notebook.

`launch` runs a job exactly as ``evtrain launch`` does — the broker, the
spec's hooks as supervised processes, the stage workers through
torch.distributed.elastic — and returns a `LaunchResult`; `evaluate` runs
``evtrain eval`` and returns an `EvalResult`::

    import evtrain

    result = evtrain.launch("examples/demo.py", steps=100, resume="auto")
    print(result.status, result.steps, result.final_loss, result.last_eval)
    scores = evtrain.evaluate("examples/demo.py", result.checkpoint)

Keyword overrides are the spec overrides of the command line (``steps=100``,
``run_dir="runs/x"``, ``balance=(3, 2)``; the Job field names work too).
Progress shows as the launcher's own display on ``out`` (default stdout),
the same lines the command line prints; ``quiet=True`` keeps only the
warnings. It is not a callback: a user function called inside the
launcher's supervision loop could delay the handling of a failure or a
Ctrl-C. Code that wants the events is a hook (``hooks=`` in the Job, or
`evtrain.HookRunner` in-process).

Errors the caller can fix (a bad spec, override, path, or a run directory
that holds another run) raise `evtrain.UsageError` / `evtrain.SpecError`
before anything starts. A run that fails is not an exception: its result
says ``failed`` with the root cause; `evaluate` raises `EvaluationFailed`,
having no metrics to return.

A `evtrain.job.Job` object instead of a path: the stage workers are other
processes, which load a spec file by path. The launcher writes one into
``RUN_DIR/launches/RUN_ID/job/`` that rebuilds the Job from a pickle, so a
Job works when everything it refers to by name can be imported again in a
fresh process — the rule of `multiprocessing`'s ``spawn`` start method:

* fine: tensors and library objects (``functools.partial(torch.optim.SGD,
  lr=0.1)``, ``layer(nn.Linear, 4, 8)``), functions and classes of importable
  modules, of spec files loaded with `evtrain.load_job`, and of the script
  being run (``python train.py``), whose top level is executed again in
  every worker — so its call to `launch` must sit under
  ``if __name__ == "__main__":``;
* not possible: a lambda or a nested function, and functions or classes
  defined in a notebook cell, the interactive interpreter or ``python -c``:
  there is no file to import them from. `launch` refuses them with one line
  naming the object; put them in a module (or a spec file) and import it.

`launch` and `evaluate` handle Ctrl-C as the command line does (a stop at
the next step boundary, a second one escalates). Inside a running event
loop (a Jupyter cell) the launcher runs in a thread of its own and a
KeyboardInterrupt is passed on to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.machinery
import importlib.util
import io
import json
import os
import pickle
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from evtrain.checkpoint import latest_committed
from evtrain.errors import UsageError
from evtrain.job import Job
from evtrain.launcher import Launcher, LaunchOptions
from evtrain.launcher.run_record import read_run_record
from evtrain.logs import configure_logging

if TYPE_CHECKING:
    from evtrain.job import Job
    from evtrain.launcher import Launcher

__all__ = [
    "EvalResult",
    "EvaluationFailed",
    "JobPayload",
    "LaunchResult",
    "evaluate",
    "launch",
    "rebuild_job",
    "write_job_spec",
]

_PICKLE_FILE = "job.pkl"
_MODULES_FILE = "modules.json"
_MAIN_ALIAS = "__evtrain_main__"
_REBUILDING = threading.local()
_GENERATED_SPEC = '''\
"""The Job handed to evtrain.launch(), rebuilt here (generated; see evtrain.tools.api)."""

from evtrain.tools.api import rebuild_job

job = rebuild_job(__file__)
'''


class EvaluationFailed(RuntimeError):
    """The evaluation ended without metrics (a stage failed); the message says why."""


@dataclass(frozen=True)
class LaunchResult:
    """How a run ended, from its ``run.json`` and its checkpoints."""

    status: str
    """``completed``, ``stopped``, ``failed``, ``hung`` or ``interrupted``."""
    exit_status: int
    """What ``evtrain launch`` would have exited with (0: completed or stopped cleanly)."""
    run_id: str
    run_dir: Path
    steps: int
    """Optimizer steps the run has completed, counting the ones before a resume."""
    final_loss: float | None
    last_eval: dict[str, float] | None
    """The metrics of the run's last evaluation (None: none happened)."""
    last_eval_step: int | None
    checkpoint: Path | None
    """The run directory's latest committed checkpoint (None: none)."""
    root_cause: str | None = None
    """Why a failed run failed (the first stage that failed)."""

    @property
    def ok(self) -> bool:
        """Whether the run completed or was stopped cleanly."""
        return self.exit_status == 0


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of a checkpoint (also written to `output` as JSON)."""

    metrics: dict[str, float | None]
    """Exactly what the last stage computed (None where a value is not finite); with
    named eval sets every name carries its set's prefix (``val/loss``)."""
    step: int
    """The checkpoint's step: the weights after that many optimizer steps."""
    samples: int
    checkpoint: Path
    recorded: dict[str, float | None]
    """The metric stored with the checkpoint when it was saved as a best one, else empty."""
    eval_dir: Path
    """The evaluation run's own directory (its record and reports)."""
    output: Path
    sets: dict[str, int] = dataclasses.field(default_factory=dict)
    """Samples of each named eval set (empty: the job has one unnamed set)."""


def launch(
    spec: str | os.PathLike[str] | Job,
    *,
    resume: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    hooks: bool = True,
    max_restarts: int = 0,
    run_id: str | None = None,
    quiet: bool = False,
    out: TextIO | None = None,
    curve_dir: str | os.PathLike[str] | None = None,
    hang_timeout: float | None = None,
    **overrides: Any,
) -> LaunchResult:
    """Train ``spec`` (a spec file or a `Job`) to the end; see the module docstring.

    ``resume``: ``"auto"`` (the latest committed checkpoint if there is one,
    else step 0), ``"latest"`` (it must exist) or a checkpoint path.
    ``overwrite`` starts over in a run directory that holds a run.
    ``curve_dir``: secure the run's bus with the CURVE keys there, as
    ``evtrain launch --curve-dir`` does. ``hang_timeout``: as ``--hang-timeout``
    (seconds without progress before the run is reported hung and ended; None:
    derived from the step time; 0: never).
    """
    options = LaunchOptions(
        **_source(spec),
        overrides=_override_strings(overrides),
        resume=None if resume is None else str(resume),
        overwrite=overwrite,
        hooks=hooks,
        max_restarts=max_restarts,
        run_id=run_id,
        quiet=quiet,
        log_level=_log_level(quiet),
        curve_dir=None if curve_dir is None else str(curve_dir),
        hang_timeout=hang_timeout,
    )
    launcher = Launcher(options, out=out)
    status = _run(launcher)
    return _launch_result(launcher, status)


def evaluate(
    spec: str | os.PathLike[str] | Job,
    checkpoint: str | os.PathLike[str],
    *,
    output: str | os.PathLike[str] | None = None,
    eval_dir: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    out: TextIO | None = None,
    **overrides: Any,
) -> EvalResult:
    """Evaluate ``checkpoint`` (or a run directory's latest committed one) once.

    The stages load it and run the job's evaluation at its step's boundary,
    as training would have there, without a training step and without
    saving anything: the metrics equal the ones recorded for that step.
    They are written as JSON to ``output`` (default
    ``EVAL_DIR/eval.json``; ``EVAL_DIR`` defaults to ``RUN_DIR/evals/RUN_ID``
    of the checkpoint's run). Raises `EvaluationFailed` when a stage fails.
    """
    options = LaunchOptions(
        **_source(spec),
        overrides=_override_strings(overrides),
        evaluate=str(checkpoint),
        eval_dir=None if eval_dir is None else str(eval_dir),
        eval_output=None if output is None else str(output),
        hooks=False,
        quiet=quiet,
        log_level=_log_level(quiet),
    )
    launcher = Launcher(options, out=out)
    status = _run(launcher)
    result = launcher.evaluation
    if result is None:
        record = _record(launcher)
        why = record.get("root_cause") or f"exit status {status}"
        raise EvaluationFailed(f"the evaluation of {checkpoint} failed: {why}")
    return EvalResult(
        metrics=dict(result["metrics"]),
        step=int(result["step"]),
        samples=int(result["samples"]),
        checkpoint=Path(result["checkpoint"]),
        recorded=dict(result["recorded"]),
        eval_dir=Path(result["eval_dir"]),
        output=Path(result["output"]),
        sets=dict(result["sets"]),
    )


# ------------------------------------------------------------------ running


def _source(spec: str | os.PathLike[str] | Job) -> dict[str, Any]:
    if getattr(_REBUILDING, "active", False):
        raise UsageError(
            "evtrain.launch() was called while a stage process rebuilt the Job from the "
            "script that defines it: put the call under `if __name__ == '__main__':`"
        )
    if isinstance(spec, Job):
        # The path is a placeholder until the launcher writes the spec that rebuilds it.
        try:
            source = JobPayload.of(spec)  # what the stage processes rebuild it from
        except UsageError as exc:
            raise exc.with_traceback(None) from None
        return {"spec": "<job>", "job": spec, "job_source": source}
    if isinstance(spec, str | os.PathLike):
        return {"spec": os.fspath(spec)}
    raise UsageError(f"expected a job spec path or an evtrain Job, got {type(spec).__name__}")


def _log_level(quiet: bool) -> str:
    """The processes' log level; this process logs at it too unless the caller set logging up."""
    import structlog

    level = "warning" if quiet else "info"
    if not structlog.is_configured():
        configure_logging("console", level)
    return level


def _override_strings(overrides: Mapping[str, Any]) -> dict[str, str]:
    """Keyword overrides as the strings of their command-line flags."""
    out: dict[str, str] = {}
    for key, value in overrides.items():
        if value is None:
            out[key] = "none"
        elif isinstance(value, bool):
            raise UsageError(f"override {key}={value!r}: expected a number, a name or a path")
        elif isinstance(value, list | tuple):
            out[key] = ",".join(str(v) for v in value)
        else:
            out[key] = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    return out


def _run(launcher: Launcher) -> int:
    """Run the launcher where it can own an event loop; UsageError without the deep frames."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    main = threading.current_thread() is threading.main_thread()
    launcher.options.handle_signals = main and not in_loop
    try:
        if not in_loop:
            return launcher.run()
        return _run_in_thread(launcher)
    except UsageError as exc:
        raise exc.with_traceback(None) from None


def _run_in_thread(launcher: Launcher) -> int:
    """Run in a thread (this one runs an event loop); pass a Ctrl-C on as SIGINT."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["status"] = launcher.run()
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="evtrain-launcher", daemon=True)
    thread.start()
    while thread.is_alive():
        try:
            thread.join(0.1)
        except KeyboardInterrupt:
            launcher.request_stop(signal.SIGINT)
    if "error" in outcome:
        raise outcome["error"]
    return int(outcome["status"])


def _record(launcher: Launcher) -> dict[str, Any]:
    if launcher.run_dir is None:
        return {}
    return read_run_record(launcher.run_dir) or {}


def _launch_result(launcher: Launcher, status: int) -> LaunchResult:
    assert launcher.run_dir is not None
    record = _record(launcher)
    latest = latest_committed(launcher.run_dir)
    return LaunchResult(
        status=str(record.get("status", "failed")),
        exit_status=status,
        run_id=str(record.get("run_id", launcher.run_id)),
        run_dir=launcher.run_dir,
        steps=int(record.get("steps") or 0),
        final_loss=record.get("final_loss"),
        last_eval=record.get("last_eval"),
        last_eval_step=record.get("last_eval_step"),
        checkpoint=latest.path if latest is not None else None,
        root_cause=record.get("root_cause"),
    )


# ------------------------------------------------- a Job object for the workers


@dataclass(frozen=True)
class JobPayload:
    """A Job as the workers rebuild it: its pickle and where its names are defined."""

    data: bytes
    files: dict[str, str]
    """Modules that are files rather than importable names (spec files, the script)."""
    paths: list[str]
    """This process's import path, for the importable ones."""

    @classmethod
    def of(cls, job: Job) -> JobPayload:
        """Pickle ``job``; `UsageError` naming what a fresh process could not import."""
        # A copy: what the job loaded and cached (the data sets) stays here.
        fresh = dataclasses.replace(job)
        try:
            data = pickle.dumps(fresh, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise UsageError(
                f"the Job cannot be sent to the stage processes: {exc} (define it in a "
                "module or a spec file; see evtrain.tools.api)"
            ) from None
        files: dict[str, str] = {}
        for module, name in _globals_of(data):
            if module in files:
                continue
            loaded = sys.modules.get(module)
            path = getattr(loaded, "__file__", None)
            if module == "__main__" and not path:
                raise UsageError(
                    f"the Job refers to {name}, defined in this interactive session (a "
                    "notebook cell, the interpreter, python -c), which the stage processes "
                    "cannot import: move it into a module or a spec file and import it"
                )
            if module == "__main__" or (path and not _importable(module)):
                files[module] = str(Path(str(path)).resolve())
        paths = [p for p in sys.path if p and Path(p).is_dir()]
        return cls(data=data, files=files, paths=paths)

    def directories(self) -> list[str]:
        """The directories of the file modules (hook processes import their neighbours)."""
        return sorted({str(Path(path).parent) for path in self.files.values()})

    def write_spec(self, directory: Path) -> Path:
        """`write_job_spec` of this payload (`evtrain.launcher.options.JobSource`)."""
        return write_job_spec(self, directory)


def _globals_of(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) the pickle refers to, in order (a load that records them)."""
    found: list[tuple[str, str]] = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.append((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return found


def _importable(module: str) -> bool:
    """Whether ``module`` is found by name (not only because it was loaded from a file)."""
    if module.startswith("_evtrain_spec_"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def write_job_spec(payload: JobPayload, directory: Path) -> Path:
    """Write a spec file (and its pickle) in ``directory`` that rebuilds the payload's Job."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _PICKLE_FILE).write_bytes(payload.data)
    modules = {"files": payload.files, "paths": payload.paths}
    (directory / _MODULES_FILE).write_text(json.dumps(modules, indent=2) + "\n")
    spec = directory / "spec.py"
    spec.write_text(_GENERATED_SPEC)
    return spec


def rebuild_job(spec_file: str | os.PathLike[str]) -> Job:
    """The Job that `write_job_spec` wrote next to ``spec_file`` (in a stage process)."""
    directory = Path(spec_file).resolve().parent
    modules = json.loads((directory / _MODULES_FILE).read_text())
    for path in modules["paths"]:
        if path not in sys.path:
            sys.path.append(path)
    files: dict[str, str] = modules["files"]
    loaded: dict[str, ModuleType] = {}

    class Rebuilder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in files:
                if module not in loaded:
                    loaded[module] = _load_file(module, files[module])
                return getattr(loaded[module], name)
            return super().find_class(module, name)

    _REBUILDING.active = True
    try:
        job: Job = Rebuilder(io.BytesIO((directory / _PICKLE_FILE).read_bytes())).load()
    finally:
        _REBUILDING.active = False
    return job


def _load_file(module: str, path: str) -> ModuleType:
    """The module ``module`` from ``path``; the script (``__main__``) under another name.

    Executing the script again defines its functions and classes; its
    ``if __name__ == "__main__":`` part does not run.
    """
    name = _MAIN_ALIAS if module == "__main__" else module
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == path:
        return existing
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader, origin=path)
    assert spec is not None
    loaded = importlib.util.module_from_spec(spec)
    loaded.__file__ = path
    sys.modules[name] = loaded
    loader.exec_module(loaded)
    return loaded
