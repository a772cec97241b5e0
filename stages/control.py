"""The per-step control exchange: one tiny message round at every step boundary.

At the `OptimizerStep` of every step all processes (every stage of every
data-parallel replica) share, over the gloo *control group* (gloo even on
CUDA, so it never queues behind NCCL work), four numbers:

* the squared L2 norm of their gradients — the sum is the squared *global*
  gradient norm, used for clipping and reported as ``grad_norm``. The
  replicas of a stage hold the same averaged gradients, so only replica 0
  contributes its stage's;
* each replica's step loss divided by the number of replicas, from the last
  stages — the sum is the global mean loss, reported as ``loss``;
* the byte length of the commands stage 0 received since the last boundary
  (only stage 0 polls the bus, so only it contributes; repeats of earlier
  commands too, so that every stage can answer a retry — see
  `evtrain.bus.commands`);
* whether a stage got SIGTERM/SIGINT — any stage's signal stops all of them
  at the same boundary, which a per-process flag alone could not guarantee.

Only when stage 0 has commands does a second round follow: a broadcast of
their msgpack bytes (a list of `evtrain.events.encode` payloads) in a uint8
tensor. So every stage applies the same commands at the same step boundary.

Why not ``all_reduce``: it is what this amounts to, but gloo's all-reduce
runs its algorithm's message rounds only once the last stage arrives, and
the last to arrive is the first stage (it runs the final backward), whose
next forward the whole pipeline then waits for. Here every stage *posts its
receives early* (`prepare`, called at the start of each step) and, at the
boundary, sends its numbers to every other process: when the first stage
arrives its peers' numbers are already there, so it does not wait at all.
Every process adds the contributions in rank order, so the sums are bitwise
identical everywhere. (PxD - 1 sends per process: fine for a few dozen
processes; hundreds would want a tree.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist

from evtrain.bus.commands import CommandReceiver
from evtrain.events import Command, DecodeError, decode, encode
from evtrain.stages import p2p

__all__ = ["ControlExchange", "ControlResult", "StepControl"]

_list_of_bytes = msgspec.msgpack.Decoder(list[bytes])
_FIELDS = 4  # squared grad norm, command bytes, signal, loss share


@dataclass
class ControlResult:
    """What every stage learned at a step boundary (identical on all stages)."""

    grad_norm: float
    """Global L2 norm of all gradients (before clipping)."""
    commands: list[Command] = field(default_factory=list)
    """Commands to apply at this boundary, in arrival order."""
    signalled: bool = False
    """Some stage received SIGTERM/SIGINT: stop after this step."""
    loss: float = 0.0
    """The step's loss, averaged over the data-parallel replicas (0 at boundary 0)."""


class ControlExchange:
    """One boundary's exchange, started by `StepControl.start`, completed by `finish`."""

    def __init__(
        self,
        control: StepControl,
        own: torch.Tensor,
        receives: dict[int, tuple[torch.Tensor, dist.Work]],
        sends: list[dist.Work],
        payload: bytes,
    ) -> None:
        self._control = control
        self._own = own
        self._receives = receives
        self._sends = sends
        self._payload = payload

    def finish(self) -> ControlResult:
        """Wait for the peers' numbers (and the command broadcast, if any); decode."""
        control = self._control
        total = torch.zeros(_FIELDS, dtype=torch.float64)
        for rank in range(control.world_size):
            if rank == control.rank:
                total += self._own
            else:
                buffer, work = self._receives[rank]
                work.wait()
                total += buffer
        for work in self._sends:
            work.wait()
        sq_norm, length, signals, loss = total.tolist()
        commands: list[Command] = []
        if int(length):
            commands = control._broadcast_commands(self._payload, int(length))
        return ControlResult(
            grad_norm=math.sqrt(max(sq_norm, 0.0)),
            commands=commands,
            signalled=signals > 0,
            loss=loss,
        )


class StepControl:
    """The control exchange of one stage (see the module docstring).

    ``group`` is the gloo control group (None with a single process: nothing
    is exchanged). ``receiver`` is the command socket, on stage 0 only.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        receiver: CommandReceiver | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.receiver = receiver if rank == 0 else None
        self.malformed = 0
        self._posted: dict[int, tuple[torch.Tensor, dist.Work]] | None = None

    def prepare(self) -> None:
        """Post the receives of the next exchange now (idempotent).

        Call it early — the stage runtime does at the start of every step —
        so the peers' numbers land while this stage still computes. Never
        leave receives posted at the end of a run: only call it when an
        exchange will follow.
        """
        if self._posted is not None or self.world_size == 1:
            return
        posted = {}
        for peer in range(self.world_size):
            if peer != self.rank:
                buffer = torch.empty(_FIELDS, dtype=torch.float64)
                posted[peer] = (buffer, p2p.posted(dist.irecv(buffer, src=peer, group=self.group)))
        self._posted = posted

    def start(
        self, local_sq_norm: float, signalled: bool, loss_share: float = 0.0
    ) -> ControlExchange:
        """Send this stage's numbers to every peer without waiting.

        The caller may do independent work (the optimizer step when no
        clipping needs the global norm) before `ControlExchange.finish`.
        """
        payload = b""
        if self.receiver is not None:
            commands = self.receiver.poll()
            if commands:
                payload = msgspec.msgpack.encode([encode(c) for c in commands])
        own = torch.tensor(
            [local_sq_norm, float(len(payload)), 1.0 if signalled else 0.0, loss_share],
            dtype=torch.float64,
        )
        self.prepare()
        receives, self._posted = self._posted or {}, None
        sends = [
            p2p.posted(dist.isend(own, dst=peer, group=self.group))
            for peer in range(self.world_size)
            if peer != self.rank
        ]
        return ControlExchange(self, own, receives, sends, payload)

    def exchange(self, local_sq_norm: float, signalled: bool = False) -> ControlResult:
        """`start` and `ControlExchange.finish` in one call."""
        return self.start(local_sq_norm, signalled).finish()

    def _broadcast_commands(self, payload: bytes, length: int) -> list[Command]:
        if self.world_size > 1:
            if self.rank == 0:
                buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            else:
                buffer = torch.empty(length, dtype=torch.uint8)
            dist.broadcast(buffer, src=0, group=self.group)
            payload = buffer.numpy().tobytes()
        commands: list[Command] = []
        for item in _list_of_bytes.decode(payload):
            try:
                msg = decode(item)
            except DecodeError:  # CommandReceiver already validated; be safe anyway
                self.malformed += 1
                continue
            if isinstance(msg, Command):
                commands.append(msg)
        return commands

    def share(self, value: float, src: int) -> float:
        """Stage ``src``'s ``value`` on every stage (collective: every stage calls it)."""
        if self.world_size == 1:
            return value
        buffer = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(buffer, src=src, group=self.group)
        return float(buffer.item())

    def barrier(self) -> None:
        """Wait until every stage got here (on the control group)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
