"""The event recorder (short name ``recorder``): every event to RUN_DIR/events.jsonl.

One JSON object per line, as `evtrain.events.to_builtins` gives it (with the
``type`` tag and the envelope), in the order the hook received them. Lines are
flushed at most ``flush_interval`` seconds apart and at once on run end, a
stage failure and teardown, so a crash loses at most that much.
``evtrain replay RUN_DIR --hook REF`` feeds the file through any hook.

`read_recording` is the one reader of such files (replay and timelines use
it): a line that is not a valid event of the schema (a truncated last line of
a killed run, an event of a newer schema, out-of-range values, garbage) is
skipped and counted per kind; one line per kind is logged when reading ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
import structlog

from evtrain.events import (
    MESSAGE_TYPES,
    DecodeError,
    Event,
    HookProbe,
    Message,
    RunEnded,
    StageFailed,
    from_builtins,
    to_builtins,
)
from evtrain.formatting import safe_text
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, path_option
from evtrain.hooks.run_output import JsonLinesFile, RunOutput
from evtrain.ratelimit import MAX_KINDS

log = structlog.get_logger("evtrain.exporters.recorder")

FILENAME = "events.jsonl"
MAX_WAITING = 10_000

EVENT_TYPES: tuple[type[Message], ...] = tuple(
    t for t in MESSAGE_TYPES if issubclass(t, Event) and t is not HookProbe
)
"""Every event type of the schema but start-up probes (commands travel on the other bus)."""


class EventRecorder(Hook):
    """Record every event.

    Options: ``dir`` (write ``DIR/events.jsonl``) or ``path`` (this file);
    default ``RUN_DIR/events.jsonl``; ``flush_interval`` (seconds, default 0.5).
    Events that arrive before the run directory is known wait in memory (the
    latest `MAX_WAITING`; older ones are dropped and counted in ``unrecorded``).
    """

    name = "recorder"
    default_priority = 10  # record an event before slower hooks act on it

    def __init__(
        self,
        *,
        dir: str | Path | None = None,
        path: str | Path | None = None,
        flush_interval: float = 0.5,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.output = RunOutput(
            self.name,
            FILENAME,
            path=path_option(self.name, "path", path),
            directory=path_option(self.name, "dir", dir),
        )
        self.flush_interval = float_option(self.name, "flush_interval", flush_interval)
        self.file: JsonLinesFile | None = None
        self._waiting: deque[dict[str, object]] = deque(maxlen=MAX_WAITING)
        self.unrecorded = 0
        """Events dropped from the front of a full waiting queue."""

    @on(*EVENT_TYPES)
    def record(self, ev: Message) -> None:
        """Append the event; flush when due (at once for the end of a run or a failure)."""
        if self.file is None:
            self.file = self.output.open(self.state.run, flush_interval=self.flush_interval)
            if self.file is None:
                if len(self._waiting) == self._waiting.maxlen:
                    self.unrecorded += 1
                self._waiting.append(to_builtins(ev))
                return
            self.log.info("recording events", path=safe_text(self.file.path))
            for record in self._waiting:
                self.file.write(record)
            self._waiting.clear()
        self.file.write(to_builtins(ev))
        if isinstance(ev, RunEnded | StageFailed):
            self.file.flush()

    async def teardown(self) -> None:
        """Flush and close."""
        if self.file is not None:
            self.file.close()
        elif self._waiting:
            self.log.warning(
                "events not recorded: no run directory known",
                events=len(self._waiting) + self.unrecorded,
            )


def read_recording(path: str | Path, *, types: Iterable[str] | None = None) -> Iterator[Message]:
    """The valid events of a recorder file, in file order.

    ``types`` keeps only those tags (``"microbatch.forward"``...) and skips
    decoding everything else. Skipped lines are counted per kind and logged
    once per kind when the iteration ends (also when it is stopped early).
    """
    wanted = None if types is None else frozenset(types)
    decoder = msgspec.json.Decoder()
    skipped = _Skipped()
    try:
        with open(path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                skipped.line = number
                line = raw.strip()
                if not line:
                    continue
                try:
                    data = decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    skipped.add("not JSON")
                    continue
                if not isinstance(data, dict):
                    skipped.add("not a JSON object")
                    continue
                if wanted is not None and data.get("type") not in wanted:
                    continue
                try:
                    msg = from_builtins(data)
                except DecodeError as exc:
                    skipped.add(exc.kind)
                    continue
                yield msg
    finally:
        skipped.log(path)


class _Skipped:
    """Lines of one file skipped so far: kind -> (lines, first line number)."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[int, int]] = {}
        self.line = 0
        self._last_bad = 0

    def add(self, kind: str) -> None:
        if kind not in self.kinds and len(self.kinds) >= MAX_KINDS:
            kind = "other"
        count, first = self.kinds.get(kind, (0, self.line))
        self.kinds[kind] = (count + 1, first)
        self._last_bad = self.line

    def log(self, path: str | Path) -> None:
        # A run killed mid-write leaves one partial last line: expected, not worth a warning.
        truncated_end = list(self.kinds) == ["not JSON"] and self.kinds["not JSON"][0] == 1
        level = log.debug if truncated_end and self._last_bad == self.line else log.warning
        for kind, (count, first) in self.kinds.items():
            level(
                "skipped lines that are not events",
                path=str(path),
                kind=kind,
                lines=count,
                first_line=first,
            )
