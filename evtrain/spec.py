"""Loading a job spec file and applying command-line overrides to it.

A spec file is Python that defines a module-level ``job`` (an
`evtrain.job.Job`) or a ``make_job()`` function returning one. Every stage
process loads the file itself (`load_job`) and applies the same overrides
(`apply_overrides` takes plain strings), so a launcher only hands the path
and the override strings to its workers — nothing is pickled.

Typical CLI use::

    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    add_override_arguments(parser)
    ns = parser.parse_args()
    job = apply_overrides(load_job(ns.spec), overrides_from_args(ns))
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from evtrain.errors import SpecError, UsageError
from evtrain.job import Job
from evtrain.job_checks import SCHEDULES, SPAN_MODES

__all__ = [
    "OVERRIDES",
    "add_override_arguments",
    "apply_overrides",
    "load_job",
    "overrides_from_args",
]

log = structlog.get_logger()


# ---------------------------------------------------------------------- loading


def _module_name(path: Path) -> str:
    # A private, unique name: the spec must never shadow or be shadowed by a
    # real module (a user's `hooks.py`, `evtrain.hooks`), yet be registered in
    # sys.modules so dataclasses, pickle and inspect work on what it defines.
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"_evtrain_spec_{stem}_{digest}"


def _spec_line(exc: BaseException, path: Path) -> int | None:
    """The innermost traceback line that lies in the spec file itself."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename and Path(frame.filename).resolve() == path:
            line = frame.lineno
    return line


def _exec_spec(path: Path) -> ModuleType:
    name = _module_name(path)
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    # Modules next to the spec are importable, now and later (factories may
    # import lazily). Appended, not prepended as `python spec.py` would: a
    # stray `torch.py` or `hooks.py` beside the spec must not shadow anything.
    spec_dir = str(path.parent)
    if spec_dir not in sys.path:
        sys.path.append(spec_dir)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        where = f"{exc.filename or path}:{exc.lineno}"
        raise UsageError(f"{where}: syntax error in job spec: {exc.msg}") from exc
    except UsageError:
        # Already names what is wrong (e.g. SpecError from Job(...)).
        sys.modules.pop(name, None)
        raise
    except Exception as exc:
        sys.modules.pop(name, None)
        line = _spec_line(exc, path)
        where = f"{path}:{line}" if line is not None else str(path)
        raise UsageError(f"{where}: job spec raised {type(exc).__name__}: {exc}") from exc
    return module


