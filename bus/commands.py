"""The stage side of commands: receive them without waiting, apply each id once.

Issuers retry a command until it is acknowledged, so a stage sees the same
``command_id`` several times: either because its acknowledgement was lost, or
because the retry crossed it. `CommandReceiver.poll` returns each id once; when
the receiver was given a publisher and the stage acknowledged through
`CommandReceiver.ack`, a repeated command gets the same acknowledgement again,
so a lost acknowledgement is healed by the next retry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import structlog
import zmq

from evtrain.bus.publisher import Publisher
from evtrain.bus.security import CurveConfig
from evtrain.errors import UsageError
from evtrain.events import Command, CommandAcked, DecodeError, decode

log = structlog.get_logger("evtrain.bus.commands")

_SEEN_LIMIT = 4096
_NOBLOCK = int(zmq.NOBLOCK)


class CommandReceiver:
    """A SUB socket on the broker's ``commands_out``; `poll` never blocks.

    ``publisher`` (the stage's event publisher) lets `ack` publish acknowledgements
    and re-send them for repeated commands. ``curve`` is needed on a CURVE bus.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        publisher: Publisher | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self.malformed = 0
        self.duplicates = 0
        self.publisher = publisher
        self._seen: OrderedDict[str, CommandAcked | None] = OrderedDict()
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

    def poll(self) -> list[Command]:
        """New commands that arrived since the last call (possibly none)."""
        out: list[Command] = []
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
            if msg.command_id in self._seen:
                self._repeat(msg.command_id)
                continue
            self._seen[msg.command_id] = None
            if len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
            out.append(msg)

    def ack(
        self, command: Command, *, stage: int, step: int, ok: bool = True, detail: str = ""
    ) -> CommandAcked:
        """Acknowledge ``command`` through the publisher; repeats of it get this ack again."""
        if self.publisher is None:
            raise RuntimeError("CommandReceiver.ack needs the receiver to have a publisher")
        acked = CommandAcked(
            command_id=command.command_id,
            command=command.topic.decode(),
            stage=stage,
            step=step,
            ok=ok,
            detail=detail,
        )
        self._seen[command.command_id] = acked
        self.publisher.publish(acked)
        return acked

    def _repeat(self, command_id: str) -> None:
        self.duplicates += 1
        acked = self._seen.get(command_id)
        if acked is not None and self.publisher is not None:
            # The issuer retried, so it has not seen our acknowledgement: send it again.
            self.publisher.publish(acked)

    def close(self) -> None:
        """Close the socket (not the publisher)."""
        self._sock.close(linger=0)

    def __enter__(self) -> CommandReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
