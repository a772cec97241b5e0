"""Replaying a recorded run through hooks, offline and in-process.

The recorder hook writes every event of a run to ``RUN_DIR/events.jsonl``;
`replay` reads it back and dispatches each event to the hooks exactly as a
live `HookRunner` would: same handlers, same priority order, `RunState`
updated before every dispatch, ``setup``/``teardown`` around it all. Commands a
hook sends cannot reach a recorded run: they are logged and collected in
`ReplayRunner.commands`, acknowledged by nobody. Events a hook publishes are
collected in `ReplayRunner.published`.

Output files: replay points the run's ``run_dir`` (from `RunStarted`) at
``out_dir`` — by default ``RUN_DIR/replay`` — and every event's ``path``
inside the recorded run directory (a checkpoint's) at the same place under
``out_dir``, so a hook that writes into the run directory never appends to
the live run's files, and a replayed checkpoint hook neither commits nor
prunes the recorded run's checkpoints (it finds no shards under ``out_dir``
and says so).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from evtrain.bus.address import BusAddress
from evtrain.errors import UsageError
from evtrain.events import (
    Command,
    CommandAcked,
    Event,
    Message,
    RunStarted,
)
from evtrain.exporters.recorder import read_recording
from evtrain.hooks.hook import Hook
from evtrain.hooks.runner import HookRunner
from evtrain.launcher.run_record import without_redone

log = structlog.get_logger("evtrain.tools.replay")

EVENTS_FILENAME = "events.jsonl"
REPLAY_DIRNAME = "replay"


def events_file(run: str | Path) -> Path:
    """The recorded events of ``run`` (a run directory or the events file itself)."""
    path = Path(run)
    if path.is_dir():
        path = path / EVENTS_FILENAME
    if not path.is_file():
        raise UsageError(
            f"no recorded events at {path} (run the 'recorder' hook during the run to get them)"
        )
    return path


def read_events(path: str | Path) -> Iterator[Message]:
    """The events of a recorder file in order; exact duplicates (a restarted recorder
    records the state snapshot again), lines that are not valid events (see
    `evtrain.exporters.recorder.read_recording`) and, of a resumed run, the
    steps a later launch redid (`evtrain.launcher.run_record.without_redone`) are skipped."""
    seen: set[tuple[str, str, int, float, str]] = set()
    for msg in without_redone(path, read_recording(path)):
        key = (msg.run_id, msg.source, msg.seq, msg.ts, msg.topic.decode())
        if key in seen:
            continue
        seen.add(key)
        yield msg


class ReplayRunner(HookRunner):
    """A `HookRunner` fed from a list of events instead of the bus."""

    def __init__(self, hooks: Sequence[Hook], *, name: str | None = None) -> None:
        # The address is never connected to: publish and send_command are replaced.
        super().__init__(hooks, BusAddress("ipc", "/nonexistent-replay"), name=name)
        self.published: list[Event] = []
        self.commands: list[Command] = []
        self.errors = 0
        self.dispatched = 0

    def publish(self, event: Event) -> bool:
        """Collect the event (there is no bus)."""
        self.published.append(event)
        return True

    async def send_command(
        self, command: Command, *, timeout: float = 60.0, acks: int | None = None
    ) -> list[CommandAcked]:
        """Collect the command; a recorded run cannot act on it, so nobody acknowledges."""
        self.commands.append(command)
        log.info("command not sent (replay)", command=command.topic.decode(), payload=str(command))
        return []

    def _report_error(self, hook: Hook, method: str, msg: Message, exc: Exception) -> None:
        self.errors += 1
        super()._report_error(hook, method, msg, exc)

    async def replay(self, messages: Iterator[Message] | Sequence[Message]) -> None:
        """Set the hooks up, dispatch every message in order, tear them down."""
        for hook in self.hooks:
            hook._runner = self
        try:
            for hook in self.hooks:
                await hook.setup()
            self.ready.set()
            for msg in messages:
                await self._handle(msg)
                self.dispatched += 1
        finally:
            for hook in self.hooks:
                try:
                    await hook.teardown()
                except Exception:
                    log.exception("hook teardown failed", hook=hook.hook_name())


@dataclass
class ReplayResult:
    """What a replay did."""

    events: int
    errors: int
    commands: list[Command] = field(default_factory=list)
    published: list[Event] = field(default_factory=list)


def _redirect(
    messages: Iterator[Message], out_dir: Path | None, recorded: Path
) -> Iterator[Message]:
    """``messages`` with the run directory, and paths inside it, moved to ``out_dir``.

    ``recorded`` is where the recording lies; the run directory the events
    name (`RunStarted.run_dir`, maybe relative to the launch's directory)
    counts too.
    """
    roots = [recorded]
    for msg in messages:
        if out_dir is not None:
            if isinstance(msg, RunStarted):
                roots.append(Path(msg.run_dir))
                msg = msgspec.structs.replace(msg, run_dir=str(out_dir))
            else:
                path = getattr(msg, "path", None)
                if isinstance(path, str):
                    msg = msgspec.structs.replace(msg, path=_moved(Path(path), roots, out_dir))
        yield msg


def _moved(path: Path, roots: list[Path], out_dir: Path) -> str:
    for root in roots:
        if path.is_relative_to(root):
            return str(out_dir / path.relative_to(root))
    return str(path)


async def replay(
    run: str | Path,
    hooks: Sequence[Hook],
    *,
    out_dir: str | Path | None = "",
) -> ReplayResult:
    """Feed the recorded events of ``run`` through ``hooks``.

    ``out_dir`` replaces the run directory the hooks see: ``""`` (default)
    means ``RUN_DIR/replay``, None keeps the recorded one (hooks then write
    into the live run's directory).
    """
    path = events_file(run)
    target: Path | None
    if out_dir == "":
        target = path.parent / REPLAY_DIRNAME
    else:
        target = None if out_dir is None else Path(out_dir)
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    runner = ReplayRunner(hooks)
    await runner.replay(_redirect(read_events(path), target, path.parent))
    return ReplayResult(
        events=runner.dispatched,
        errors=runner.errors,
        commands=runner.commands,
        published=runner.published,
    )
