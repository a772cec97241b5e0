"""The `Hook` base class, the `@on` handler decorator and `EventFilter`.

A hook is an event subscriber. It declares handlers with ``@on(EventType)``; a
`HookRunner` subscribes to exactly those topics and calls the handlers in
priority order (lower first, ties by registration order). The same class runs
in its own process (``evtrain hook pkg.mod:Class --bus ENDPOINT``) or inside any
asyncio program (tests, notebooks) through `HookRunner`. Under ``evtrain
launch`` each user hook of the spec runs in a process of its own, while the
built-in hooks share one host process and runner, where their ``priority``
orders them; a built-in's spec entry with ``isolate=True`` gives it its own
process (`evtrain.launcher.hook_supervisor`).

``@on`` takes filters, as ignite's ``Events.X(every=, once=)`` does:
``@on(StepEnded, every=10)`` calls the handler for steps 10, 20, ...;
``once=K`` for step K only; ``stage=S`` and ``replica=R`` (an index or a
collection of them) for the events of those stages or data-parallel replicas
only. They combine (``every`` or ``once``, and ``stage``, ``replica``); what
they mean is `EventFilter`'s to say. A base class
(``@on(MicrobatchSpan)``, ``@on(Event)``) stands for every concrete event type
derived from it (`evtrain.events.MESSAGE_TYPES`). A handler registered for one
type several times (for a base class and a subclass of it, or by two ``@on``)
is called once per event: when any of its registrations accepts the event.
Misuse (a filter value that is not a positive step, a filter on a type without
the field it reads, a type that is not an event) raises at class definition,
naming the handler.

Hooks act on the run by sending commands (`stop`, `checkpoint`, `evaluate`);
every stage applies a command at the same step boundary and acknowledges it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import structlog

from evtrain.events import (
    MESSAGE_TYPES,
    CheckpointNow,
    Command,
    CommandAcked,
    EpochEnded,
    EvaluateNow,
    Event,
    Message,
    StopRun,
)
from evtrain.run_state import RunState, of_run

if TYPE_CHECKING:
    from evtrain.hooks.runner import HookRunner

E = TypeVar("E", bound=Message)
Handler = Callable[[Any, Any], Awaitable[None] | None]
Accepts = Callable[[Any], bool]
"""Whether a handler wants an event (an `EventFilter`, or several of them)."""

_HANDLER_ATTR = "__evtrain_on__"
_NO_RUN = RunState()
_READS = {"every": "step", "once": "step", "stage": "stage", "replica": "replica"}


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _indices(option: str, value: int | Collection[int] | None) -> frozenset[int] | None:
    """``stage=`` / ``replica=``: one index or a non-empty collection of them."""
    if value is None:
        return None
    given: object = (value,) if _is_index(value) else value
    if isinstance(given, str | bytes) or not isinstance(given, Collection):
        raise TypeError(f"{option}= must be an int or a collection of ints, got {value!r}")
    if not all(_is_index(s) for s in given):
        raise TypeError(f"{option}= must hold ints only, got {value!r}")
    indices = frozenset(int(s) for s in given)
    if not indices:
        raise ValueError(f"{option}= names no {option}: the handler would never be called")
    if min(indices) < 0:
        raise ValueError(f"{option}= must be {option} indices >= 0, got {value!r}")
    return indices


@dataclass(frozen=True, slots=True, init=False)
class EventFilter:
    """Which events (or anything with a ``step``, like a merged step) pass.

    * ``every=N``: those whose ``step`` is a multiple of N (steps count from 1,
      so ``every=10`` passes steps 10, 20, ...);
    * ``once=K``: those whose ``step`` is K: one per stage that reports step K,
      unless ``stage`` narrows it down;
    * ``stage=S``: those whose ``stage`` is S, or one of S;
    * ``replica=R``: those of data-parallel replica R (or one of R); with
      replicas, ``replica=0`` sees each stage's step once.

    On `EpochEnded` ``every`` and ``once`` count epochs, as ignite's
    ``EPOCH_COMPLETED(every=N)`` does: ``every=2`` passes the end of the 2nd,
    4th, ... epoch, ``once=1`` the end of the first (``EpochEnded.epoch`` counts
    from 0).

    ``every`` and ``once`` exclude each other; either combines with ``stage``
    and ``replica``. An object whose ``step`` (or ``stage``) is None does not
    pass a filter on it. A filter without conditions passes everything.
    """

    every: int | None
    once: int | None
    stage: frozenset[int] | None
    replica: frozenset[int] | None

    def __init__(
        self,
        *,
        every: int | None = None,
        once: int | None = None,
        stage: int | Collection[int] | None = None,
        replica: int | Collection[int] | None = None,
    ) -> None:
        if every is not None:
            if not _is_index(every):
                raise TypeError(f"every= must be an int, got {every!r}")
            if every < 1:
                raise ValueError(f"every= must be >= 1, got {every}")
        if once is not None:
            if not _is_index(once):
                raise TypeError(f"once= must be an int, got {once!r}")
            if once < 0:
                raise ValueError(f"once= must be a step >= 0, got {once}")
            if every is not None:
                raise ValueError("once= and every= exclude each other: once= is one step")
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "once", once)
        object.__setattr__(self, "stage", _indices("stage", stage))
        object.__setattr__(self, "replica", _indices("replica", replica))

    @property
    def reads(self) -> dict[str, str]:
        """Each condition set (``every``, ``once``, ``stage``, ``replica``) and the field
        it reads."""
        options = {
            "every": self.every,
            "once": self.once,
            "stage": self.stage,
            "replica": self.replica,
        }
        return {option: _READS[option] for option, value in options.items() if value is not None}

    def __call__(self, msg: Any) -> bool:
        """Whether ``msg`` passes."""
        if self.stage is not None and msg.stage not in self.stage:
            return False
        if self.replica is not None and msg.replica not in self.replica:
            return False
        if self.every is None and self.once is None:
            return True
        count = msg.epoch + 1 if isinstance(msg, EpochEnded) else msg.step
        if self.every is not None:
            return count is not None and count % self.every == 0
        return bool(count == self.once)


def _any_of(filters: tuple[EventFilter, ...]) -> Accepts:
    if len(filters) == 1:
        return filters[0]
    return lambda msg: any(accepts(msg) for accepts in filters)


def _concrete(event_type: type[Message]) -> list[type[Message]]:
    return [t for t in MESSAGE_TYPES if issubclass(t, event_type)]


def on(
    *event_types: type[Message],
    every: int | None = None,
    once: int | None = None,
    stage: int | Collection[int] | None = None,
    replica: int | Collection[int] | None = None,
) -> Callable[[Handler], Handler]:
    """Mark a method as the handler of one or more event types, optionally filtered.

    A base class subscribes to each concrete event type derived from it. The
    filters are those of `EventFilter`; they apply to every type given, so each
    must have the fields they read.
    """
    if not event_types:
        raise TypeError("@on needs at least one event type")

    def mark(fn: Handler) -> Handler:
        name = getattr(fn, "__qualname__", repr(fn))
        where = f"@on({', '.join(getattr(t, '__name__', repr(t)) for t in event_types)}) on {name}"
        try:
            accepts = EventFilter(every=every, once=once, stage=stage, replica=replica)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        registered: list[tuple[type[Message], EventFilter | None]] = []
        for event_type in event_types:
            if not (isinstance(event_type, type) and issubclass(event_type, Message)):
                raise TypeError(f"{where}: expects evtrain event types, got {event_type!r}")
            for option, field in accepts.reads.items():
                if field not in event_type.__struct_fields__:
                    raise TypeError(
                        f"{where}: {event_type.__name__} has no {field} field for {option}= to read"
                    )
            concrete = _concrete(event_type)
            if not concrete:
                raise TypeError(
                    f"{where}: {event_type.__name__} is not an event type of the bus schema "
                    "(evtrain.events.MESSAGE_TYPES has no type derived from it)"
                )
            registered.extend((t, accepts if accepts.reads else None) for t in concrete)
        setattr(fn, _HANDLER_ATTR, (*getattr(fn, _HANDLER_ATTR, ()), *registered))
        return fn

    return mark


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
    plans_checkpoints: ClassVar[bool] = False
    """This hook coordinates checkpoints (it sends a `CheckpointPlan` and commits):
    the stages wait for its plan before the first step and for its verdicts at
    the end."""

    def watched_metric(self) -> tuple[str, str] | None:
        """(option, eval metric name) this hook acts on, or None: the launcher refuses
        a name that the job's eval sets never report before anything starts."""
        return None

    def __init__(self, *, priority: int | None = None) -> None:
        self.priority = self.default_priority if priority is None else int(priority)
        self._runner: HookRunner | None = None
        self.log = structlog.get_logger(f"evtrain.hooks.{self.hook_name()}")

    @classmethod
    def hook_name(cls) -> str:
        """The hook's short name."""
        return cls.name or _snake(cls.__name__)

    @classmethod
    def handlers(cls) -> list[tuple[type[Message], str, Accepts | None]]:
        """(concrete event type, method name, filter) in definition order, base classes first.

        A method appears once per event type, however often it was registered
        for it; its filter is None when some registration has none (it wants
        every event of that type), else one accepting what any of them accepts.
        An overriding method keeps the position of the one it overrides and
        brings its own registrations.
        """
        methods: dict[str, tuple[tuple[type[Message], EventFilter | None], ...]] = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                registered = getattr(fn, _HANDLER_ATTR, None)
                if registered is not None:
                    methods[attr] = registered
        found: list[tuple[type[Message], str, Accepts | None]] = []
        for attr, registered in methods.items():
            by_type: dict[type[Message], list[EventFilter] | None] = {}
            for event_type, accepts in registered:
                filters = by_type.setdefault(event_type, [])
                if filters is None:
                    continue
                if accepts is None:
                    by_type[event_type] = None
                else:
                    filters.append(accepts)
            for event_type, filters in by_type.items():
                accepts_any = None if filters is None else _any_of(tuple(dict.fromkeys(filters)))
                found.append((event_type, attr, accepts_any))
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

    async def stop(
        self, reason: str = "", *, at_step: int | None = None, timeout: float = 60.0
    ) -> list[CommandAcked]:
        """Ask every stage to end the run cleanly at boundary ``at_step`` (default: the next)."""
        return await self.send_command(
            StopRun(
                command_id=_new_id(),
                at_step=at_step,
                reason=reason or f"stopped by {self.hook_name()}",
            ),
            timeout=timeout,
        )

    async def evaluate(
        self, *, at_step: int | None = None, timeout: float = 60.0
    ) -> list[CommandAcked]:
        """Ask the stages to evaluate at boundary ``at_step`` (default: the next)."""
        return await self.send_command(
            EvaluateNow(command_id=_new_id(), at_step=at_step), timeout=timeout
        )

    async def checkpoint(
        self,
        checkpoint_id: str,
        path: str,
        *,
        reason: str = "",
        at_step: int | None = None,
        timeout: float = 60.0,
    ) -> list[CommandAcked]:
        """Ask the stages to save a checkpoint into ``path`` at boundary ``at_step``.

        ``path`` may hold a ``{step}`` placeholder. A checkpoint coordinator
        (the ``checkpoint`` hook) commits it; without one it stays uncommitted.
        """
        return await self.send_command(
            CheckpointNow(
                command_id=_new_id(),
                at_step=at_step,
                checkpoint_id=checkpoint_id,
                path=path,
                reason=reason,
            ),
            timeout=timeout,
        )


def _new_id() -> str:
    return uuid.uuid4().hex