def load_job(path: str | Path) -> Job:
    """Execute the spec file at ``path`` and return its validated `Job`.

    Takes ``make_job()`` if the file defines it, else the module-level
    ``job``. Raises `UsageError` (one line, with ``file:line`` where it
    helps) when the file is missing, does not compile, raises while running,
    defines neither name, defines both, or yields something else than a Job;
    a `SpecError` from the Job itself passes through unchanged. The spec's
    directory is appended to ``sys.path`` so it can import its neighbours.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"job spec file not found: {path}")
    if not path.is_file():
        raise UsageError(f"job spec is not a file: {path}")
    path = path.resolve()
    module = _exec_spec(path)
    has_job = hasattr(module, "job")
    make_job = getattr(module, "make_job", None)
    if has_job and make_job is not None:
        raise UsageError(f"{path}: defines both 'job' and 'make_job'; keep one")
    if make_job is not None:
        if not callable(make_job):
            raise UsageError(f"{path}: 'make_job' is not a function")
        try:
            job = make_job()
        except UsageError:
            raise
        except Exception as exc:
            line = _spec_line(exc, path)
            where = f"{path}:{line}" if line is not None else str(path)
            raise UsageError(f"{where}: make_job() raised {type(exc).__name__}: {exc}") from exc
        what = "make_job() returned"
    elif has_job:
        job = module.job
        what = "'job' is"
    else:
        raise UsageError(f"{path}: defines neither 'job' nor 'make_job()'")
    if not isinstance(job, Job):
        raise UsageError(f"{path}: {what} a {type(job).__name__}, expected an evtrain.job.Job")
    return job


# -------------------------------------------------------------------- overrides


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _parse_int(text)


def _parse_optional_float(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text.strip())


def _parse_balance(text: str) -> tuple[int, ...] | str | None:
    word = text.strip().lower()
    if word in ("auto", "none", ""):
        return None
    if word in ("params", "compute"):
        return word
    return tuple(int(part) for part in text.split(","))


def _parse_str(text: str) -> str:
    return text.strip()


@dataclass(frozen=True)
class Override:
    """One command-line override: ``--flag VALUE`` sets Job field ``field``."""

    flag: str
    field: str
    parse: Callable[[str], Any]
    expect: str
    help: str


OVERRIDES: dict[str, Override] = {
    o.flag.replace("-", "_"): o
    for o in (
        Override("stages", "stages", _parse_int, "an integer", "pipeline stages P"),
        Override(
            "dp",
            "data_parallel",
            _parse_int,
            "an integer",
            "data-parallel replicas D of the pipeline (P x D processes)",
        ),
        Override(
            "microbatches",
            "num_microbatches",
            _parse_int,
            "an integer",
            "microbatches per batch M (must divide the batch size)",
        ),
        Override("schedule", "schedule", _parse_str, "a name", f"one of {', '.join(SCHEDULES)}"),
        Override(
            "virtual-stages",
            "virtual_stages",
            _parse_int,
            "an integer",
            "model chunks V per stage for --schedule interleaved (P x V chunks; 2 for zbv)",
        ),
        Override(
            "steps",
            "max_steps",
            _parse_optional_int,
            "an integer or 'none'",
            "optimizer steps to train; without --epochs it replaces the spec's epochs",
        ),
        Override(
            "epochs",
            "epochs",
            _parse_optional_int,
            "an integer or 'none'",
            "epochs to train; without --steps it replaces the spec's max_steps",
        ),
        Override("batch-size", "batch_size", _parse_int, "an integer", "samples per batch"),
        Override("seed", "seed", _parse_int, "an integer", "seed for init and shuffling"),
        Override("run-dir", "run_dir", _parse_str, "a path", "run directory"),
        Override("device", "device", _parse_str, "a device", "cpu or cuda"),
        Override(
            "balance",
            "balance",
            _parse_balance,
            "comma-separated integers, 'params' or 'compute'",
            "layers per stage, e.g. 2,3, or 'params' / 'compute' to balance automatically",
        ),
        Override(
            "eval-every",
            "eval_every",
            _parse_optional_int,
            "an integer or 'none'",
            "evaluate every N steps",
        ),
        Override(
            "grad-clip",
            "grad_clip",
            _parse_optional_float,
            "a number or 'none'",
            "max global gradient L2 norm",
        ),
        Override(
            "spans",
            "microbatch_spans",
            _parse_str,
            "a mode",
            f"microbatch span events: {', '.join(SPAN_MODES)}",
        ),
        Override(
            "threads",
            "threads",
            _parse_optional_int,
            "an integer or 'none'",
            "torch threads per stage process",
        ),
    )
}
"""Override keys (the flag with ``_`` for ``-``) -> what they set."""

_BY_FIELD = {o.field: key for key, o in OVERRIDES.items()}


def apply_overrides(job: Job, overrides: Mapping[str, str | None]) -> Job:
    """A validated copy of ``job`` with command-line strings applied.

    Keys are `OVERRIDES` keys (``"stages"``, ``"microbatches"``,
    ``"batch_size"``, ``"spans"``, ...) or the Job field names they set
    (``"num_microbatches"``, ``"max_steps"``, ...); values are the raw
    strings; ``None`` values are ignored. Errors are `SpecError` naming the
    Job field and the flag. Two conveniences, logged when they apply:

    * ``steps`` without ``epochs`` (or the reverse) replaces the spec's whole
      stopping rule: the other one is cleared.
    * ``stages`` without ``balance`` drops a spec ``balance`` (or
      ``split_points``) that no longer fits, so the layers are balanced
      automatically.
    """
    changes: dict[str, Any] = {}
    flags: dict[str, str] = {}
    for key, text in overrides.items():
        if text is None:
            continue
        key_norm = key.replace("-", "_")
        if key_norm in _BY_FIELD:
            key_norm = _BY_FIELD[key_norm]
        override = OVERRIDES.get(key_norm)
        if override is None:
            raise SpecError(key, f"not an override; choose from {', '.join(sorted(OVERRIDES))}")
        try:
            value = override.parse(str(text))
        except ValueError:
            raise SpecError(
                override.field, f"--{override.flag} expects {override.expect}, got {text!r}"
            ) from None
        changes[override.field] = value
        flags[override.field] = f"--{override.flag} {text}"

    if "max_steps" in changes and "epochs" not in changes and job.epochs is not None:
        changes["epochs"] = None
        log.info("override clears the spec's epochs", max_steps=changes["max_steps"])
    if "epochs" in changes and "max_steps" not in changes and job.max_steps is not None:
        changes["max_steps"] = None
        log.info("override clears the spec's max_steps", epochs=changes["epochs"])
    if (
        "stages" in changes
        and "balance" not in changes
        and isinstance(job.balance, tuple)
        and len(job.balance) != changes["stages"]
    ):
        changes["balance"] = None
        log.info("override drops the spec's balance", stages=changes["stages"])
    if (
        "stages" in changes
        and job.split_points is not None
        and len(job.split_points) != changes["stages"] - 1
    ):
        changes["split_points"] = None
        log.info("override drops the spec's split_points", stages=changes["stages"])

    try:
        return job.with_overrides(**changes)
    except SpecError as exc:
        if exc.field in flags:
            raise SpecError(exc.field, f"{exc.message} (from {flags[exc.field]})") from None
        raise


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--stages --microbatches --schedule --steps ...`` (see `OVERRIDES`) to ``parser``.

    All default to None (= keep the spec's value) and are kept as strings;
    `overrides_from_args` collects them for `apply_overrides`.
    """
    group = parser.add_argument_group("job spec overrides")
    for key, o in OVERRIDES.items():
        group.add_argument(
            f"--{o.flag}",
            dest=key,
            default=None,
            metavar=o.flag.split("-")[-1].upper(),
            help=f"{o.help} (sets {o.field})",
        )


def overrides_from_args(ns: argparse.Namespace) -> dict[str, str]:
    """The override strings given on the command line, keyed as `apply_overrides` expects."""
    return {key: value for key in OVERRIDES if (value := getattr(ns, key, None)) is not None}
