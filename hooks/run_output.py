"""Where hooks write files, and an append-only JSON-lines file.

A hook's file goes to, in this order: its explicit ``path`` option, ``DIR/NAME``
for its ``dir`` option, or ``RUN_DIR/NAME`` where RUN_DIR comes from the run's
`RunStarted` event (``run_dir``). Files are opened for append, so a hook the
launcher restarted after a crash continues the same file. A file that cannot
be opened (the event named a directory that cannot exist or be written) is
one warning and no output, not an error on every event.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

from evtrain.events import RunStarted
from evtrain.formatting import safe_text

log = structlog.get_logger("evtrain.hooks.run_output")

_MAX_FAILED = 100


class RunOutput:
    """Resolves the output file ``filename`` of one hook."""

    def __init__(
        self, hook: str, filename: str, *, path: Path | None = None, directory: Path | None = None
    ) -> None:
        self.hook = hook
        self.filename = filename
        self.path = path
        self.directory = directory
        self._warned = False
        self._failed: set[Path] = set()

    @property
    def fixed(self) -> Path | None:
        """The file if options alone decide it (no need to wait for the run)."""
        if self.path is not None:
            return self.path
        if self.directory is not None:
            return self.directory / self.filename
        return None

    def resolve(self, run: RunStarted | None) -> Path | None:
        """The file for ``run``; None (and one warning) if nothing says where."""
        fixed = self.fixed
        if fixed is not None:
            return fixed
        if run is not None and run.run_dir:
            return Path(run.run_dir) / self.filename
        if not self._warned:
            self._warned = True
            log.debug(
                "no run directory known yet: output waits for run.started "
                "(or pass the hook a 'dir' or 'path' option)",
                hook=self.hook,
                file=self.filename,
            )
        return None

    def open(self, run: RunStarted | None, *, flush_interval: float = 0.0) -> JsonLinesFile | None:
        """The file for ``run``, opened for append; None if unknown or it cannot be opened."""
        path = self.resolve(run)
        if path is None or path in self._failed:
            return None
        try:
            return JsonLinesFile(path, flush_interval=flush_interval)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            if len(self._failed) >= _MAX_FAILED:
                self._failed.clear()
            self._failed.add(path)
            log.warning(
                "cannot write hook output",
                hook=self.hook,
                path=safe_text(str(path), 300),
                error=safe_text(str(exc), 300),
            )
            return None


class JsonLinesFile:
    """Appends JSON lines to one file, flushed at most ``flush_interval`` s apart."""

    def __init__(self, path: Path, *, flush_interval: float = 0.0) -> None:
        self.path = path
        self.lines = 0
        self._flush_interval = flush_interval
        self._last_flush = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = path.open("ab")
        self._encoder = msgspec.json.Encoder()

    def write(self, record: Any) -> None:
        """Write one JSON object (anything msgspec can encode) as a line."""
        self._file.write(self._encoder.encode(record) + b"\n")
        self.lines += 1
        now = time.monotonic()
        if now - self._last_flush >= self._flush_interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Hand buffered lines to the OS."""
        self._file.flush()
        self._last_flush = time.monotonic() if now is None else now

    def close(self) -> None:
        """Flush and close."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()


def rewind_json_lines(path: str | os.PathLike[str], step: int) -> int:
    """Drop the lines of the JSON-lines log at ``path`` whose ``step`` is after ``step``;
    how many were dropped.

    The file is rewritten in place, so a writer holding it open for append
    goes on at its new end. Lines without a step are kept, except a last line
    without its newline (a writer killed mid-line), which the next line would
    corrupt.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()
    kept = [line for line in lines if not _after(line, step)]
    if len(kept) == len(lines) and len(data) == sum(map(len, lines)):
        return 0
    with path.open("r+b") as fh:
        fh.write(b"".join(kept))
        fh.truncate()
    return len(lines) - len(kept)


def _after(line: bytes, step: int) -> bool:
    try:
        record = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    value = record.get("step") if isinstance(record, dict) else None
    return isinstance(value, int) and value > step
