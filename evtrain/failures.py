"""Why a run failed: the first stage that failed, and what followed from it.

When one stage of a pipeline fails, the others fail soon after: their
point-to-point receives and collectives see the dead peer's connections close
("Connection closed by peer", "Read error" from gloo, NCCL errors). Those
follow-on errors are symptoms, and the stage that caused them may have said
nothing at all (killed by SIGKILL, the OOM killer, a native crash). The
launcher therefore decides from evidence that does not depend on the bus:

* every stage's own `evtrain.stages.worker.StageReport`: the exception, the
  time it was caught, the innermost frame in user code, whether it is a
  communication error (`is_communication_error`);
* the elastic agent's record of every worker process (`evtrain.launcher.elastic_agent`):
  when it died, its exit status or signal, whether the agent killed it after
  another worker had failed;
* ``StageFailed`` events from the bus, for stages the first two do not cover
  (another machine's).

`find_root_cause` takes the earliest failure that is not a consequence (not a
communication error, not a kill by the agent); when every failure is one, the
earliest of all. Its `Failure.headline` is what the launcher prints once and
what ``RunEnded.root_cause`` carries; the others are listed one short line
each as consequences.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import signal
import sysconfig
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import TracebackType

__all__ = [
    "Failure",
    "RootCause",
    "failure_from_exit",
    "find_root_cause",
    "frame_location",
    "frame_text",
    "is_communication_error",
    "is_user_file",
    "short_error",
    "signal_name",
    "user_frames",
]

_COMMUNICATION_TYPES = frozenset(
    {
        "DistNetworkError",
        "DistBackendError",
        "DistStoreError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
    }
)
_COMMUNICATION_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Broken pipe",
    "Socket Timeout",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "recvValue failed",
    "failed to recv",
)
_ERROR_CHARS = 160


def is_communication_error(error: str) -> bool:
    """Whether ``error`` (``"Type: message"``) is a failure to talk to another process."""
    kind, _, message = error.partition(":")
    if kind.strip().rpartition(".")[2] in _COMMUNICATION_TYPES:
        return True
    return any(marker in message for marker in _COMMUNICATION_MARKERS)


def short_error(error: str, limit: int = _ERROR_CHARS) -> str:
    """The first line of ``error``, at most ``limit`` characters."""
    first = error.strip().splitlines()[0] if error.strip() else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


def signal_name(exit_code: int) -> str:
    """``-9`` -> ``"SIGKILL"`` (a negative exit code is a signal, as in `subprocess`)."""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


# --------------------------------------------------------------- user frames


@cache
def _library_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    packages = ("evtrain", "evtrain.bus", "evtrain.stages", "evtrain.hooks", "evtrain.exporters")
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            roots.update(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is user code: not evtrain, torch or anything installed, not
    the standard library."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    real = os.path.realpath(filename)
    return not any(real.startswith(root) for root in _library_roots())


def user_frames(tb: TracebackType | None) -> list[str]:
    """The frames of ``tb`` in user code (not evtrain, torch, the stdlib), innermost last.

    Each is ``FILE:LINE in FUNCTION: SOURCE``. A failure entirely inside
    library code gives its innermost frame instead, so there is always a place
    to look (empty only without a traceback).
    """
    frames = traceback.extract_tb(tb)
    chosen = [f for f in frames if is_user_file(f.filename)] or frames[-1:]
    return [frame_text(f.filename, f.lineno or 0, f.name, f.line) for f in chosen]


def frame_text(filename: str, lineno: int, function: str, source: str | None = None) -> str:
    """A frame as `user_frames` gives it: ``FILE:LINE in FUNCTION: SOURCE`` (the source
    line read from the file when not given)."""
    line = (source or linecache.getline(filename, lineno)).strip()
    where = f"{_display_path(filename)}:{lineno} in {function}"
    return f"{where}: {line}" if line else where


def frame_location(frame: str) -> str:
    """``FILE:LINE in FUNCTION`` of a `user_frames` entry (without its source line)."""
    return frame.split(": ", 1)[0]


def _display_path(filename: str) -> str:
    path = Path(filename)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- root cause


@dataclass(frozen=True)
class Failure:
    """One stage's failure as established from the evidence."""

    stage: int
    at: float
    """Wall-clock time it happened (caught, or the death observed)."""
    what: str
    """The error (``"RuntimeError: ..."``), or for a process that died what happened
    to it (``"was killed by SIGKILL"``)."""
    consequence: bool
    """A symptom of another failure (communication error, killed by the agent)."""
    location: str = ""
    step: int | None = None
    """The step it failed in, or (for a process that died) the steps it had completed."""
    died: bool = False
    """The process ended without reporting an error (signal or bare exit)."""
    user_frames: tuple[str, ...] = ()
    traceback: str = ""
    certain: bool = True
    """False while a dead process's exit status is not known yet."""
    replica: int | None = None
    """Which of the stage's data-parallel replicas failed, when the run has several."""
    tp: int | None = None
    """Which of the stage's tensor ranks failed, when the run has several."""

    def headline(self, *, brief: bool = False) -> str:
        """One line: which stage, when, what, where (``brief``: the error's first sentence)."""
        who = f"stage {self.stage}"
        if self.replica is not None:
            who += f" replica {self.replica}"
        if self.tp is not None:
            who += f" tensor rank {self.tp}"
        if self.died:
            after = f" after step {self.step}" if self.step else ""
            return f"{who} {self.what}{after}"
        at = f" at step {self.step}" if self.step is not None else ""
        if brief:
            return f"{who} failed{at}: {short_error(self.what.split('. ')[0])}"
        where = f" ({self.location})" if self.location else ""
        return f"{who} failed{at}: {short_error(self.what)}{where}"


