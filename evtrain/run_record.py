"""``RUN_DIR/run.json``: what the launcher records about the latest launch into a run directory.

The launcher writes it before anything starts (``status: "running"``, its pid,
host and process start time, the bus, the spec) and completes it at the end
(``completed`` / ``stopped`` / ``failed`` / ``interrupted``, steps, exit
status, root cause). A record still saying ``running`` whose launcher is gone
(killed by SIGKILL, the machine went down) is *stale*: the launcher's elastic
agent marks it ``interrupted`` when it outlives the launcher, and otherwise the
next ``evtrain launch`` into the directory or ``evtrain ckpt list`` does
(`mark_if_stale`), removing the dead launcher's private ipc directory too.

Torch-free and bus-free: ``evtrain ckpt`` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_RECORD",
    "launcher_alive",
    "mark_if_stale",
    "mark_interrupted",
    "process_start_ticks",
    "read_run_record",
    "write_run_record",
]

RUN_RECORD = "run.json"


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
