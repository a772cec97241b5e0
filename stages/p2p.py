"""Point-to-point exchange of activations and gradients between neighbouring stages.

Stage ``s`` runs on global rank ``s``. Activations flow ``s -> s+1`` on the
*activation group* (the default process group) and gradients ``s+1 -> s`` on a
separate *gradient group*, so each direction has its own connections: on gloo
a second TCP connection per direction helps (measured: docs/benchmarks.md,
"Measurements behind design choices"), and on NCCL it keeps the two
directions on separate communicators/streams, which is what lets receives be
posted far ahead without blocking sends queued behind them.

What crosses a boundary is a pytree of tensors (`evtrain.stages.pytree`).
Its structure, shapes and dtypes are agreed once per shape of the data,
without pickling (`exchange_shapes`; which shapes, and when,
`evtrain.stages.shapes`): stage 0 derives its input specs from the data, and
each stage infers its output spec with one forward on zeros and sends the
specs downstream as one small JSON message. After that, every microbatch
moves as its leaves, one message each, into buffers of known shape.

Performance rules this module is built for (measured on gloo):

* receives are *posted early* (`post_recv`) and waited on only when the data
  is needed: gloo writes a send to the socket only once the peer's receive
  is posted;
* sends are never waited on right after posting (`Mailbox.drain_sends` at the
  step end): waiting at once serializes the pipeline and, with just-in-time
  receives, deadlocks 1F1B.

gloo work cannot be polled or awaited (``is_completed`` stays False until
``wait``), so waits block the calling thread; the stage actor runs a whole
step in one worker thread for that reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from evtrain.stages.pytree import (
    BoundarySpec,
    TensorSpec,
    call,
    decode_specs,
    encode_specs,
    spec_of,
)

__all__ = [
    "Mailbox",
    "PendingRecv",
    "exchange_shapes",
    "infer_output_spec",
    "posted",
]


def posted(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point operation just posted.

    torch types it optional: None means this rank is not in the group, which
    no stage's own groups allow.
    """
    if work is None:
        raise RuntimeError("a point-to-point operation was posted outside its process group")
    return work


def infer_output_spec(
    module: nn.Module, spec: BoundarySpec, device: torch.device, where: str
) -> BoundarySpec:
    """Output spec of ``module`` for an input of ``spec``, leaving its state untouched.

    Runs one real forward on a zero input in ``eval()`` mode with the RNG
    forked: eval mode keeps BatchNorm statistics and dropout streams as they
    are, and the shapes are those of training. Gradients are enabled (and
    the floating input leaves that carry gradients require them) so that the
    spec knows which output leaves need a gradient back. A meta-device
    forward would cost no compute, but its decompositions import
    torch._dynamo and sympy — seconds of startup per process on a small
    machine — while one microbatch forward is milliseconds. ``where`` names
    the stage in the `SpecError` for an output that cannot cross a boundary.
    """
    devices = [device] if device.type == "cuda" else []
    inputs = spec.unflatten(
        [
            torch.zeros(s.shape, dtype=s.dtype, device=device).requires_grad_(s.requires_grad)
            for s in spec.leaves
        ],
        device,
    )
    was_training = module.training
    module.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            out = call(module, inputs)
        return spec_of(out, where)
    finally:
        module.train(was_training)
        module.zero_grad(set_to_none=True)


def exchange_shapes(
    *,
    prev: int | None,
    next: int | None,
    input_specs: Sequence[BoundarySpec] | None,
    output_spec_of: Callable[[BoundarySpec], BoundarySpec],
    last: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[list[BoundarySpec], list[BoundarySpec | None]]:
    """Agree on the boundary specs of one model chunk for some shapes of the data.

    ``prev``/``next`` are the global ranks the chunk receives from and sends
    to, None where there is no other process: at the model's ends, and at a
    hand-off between two chunks of this process. Without ``prev``,
    ``input_specs`` are the chunk's input specs for each distinct microbatch
    size, in an order every stage knows (the data's on the model's first
    chunk, the previous chunk's outputs at a hand-off); otherwise they come
    in one message from ``prev``. ``output_spec_of`` maps an input spec to
    the chunk's output spec; the model's ``last`` chunk has none and does not
    call it. Returns ``(input specs, output specs)``, index-aligned.
    """
    if prev is None:
        assert input_specs is not None
        inputs = list(input_specs)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, src=prev, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(data, src=prev, group=group)
        inputs = decode_specs(data)
    if last:
        return inputs, [None] * len(inputs)
    outputs = [output_spec_of(spec) for spec in inputs]
    if next is not None:
        data = encode_specs(outputs).to(device)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), next, group)
        dist.send(data, next, group)
    return inputs, list(outputs)


