"""Log lines of evtrain processes: structlog to stderr as console or JSON lines.

Every evtrain process (launcher, hooks, stage workers, ``evtrain bus``)
configures structlog with `configure_logging`. Lines go to `LOG_STREAM`,
which writes each line in one piece to the current ``sys.stderr``, or to the
sink `LogStream.redirect` installed (the launcher's live display prints log
lines above itself that way). A line whose reader went away (the launcher
that relayed this process's stderr died) is dropped, so logging never
raises.

Who logs what when a launcher shows the run (`LAUNCHER_CONSOLE_ENV`): the
launcher's console owns the run's header, its progress, every evaluation
and the end-of-run summary (`evtrain.launcher.progress`); the processes it starts
log only what the console does not show (a stage's partition, checkpoint
commits, warnings, errors) and keep their attach and start-up details at
debug level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, TextIO, cast

import structlog

__all__ = [
    "LAUNCHER_CONSOLE_ENV",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "LOG_STREAM",
    "LogFormat",
    "LogStream",
    "configure_logging",
    "launcher_console",
]

LogFormat = Literal["console", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

LAUNCHER_CONSOLE_ENV = "EVTRAIN_LAUNCHER_CONSOLE"
"""Set to ``1`` in the processes a launcher starts while its console shows the run."""


def launcher_console() -> bool:
    """Whether this process runs under a launcher whose console shows the run."""
    return os.environ.get(LAUNCHER_CONSOLE_ENV) == "1"


class LogStream:
    """A text stream for log lines: stderr, or a line sink while one is installed.

    `write` takes whole lines (structlog's `WriteLogger` writes each line with
    its newline in one call), so lines from several threads never interleave.
    """

    def __init__(self) -> None:
        self._sink: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        sink = self._sink
        if sink is not None:
            for line in text.splitlines():
                sink(line)
            return len(text)
        try:
            sys.stderr.write(text)
        except (BrokenPipeError, ValueError, OSError):
            pass  # stderr is gone (a closed pipe): the line has no reader
        return len(text)

    def flush(self) -> None:
        if self._sink is None:
            try:
                sys.stderr.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def as_file(self) -> TextIO:
        """This stream typed as the text file loggers take (they only write and flush)."""
        return cast(TextIO, self)

    @contextmanager
    def redirect(self, sink: Callable[[str], None]) -> Iterator[None]:
        """Send every line to ``sink`` (one call per line, no newline) until exit."""
        with self._lock:
            previous, self._sink = self._sink, sink
        try:
            yield
        finally:
            with self._lock:
                self._sink = previous


LOG_STREAM = LogStream()
"""Where this process's structlog lines go."""


def configure_logging(fmt: LogFormat = "console", level: str = "info") -> None:
    """Route structlog to `LOG_STREAM` as colourless console lines or JSON lines."""
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S"),
            structlog.processors.format_exc_info if fmt == "json" else _identity,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.WriteLoggerFactory(file=LOG_STREAM.as_file()),
        cache_logger_on_first_use=False,
    )


def _identity(
    logger: object, name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    return event_dict
