"""Loading a job spec file.

A spec file is Python that defines a module-level ``job`` (an
`evtrain.job.Job`) or a ``make_job()`` function returning one. Every stage
process loads the file itself (`load_job`) and applies the same overrides
(`evtrain.overrides.apply_overrides` takes plain strings), so a launcher only
hands the path and the override strings to its workers — nothing is pickled.

Typical CLI use::

    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    add_override_arguments(parser)
    ns = parser.parse_args()
    job = apply_overrides(load_job(ns.spec), overrides_from_args(ns))
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType

from evtrain.errors import UsageError
from evtrain.job import Job

__all__ = ["load_job"]


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
