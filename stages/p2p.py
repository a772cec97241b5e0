"""Point-to-point exchange of activations and gradients between neighbouring stages.

Stage ``s`` runs on global rank ``s``. Activations flow ``s -> s+1`` on the
*activation group* (the default process group) and gradients ``s+1 -> s`` on a
separate *gradient group*, so each direction has its own connections: on gloo
a second TCP connection measurably helped (best median step time on 2 cores),
and on NCCL it keeps the two directions on separate communicators/streams,
which is what lets receives be posted far ahead without blocking sends queued
behind them.

Shapes and dtypes are agreed once, before training, without pickling
(`exchange_shapes`): every stage knows the few distinct microbatch sizes of
the run (training and evaluation), stage 0 derives its input shapes from the
data, and each stage infers its output shape with a meta-device forward and
sends it downstream as a small int64 header tensor. After that, every
microbatch moves as raw data into a buffer of known shape.

Performance rules this module is built for (measured on gloo, 2 CPU processes):

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

__all__ = [
    "HEADER_LEN",
    "Mailbox",
    "PendingRecv",
    "TensorSpec",
    "decode_header",
    "encode_header",
    "exchange_shapes",
    "infer_output_spec",
    "posted",
]

# dtype <-> small integer code for headers; the order is part of the wire format.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODES = {dtype: i for i, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 14
HEADER_LEN = 2 + _MAX_DIMS
"""int64 entries per header: dtype code, number of dims, the dims (zero-padded)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient flows back for it (floating/complex activations only)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def empty(self, device: torch.device) -> torch.Tensor:
        """An uninitialized buffer of this spec."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def posted(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point operation just posted.

    torch types it optional: None means this rank is not in the group, which
    no stage's own groups allow.
    """
    if work is None:
        raise RuntimeError("a point-to-point operation was posted outside its process group")
    return work


def encode_header(spec: TensorSpec) -> torch.Tensor:
    """The int64 header describing ``spec`` (length `HEADER_LEN`)."""
    if len(spec.shape) > _MAX_DIMS:
        raise ValueError(f"activations of more than {_MAX_DIMS} dims are not supported")
    if spec.dtype not in _CODES:
        raise ValueError(f"activation dtype {spec.dtype} cannot cross a stage boundary")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = _CODES[spec.dtype]
    header[1] = len(spec.shape)
    if spec.shape:
        header[2 : 2 + len(spec.shape)] = torch.tensor(spec.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> TensorSpec:
    """Inverse of `encode_header`."""
    values = header.tolist()
    ndim = int(values[1])
    return TensorSpec(tuple(int(d) for d in values[2 : 2 + ndim]), _DTYPES[int(values[0])])


def infer_output_spec(module: nn.Module, spec: TensorSpec, device: torch.device) -> TensorSpec:
    """Output spec of ``module`` for an input of ``spec``, leaving its state untouched.

    Runs one real forward on a zero input in ``eval()`` mode under
    ``no_grad`` with the RNG forked: eval mode keeps BatchNorm statistics and
    dropout streams as they are, and the shapes are those of training. (A
    meta-device forward would cost no compute, but its decompositions import
    torch._dynamo and sympy — seconds of startup per process on a small
    machine — while one microbatch forward is milliseconds.)
    """
    devices = [device] if device.type == "cuda" else []
    was_training = module.training
    module.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            out = module(torch.zeros(spec.shape, dtype=spec.dtype, device=device))
    finally:
        module.train(was_training)
    return TensorSpec(tuple(out.shape), out.dtype)


def exchange_shapes(
    *,
    stage: int,
    num_stages: int,
    input_specs: Sequence[TensorSpec] | None,
    output_spec_of: Callable[[TensorSpec], TensorSpec],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[list[TensorSpec], list[TensorSpec | None]]:
    """Agree on every boundary shape of the run, once, before training.

    ``input_specs`` (stage 0 only) are the input specs for each distinct
    microbatch size, in an order every stage knows; the other stages receive
    theirs in one header message from the previous stage. ``output_spec_of``
    maps an input spec to this stage's output spec; the last stage sends
    nothing and does not call it. Returns ``(input specs, output specs)``,
    index-aligned; the output specs are None on the last stage.
    """
    if stage == 0:
        assert input_specs is not None
        inputs = list(input_specs)
    else:
        count = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(count, src=stage - 1, group=group)
        headers = torch.empty(int(count.item()), HEADER_LEN, dtype=torch.int64, device=device)
        dist.recv(headers, src=stage - 1, group=group)
        inputs = [decode_header(h) for h in headers.cpu()]
    if stage == num_stages - 1:
        return inputs, [None] * len(inputs)
    outputs = [output_spec_of(spec) for spec in inputs]
    headers = torch.stack([encode_header(spec) for spec in outputs]).to(device)
    dist.send(torch.tensor([len(outputs)], dtype=torch.int64, device=device), stage + 1, group)
    dist.send(headers, stage + 1, group)
    return inputs, list(outputs)


@dataclass
class PendingRecv:
    """A posted receive: the buffer it fills and the work to wait on."""

    buffer: torch.Tensor
    work: dist.Work | None


@dataclass
class Mailbox:
    """One stage's posted receives and unfinished sends, with wait-time accounting.

    ``prev``/``next`` are the neighbour ranks (None at the ends). Activations
    use ``act_group``, gradients ``grad_group``.
    """

    stage: int
    num_stages: int
    device: torch.device
    act_group: dist.ProcessGroup | None
    grad_group: dist.ProcessGroup | None
    wait_s: float = 0.0
    """Seconds blocked in ``wait()`` since the last `reset_wait`."""
    _sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    @property
    def prev(self) -> int | None:
        return self.stage - 1 if self.stage > 0 else None

    @property
    def next(self) -> int | None:
        return self.stage + 1 if self.stage < self.num_stages - 1 else None

    def post_recv_activation(self, spec: TensorSpec) -> PendingRecv:
        """Post the receive of one activation from the previous stage."""
        buffer = spec.empty(self.device)
        assert self.prev is not None
        return PendingRecv(buffer, dist.irecv(buffer, src=self.prev, group=self.act_group))

    def post_recv_grad(self, spec: TensorSpec) -> PendingRecv:
        """Post the receive of the gradient of one of our outputs from the next stage."""
        buffer = spec.empty(self.device)
        assert self.next is not None
        return PendingRecv(buffer, dist.irecv(buffer, src=self.next, group=self.grad_group))

    def wait(self, pending: PendingRecv) -> tuple[torch.Tensor, float, float]:
        """Block until ``pending`` arrived; returns (tensor, start, end) in perf_counter s."""
        start = time.perf_counter()
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        end = time.perf_counter()
        self.wait_s += end - start
        return pending.buffer, start, end

    def send_activation(self, tensor: torch.Tensor) -> None:
        """Post the send of an output to the next stage (waited on in `drain_sends`)."""
        assert self.next is not None
        tensor = tensor.detach().contiguous()
        self._sends.append(
            (posted(dist.isend(tensor, dst=self.next, group=self.act_group)), tensor)
        )

    def send_grad(self, tensor: torch.Tensor) -> None:
        """Post the send of an input gradient to the previous stage."""
        assert self.prev is not None
        tensor = tensor.detach().contiguous()
        self._sends.append(
            (posted(dist.isend(tensor, dst=self.prev, group=self.grad_group)), tensor)
        )

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
