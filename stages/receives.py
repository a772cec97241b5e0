"""The receives of one pass, posted ahead of the instructions that wait for them.

gloo moves a message only once its receive is posted, so a just-in-time
receive would cost a round trip. A pass posts the first `RECEIVES_AT_START`
activation receives of each chunk at its start (and of its output gradients
right after its first activation send, `PassReceives.open_grads`), then one
more receive after every instruction (`PassReceives.post_one`), on the
channel (activations or gradients of a chunk) with the fewest posted ahead,
up to ``window`` ahead of the waits (default: all of a pass). Posting a
receive costs tens to hundreds of microseconds; posting a whole pass's at
once would hold the first forward of a step, which the whole pipeline waits
for, by milliseconds. An instruction that waits for a receive not posted yet
posts it (and every one before it) first (`PassReceives.take`).

Chunks whose neighbour is on the same process (zbv's turn on stage 0) hand
their tensors over in memory and receive nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from evtrain.stages.mesh import ChunkRoutes
from evtrain.stages.p2p import Mailbox, PendingRecv
from evtrain.stages.pytree import BoundarySpec

__all__ = ["RECEIVES_AT_START", "PassReceives"]

RECEIVES_AT_START = 2
"""Receives a channel posts when it opens; the rest follow one per instruction."""

Kind = Literal["act", "grad"]


@dataclass
class _Channel:
    """The receives of one chunk's activations or gradients from one peer, in a pass."""

    peer: int
    pending: list[PendingRecv | None]
    """By microbatch: the posted receive not taken yet (None: not posted, taken, or
    carrying no gradient)."""
    posted: int = 0
    """Microbatches whose receive is posted (they are posted in order)."""
    waited: int = 0
    """Microbatches whose receive was waited for."""


class PassReceives:
    """Posts and hands out the receives of a stage's passes (module docstring).

    ``specs`` given to `begin` are the pass's (input, output) `BoundarySpec` of chunk
    ``v``'s microbatch ``m`` at ``v * n + m``.
    """

    def __init__(self, mailbox: Mailbox, routes: ChunkRoutes, window: int) -> None:
        self.mailbox = mailbox
        self.routes = routes
        self.window = window
        self._channels: dict[tuple[Kind, int], _Channel] = {}
        self._specs: Sequence[tuple[BoundarySpec, BoundarySpec | None]] = ()
        self._n = 0

    def begin(self, specs: Sequence[tuple[BoundarySpec, BoundarySpec | None]], n: int) -> None:
        """A pass of ``n`` microbatches begins: its activation receives open."""
        self._specs, self._n = specs, n
        self._channels = {}
        for v in range(len(self.routes.prev)):
            self._open("act", v)
        # Gradient receives open right after the first activation send (or at
        # the first gradient wait): not needed before then, and posting them
        # here would delay the first stage's first forward.

    def open_grads(self) -> None:
        """Start posting every chunk's gradient receives (once per pass)."""
        for v in range(len(self.routes.next)):
            self._open("grad", v)

    def end(self) -> None:
        self._channels = {}
        self._specs = ()

    def take(self, kind: Kind, v: int, m: int) -> PendingRecv | None:
        """Chunk ``v``'s microbatch ``m`` ``kind`` receive, waited for now: posted (with
        every one before it) and handed out once. None where nothing comes: a gradient
        of outputs that take none."""
        channel = self._channels.get((kind, v))
        if channel is None:
            return None
        self._post_until(kind, v, m + 1)
        channel.waited = m + 1
        pending, channel.pending[m] = channel.pending[m], None
        return pending

    def post_one(self) -> None:
        """Post one more receive: on the channel with the fewest posted ahead of its waits."""
        best: tuple[int, tuple[Kind, int]] | None = None
        for key, channel in self._channels.items():
            ahead = channel.posted - channel.waited
            open_ = channel.posted < self._n and ahead < self.window
            if open_ and (best is None or ahead < best[0]):
                best = (ahead, key)
        if best is not None:
            kind, v = best[1]
            self._post_until(kind, v, self._channels[kind, v].posted + 1)

    def _open(self, kind: Kind, v: int) -> None:
        """Start posting chunk ``v``'s ``kind`` receives (when they come from another process)."""
        peer = self.routes.prev[v] if kind == "act" else self.routes.next[v]
        if peer is None or self.routes.local(peer) or (kind, v) in self._channels:
            return
        self._channels[kind, v] = _Channel(peer[0], [None] * self._n)
        self._post_until(kind, v, RECEIVES_AT_START)

    def _post_until(self, kind: Kind, v: int, stop: int) -> None:
        """Post chunk ``v``'s ``kind`` receives of the microbatches below ``stop``."""
        channel = self._channels[kind, v]
        n = self._n
        while channel.posted < min(stop, n):
            m = channel.posted
            act_spec, out_spec = self._specs[v * n + m]
            if kind == "act":
                channel.pending[m] = self.mailbox.post_recv_activation(act_spec, channel.peer, v)
            elif out_spec is not None and out_spec.carries_grad:
                channel.pending[m] = self.mailbox.post_recv_grad(out_spec, channel.peer, v)
            channel.posted += 1
