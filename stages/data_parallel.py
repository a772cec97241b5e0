"""Data parallelism for one stage: DDP's reducer over the stage's replicas.

Every stage runs on D processes (its replicas, `evtrain.stages.mesh`); each
reads its own ``batch_size / D`` samples of every batch and computes the
gradients of its share. torch's `DistributedDataParallel` averages them over
the replicas — bucketed, in the order the gradients become ready, its
all-reduces overlapped with the rest of the backward. The pipeline adds one
twist, the one torch.distributed.pipelining's `PipelineStage` makes too: a
step runs M (x grad_accum) backwards, and only the last may reduce.

* Every forward runs under ``no_sync()``, so DDP's own forward never arms the
  reducer (it would reduce at the first backward after the last forward,
  which in 1F1B is not the last backward).
* Every backward but the step's last runs under ``no_sync()`` as well: the
  gradients accumulate locally.
* The last backward arms the reducer by hand (``prepare_for_backward`` on the
  tensors it back-propagates) and runs outside ``no_sync()``: the bucket
  all-reduces start as the accumulated gradients become ready and DDP
  finalizes them (waits, copies the averages back) when the backward ends.

Why DDP and not FSDP2 (``fully_shard``): a pipeline stage already holds only
its slice of the model, so sharding its parameters further buys memory only
for stages too big for one device, and costs an all-gather of the parameters
before every microbatch forward and backward (2M collectives per step
instead of one reduction), unless it keeps them unsharded between
microbatches, which gives the memory back. Why DDP
and not a loop of all-reduces at the step end: DDP's buckets overlap the
reduction with the last backward and send a few large messages instead of
one per parameter.

Buffers are synchronized at start only (``forward_sync_buffers=False``): syncing them at
every forward is a collective per microbatch. BatchNorm running statistics
therefore differ between replicas; replica 0's are the ones evaluated and
saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

__all__ = ["Replicas"]


class Replicas:
    """One stage's DDP wrapper; construct it on every replica (collective: DDP
    broadcasts replica 0's parameters and buffers to the others)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=group,
            forward_sync_buffers=False,
        )

    @property
    def module(self) -> nn.Module:
        """What the stage calls forward: the DDP wrapper (``no_sync`` is its state)."""
        return self.ddp

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradients accumulate locally inside (forwards, and every backward but the last)."""
        with self.ddp.no_sync():
            yield

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the next backward, from ``tensors``, reduce over the replicas."""
        self.ddp.reducer.prepare_for_backward(list(_find_tensors(list(tensors))))
