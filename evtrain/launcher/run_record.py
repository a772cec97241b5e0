"""The run directory: ``run.json``, and how successive launches share one directory.

``RUN_DIR/run.json`` is what the launcher records about the latest launch
into a run directory. It writes it before anything starts (``status:
"running"``, its pid, host and process start time, the bus, the spec) and
completes it at the end (``completed`` / ``stopped`` / ``failed`` /
``interrupted``, steps, exit status, root cause). A record still saying
``running`` whose launcher is gone (killed by SIGKILL, the machine went down)
is *stale*: the launcher's elastic agent marks it ``interrupted`` when it
outlives the launcher, and otherwise the next ``evtrain launch`` into the
directory or ``evtrain ckpt list`` does (`mark_if_stale`), removing the dead
launcher's private ipc directory too.

One run per directory. A run directory holds one run: its checkpoints, its
logs (``metrics.jsonl``, ``events.jsonl``), its record and the reports of
each launch (``launches/RUN_ID/``). A directory that holds any of
`RUN_FILES` is *used* (`used_by`), and a new run is never started in it: the
launcher refuses unless it is told to continue the run there (``--resume``)
or to start over (``--overwrite``, `clear_run`). A resumed launch continues
the same run's files, so readers see one history, not several:

* ``metrics.jsonl`` is rewound to the resumed step (`rewind_metrics`): the
  lines of steps after it describe weights that no checkpoint kept, and the
  resumed launch writes those steps again (as TensorBoard's ``purge_step``);
* ``events.jsonl`` keeps everything, failures of earlier launches included;
  its readers (timelines, replay) drop the progress events of steps that a
  later launch redid (`without_redone`), so each step appears once, from
  the launch whose weights went on.

Torch-free: ``evtrain ckpt`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from evtrain.events import DecodeError, RunStarted, from_builtins
from evtrain.hooks.run_output import rewind_json_lines

if TYPE_CHECKING:
    from evtrain.events import Message

__all__ = [
    "EVALS_DIR",
    "LAUNCHES_DIR",
    "METRICS_FILE",
    "RUN_FILES",
    "RUN_RECORD",
    "clear_run",
    "describe_run",
    "launcher_alive",
    "mark_if_stale",
    "mark_interrupted",
    "process_start_ticks",
    "read_run_record",
    "rewind_metrics",
    "used_by",
    "without_redone",
    "write_run_record",
]

RUN_RECORD = "run.json"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LAUNCHES_DIR = "launches"
"""Each launch's reports, ``launches/RUN_ID`` (stage and agent reports, the failure report)."""
EVALS_DIR = "evals"
"""Where evaluations of the run's checkpoints keep their own files (``evtrain eval``)."""
RUN_FILES: tuple[str, ...] = (
    RUN_RECORD,
    METRICS_FILE,
    EVENTS_FILE,
    "checkpoints",
    LAUNCHES_DIR,
    "elastic",
    "tensorboard",
    "timeline.json",
    "replay",
    EVALS_DIR,
)
"""What a run leaves in its directory (the launcher's, the built-in hooks', the tools')."""
_LOGS = (METRICS_FILE, EVENTS_FILE)
_PROGRESS_TAGS = frozenset(
    (
        "step.started",
        "step.ended",
        "microbatch.forward",
        "microbatch.backward",
        "microbatch.wait",
        "eval.started",
        "eval.ended",
        "epoch.ended",
    )
)
"""Events that describe the training of one step (``step`` = steps completed or running)."""
_RUN_STARTED_TAG = "run.started"


def _path(run_dir_or_file: str | os.PathLike[str]) -> Path:
    path = Path(run_dir_or_file)
    return path if path.name == RUN_RECORD else path / RUN_RECORD


