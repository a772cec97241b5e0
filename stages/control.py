"""The per-step control exchange: one tiny message round at every step boundary.

At the `OptimizerStep` of every step all processes (every stage of every
data-parallel replica) share, over the gloo *control group* (gloo even on
CUDA, so it never queues behind NCCL work), five numbers:

* the squared L2 norm of their gradients — the sum is the squared *global*
  gradient norm, used for clipping and reported as ``grad_norm``. The
  replicas of a stage hold the same averaged gradients, so only replica 0
  contributes its stage's;
* each replica's step loss divided by the number of replicas, from the last
  stages — the sum is the global mean loss, reported as ``loss``; with
  `evtrain.job.Job.loss_weight`, each replica's weighted loss sum instead;
* with ``loss_weight``, each replica's total weight (its step's units, e.g.
  tokens), from the last stages — the sum divides the weighted loss sum and
  scales every stage's gradients (`evtrain.stages.update`);
* the byte length of the commands stage 0 received since the last boundary
  (only stage 0 polls the bus, so only it contributes; repeats of earlier
  commands too, so that every stage can answer a retry — see
  `evtrain.bus.commands`);
* whether a stage got SIGTERM/SIGINT — any stage's signal stops all of them
  at the same boundary, which a per-process flag alone could not guarantee.

Only when stage 0 has commands does a second round follow: a broadcast of
their msgpack bytes (a list of `evtrain.events.encode` payloads) in a uint8
tensor. So every stage applies the same commands at the same step boundary.

The numbers travel along a binary tree over the ranks (rank r's parent is
(r - 1) // 2): each process adds its children's subtree sums to its own and
sends the result up; rank 0 (stage 0, replica 0) adds the last ones and
sends the total down, and each process passes it on to its children. So a
process sends and receives at most three small messages per step, however
many processes run, and the total is computed once: bitwise the same
everywhere.

Why this shape: the last process to reach a boundary is stage 0 (it runs the
final backward), whose next forward the whole pipeline then waits for. The
tree's root is stage 0, and its children are higher ranks (later stages),
which reached the boundary earlier: their subtree sums are already there
when stage 0 arrives, so it does not wait (every receive is posted early,
`prepare`, at the start of each step). The others learn the total a few
hops later, while stage 0's next forward runs. gloo's ``all_reduce`` would
instead start its message rounds only once stage 0 arrived, and an
all-to-all exchange costs P x D - 1 messages per process.
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
_FIELDS = 5  # squared grad norm, command bytes, signal, loss share, loss weight


@dataclass
class _Posted:
    """The receives of one exchange: the children's subtree sums, the total from the parent."""

    ups: list[tuple[torch.Tensor, dist.Work]]
    down: tuple[torch.Tensor, dist.Work] | None


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
    weight: float = 0.0
    """The step's total loss weight over the replicas (`evtrain.job.Job.loss_weight`;
    0 without it)."""


class ControlExchange:
    """One boundary's exchange, started by `StepControl.start`, completed by `finish`."""

    def __init__(
        self,
        control: StepControl,
        *,
        total: torch.Tensor | None,
        down: tuple[torch.Tensor, dist.Work] | None,
        sends: list[dist.Work],
        payload: bytes,
    ) -> None:
        self._control = control
        self._total = total
        self._down = down
        self._sends = sends
        self._payload = payload

    def finish(self) -> ControlResult:
        """Wait for the total (and the command broadcast, if any); pass it on; decode."""
        control = self._control
        total = self._total
        if total is None:
            assert self._down is not None
            total, work = self._down
            work.wait()
            self._sends += [
                p2p.posted(dist.isend(total, dst=child, group=control.group))
                for child in control.children
            ]
        for work in self._sends:
            work.wait()
        sq_norm, length, signals, loss, weight = total.tolist()
        commands: list[Command] = []
        if int(length):
            commands = control._broadcast_commands(self._payload, int(length))
        return ControlResult(
            grad_norm=math.sqrt(max(sq_norm, 0.0)),
            commands=commands,
            signalled=signals > 0,
            loss=loss,
            weight=weight,
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
        self.parent = (rank - 1) // 2 if rank > 0 else None
        self.children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]
        self._posted: _Posted | None = None

    def prepare(self) -> None:
        """Post the receives of the next exchange now (idempotent).

        Call it early — the stage runtime does at the start of every step —
        so the peers' numbers land while this stage still computes. Never
        leave receives posted at the end of a run: only call it when an
        exchange will follow.
        """
        if self._posted is not None or self.world_size == 1:
            return
        ups = [self._receive(child) for child in self.children]
        down = None if self.parent is None else self._receive(self.parent)
        self._posted = _Posted(ups, down)

    def _receive(self, peer: int) -> tuple[torch.Tensor, dist.Work]:
        buffer = torch.empty(_FIELDS, dtype=torch.float64)
        return buffer, p2p.posted(dist.irecv(buffer, src=peer, group=self.group))

    def start(
        self,
        local_sq_norm: float,
        signalled: bool,
        loss_share: float = 0.0,
        weight: float = 0.0,
    ) -> ControlExchange:
        """Add this stage's numbers to its children's and send them on.

        Waits only for the children, which are later stages and got here
        first. The caller may do independent work (the optimizer step when no
        clipping needs the global norm) before `ControlExchange.finish`.
        """
        payload = b""
        if self.receiver is not None:
            commands = self.receiver.poll()
            if commands:
                payload = msgspec.msgpack.encode([encode(c) for c in commands])
        subtotal = torch.tensor(
            [local_sq_norm, float(len(payload)), 1.0 if signalled else 0.0, loss_share, weight],
            dtype=torch.float64,
        )
        if self.world_size == 1:
            return ControlExchange(self, total=subtotal, down=None, sends=[], payload=payload)
        self.prepare()
        posted, self._posted = self._posted, None
        assert posted is not None
        for buffer, work in posted.ups:
            work.wait()
            subtotal += buffer
        if self.parent is None:
            sends = [
                p2p.posted(dist.isend(subtotal, dst=child, group=self.group))
                for child in self.children
            ]
            return ControlExchange(self, total=subtotal, down=None, sends=sends, payload=payload)
        sends = [p2p.posted(dist.isend(subtotal, dst=self.parent, group=self.group))]
        return ControlExchange(self, total=None, down=posted.down, sends=sends, payload=payload)

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
