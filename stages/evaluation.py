"""Evaluation on a stage: every eval set in forward-only passes, and how the last
stage turns a set's microbatches into its metrics.

`StageEvaluator` runs one evaluation (all the sets) through the stage's
executor, publishes ``EvalStarted``/``EvalEnded`` and, with the heartbeats,
``EvalProgress`` (last stage). ``loss`` and the plain (additive) metrics are sums weighted by each
microbatch's `Job.eval_weight` (its samples by default), divided once by the
set's total weight; metric objects (`Job.metrics` with ``update`` /
``compute`` / ``reset``) see every microbatch and are computed once at the
end of the set. The sums stay tensors on the device: one conversion per set,
not a device synchronization per microbatch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import torch
from torch import nn

from evtrain.data import eval_microbatches
from evtrain.events import EvalEnded, EvalProgress, EvalStarted, Event
from evtrain.job import Job
from evtrain.job_checks import MetricFactory, is_metric_object
from evtrain.reporting import Reporter
from evtrain.stages.executor import StageExecutor
from evtrain.stages.loading import Reader

__all__ = [
    "EvalResult",
    "EvalSet",
    "EvalStats",
    "EvalTally",
    "MetricObjects",
    "StageEvaluator",
]


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


@dataclass(frozen=True)
class EvalResult:
    """One evaluation on the last stage: the metrics of every set (prefixed ``SET/``
    for named sets) and the samples of each set (by name; ``""`` the unnamed one)."""

    metrics: dict[str, float]
    samples: dict[str, int]


class StageEvaluator:
    """The evaluations of one stage (see the module docstring).

    Replica 0's pipeline evaluates every set whole, once; other replicas
    skip. ``reporter`` holds what the model reported (`evtrain.report`)
    during the evaluation: it joins the set's metrics.
    """

    def __init__(
        self,
        *,
        executor: StageExecutor,
        sets: Sequence[EvalSet],
        last: bool,
        replica: int,
        publish: Callable[[Event], None],
        reporter: Reporter,
    ) -> None:
        self._executor = executor
        self._job = executor.job
        self.sets = list(sets)
        self._stage = executor.stage
        self._last = last
        self._replica = replica
        self._publish = publish
        self._reporter = reporter
        self._objects = MetricObjects(executor.job, executor.device)
        self._batches = sum(
            len(eval_microbatches(e.num_samples, self._job.effective_eval_batch_size, executor.M))
            for e in self.sets
        )
        self._progress: EvalProgress | None = None
        """The last stage, evaluating: the set in progress and the batches before it."""
        self._done_in_set = 0
        """Batches of the set in progress finished (read by the heartbeats from another
        thread: a plain int, replaced, never mutated)."""

    async def evaluate(self, step: int) -> EvalResult | None:
        """Evaluate the weights after ``step`` steps on every set (collective along the
        pipeline); the result on the last stage, else None."""
        if self._replica:
            return None
        start = time.perf_counter()
        if self._last:
            self._publish(EvalStarted(step=step, stage=self._stage, num_batches=self._batches))
        self._reporter.collect()  # training-time leftovers do not belong to the eval
        metrics: dict[str, float] = {}
        samples: dict[str, int] = {}
        done = 0
        for index, evaluation in enumerate(self.sets):
            if self._last:
                # Before the heartbeats see the new set: not the last set's count on top.
                self._done_in_set = 0
                self._progress = EvalProgress(
                    step=step,
                    stage=self._stage,
                    batches_done=done,
                    num_batches=self._batches,
                    set=evaluation.name,
                )
            stats = await anyio.to_thread.run_sync(self._run_set, index)
            done += stats.num_batches
            prefix = f"{evaluation.name}/" if evaluation.name else ""
            values = {**self._reporter.collect(), **stats.metrics}
            metrics.update({prefix + k: v for k, v in values.items()})
            samples[evaluation.name] = stats.samples
        self._progress = None
        if not self._last:
            return None
        self._publish(
            EvalEnded(
                step=step,
                stage=self._stage,
                metrics=metrics,
                samples=sum(samples.values()),
                duration_s=time.perf_counter() - start,
                sets={k: v for k, v in samples.items() if k},
            )
        )
        return EvalResult(metrics, samples)

    def progress(self) -> EvalProgress | None:
        """The last stage, evaluating: how far it got (published with every heartbeat,
        so a console that joins late or an event that was dropped costs at most a second)."""
        current = self._progress
        if current is None:
            return None
        done = current.batches_done + self._done_in_set
        return EvalProgress(
            step=current.step,
            stage=self._stage,
            batches_done=min(done, current.num_batches),
            num_batches=current.num_batches,
            set=current.set,
        )

    def _run_set(self, index: int) -> EvalStats:
        """One forward-only pass over set ``index`` (blocking).

        Every sample is read once (`evtrain.data.eval_microbatches`); on the
        last stage ``loss`` and the plain metrics are means over the set
        weighted by `Job.eval_weight`, metric objects are computed once.
        """
        start = time.perf_counter()
        executor, evaluation = self._executor, self.sets[index]
        plan = eval_microbatches(
            evaluation.num_samples, self._job.effective_eval_batch_size, executor.M
        )
        tally = None
        if self._last:
            objects = self._objects.fresh(evaluation.name)
            tally = EvalTally(job=self._job, device=executor.device, objects=objects)
        with executor.forward_only():
            for batch in plan:
                executor.forward_pass(batch, evaluation.reader, tally)
                self._done_in_set += 1
        metrics = tally.results() if tally is not None and evaluation.num_samples else {}
        return EvalStats(metrics, evaluation.num_samples, len(plan), time.perf_counter() - start)
