"""The stage side of commands: receive them without waiting, apply each id once."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import structlog
import zmq

from evtrain.errors import UsageError
from evtrain.events import Command, DecodeError, decode

log = structlog.get_logger("evtrain.bus.commands")

_SEEN_LIMIT = 4096


class CommandReceiver:
    """A SUB socket on the broker's ``commands_out``; `poll` never blocks.

    Issuers retry until acknowledged, so the same command can arrive several
    times: `poll` returns each ``command_id`` only once.
    """

    def __init__(self, endpoint: str, *, context: zmq.Context | None = None) -> None:
        self.malformed = 0
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
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
                frames: list[Any] = self._sock.recv_multipart(zmq.NOBLOCK)
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
            if not isinstance(msg, Command) or msg.command_id in self._seen:
                continue
            self._seen[msg.command_id] = None
            if len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
            out.append(msg)

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(linger=0)