@dataclass(frozen=True)
class RootCause:
    """The failure that caused the others, and the others in time order."""

    first: Failure
    consequences: list[Failure] = field(default_factory=list)

    def headline(self) -> str:
        """The root cause in one line (`Failure.headline` of the first)."""
        return self.first.headline()

    def report(self) -> str:
        """Everything known, for a file: headline, traceback, the consequences in full."""
        parts = [self.headline(), ""]
        if self.first.traceback:
            parts += [self.first.traceback.rstrip(), ""]
        for other in self.consequences:
            parts.append(f"consequence: {other.headline()}")
            if other.traceback:
                parts += [other.traceback.rstrip(), ""]
        return "\n".join(parts).rstrip() + "\n"


def failure_from_exit(
    stage: int,
    exit_code: int | None,
    died_at: float,
    *,
    killed_by_agent: bool,
    step: int | None,
    replica: int | None = None,
    tp: int | None = None,
) -> Failure:
    """The failure of a worker process that ended without reporting an error.

    ``replica``: the stage's data-parallel replica it ran (None for a run without);
    ``tp``: its tensor rank (None for a run without).
    """
    if killed_by_agent:
        what, consequence = "was killed after another stage failed", True
    elif exit_code is None:
        what, consequence = "ended without reporting an error (exit status unknown)", False
    elif exit_code < 0:
        what, consequence = f"was killed by {signal_name(exit_code)}", False
    else:
        what, consequence = f"exited with status {exit_code} without reporting an error", False
    return Failure(
        stage=stage,
        at=died_at,
        what=what,
        consequence=consequence,
        step=step,
        died=True,
        certain=killed_by_agent or exit_code is not None,
        replica=replica,
        tp=tp,
    )


def find_root_cause(failures: Iterable[Failure]) -> RootCause | None:
    """The earliest failure that is not a consequence (else the earliest); None if none."""
    ordered = sorted(failures, key=lambda f: (f.at, f.stage))
    if not ordered:
        return None
    primary = [f for f in ordered if not f.consequence]
    first = primary[0] if primary else ordered[0]
    return RootCause(first=first, consequences=[f for f in ordered if f is not first])
