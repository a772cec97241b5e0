"""`HookRunner`: attaches hooks to a bus and dispatches events to their handlers.

One runner serves the hooks of one process. It subscribes to exactly the
topics the handlers declare, proves its subscription is live before `setup`
(it publishes `HookProbe` until one comes back through the broker, then
announces itself with one `HookStarted`), loads the run's state from the
broker so a hook that joins mid-run knows the run at once, and then dispatches
each event to the handlers in priority order and through their filters (see
`evtrain.hooks.hook`). Reading and dispatch are separate tasks from `setup`
on: the snapshot's events are dispatched first (with `Hook.state` already
holding all of it) and live ones queue behind them, yet acknowledgements of
commands reach their sender at once, so a handler may send a command and await
it while it handles the snapshot (a hook restarted mid-run re-arming what it
had armed). Each wake-up of the reader takes every message ZeroMQ already
holds (`Subscriber.receive` drains without awaiting again, up to its
``DRAIN_LIMIT``), so a burst of events costs one wake-up, not one per event.

A handler that raises is logged and published as `HookError`; the hook keeps
running, and so do the runner's other hooks. The first `HOOK_TRACEBACKS`
raises of one kind (hook, handler, error type) are logged and published with
their traceback; after that one line and one `HookError` (whose ``count``
says how many raises it stands for) per kind at most every
`ERROR_REPORT_INTERVAL` seconds, and the rest at teardown. A hook whose
`setup` raises is logged, published as `HookError` (handler ``setup``) and
left out while the others run; only when every hook's setup raised does
`run` raise (the first error). Handlers run one after another: one that
blocks (or awaits long) delays the other hooks' events, never the stages.

Sequence gaps are published as `BusGaps` at most once a second, for at most
`MAX_GAP_SOURCES` sources at a time (the ones that lost most).

A lost bus is said, not waited out in silence: after `BUS_QUIET_S` without
any message the runner sends itself a `HookProbe` through the broker (once a
second while it stays quiet); when nothing at all arrived for
`BUS_LOST_AFTER_S` more it logs one warning that the bus is lost, keeps
listening (ZeroMQ reconnects by itself), and logs again once the bus answers.

Stopped by a signal (``stop(signalled=True)``), each hook's `teardown` has
`SIGNAL_TEARDOWN_S` seconds: whatever it waits for (a last scrape, a flush),
a signal ends the process promptly.
"""

from __future__ import annotations

import functools
import math
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from evtrain.bus.address import BusAddress
from evtrain.bus.commands import Delivery
from evtrain.bus.publisher import Publisher
from evtrain.bus.security import CurveConfig
from evtrain.bus.state_service import fetch_snapshot
from evtrain.bus.subscriber import Subscriber
from evtrain.errors import UsageError
from evtrain.events import (
    BusGaps,
    Command,
    CommandAcked,
    Event,
    HookError,
    HookProbe,
    HookStarted,
    Message,
    RunEnded,
)
from evtrain.formatting import safe_text
from evtrain.hooks.hook import Accepts, Hook
from evtrain.logs import launcher_console
from evtrain.ratelimit import MAX_KINDS, RateLimitedLog
from evtrain.run_state import RunState, of_run

log = structlog.get_logger("evtrain.hooks.runner")

_Bound = Callable[[Message], Any]
"""A handler bound to its hook."""


_YIELD_EVERY = 256
"""Messages the reader queues, or dispatch handles, before letting the other task run."""
BUS_QUIET_S = 5.0
"""Seconds without any message after which the runner probes its bus."""
SIGNAL_TEARDOWN_S = 2.0
"""Seconds each hook's teardown has after a signal stopped the runner."""
BUS_LOST_AFTER_S = 10.0
"""Seconds of unanswered probes after which the bus counts as lost (a warning)."""
HOOK_TRACEBACKS = 3
"""Raises of one kind reported with their traceback before only counts are."""
ERROR_REPORT_INTERVAL = 10.0
"""Seconds between two count reports of one kind of raise."""
GAP_REPORT_INTERVAL = 1.0
MAX_GAP_SOURCES = 16


class CommandTimeout(TimeoutError):
    """A command was not acknowledged by enough stages in time."""


