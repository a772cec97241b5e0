"""Commands: how a hook's request reaches every stage, when it applies, how it is acknowledged.

Delivery. A hook publishes a `evtrain.events.Command` on the broker's
``commands_in``. Stage 0 alone subscribes (`CommandReceiver`) and hands
whatever arrived to all stages in the control exchange of its next step
boundary (`evtrain.stages.control`), so every stage sees every command at the
same boundary ("boundary k" is the point after k optimizer steps).

Boundaries. The boundary where the stages receive a command is where they
*accept* it, and each stage acknowledges it there at once (`CommandAcked`,
through its `CommandLedger`), with ``step`` = the boundary it applies at:

* ``at_step=None``: the receiving boundary.
* ``at_step=k`` ahead of the stages: kept and applied exactly at boundary k,
  however long before the command came. Hooks that know in advance (every N
  steps, epoch ends) ask ahead this way, so their work lands on the step
  they mean without holding training up.
* ``at_step=k`` already passed (the command was late): applied at the
  receiving boundary, acknowledged with ``late=True`` and that boundary as
  ``step``. A late checkpoint holds, and is named for, the later step.
* ``at_step`` beyond the run's last step, or a command the stage cannot carry
  out (an evaluation without eval data, an unknown command): refused,
  ``ok=False`` with a ``detail``; it is never applied.

What the work itself produced is reported by its own events
(``EvalEnded``, ``CheckpointShardSaved``/``CheckpointFailed``, ``RunEnded``),
not by the acknowledgement. Commands that arrive after a run's final boundary
are neither applied nor acknowledged; every acknowledgement a run gave comes
before its ``RunEnded``, so an issuer stops waiting there
(`evtrain.hooks.runner.HookRunner.send_command` raises `CommandTimeout`
saying that the run ended).

Retries. The issuer publishes the command again every `RETRY_S` until every
stage acknowledged it (`Delivery` keeps that account, for a hook's
`evtrain.hooks.runner.HookRunner.send_command` and the launcher's stop alike).
Stage 0 hands repeats on like new commands; each stage's `CommandLedger`
applies one ``command_id`` once and answers a repeat with the acknowledgement
it already gave, so an acknowledgement lost on the way is healed by the next
retry.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import structlog
import zmq

from evtrain.bus.publisher import Publisher
from evtrain.bus.security import CurveConfig
from evtrain.errors import UsageError
from evtrain.events import Command, CommandAcked, DecodeError, decode

__all__ = ["DROP_FIRST_ACK_ENV", "RETRY_S", "CommandLedger", "CommandReceiver", "Delivery"]

log = structlog.get_logger("evtrain.bus.commands")

RETRY_S = 1.0
"""Seconds between two publications of a command that a stage has not acknowledged."""

SEEN_LIMIT = 4096
"""Command ids a ledger remembers (retries come within seconds; ids are never reused)."""
DROP_FIRST_ACK_ENV = "EVTRAIN_DROP_FIRST_ACK"
"""Fault injection for tests: a stage index whose first acknowledgement is never published."""
_NOBLOCK = int(zmq.NOBLOCK)


class CommandReceiver:
    """A SUB socket on the broker's ``commands_out`` (stage 0); `poll` never blocks.

    ``curve`` is needed on a CURVE bus.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self.malformed = 0
        self._held: dict[str, Command] = {}
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"cmd.")
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise UsageError(f"cannot connect to the bus at {endpoint}: {exc}") from None

    def wait_for(self, kind: type[Command], timeout: float) -> bool:
        """Block until a ``kind`` command arrived (True) or ``timeout`` passed (False).

        What arrives meanwhile is kept for the next `poll`.
        """
        deadline = time.monotonic() + timeout
        while not any(isinstance(c, kind) for c in self._held.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._sock.poll(min(left, 0.1) * 1000):
                self._held.update(self._receive())
        return True

    def poll(self) -> list[Command]:
        """Valid commands that arrived since the last call, repeats included (possibly none).

        Copies of one id within one call count once: a burst of retries costs
        the control exchange one command.
        """
        held, self._held = self._held, {}
        held.update((cid, c) for cid, c in self._receive().items() if cid not in held)
        return list(held.values())

    def _receive(self) -> dict[str, Command]:
        out: dict[str, Command] = {}
        while True:
            try:
                frames: list[Any] = self._sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                self.malformed += 1
                continue
            try:
                msg = decode(frames[1], frames[0])
            except DecodeError:
                self.malformed += 1
                continue
            if not isinstance(msg, Command):
                self.malformed += 1
                continue
            out.setdefault(msg.command_id, msg)

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(linger=0)

    def __enter__(self) -> CommandReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CommandLedger:
    """One stage's record of the commands it accepted and the acknowledgements it gave.

    `admit` says whether a command is new; a repeat is answered with its
    earlier acknowledgement (republished) and must not be applied again.
    ``publisher`` is the stage's event publisher (None: acknowledgements are
    only recorded, as in a run without a bus).
    """

    def __init__(self, stage: int, publisher: Publisher | None) -> None:
        self.stage = stage
        self.publisher = publisher
        self.repeats = 0
        self._acks: OrderedDict[str, CommandAcked | None] = OrderedDict()
        self._drop_next = os.environ.get(DROP_FIRST_ACK_ENV, "") == str(stage)

    def admit(self, command: Command) -> bool:
        """True for a command seen for the first time; False (and the old ack again) otherwise."""
        if command.command_id in self._acks:
            self.repeats += 1
            acked = self._acks[command.command_id]
            if acked is not None:
                self._publish(acked)
            return False
        self._acks[command.command_id] = None
        if len(self._acks) > SEEN_LIMIT:
            self._acks.popitem(last=False)
        return True

    def ack(
        self,
        command: Command,
        *,
        step: int,
        ok: bool = True,
        detail: str = "",
        late: bool = False,
    ) -> CommandAcked:
        """Acknowledge ``command`` for boundary ``step``; repeats of it get this ack again."""
        acked = CommandAcked(
            command_id=command.command_id,
            command=command.topic.decode(),
            stage=self.stage,
            step=step,
            ok=ok,
            detail=detail,
            late=late,
        )
        self._acks[command.command_id] = acked
        if self._drop_next:
            self._drop_next = False
            log.warning("acknowledgement dropped (fault injection)", command_id=command.command_id)
        else:
            self._publish(acked)
        return acked

    def _publish(self, acked: CommandAcked) -> None:
        if self.publisher is not None:
            self.publisher.publish(acked)


class Delivery:
    """The issuer's account of one command: which stages acknowledged it and whether
    it is time to publish it again (no clock, no socket: the issuer feeds both)."""

    def __init__(self, wanted: int, retry_s: float = RETRY_S) -> None:
        self.wanted = wanted
        """Acknowledgements needed: one per stage."""
        self.retry_s = retry_s
        self.stages: set[int] = set()
        self._sent_at: float | None = None

    @property
    def done(self) -> bool:
        return len(self.stages) >= self.wanted

    def sent(self, now: float) -> None:
        """The command was published at ``now``."""
        self._sent_at = now

    def acknowledged(self, stage: int) -> bool:
        """``stage`` acknowledged the command; whether that is news (a stage applies a
        command once and answers every repeat with the same acknowledgement)."""
        if stage in self.stages:
            return False
        self.stages.add(stage)
        return True

    def due(self, now: float) -> bool:
        """Whether to publish the command (again) at ``now``."""
        if self.done:
            return False
        return self._sent_at is None or now - self._sent_at >= self.retry_s
