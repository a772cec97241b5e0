"""The event recorder (short name ``recorder``): every event to RUN_DIR/events.jsonl.

One JSON object per line, as `evtrain.events.to_builtins` gives it (with the
``type`` tag and the envelope), in the order the hook received them. Lines are
flushed at most ``flush_interval`` seconds apart and at once on run end, a
stage failure and teardown, so a crash loses at most that much.
``evtrain replay RUN_DIR --hook REF`` feeds the file through any hook.
"""

from __future__ import annotations

from pathlib import Path

from evtrain.events import MESSAGE_TYPES, Event, Message, RunEnded, StageFailed, to_builtins
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, path_option
from evtrain.hooks.run_output import JsonLinesFile, RunOutput

FILENAME = "events.jsonl"

EVENT_TYPES: tuple[type[Message], ...] = tuple(t for t in MESSAGE_TYPES if issubclass(t, Event))
"""Every event type of the schema (commands travel on the other bus)."""


class EventRecorder(Hook):
    """Record every event.

    Options: ``dir`` (write ``DIR/events.jsonl``) or ``path`` (this file);
    default ``RUN_DIR/events.jsonl``; ``flush_interval`` (seconds, default 0.5).
    Events that arrive before the run directory is known wait in memory.
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
        self._waiting: list[dict[str, object]] = []

    @on(*EVENT_TYPES)
    def record(self, ev: Message) -> None:
        """Append the event; flush when due (at once for the end of a run or a failure)."""
        if self.file is None:
            path = self.output.resolve(self.state.run)
            if path is None:
                self._waiting.append(to_builtins(ev))
                return
            self.file = JsonLinesFile(path, flush_interval=self.flush_interval)
            self.log.info("recording events", path=str(path))
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
                "events not recorded: no run directory known", events=len(self._waiting)
            )