class HookRunner:
    """Runs ``hooks`` against the bus at ``bus`` until `stop` (or the run ends).

    ``exit_on_run_end`` ends the runner after `RunEnded` was dispatched: the
    launcher starts hooks that way so they finish their work and exit cleanly.
    ``curve`` (`evtrain.bus.security.CurveConfig`) is needed on a CURVE bus.
    """

    def __init__(
        self,
        hooks: Sequence[Hook],
        bus: BusAddress | str,
        *,
        name: str | None = None,
        exit_on_run_end: bool = False,
        ready_timeout: float = 30.0,
        retry_interval: float = 1.0,
        buffer: int = 10_000,
        curve: CurveConfig | None = None,
    ) -> None:
        if not hooks:
            raise ValueError("HookRunner needs at least one hook")
        self.address = bus if isinstance(bus, BusAddress) else BusAddress.parse(bus)
        # Stable sort: equal priorities keep registration order.
        self.hooks = sorted(hooks, key=lambda hook: hook.priority)
        self.name = name or "+".join(hook.hook_name() for hook in self.hooks)
        self.exit_on_run_end = exit_on_run_end
        self.state = RunState()
        self.ready = anyio.Event()
        self._ready_timeout = ready_timeout
        self._retry_interval = retry_interval
        self._buffer = buffer
        self._curve = curve
        self._stop = anyio.Event()
        self._signalled = False
        self._bind(self.hooks)
        self.topics = sorted(t.topic.decode() for t in (*self._handlers, *self._filtered))
        if exit_on_run_end and RunEnded.topic.decode() not in self.topics:
            self.topics.append(RunEnded.topic.decode())
        self._publisher: Publisher | None = None
        self._command_publisher: Publisher | None = None
        self._subscriber: Subscriber | None = None
        self._pending: dict[str, tuple[anyio.Event, Delivery, list[CommandAcked]]] = {}
        self._ended: set[str] = set()
        """Pending commands whose run ended before they were acknowledged."""
        self._reported_gaps = 0
        self._last_gap_report = -GAP_REPORT_INTERVAL
        self._errors = RateLimitedLog(
            log,
            "hook handler raised",
            first=HOOK_TRACEBACKS,
            interval=ERROR_REPORT_INTERVAL,
            level="error",
            on_summary=self._publish_error_count,
        )
        # kind -> (hook, handler, event type, error) of its latest raise, for the counts.
        self._error_kinds: dict[str, tuple[str, str, str, str]] = {}
        self._queue: deque[Message] = deque()
        self._queued = anyio.Event()
        self._replayed: dict[tuple[str, bytes], tuple[int, float]] = {}
        self._heard = time.monotonic()
        """When the reader last got a message (anything: the bus is alive)."""

    def _bind(self, hooks: Sequence[Hook]) -> None:
        """Build the dispatch tables of ``hooks`` (in priority order)."""
        # Bound once: a getattr per event and handler shows up at 100k events/s.
        dispatch: dict[type[Message], list[tuple[Hook, str, _Bound, Accepts | None]]] = {}
        for hook in hooks:
            for event_type, method, accepts in hook.handlers():
                entry = (hook, method, getattr(hook, method), accepts)
                dispatch.setdefault(event_type, []).append(entry)
        # Types no handler filters keep the lean path: their handlers as they are.
        self._handlers: dict[type[Message], list[tuple[Hook, str, _Bound]]] = {
            event_type: [(hook, method, fn) for hook, method, fn, _ in entries]
            for event_type, entries in dispatch.items()
            if all(accepts is None for *_, accepts in entries)
        }
        self._filtered = {t: e for t, e in dispatch.items() if t not in self._handlers}

    # -- used by hooks -------------------------------------------------------

    def publish(self, event: Event) -> bool:
        """Publish an event as ``hook/NAME``."""
        if self._publisher is None:
            raise RuntimeError("the hook runner is not running")
        return self._publisher.publish(event)

    async def send_command(
        self, command: Command, *, timeout: float = 60.0, acks: int | None = None
    ) -> list[CommandAcked]:
        """Publish ``command`` until ``acks`` stages acknowledged it or ``timeout`` passed.

        Raises `CommandTimeout` then, and at once when the run ends first: a run
        acknowledges nothing after its final boundary, and every acknowledgement
        it gave comes before its `RunEnded`.
        """
        if self._subscriber is None:
            raise RuntimeError("the hook runner is not running")
        if self._command_publisher is None:
            self._subscriber.subscribe(CommandAcked.topic.decode())
            self._subscriber.subscribe(RunEnded.topic.decode())
            self._command_publisher = Publisher(
                self.address.endpoint("commands_in"), source=f"hook/{self.name}", curve=self._curve
            )
        delivery = Delivery(acks or self.state.num_stages or 1, self._retry_interval)
        done = anyio.Event()
        received: list[CommandAcked] = []
        self._pending[command.command_id] = (done, delivery, received)
        try:
            with anyio.fail_after(timeout):
                while not delivery.done:
                    self._command_publisher.publish(command)
                    with anyio.move_on_after(delivery.retry_s):
                        await done.wait()
                    if command.command_id in self._ended and not delivery.done:
                        break
            if not delivery.done:
                raise CommandTimeout(
                    f"{command.topic.decode()} {command.command_id}: the run ended with "
                    f"{len(received)} of {delivery.wanted} acknowledgements"
                )
            return received
        except CommandTimeout:
            raise
        except TimeoutError:
            raise CommandTimeout(
                f"{command.topic.decode()} {command.command_id}: {len(received)} of "
                f"{delivery.wanted} acknowledgements within {timeout:g} s"
            ) from None
        finally:
            self._pending.pop(command.command_id, None)
            self._ended.discard(command.command_id)

    # -- lifecycle -----------------------------------------------------------

    def stop(self, *, signalled: bool = False) -> None:
        """Ask the runner to finish (teardown runs, then `run` returns); ``signalled``:
        for a signal, which bounds each teardown (`SIGNAL_TEARDOWN_S`)."""
        self._signalled = self._signalled or signalled
        self._stop.set()

    async def run(self) -> None:
        """Attach, set up the hooks, dispatch events until stopped."""
        self._publisher = Publisher(
            self.address.endpoint("events_in"), source=f"hook/{self.name}", curve=self._curve
        )
        self._subscriber = Subscriber(
            self.address.endpoint("events_out"),
            [*self.topics, HookProbe.topic.decode()],
            curve=self._curve,
        )
        failed: list[Exception] = []
        try:
            # The snapshot comes first: every live event is then as new as it or
            # newer, and `_prepare` drops live copies of what it already held.
            snapshot = await anyio.to_thread.run_sync(
                functools.partial(fetch_snapshot, self.address, curve=self._curve)
            )
            await self._prove_subscription()
            for hook in self.hooks:
                hook._runner = self
            async with anyio.create_task_group() as tg:
                # The reader runs from here on: a handler that sends a command while
                # it sets up or replays the snapshot gets the acknowledgements it
                # awaits, and live events queue up behind the snapshot meanwhile.
                tg.start_soon(self._read)
                tg.start_soon(self._attach, snapshot, failed)
                tg.start_soon(self._watch_bus)
                await self._stop.wait()
                tg.cancel_scope.cancel()
            if failed:
                raise failed[0]
        finally:
            with anyio.CancelScope(shield=True):
                for hook in self.hooks:
                    limit = SIGNAL_TEARDOWN_S if self._signalled else math.inf
                    try:
                        with anyio.move_on_after(limit) as scope:
                            await hook.teardown()
                    except Exception:
                        log.exception("hook teardown failed", hook=hook.hook_name())
                    if scope.cancelled_caught:
                        log.warning(
                            "hook teardown cut short by the signal",
                            hook=hook.hook_name(),
                            after_s=limit,
                        )
                self._errors.flush()
                self._report_gaps(force=True)
                self._close()

    async def _attach(self, snapshot: list[Message], failed: list[Exception]) -> None:
        errors: list[Exception] = []
        left_out: list[Hook] = []
        for hook in self.hooks:
            try:
                await hook.setup()
            except Exception as exc:
                errors.append(exc)
                left_out.append(hook)
        if len(left_out) == len(self.hooks):
            # Raised by `run` itself, not wrapped in the task group's exception group.
            failed.append(errors[0])
            self._stop.set()
            return
        if left_out:
            # Siblings in one process do not share a failure: the others go on.
            for hook, error in zip(left_out, errors, strict=True):
                self._report_setup_error(hook, error)
            self._bind([hook for hook in self.hooks if hook not in left_out])
        # The state is the snapshot's whole from the first replayed event on: a
        # handler replaying the run's start already knows that the run ended.
        for msg in snapshot:
            self.state.update(msg)
        for msg in snapshot:
            await self._handle(msg)
        self._replayed = {(msg.source, msg.topic): (msg.seq, msg.ts) for msg in snapshot}
        if self._queue:
            self._queued.set()  # events that arrived while proving the subscription
        self.ready.set()
        # Under a launcher, which shows the run itself, attaching is a detail;
        # for a hook attached by hand it is the line that says it works.
        attached = log.debug if launcher_console() else log.info
        attached("hooks attached", hooks=self.name, bus=str(self.address))
        log.debug("subscribed", hooks=self.name, topics=self.topics)
        await self._dispatch_all()

    def _close(self) -> None:
        for closable in (self._publisher, self._command_publisher, self._subscriber):
            if closable is not None:
                closable.close()
        self._publisher = self._command_publisher = self._subscriber = None

    async def _prove_subscription(self) -> None:
        assert self._publisher is not None and self._subscriber is not None
        probe = HookProbe(pid=os.getpid())
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            self._publisher.publish(probe)
            proved = False
            for msg in await self._subscriber.receive(timeout=0.2):
                if type(msg) is HookProbe:
                    proved = proved or msg.source == self._publisher.source
                else:
                    # Once an earlier probe made it, real events may already flow:
                    # keep them for dispatch after setup instead of losing them.
                    self._queue.append(msg)
            if proved:
                self._publisher.publish(
                    HookStarted(
                        hooks=[hook.hook_name() for hook in self.hooks],
                        topics=self.topics,
                        pid=os.getpid(),
                    )
                )
                return
        raise TimeoutError(f"no events came back from the bus at {self.address}")

    async def _read(self) -> None:
        # Reading runs apart from dispatch so that a handler awaiting a command's
        # acknowledgement does not block the very event that acknowledges it.
        # Whole batches are handed over through a deque: a memory stream costs two
        # scheduling points per item, which capped a hook well below the broker.
        assert self._subscriber is not None
        receive = self._subscriber.receive
        queue = self._queue
        own = self._publisher.source if self._publisher is not None else None
        while True:
            batch = await receive()
            self._heard = time.monotonic()
            for msg in batch:
                if type(msg) is CommandAcked:
                    self._resolve(msg)
                elif type(msg) is RunEnded and self._pending and of_run(msg, self.state):
                    self._ended.update(self._pending)
                    for done, _, _ in self._pending.values():
                        done.set()
            if any(type(m) is HookProbe and m.source == own for m in batch):
                # Our own liveness probes: they proved the bus, there is nothing to handle.
                batch = [m for m in batch if not (type(m) is HookProbe and m.source == own)]
            queue.extend(batch)
            self._queued.set()
            self._report_gaps()
            if len(queue) >= _YIELD_EVERY:
                # More was ready at once: let dispatch run before reading on.
                await anyio.lowlevel.checkpoint()
            while len(queue) >= self._buffer:
                # Dispatch is behind: leave the rest queued in ZeroMQ (the broker
                # drops beyond its HWM, and the gap is reported).
                await anyio.sleep(0.005)

    async def _watch_bus(self) -> None:
        """Probe a quiet bus; say when it is lost and when it answers again."""
        lost = False
        while True:
            await anyio.sleep(1.0)
            quiet = time.monotonic() - self._heard
            if quiet < BUS_QUIET_S:
                if lost:
                    lost = False
                    log.warning("the bus answers again", hooks=self.name, bus=str(self.address))
                continue
            if self._publisher is not None:
                self._publisher.publish(HookProbe(pid=os.getpid()))
            if not lost and quiet >= BUS_QUIET_S + BUS_LOST_AFTER_S:
                lost = True
                log.warning(
                    f"the bus is lost: nothing arrived for {quiet:.0f} s, not even this "
                    "runner's own probe; still listening (a run that ended has taken its "
                    "bus with it: end this hook, or start it with --exit-on-run-end)",
                    hooks=self.name,
                    bus=str(self.address),
                )

    async def _dispatch_all(self) -> None:
        # `_handle` inlined: a coroutine per message costs as much as a handler call.
        prepare = self._prepare
        queue = self._queue
        while True:
            await self._queued.wait()
            self._queued = anyio.Event()
            handled = 0
            while queue:
                msg = queue.popleft()
                for hook, method, fn in prepare(msg):
                    try:
                        result = fn(msg)
                        if result is not None:
                            await result
                    except Exception as exc:
                        self._report_error(hook, method, msg, exc)
                if self.exit_on_run_end and type(msg) is RunEnded and of_run(msg, self.state):
                    self._stop.set()
                    return
                handled += 1
                if not handled % _YIELD_EVERY:
                    await anyio.lowlevel.checkpoint()  # let the reader keep ZeroMQ drained

    def _resolve(self, ack: CommandAcked) -> None:
        pending = self._pending.get(ack.command_id)
        if pending is None:
            return
        done, delivery, received = pending
        if delivery.acknowledged(ack.stage):
            received.append(ack)
        if delivery.done:
            done.set()

    def _report_gaps(self, force: bool = False) -> None:
        if self._subscriber is None or self._publisher is None:
            return
        tracker = self._subscriber.gaps
        if tracker.total_missing == self._reported_gaps:
            return
        now = time.monotonic()
        if not force and now - self._last_gap_report < GAP_REPORT_INTERVAL:
            return  # the next batch after the interval reports these too
        self._last_gap_report = now
        self._reported_gaps = tracker.total_missing
        worst = sorted(tracker.missing.items(), key=lambda item: -item[1])[:MAX_GAP_SOURCES]
        tracker.missing.clear()
        log.warning(
            "bus gap: events lost",
            missing={safe_text(source, 100): count for source, count in worst},
            total_missing=tracker.total_missing,
        )
        for source, missing in worst:
            self._publisher.publish(
                BusGaps(from_source=source, missing=missing, total_missing=tracker.total_missing)
            )

    def _prepare(self, msg: Message) -> Sequence[tuple[Hook, str, _Bound]]:
        """Fold ``msg`` into the state; the handlers it goes to (none if replayed)."""
        if self._replayed:
            seen = self._replayed.get((msg.source, msg.topic))
            if seen is not None:
                if msg.seq <= seen[0] and msg.ts <= seen[1]:
                    return ()  # already dispatched from the state snapshot (or older)
                # Newer (or a restarted source counting from 0 again): live from here.
                del self._replayed[(msg.source, msg.topic)]
        self.state.update(msg)
        return self._handlers.get(type(msg)) or self._accepting(msg)

    def _accepting(self, msg: Message) -> Sequence[tuple[Hook, str, _Bound]]:
        """The handlers of a type some handler filters that accept ``msg``."""
        filtered = self._filtered.get(type(msg))
        if filtered is None:
            return ()
        return [
            (hook, method, fn)
            for hook, method, fn, accepts in filtered
            if accepts is None or accepts(msg)
        ]

    async def _handle(self, msg: Message) -> None:
        for hook, method, fn in self._prepare(msg):
            try:
                result = fn(msg)
                if result is not None:
                    await result
            except Exception as exc:
                self._report_error(hook, method, msg, exc)

    def _report_error(self, hook: Hook, method: str, msg: Message, exc: Exception) -> None:
        name = hook.hook_name()
        event_type = msg.topic.decode()
        error = safe_text(repr(exc), 1000)
        kind = f"{name}.{method}: {type(exc).__name__}"
        if kind in self._error_kinds or len(self._error_kinds) < MAX_KINDS:
            self._error_kinds[kind] = (name, method, event_type, error)
        full = self._errors(
            kind, hook=name, handler=method, event_type=event_type, error=error, exc_info=exc
        )
        if full and self._publisher is not None:
            self._publisher.publish(
                HookError(
                    hook=name,
                    handler=method,
                    event_type=event_type,
                    error=error,
                    traceback="".join(traceback.format_exception(exc))[-4000:],
                )
            )

    def _report_setup_error(self, hook: Hook, exc: Exception) -> None:
        name = hook.hook_name()
        error = safe_text(repr(exc), 1000)
        log.error(
            "hook setup failed; the other hooks of this process go on without it",
            hook=name,
            error=error,
            # A usage mistake (a port in use) is its message; anything else a bug to trace.
            exc_info=None if isinstance(exc, UsageError) else exc,
        )
        if self._publisher is not None:
            self._publisher.publish(
                HookError(
                    hook=name,
                    handler="setup",
                    event_type="",
                    error=error,
                    traceback="".join(traceback.format_exception(exc))[-4000:],
                )
            )

    def _publish_error_count(self, kind: str, more: int) -> None:
        if self._publisher is None:
            return
        name, method, event_type, error = self._error_kinds.get(kind, ("", "", "", kind))
        self._publisher.publish(
            HookError(hook=name, handler=method, event_type=event_type, error=error, count=more)
        )