@dataclass
class PendingRecv:
    """A posted receive of some leaves: the buffers they fill and the work to wait on."""

    buffers: list[torch.Tensor]
    works: list[dist.Work]


@dataclass
class Mailbox:
    """One stage's posted receives and unfinished sends, with wait-time accounting.

    Every operation names its peer's global rank. Activations use
    ``act_group``, gradients ``grad_group``; with model chunks what goes into
    chunk v (``chunk``, the receiver's) uses ``chunk_groups[v]``
    (`evtrain.stages.mesh`), whose pair 0 is (``act_group``, ``grad_group``).
    """

    device: torch.device
    act_group: dist.ProcessGroup | None
    grad_group: dist.ProcessGroup | None
    chunk_groups: Sequence[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]] = ()
    wait_s: float = 0.0
    """Seconds blocked in ``wait()`` since the last `reset_wait`."""
    _sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    def _act(self, chunk: int) -> dist.ProcessGroup | None:
        return self.chunk_groups[chunk][0] if chunk else self.act_group

    def _grad(self, chunk: int) -> dist.ProcessGroup | None:
        return self.chunk_groups[chunk][1] if chunk else self.grad_group

    def post_recv_activation(self, spec: BoundarySpec, src: int, chunk: int = 0) -> PendingRecv:
        """Post the receives of one activation's leaves from rank ``src`` into ``chunk``."""
        return self._post(spec.leaves, src, self._act(chunk))

    def post_recv_grad(self, spec: BoundarySpec, src: int, chunk: int = 0) -> PendingRecv:
        """Post the receives of the gradients of one output's grad-carrying leaves
        (of this stage's ``chunk``) from rank ``src``."""
        return self._post(
            [leaf for leaf in spec.leaves if leaf.carries_grad], src, self._grad(chunk)
        )

    def _post(
        self, leaves: Sequence[TensorSpec], src: int, group: dist.ProcessGroup | None
    ) -> PendingRecv:
        buffers = [leaf.empty(self.device) for leaf in leaves]
        works = [posted(dist.irecv(b, src=src, group=group)) for b in buffers]
        return PendingRecv(buffers, works)

    def wait(self, pending: PendingRecv) -> tuple[list[torch.Tensor], float, float]:
        """Block until ``pending`` arrived; returns (leaves, start, end) in perf_counter s."""
        start = time.perf_counter()
        for work in pending.works:
            work.wait()
        pending.works = []
        end = time.perf_counter()
        self.wait_s += end - start
        return pending.buffers, start, end

    def send_activation(self, leaves: Sequence[torch.Tensor], dst: int, chunk: int = 0) -> None:
        """Post the sends of an output's leaves to rank ``dst``'s chunk ``chunk``
        (waited on in `drain_sends`)."""
        self._send(leaves, dst, self._act(chunk))

    def send_grad(self, grads: Sequence[torch.Tensor], dst: int, chunk: int = 0) -> None:
        """Post the sends of an input's leaf gradients to rank ``dst``'s chunk ``chunk``
        (the chunk whose output they are the gradient of)."""
        self._send(grads, dst, self._grad(chunk))

    def _send(
        self, tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None
    ) -> None:
        for tensor in tensors:
            tensor = tensor.detach().contiguous()
            self._sends.append((posted(dist.isend(tensor, dst=dst, group=group)), tensor))

    def drain_sends(self) -> tuple[float, float]:
        """Wait for every posted send; the tensors may be freed afterwards."""
        start = time.perf_counter()
        for work, _tensor in self._sends:
            work.wait()
        self._sends.clear()
        end = time.perf_counter()
        self.wait_s += end - start
        return start, end

    def reset_wait(self) -> float:
        """Return the accumulated wait seconds and start counting from zero."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited


def distinct(values: Iterable[int]) -> list[int]:
    """Sorted distinct values (the microbatch sizes every stage agrees on)."""
    return sorted(set(values))
