"""Sharded data parallelism for one stage: torch's FSDP2 over the stage's replicas.

With `evtrain.job.Job.shard` the D replicas of a stage split its state
instead of each holding all of it (`evtrain.stages.data_parallel` is the
unsharded, DDP path). Every unit (layer) of the stage is a ``fully_shard``
unit on the stage's replica sub-mesh (the ``dp`` dimension of the ``(pp,
dp)`` mesh), and so is each of the stage's model chunks (the stage module
itself, with one chunk), for what no unit holds. The optimizer is built on the
sharded parameters, so its state is sharded too.

Between steps every mode holds 1/D of the parameters, gradients and
optimizer state. Within a step the modes differ in what they keep whole,
and so in what they cost:

=========== ============================== ===================================
mode        kept whole during a step       collectives per unit and step
=========== ============================== ===================================
optimizer   parameters, gradients          1 all-gather, 1 reduce-scatter
grads       parameters                     1 all-gather, M reduce-scatters
full        one unit at a time             2M all-gathers, M reduce-scatters
=========== ============================== ===================================

(M microbatches per step, times ``grad_accum``.) The pipeline's twist is the
one DDP has: a step runs M backwards. As torch.distributed.pipelining's
``PipelineStage`` does, every backward runs with FSDP's end-of-backward work
off (`begin_step`), and `reduce` does it once, at the step's ``ReduceGrads``:
the reduce-scatter of what accumulated unreduced and the resharding. A split
backward (zero bubble) fits that order: its weight halves accumulate like
any backward until ``ReduceGrads``; in ``grads`` mode each weight half
reduce-scatters what its microbatch left (`weight_half_done`), since FSDP's
own hook would fire after the input half. ``full`` reshards between the two
halves, so it does not combine with a split backward.

Forward-only passes (evaluation, PreciseBN) run between `gather` and
`release`: every replica gathers the whole stage once, whatever its share of
the batches, so replicas that evaluate unequal shares never wait on each
other's collectives.

Gradient clipping and the loss scaler act on the local shards
(`local_tensor`); the global norm sums every replica's shard (the control
exchange adds up each process's contribution). A weight tied across stages is
sharded alike on each of them, so `evtrain.stages.tied` sums its gradient
shard by shard. Each replica writes its own shards of a checkpoint
(`evtrain.checkpoint.writer.ShardWriter`'s ``group``); DCP reassembles them
for any D, P or mode that resumes it. The weight dump gathers each tensor
whole (`full_tensor`). With tensor parallelism the parameters FSDP shards are
already DTensors on the ``tp`` dimension: it shards each rank's slices over
``dp``, a 2-D DTensor per parameter (`evtrain.stages.tensor_parallel`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from evtrain.errors import UsageError
from evtrain.stages.data_parallel import check_used
from evtrain.stages.standins import calls_elsewhere

__all__ = ["ShardedReplicas", "full_tensor", "local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: its local shard for a DTensor, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: gathered for a DTensor (collective over its mesh), else itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    # A slice of a tensor-parallel slice (FSDP over TP) gathers in two all-gathers, of
    # which torch warns on every rank for the reduction orders they could differ in;
    # an all-gather reduces nothing.
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        redistribute.setLevel(level)


class ShardedReplicas:
    """One stage's FSDP2 units over its replicas (see the module docstring); construct
    it on every replica (collective: replica 0's parameters and buffers become every
    replica's before they are sharded)."""

    sharded = True

    def __init__(
        self,
        module: nn.Module,
        chunks: Sequence[nn.Module],
        units: Sequence[nn.Module],
        mesh: DeviceMesh,
        mode: str,
        device: torch.device,
        *,
        split_backward: bool = False,
        find_unused: bool = False,
    ) -> None:
        self.mode = mode
        self._device = device
        # grads, with a split backward: FSDP would reduce after the input half, before
        # the weight half; `weight_half_done` reduces after each weight half instead.
        self._per_weight_half = split_backward and mode == "grads"
        self.find_unused = find_unused
        owners: dict[nn.Parameter, int] = {}
        for index, unit in enumerate(units):
            for name, param in unit.named_parameters():
                if owners.setdefault(param, index) != index:
                    raise UsageError(
                        f"shard={mode!r}: parameter {name!r} is shared by units "
                        f"{owners[param]} and {index} of this stage, and a sharded parameter "
                        "belongs to one unit; use shard='none'"
                    )
        _broadcast_state(module, mesh.get_group())
        full = mode == "full"
        self._units: list[FSDPModule] = []
        for unit in units:
            # A unit with calls on other stages is left to its chunk's root: FSDP's own
            # forward hooks would run for the calls it stands in for, and a forward
            # that ends at the stage's boundary inside them.
            if any(True for _ in unit.parameters()) and not calls_elsewhere(unit):
                self._units.append(fully_shard(unit, mesh=mesh, reshard_after_forward=full))
        # The roots are what the executor calls: each model chunk (the stage module
        # itself, with one chunk), for whatever parameters no unit holds.
        self._roots: list[FSDPModule] = [
            fully_shard(chunk, mesh=mesh, reshard_after_forward=full) for chunk in chunks
        ]
        # The roots' own groups first: the order every replica gathers in.
        self._all = [*self._roots, *self._units]
        if find_unused:
            # What one replica did not use it reduces as zeros: the same collectives
            # on every replica, as DDP's find_unused_parameters.
            for root in self._roots:
                root.set_reduce_scatter_unused_params(True)
        self._names = {p: name for name, p in module.named_parameters() if p.requires_grad}

    @property
    def module(self) -> nn.Module:
        """What a one-chunk stage calls forward: the stage module itself (sharded in place)."""
        root = self._roots[0]
        assert isinstance(root, nn.Module)
        return root

    def check_used(self, params: Sequence[nn.Parameter]) -> None:
        """`evtrain.stages.data_parallel.check_used` (before `reduce`'s collectives), on
        where FSDP holds a parameter's gradient in the step: reduced onto its shard, or
        still whole and unreduced."""
        if self.find_unused:
            return
        got = {
            fsdp_param.sharded_param
            for fsdp_param in self._fsdp_params()
            if fsdp_param.sharded_param.grad is not None
            or fsdp_param.unsharded_accumulated_grad is not None
            or (
                getattr(fsdp_param, "_unsharded_param", None) is not None
                and fsdp_param._unsharded_param.grad is not None
            )
        }
        check_used([p for p in params if p not in got], self._names)

    def _fsdp_params(self) -> Iterator[Any]:
        for unit in self._all:
            param_group = fully_shard.state(unit)._fsdp_param_group  # type: ignore[attr-defined]
            if param_group is not None:
                yield from param_group.fsdp_params

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Nothing to do: `begin_step` set every backward to accumulate."""
        yield

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Nothing to do: `reduce` reduces at ``ReduceGrads``."""

    def begin_step(self) -> None:
        """Before a step's first forward (collective): FSDP's end-of-backward work off,
        and, unless ``full``, the stage gathered once for the whole step."""
        self._bind()
        for root in self._roots:
            root.set_is_last_backward(False)
            root.set_requires_gradient_sync(self.mode != "optimizer" and not self._per_weight_half)
            root.set_reshard_after_backward(self.mode == "full")
        if self.mode != "full":
            for unit in self._all:
                unit.unshard()

    def weight_half_done(self) -> None:
        """After a split backward's weight half: ``grads`` reduce-scatters what the
        microbatch's halves left whole (collective)."""
        if not self._per_weight_half:
            return
        for root in self._roots:
            state = fully_shard.state(root)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for param_group in each._fsdp_param_groups:
                    param_group.reduce_grads = True
                    param_group.post_backward()
                    param_group.reduce_grads = False

    def reduce(self, params: Sequence[nn.Parameter]) -> None:
        """``ReduceGrads``: reduce-scatter what accumulated unreduced, reshard, and let
        FSDP finish its backward, as torch's ``PipelineStage.perform_reduce_grad``."""
        for root in self._roots:
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
            state = fully_shard.state(root)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for param_group in each._fsdp_param_groups:
                    param_group.post_backward()
            state._root_post_backward_final_callback()

    def gather(self) -> None:
        """Before forward-only passes (collective): the whole stage, kept until `release`."""
        self._bind()
        for root in self._roots:
            root.set_reshard_after_forward(False)
        for unit in self._all:
            unit.unshard()

    def release(self) -> None:
        """After forward-only passes: back to the shards (and to the mode's resharding)."""
        self._bind()
        for unit in self._all:
            unit.reshard()
        for root in self._roots:
            root.set_reshard_after_forward(self.mode == "full")

    def _bind(self) -> None:
        # The calling thread's device: FSDP allocates the gathered tensors there.
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)


def _broadcast_state(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Replica 0's parameters and buffers on every replica, as DDP starts (a tensor
    rank's slices from the same tensor rank of replica 0)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(local_tensor(tensor), src=src, group=group)
