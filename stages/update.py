"""The end of a training step on one stage: its gradients made final, the step's
control exchange, loss scaling, clipping by the global norm, the optimizer and
the LR scheduler.

`WeightUpdate` runs the executor's last two instructions, `ReduceGrads` and
`OptimizerStep`. The global gradient norm and the fp16 skip decision come from
the control exchange (`evtrain.stages.control`), so every stage clips by the
same norm and skips the same steps.

The last stage computes ``loss_fn(output, target)`` per microbatch and
back-propagates ``loss / (M * grad_accum)`` (`StepLoss`), so with a
mean-reduced loss a step equals one single-process step on all the step's
samples (DDP divides by the D replicas, each of which reads ``1/D`` of every
batch). With `evtrain.job.Job.loss_weight` the last stages back-propagate each
microbatch's loss times its weight (and ``1 / (M * grad_accum)``), the
replicas average, and the exchange sums the weights: every
stage then multiplies its gradients by ``weight_scale / W`` (``weight_scale =
D * M * grad_accum``, W the step's total weight), which makes them the
gradient of the mean over every unit of the step's batch. The gradient norm
(for clipping and reporting) scales with them, and the step's loss is the
weighted loss sum over W. A step of weight 0 applies no gradient.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evtrain.job import Job
from evtrain.stages.control import ControlResult, StepControl
from evtrain.stages.data_parallel import Replicas
from evtrain.stages.mesh import Place
from evtrain.stages.precision import LossScaler
from evtrain.stages.sharded import ShardedReplicas, local_tensor
from evtrain.stages.tensor_parallel import TensorParallel
from evtrain.stages.tied import TiedWeights

__all__ = ["StepLoss", "Timed", "WeightUpdate", "state_bytes_of"]


def state_bytes_of(params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``params`` and their optimizer state that this process holds: the local
    shards of sharded ones."""
    total = 0
    for p in params:
        tensors = [p.detach()]
        if optimizer is not None:
            state = optimizer.state.get(p, {}).values()
            tensors.extend(v for v in state if isinstance(v, torch.Tensor))
        total += sum(local_tensor(t).numel() * t.element_size() for t in tensors)
    return total