def read_run_record(run_dir_or_file: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record, or None when there is none (or it is not a JSON object)."""
    try:
        data = json.loads(_path(run_dir_or_file).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_run_record(run_dir_or_file: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Replace the record atomically."""
    path = _path(run_dir_or_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses.
    return int(stat.rsplit(b")", 1)[1].split()[19])


def launcher_alive(record: dict[str, Any]) -> bool:
    """Whether the launcher that wrote ``record`` still runs (True when it cannot be told).

    A record from another host is never judged. The process start time tells a
    recycled pid from the launcher itself.
    """
    pid = record.get("launcher_pid")
    if not isinstance(pid, int) or record.get("host", socket.gethostname()) != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    started = record.get("launcher_start")
    return started is None or process_start_ticks(pid) in (None, started)


def mark_interrupted(run_dir_or_file: str | os.PathLike[str], why: str) -> dict[str, Any] | None:
    """Turn a ``running`` record into ``interrupted``; the updated record, else None."""
    record = read_run_record(run_dir_or_file)
    if record is None or record.get("status") != "running":
        return None
    record["status"] = "interrupted"
    record["interrupted"] = {"why": why, "noticed": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_run_record(run_dir_or_file, record)
    return record


def mark_if_stale(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Mark a stale record ``interrupted`` and remove its launcher's ipc directory.

    Returns the record it marked, None when the record is absent, finished or
    its launcher alive.
    """
    record = read_run_record(run_dir)
    if record is None or record.get("status") != "running" or launcher_alive(record):
        return None
    marked = mark_interrupted(run_dir, f"its launcher (pid {record.get('launcher_pid')}) is gone")
    owned = record.get("owned_bus_dir")
    if isinstance(owned, str) and owned:
        shutil.rmtree(owned, ignore_errors=True)
    return marked


# ------------------------------------------------------------ one run per directory


def used_by(run_dir: str | os.PathLike[str]) -> list[str]:
    """The `RUN_FILES` present in ``run_dir`` (empty: no run has used it)."""
    root = Path(run_dir)
    return [name for name in RUN_FILES if (root / name).exists()]


def describe_run(run_dir: str | os.PathLike[str]) -> str:
    """``run 2025... (completed, 300 steps)`` for the run recorded in ``run_dir``."""
    record = read_run_record(run_dir)
    if record is None:
        return "the files of an earlier run (" + ", ".join(used_by(run_dir)) + ")"
    steps = record.get("steps")
    what = [str(record.get("status", "unknown status"))]
    if isinstance(steps, int):
        what.append(f"{steps} steps")
    return f"run {record.get('run_id')} ({', '.join(what)})"


def clear_run(run_dir: str | os.PathLike[str]) -> None:
    """Remove what a run left in ``run_dir`` (`RUN_FILES`), for a run that starts over.

    Other files stay (a spec kept in the directory, a user hook's output).
    The JSON-lines logs are emptied in place rather than removed: a hook
    that keeps one open for append across runs (a long-lived service) then
    writes into the emptied file instead of a deleted one.
    """
    root = Path(run_dir)
    for name in RUN_FILES:
        path = root / name
        if name in _LOGS and path.is_file():
            os.truncate(path, 0)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def rewind_metrics(run_dir: str | os.PathLike[str], step: int) -> int:
    """Drop the ``metrics.jsonl`` lines of steps after ``step``; how many were dropped.

    For a launch that resumes the run at ``step`` (0: a run that starts from
    scratch in its own directory again); see `rewind_json_lines`.
    """
    return rewind_json_lines(Path(run_dir) / METRICS_FILE, step)


def without_redone(
    events_file: str | os.PathLike[str], messages: Iterable[Message]
) -> Iterator[Message]:
    """``messages`` without the progress events of steps that a later launch redid.

    ``messages`` are the events of the recording ``events_file`` in file
    order, its `RunStarted` events included (they mark where each launch,
    or elastic restart, begins). A launch that resumed at step K redid every
    step after K, so the earlier launches' step, span and evaluation events
    after K are dropped; everything else (failures, checkpoints, the runs'
    starts and ends) stays.
    """
    cutoffs = _redo_cutoffs(Path(events_file))
    seen: set[tuple[object, ...]] = set()
    launch = -1
    for msg in messages:
        if isinstance(msg, RunStarted):
            key = (msg.run_id, msg.source, msg.seq, msg.ts)
            if key not in seen:
                seen.add(key)
                launch += 1
        elif (
            0 <= launch < len(cutoffs)
            and str(type(msg).__struct_config__.tag) in _PROGRESS_TAGS
            and getattr(msg, "step", -1) > cutoffs[launch]
        ):
            continue
        yield msg


def _redo_cutoffs(path: Path) -> list[float]:
    """Per launch in the recording: the step after which a later launch redid its steps."""
    starts: list[int] = []
    # A restarted recorder records the run's state again: the same RunStarted
    # (same envelope) is one launch, not two.
    seen: set[tuple[object, ...]] = set()
    needle = f'"{_RUN_STARTED_TAG}"'.encode()
    try:
        with path.open("rb") as lines:
            for line in lines:
                if needle not in line:
                    continue
                try:
                    record = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    continue
                if not isinstance(record, dict) or record.get("type") != _RUN_STARTED_TAG:
                    continue
                try:  # counted only where the reader of the recording yields it
                    msg = from_builtins(record)
                except DecodeError:
                    continue
                if isinstance(msg, RunStarted):
                    key = (msg.run_id, msg.source, msg.seq, msg.ts)
                    if key not in seen:
                        seen.add(key)
                        starts.append(msg.start_step)
    except OSError:
        return []
    cutoffs: list[float] = []
    later = math.inf
    for start in reversed(starts):
        cutoffs.append(later)
        later = min(later, start)
    return cutoffs[::-1]
