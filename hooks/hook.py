"""The `Hook` base class and the `@on` handler decorator.

A hook is an event subscriber. It declares handlers with ``@on(EventType)``; a
`HookRunner` subscribes to exactly those topics and calls the handlers in
priority order (lower first, ties by registration order). The same class runs
in its own process (``evtrain hook pkg.mod:Class --bus ENDPOINT``) or inside any
asyncio program (tests, notebooks) through `HookRunner`.

Hooks act on the run by sending commands (`stop`, `checkpoint`, `evaluate`);
every stage applies a command at the same step boundary and acknowledges it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import structlog

from evtrain.events import (
    CheckpointNow,
    Command,
    CommandAcked,
    EvaluateNow,
    Event,
    Message,
    StopRun,
)
from evtrain.run_state import RunState

if TYPE_CHECKING:
    from evtrain.hooks.runner import HookRunner

E = TypeVar("E", bound=Message)
Handler = Callable[[Any, Any], Awaitable[None] | None]

_HANDLER_ATTR = "__evtrain_on__"
_NO_RUN = RunState()


def on(*event_types: type[Message]) -> Callable[[Handler], Handler]:
    """Mark a method as the handler of one or more event types."""
    if not event_types:
        raise TypeError("@on needs at least one event type")
    for event_type in event_types:
        if not (isinstance(event_type, type) and issubclass(event_type, Message)):
            raise TypeError(f"@on expects evtrain event types, got {event_type!r}")

    def mark(fn: Handler) -> Handler:
        setattr(fn, _HANDLER_ATTR, (*getattr(fn, _HANDLER_ATTR, ()), *event_types))
        return fn

    return mark


def of_run(msg: Message, state: RunState) -> bool:
    """Whether ``msg`` belongs to the run ``state`` knows.

    Events of another run (late ones of the previous run, or made up) must not
    end, count towards or otherwise change the current one. Before a run is
    known every event may be of it, and so is one without a run id (hooks
    publish theirs without).
    """
    return state.run is None or not msg.run_id or msg.run_id == state.run.run_id


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Hook:
    """Base class of every hook.

    Subclasses take their options as keyword arguments of ``__init__`` (the CLI's
    ``--option key=value`` and the job spec's hook dicts become those arguments)
    and must pass ``priority`` on to ``super().__init__``.
    """

    name: ClassVar[str] = ""
    """Short name used as the bus source (``hook/NAME``); defaults to snake_case."""
    default_priority: ClassVar[int] = 100

    def __init__(self, *, priority: int | None = None) -> None:
        self.priority = self.default_priority if priority is None else int(priority)
        self._runner: HookRunner | None = None
        self.log = structlog.get_logger(f"evtrain.hooks.{self.hook_name()}")

    @classmethod
    def hook_name(cls) -> str:
        """The hook's short name."""
        return cls.name or _snake(cls.__name__)

    @classmethod
    def handlers(cls) -> list[tuple[type[Message], str]]:
        """(event type, method name) pairs in definition order, base classes first."""
        found: list[tuple[type[Message], str]] = []
        seen: set[str] = set()
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                types = getattr(fn, _HANDLER_ATTR, None)
                if types is None:
                    continue
                if attr in seen:  # overridden: keep the first position, latest types
                    found = [(t, a) for t, a in found if a != attr]
                seen.add(attr)
                found.extend((t, attr) for t in types)
        return found

    # -- lifecycle, overridable --------------------------------------------------

    async def setup(self) -> None:
        """Called once the hook's subscription is live, before any event."""

    async def teardown(self) -> None:
        """Called once when the runner stops (also after errors)."""

    # -- acting on the run -------------------------------------------------------

    @property
    def runner(self) -> HookRunner:
        """The runner this hook is attached to (set when it starts)."""
        if self._runner is None:
            raise RuntimeError(f"hook {self.hook_name()} is not attached to a HookRunner")
        return self._runner

    @property
    def state(self) -> RunState:
        """What the runner knows of the run: run info, stages, last step and eval.

        A hook not attached to a runner (handlers called directly) knows no run.
        """
        if self._runner is None:
            return _NO_RUN
        return self._runner.state

    def of_this_run(self, msg: Message) -> bool:
        """Whether ``msg`` belongs to the run this hook knows (see `of_run`)."""
        return of_run(msg, self.state)

    def publish(self, event: Event) -> bool:
        """Publish an event from this hook (``source`` = ``hook/NAME``)."""
        return self.runner.publish(event)

    async def send_command(
        self, command: Command, *, timeout: float = 60.0, acks: int | None = None
    ) -> list[CommandAcked]:
        """Send ``command`` and wait for its acknowledgements (retrying until then).

        ``acks`` defaults to the number of stages known from the run, else 1.
        Raises `CommandTimeout` if they do not all arrive within ``timeout``.
        """
        return await self.runner.send_command(command, timeout=timeout, acks=acks)

    async def stop(self, reason: str = "", *, timeout: float = 60.0) -> list[CommandAcked]:
        """Ask every stage to end the run cleanly at the next step boundary."""
        return await self.send_command(
            StopRun(command_id=_new_id(), reason=reason or f"stopped by {self.hook_name()}"),
            timeout=timeout,
        )

    async def evaluate(self, *, timeout: float = 60.0) -> list[CommandAcked]:
        """Ask the stages to evaluate at the next step boundary."""
        return await self.send_command(EvaluateNow(command_id=_new_id()), timeout=timeout)

    async def checkpoint(
        self,
        checkpoint_id: str,
        path: str,
        *,
        reason: str = "",
        on_stop: bool = False,
        timeout: float = 60.0,
    ) -> list[CommandAcked]:
        """Ask the stages to save a checkpoint into ``path`` at the next step boundary.

        ``on_stop`` arms it instead: the stages save when the run ends.
        """
        return await self.send_command(
            CheckpointNow(
                command_id=_new_id(),
                checkpoint_id=checkpoint_id,
                path=path,
                reason=reason,
                on_stop=on_stop,
            ),
            timeout=timeout,
        )


def _new_id() -> str:
    return uuid.uuid4().hex