class StepLoss:
    """The last stage's loss over one step: what each microbatch's backward starts from,
    and the step's loss (and weight) that the control exchange shares (module docstring).
    ``scaler``: fp16's loss scale applies to every backward."""

    def __init__(self, job: Job, scaler: LossScaler | None) -> None:
        self._weight_of = job.loss_weight
        self._microbatches = job.num_microbatches * job.grad_accum
        self._scaler = scaler
        self._sum: torch.Tensor | None = None
        """The step's loss sum (weighted, with `Job.loss_weight`)."""
        self._weights: torch.Tensor | None = None

    def reset(self) -> None:
        self._sum = self._weights = None

    def add(self, loss: torch.Tensor, target: Any) -> torch.Tensor | None:
        """Count one microbatch's ``loss``; its `Job.loss_weight` (None without)."""
        detached, weight = loss.detach(), None
        if self._weight_of is not None:
            weight = torch.as_tensor(self._weight_of(target), device=loss.device).detach()
            detached = detached.double() * weight.double()
            w = weight.double()
            self._weights = w if self._weights is None else self._weights + w
        self._sum = detached if self._sum is None else self._sum + detached
        return weight

    def root(self, loss: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """What the microbatch's backward starts from."""
        scale = (self._scaler.scale if self._scaler is not None else 1.0) / self._microbatches
        if weight is not None:
            loss = loss * weight.to(loss.dtype)
        return loss * scale

    def local(self) -> tuple[float | None, float]:
        """This replica's step loss (the weighted sum, with `Job.loss_weight`) and weight;
        (None, 0) on a stage that computes no loss."""
        if self._sum is None:
            return None, 0.0
        if self._weights is None:
            return float(self._sum) / self._microbatches, 0.0
        return float(self._sum), float(self._weights)


@dataclass(frozen=True)
class Timed:
    """A wait at the end of a step: its span (perf_counter seconds) and the time blocked."""

    start: float
    end: float
    waited: float


class WeightUpdate:
    """Reduce a stage's gradients and apply them (see the module docstring).

    ``average_at_reduce``: the replicas' gradients are averaged at
    `reduce_grads` (a split backward, or several chunks) rather than by DDP
    at the end of the last backward. ``scaler``: fp16's dynamic loss scale.
    ``weight_scale``: with `Job.loss_weight`, what the gradients are multiplied
    by before dividing by the step's weight (module docstring); None without.
    """

    def __init__(
        self,
        *,
        params: Sequence[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: LossScaler | None,
        control: StepControl,
        place: Place,
        grad_clip: float | None,
        tied: TiedWeights | None,
        replicas: Replicas | ShardedReplicas | None,
        average_at_reduce: bool,
        tensor: TensorParallel | None = None,
        weight_scale: float | None = None,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.control = control
        self.place = place
        self.grad_clip = grad_clip
        self.tied = tied
        self.replicas = replicas
        self.tensor = tensor
        self._average = replicas is not None and (average_at_reduce or replicas.sharded)
        # Sharded, each replica holds a part of every gradient: it counts its own part
        # in the norm and scales only that.
        self._sharded = replicas is not None and replicas.sharded
        self.weight_scale = weight_scale
        self.skipped = False
        """fp16: the last step overflowed somewhere in the pipeline and was dropped."""
        self._state_bytes: int | None = None
        self._applied = False

    def state_bytes(self) -> int:
        """Bytes of the parameters and optimizer state this process holds (its shards);
        fixed once the optimizer stepped (its state exists), so counted once then."""
        if self._state_bytes is not None:
            return self._state_bytes
        total = state_bytes_of(self.params, self.optimizer)
        if self._applied:
            self._state_bytes = total
        return total

    def reduce_grads(self) -> Timed | None:
        """`ReduceGrads`: the replicas' average (when not DDP's) and the tied weights'
        sum over their stages; None when there is nothing to reduce. With replicas it
        first checks that every parameter got a gradient (`Replicas.check_used`):
        before any collective that would not match across replicas."""
        if self.replicas is not None:
            self.replicas.check_used(self.params)
        start = time.perf_counter()
        if self.tensor is not None and not self._sharded:
            # (FSDP lays its gradients out as its parameters itself.)
            self.tensor.align_grads(self.params)
        tensor = self.tensor if self.tensor is not None and self.tensor.partial else None
        if self.tied is None and not self._average and tensor is None:
            return None
        if self._average:
            assert self.replicas is not None
            self.replicas.reduce(self.params)
        if tensor is not None:
            # After the replicas: sharded, the gradients exist once reduce-scattered.
            tensor.reduce_grads()
        if self.tied is not None:
            self.tied.reduce_grads()
        end = time.perf_counter()
        return Timed(start, end, end - start)

    def step(
        self, local_loss: float | None, stop_requested: bool, local_weight: float = 0.0
    ) -> tuple[ControlResult, Timed]:
        """`OptimizerStep`: the control exchange, then scaling, clipping, the optimizer
        and the scheduler.

        ``local_loss`` is this replica's step loss (last stage only); the
        exchange returns the mean over the replicas. With ``weight_scale`` it is
        the replica's weighted loss sum and ``local_weight`` its total weight.
        """
        self.skipped = False
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        if self.scaler is not None and grads:
            self.scaler.unscale_(grads)
        counted = grads
        if self.tied is not None or self.tensor is not None:
            excluded = self.tied.norm_excluded if self.tied is not None else set()
            tensor = self.tensor
            counted = [
                local_tensor(p.grad)
                for p in self.params
                if p.grad is not None
                and id(p) not in excluded
                and (tensor is None or tensor.counts(p))
            ]
        sq_norm = 0.0
        # Unsharded, the replicas hold the same averaged gradients: replica 0 counts
        # them once.
        if counted and (self._sharded or self.place.replica == 0):
            norms = torch._foreach_norm(counted)
            sq_norm = float(torch.stack(norms).double().square().sum())
        weighted = self.weight_scale is not None
        # Every tensor rank computed the same loss: rank 0's counts.
        if self.place.tp != 0:
            local_loss, local_weight = None, 0.0
        loss_share = 0.0 if local_loss is None else local_loss
        if not weighted:
            loss_share /= self.place.replicas
        start = time.perf_counter()
        exchange = self.control.start(sq_norm, stop_requested, loss_share, local_weight)
        if self.grad_clip is None and self.scaler is None and not weighted:
            # Nothing here needs the global norm: overlap the exchange's
            # latency with the optimizer step.
            started = time.perf_counter()
            self._apply()
            wait_start = time.perf_counter()
            result = exchange.finish()
            end = time.perf_counter()
            return result, Timed(start, end, (started - start) + (end - wait_start))
        result = exchange.finish()
        end = time.perf_counter()
        timed = Timed(start, end, end - start)
        if self.weight_scale is not None:
            total = result.weight
            coef = self.weight_scale / total if total > 0 else 0.0
            if grads:
                torch._foreach_mul_(grads, coef)
            result = dataclasses.replace(
                result,
                grad_norm=result.grad_norm * coef,
                loss=result.loss / total if total > 0 else 0.0,
            )
        norm = result.grad_norm
        if self.scaler is not None and self.scaler.update(not math.isfinite(norm)):
            # Overflow on some stage: every stage drops this step's gradients.
            self.skipped = True
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return result, timed
        if self.grad_clip is not None and grads and math.isfinite(norm):
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self._apply()
        return result, timed

    def _apply(self) -> None:
        self._applied = True
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
