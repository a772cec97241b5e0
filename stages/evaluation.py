"""How the last stage turns one eval set's microbatches into the set's metrics.

``loss`` and the plain (additive) metrics are sums weighted by each
microbatch's `Job.eval_weight` (its samples by default), divided once by the
set's total weight; metric objects (`Job.metrics` with ``update`` /
``compute`` / ``reset``) see every microbatch and are computed once at the
end of the set. The sums stay tensors on the device: one conversion per set,
not a device synchronization per microbatch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from evtrain.job import Job
from evtrain.job_checks import MetricFactory, is_metric_object
from evtrain.stages.loading import Reader

__all__ = ["EvalSet", "EvalStats", "EvalTally", "MetricObjects"]


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set as a stage sees it: its name (``""`` for the single unnamed
    set), the reader of what this stage consumes (None: it reads nothing) and its size."""

    name: str
    reader: Reader | None
    num_samples: int


@dataclass
class EvalStats:
    """One evaluation pass over one set; ``metrics`` is empty except on the last stage.

    Metric names are the job's (``loss``, ``accuracy``), without the set's prefix.
    """

    metrics: dict[str, float]
    samples: int
    num_batches: int
    duration_s: float


class MetricObjects:
    """The job's metric objects, this stage's own copies: one set of them per eval set,
    built on first use."""

    def __init__(self, job: Job, device: torch.device) -> None:
        self._job = job
        self._device = device
        self._by_set: dict[str, dict[str, Any]] = {}

    def fresh(self, name: str) -> dict[str, Any]:
        """Eval set ``name``'s metric objects, reset."""
        objects = self._by_set.get(name)
        if objects is None:
            objects = {}
            for key, value in self._job.metrics.items():
                if isinstance(value, MetricFactory):
                    objects[key] = _stage_local(value(), self._device)
                elif is_metric_object(value):
                    objects[key] = _stage_local(copy.deepcopy(value), self._device)
            self._by_set[name] = objects
        for obj in objects.values():
            obj.reset()
        return objects


@dataclass
class EvalTally:
    """One pass over one eval set on the last stage: weighted sums and metric objects."""

    job: Job
    device: torch.device
    objects: dict[str, Any]
    """The set's metric objects, reset (`MetricObjects.fresh`)."""
    _sums: dict[str, torch.Tensor] = field(default_factory=dict)
    _weight: torch.Tensor | None = None

    def add(self, output: Any, target: Any, samples: int) -> None:
        """One microbatch of ``samples`` samples: its model output and targets."""
        job = self.job
        raw = samples if job.eval_weight is None else job.eval_weight(target)
        weight = torch.as_tensor(raw, device=self.device).detach().double()
        self._weight = weight if self._weight is None else self._weight + weight
        values: dict[str, float | torch.Tensor] = {"loss": job.loss(output, target)}
        for name, fn in job.metrics.items():
            obj = self.objects.get(name)
            if obj is not None:
                obj.update(output, target)
            else:
                values[name] = fn(output, target)
        for name, value in values.items():
            mean = torch.as_tensor(value, device=self.device).detach().double()
            # A microbatch of weight 0 (all padding) has a mean of 0/0: it adds nothing.
            weighted = torch.where(weight > 0, mean * weight, torch.zeros_like(mean))
            previous = self._sums.get(name)
            self._sums[name] = weighted if previous is None else previous + weighted

    def results(self) -> dict[str, float]:
        """``loss`` and the job's metrics over the whole set, in the job's order."""
        weight = float(self._weight) if self._weight is not None else 0.0
        results: dict[str, float] = {}
        for name in ("loss", *self.job.metrics):
            obj = self.objects.get(name)
            if obj is not None:
                results[name] = _one_number(name, obj.compute())
            elif name in self._sums:
                results[name] = float(self._sums[name]) / weight if weight else math.nan
        return results


def _stage_local(obj: Any, device: torch.device) -> Any:
    """A metric object made to compute on this stage alone, on its device.

    torchmetrics gathers a metric's state over the default process group when
    one exists; here that group is the pipeline, whose other stages take no
    part in the evaluation, so the gather would wait for peers that never
    join it (until the process group's timeout).
    """
    modules = obj.modules() if isinstance(obj, nn.Module) else [obj]
    for module in modules:
        if hasattr(module, "distributed_available_fn"):
            module.distributed_available_fn = _not_distributed
    if isinstance(obj, nn.Module):
        obj = obj.to(device)
    return obj


def _not_distributed() -> bool:
    return False


def _one_number(name: str, value: Any) -> float:
    """A computed metric as a float; anything but one number is the metric's mistake."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    what = (
        f"a tensor of shape {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"a {type(value).__name__}"
    )
    raise RuntimeError(
        f"metric {name!r} computed {what}; a metric reports one number (e.g. pick an "
        "average, or give each value its own name in Job.metrics)"
    )
