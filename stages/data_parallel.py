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

Why DDP, measured by ``bench/dp_reducer.py`` (every variant equal to
single-process training; figures: docs/benchmarks.md, "Measurements behind
design choices"):

* reducing once per step instead of after every microbatch (DDP without
  ``no_sync``) is much faster;
* DDP's buckets beat a loop of one all-reduce per parameter at the step end;
* one flat all-reduce of every gradient at the step end is as fast as DDP
  (within noise) on a small stage, where DDP's rebuilt buckets are few and
  only the last layer's overlaps the backward; larger stages give the
  overlap more to hide;
* FSDP2 (``fully_shard``, gradient sync only in the last backward) is several
  times slower, with many more collectives per step: a stage already holds
  only its slice of the model, so sharding it further pays only for a stage
  too big for one device (`Job.shard`, `evtrain.stages.sharded`).

Buffers are synchronized at start only (``forward_sync_buffers=False``):
syncing them at every forward is a collective per microbatch. BatchNorm
running statistics therefore drift apart between replicas, and are made
their mean before every evaluation and every save
(`evtrain.stages.batchnorm.average_running_stats`),
so what is evaluated and saved does not depend on the replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from evtrain.errors import UsageError

__all__ = ["Replicas", "all_gathered", "average_in_place", "check_used"]


def average_in_place(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Make each of ``tensors`` its mean over ``group``: one flat all-reduce per dtype
    (blocking, collective; every member passes the same shapes in the same order)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        for tensor, mean in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            tensor.copy_(mean)


def all_gathered(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every member's ``value`` (picklable), in rank order (blocking, collective)."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def check_used(params: Sequence[nn.Parameter], names: Mapping[nn.Parameter, str]) -> None:
    """Raise `UsageError` naming the trainable parameters that got no gradient in this
    step (before any collective that would not match across replicas)."""
    unused = [names.get(p, "?") for p in params if p.grad is None]
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if unused[5:] else "")
        raise UsageError(
            f"parameters {shown} got no gradient in this step: set "
            "Job(find_unused_parameters=True) or freeze them (requires_grad=False)"
        )


class Replicas:
    """One stage's DDP wrapper; construct it on every replica (collective: DDP
    broadcasts replica 0's parameters and buffers to the others).

    ``reducer=False`` (a tensor-parallel stage, whose parameters DDP cannot bucket):
    no wrapper; the gradients, this rank's slices, are averaged at ``ReduceGrads``
    (`reduce`) — every replica built the same weights from the same seeds.
    """

    sharded = False
    """Each replica holds the whole stage (`ShardedReplicas`: a shard of it)."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        find_unused: bool = False,
        reducer: bool = True,
    ) -> None:
        self.group = group
        self.find_unused = find_unused
        self._module = module
        self.ddp = (
            DistributedDataParallel(
                module,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group,
                forward_sync_buffers=False,
                find_unused_parameters=find_unused,
            )
            if reducer
            else None
        )
        self._names = {p: name for name, p in module.named_parameters() if p.requires_grad}

    def check_used(self, params: Sequence[nn.Parameter]) -> None:
        """`check_used`, unless the job lets parameters go unused
        (`Job.find_unused_parameters`)."""
        if not self.find_unused:
            check_used(params, self._names)

    @property
    def module(self) -> nn.Module:
        """What the stage calls forward: the DDP wrapper (``no_sync`` is its state)."""
        return self.ddp if self.ddp is not None else self._module

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradients accumulate locally inside (forwards, and every backward but the last)."""
        with self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext():
            yield

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the next backward, from ``tensors``, reduce over the replicas."""
        if self.ddp is not None:
            self.ddp.reducer.prepare_for_backward(list(_find_tensors(list(tensors))))

    def begin_step(self) -> None:
        """Nothing to do before a step (`ShardedReplicas` gathers there)."""

    def weight_half_done(self) -> None:
        """Nothing to do after a weight half: `reduce` averages at ``ReduceGrads``."""

    def gather(self) -> None:
        """Nothing to do before forward-only passes: every replica holds the whole stage."""

    def release(self) -> None:
        """Nothing to do after forward-only passes."""

    def reduce(self, params: Sequence[nn.Parameter]) -> None:
        """Average ``params``' gradients over the replicas (`average_in_place`).

        For a split backward, whose weight gradients are complete only after
        the step's last W (the reducer's hooks never see them): as fast as
        DDP's buckets at the step end (see the module docstring).
        """
        if self.find_unused and params:
            # A parameter unused here may have a gradient on another replica: every
            # replica adds the same tensors (zeros for its own missing ones), and
            # one unused everywhere keeps no gradient, as on one replica.
            used = torch.tensor(
                [p.grad is not None for p in params], dtype=torch.int32, device=params[0].device
            )
            dist.all_reduce(used, group=self.group)
            for p, anywhere in zip(params, used.tolist(), strict=True):
                if anywhere and p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        average_in_place([g.to_local() if isinstance(g, DTensor) else g for g in grads], self.group)
