"""Evaluation on a stage: every eval set in forward-only passes, and how the last
stage turns a set's microbatches into its metrics.

`StageEvaluator` runs one evaluation (all the sets) through the stage's
executor, publishes ``EvalStarted``/``EvalEnded`` and, with the heartbeats,
``EvalProgress`` (last stage). ``loss`` and the plain (additive) metrics are sums weighted by each
microbatch's `Job.eval_weight` (its samples by default), divided once by the
set's total weight; metric objects (`Job.metrics` with ``update`` /
``compute`` / ``reset``) see every microbatch and are computed once at the
end of the set. The terms stay tensors on the device: one conversion per set,
not a device synchronization per microbatch.

With data parallelism the replicas share every set: replica r evaluates the
set's batches r, r + D, ... (`replica_share`), and the last stage's replicas
combine what they saw. The sums are exact (`math.fsum` over every
microbatch's term, so the result is the same bits at any D); metric objects
sync their state over the replicas (torchmetrics' own ``sync``, on the
stage's replica group); reported values add their sums and counts. A metric
object that cannot sync (no torchmetrics ``process_group``) makes replica 0
evaluate every set whole, as one replica would.

Before each evaluation the BatchNorm running statistics are recomputed
(`Job.precise_bn`) and made the replicas' mean (`evtrain.stages.batchnorm`),
so every replica evaluates the same model.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import torch
import torch.distributed as dist
from torch import nn

from evtrain.events import EvalEnded, EvalProgress, EvalStarted, Event
from evtrain.job import Job
from evtrain.job_checks import MetricFactory, is_metric_object
from evtrain.reporting import Reporter
from evtrain.stages.batchnorm import average_running_stats, recomputing_statistics
from evtrain.stages.data_parallel import all_gathered
from evtrain.stages.executor import StageExecutor
from evtrain.stages.loading import Reader
from evtrain.stages.sharded import local_tensor
from evtrain.stages.tensor_parallel import gathered

__all__ = [
    "EvalResult",
    "EvalSet",
    "EvalStats",
    "EvalTally",
    "MetricObjects",
    "StageEvaluator",
    "replica_share",
    "unsyncable_metric",
]

Plan = list[list[range]]
"""Batches of microbatch sample ranges (`evtrain.data.eval_microbatches`)."""


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set as a stage sees it: its name (``""`` for the single unnamed
    set), the reader of what this stage consumes (None: it reads nothing), its size
    and the batches this replica evaluates (`replica_share`)."""

    name: str
    reader: Reader | None
    num_samples: int
    plan: Plan


def replica_share(plan: Plan, replica: int, replicas: int, shared: bool) -> Plan:
    """The batches of ``plan`` that ``replica`` evaluates: every D-th from its own
    (``shared``), else all of them on replica 0 and none elsewhere."""
    if shared:
        return plan[replica::replicas]
    return plan if replica == 0 else []


def unsyncable_metric(job: Job) -> str | None:
    """The name of a metric object of ``job`` that cannot combine the replicas' shares
    (it is no torchmetrics Metric: `_syncable`), or None."""
    for name, value in job.metrics.items():
        if isinstance(value, MetricFactory):
            value = value()
        elif not is_metric_object(value):
            continue
        if not _syncable(value):
            return name
    return None


def _metric_modules(obj: Any) -> list[Any]:
    """The torchmetrics metrics inside ``obj`` (itself, or a collection's members)."""
    modules = obj.modules() if isinstance(obj, nn.Module) else [obj]
    return [m for m in modules if hasattr(m, "distributed_available_fn")]


def _syncable(obj: Any) -> bool:
    metrics = _metric_modules(obj)
    return bool(metrics) and all(hasattr(m, "process_group") for m in metrics)


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
    built on first use, syncing over ``group`` (None: computed on this stage alone)."""

    def __init__(
        self, job: Job, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> None:
        self._job = job
        self._device = device
        self._group = group
        self._by_set: dict[str, dict[str, Any]] = {}

    def fresh(self, name: str) -> dict[str, Any]:
        """Eval set ``name``'s metric objects, reset."""
        objects = self._by_set.get(name)
        if objects is None:
            objects = {}
            for key, value in self._job.metrics.items():
                if isinstance(value, MetricFactory):
                    objects[key] = _placed(value(), self._device, self._group)
                elif is_metric_object(value):
                    objects[key] = _placed(copy.deepcopy(value), self._device, self._group)
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
    group: dist.ProcessGroup | None = None
    """The last stage's replicas that share the set (None: this stage saw it whole)."""
    _terms: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per name, every microbatch's weighted mean (its weight under ``""``)."""

    def add(self, output: Any, target: Any, samples: int) -> None:
        """One microbatch of ``samples`` samples: its model output and targets."""
        job = self.job
        raw = samples if job.eval_weight is None else job.eval_weight(target)
        weight = torch.as_tensor(raw, device=self.device).detach().double()
        self._terms.setdefault("", []).append(weight)
        values: dict[str, float | torch.Tensor] = {"loss": local_tensor(job.loss(output, target))}
        output = gathered(output)  # logits split over tensor ranks, whole for the metrics
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
            self._terms.setdefault(name, []).append(weighted)

    def results(self) -> dict[str, float]:
        """``loss`` and the job's metrics over the whole set, in the job's order
        (collective over ``group``)."""
        terms = {name: torch.stack(ts).tolist() for name, ts in self._terms.items()}
        if self.group is not None:
            shares = all_gathered(terms, self.group)
            names = dict.fromkeys(name for share in shares for name in share)
            terms = {name: [t for share in shares for t in share.get(name, [])] for name in names}
        # An exactly rounded sum: the same bits whichever replica added which term.
        sums = {name: _exact_sum(ts) for name, ts in terms.items()}
        weight = sums.pop("", 0.0)
        results: dict[str, float] = {}
        for name in ("loss", *self.job.metrics):
            obj = self.objects.get(name)
            if obj is not None:
                results[name] = _one_number(name, obj.compute())
            elif name in sums:
                results[name] = sums[name] / weight if weight else math.nan
        return results


def _exact_sum(values: Iterable[float]) -> float:
    """The exactly rounded sum (`math.fsum`); NaN where infinities of both signs meet."""
    try:
        return math.fsum(values)
    except ValueError:  # inf + -inf
        return math.nan


def _placed(obj: Any, device: torch.device, group: dist.ProcessGroup | None) -> Any:
    """A metric object on this stage's device, syncing over ``group`` only.

    torchmetrics gathers a metric's state over the default process group when
    one exists; that group holds every stage, whose others take no part in
    the evaluation, so the gather would wait for peers that never join it
    (until the process group's timeout).
    """
    for module in _metric_modules(obj):
        module.distributed_available_fn = _not_distributed if group is None else _distributed
        if group is not None:
            module.process_group = group
    if isinstance(obj, nn.Module):
        obj = obj.to(device)
    return obj


def _not_distributed() -> bool:
    return False


def _distributed() -> bool:
    return True


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

    Each replica evaluates its share of every set (`EvalSet.plan`);
    ``group`` is the stage's replica group (None without replicas), over
    which the last stage combines the shares when ``shared``. ``reporter``
    holds what the model reported (`evtrain.report`) during the evaluation:
    it joins the set's metrics.
    """

    def __init__(
        self,
        *,
        executor: StageExecutor,
        sets: Sequence[EvalSet],
        last: bool,
        replica: int,
        group: dist.ProcessGroup | None,
        shared: bool,
        publish: Callable[[Event], None],
        reporter: Reporter,
    ) -> None:
        self._executor = executor
        self._job = executor.job
        self.sets = list(sets)
        self._stage = executor.stage
        self._last = last
        self._replica = replica
        self._group = group
        self._combine = group if shared and last else None
        """The group the last stage's replicas combine their shares over."""
        self._evaluates = shared or replica == 0
        self._publish = publish
        self._reporter = reporter
        self._objects = MetricObjects(executor.job, executor.device, self._combine)
        self._batches = sum(len(e.plan) for e in self.sets)
        self._progress: EvalProgress | None = None
        """The last stage, evaluating: the set in progress and the batches before it."""
        self._done_in_set = 0
        """Batches of the set in progress finished (read by the heartbeats from another
        thread: a plain int, replaced, never mutated)."""

    async def evaluate(self, step: int) -> EvalResult | None:
        """Evaluate the weights after ``step`` steps on every set (collective along the
        pipeline and the replicas); the result on replica 0's last stage, else None."""
        replicas = self._executor.replicas
        if replicas is None or not replicas.sharded:
            return await self._evaluate(step)
        # Sharded, every replica gathers the stage once, whatever its share.
        await anyio.to_thread.run_sync(replicas.gather)
        try:
            return await self._evaluate(step)
        finally:
            await anyio.to_thread.run_sync(replicas.release)

    async def _evaluate(self, step: int) -> EvalResult | None:
        if self._job.precise_bn:
            await anyio.to_thread.run_sync(self._precise_bn, step)
        if self._group is not None:
            await anyio.to_thread.run_sync(
                average_running_stats, self._executor.module, self._group
            )
        if not self._evaluates:
            return None
        start = time.perf_counter()
        publishes = self._last and self._replica == 0
        if publishes:
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
            metrics.update({prefix + k: v for k, v in stats.metrics.items()})
            samples[evaluation.name] = stats.samples
        self._progress = None
        if not publishes:
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

        Every sample is read once (`evtrain.data.eval_microbatches`), by one
        replica; on the last stage ``loss`` and the plain metrics are means
        over the set weighted by `Job.eval_weight`, metric objects are
        computed once, and what the model reported joins them.
        """
        start = time.perf_counter()
        executor, evaluation = self._executor, self.sets[index]
        tally = None
        if self._last:
            objects = self._objects.fresh(evaluation.name)
            tally = EvalTally(
                job=self._job, device=executor.device, objects=objects, group=self._combine
            )
        with executor.forward_only():
            for batch in evaluation.plan:
                executor.forward_pass(batch, evaluation.reader, tally)
                self._done_in_set += 1
        metrics = self._reported()
        if tally is not None and evaluation.num_samples:
            metrics.update(tally.results())
        return EvalStats(
            metrics, evaluation.num_samples, len(evaluation.plan), time.perf_counter() - start
        )

    def _precise_bn(self, step: int) -> None:
        """`Job.precise_bn`: the running statistics recomputed over the training batches
        after ``step`` (blocking, collective along the pipeline)."""
        executor, count = self._executor, self._job.precise_bn
        assert count is not None
        first = executor.stream.batch_index(step)
        with (
            recomputing_statistics(executor.module, executor.device),
            executor.forward_only(train_mode=True),
        ):
            for batch in range(first, first + count):
                executor.forward_training_batch(batch)
        self._reporter.collect()  # what the model reported in them is not the eval's

    def _reported(self) -> dict[str, float]:
        """The mean of each value the model reported during the set, over every replica
        that evaluated a share of it (blocking, collective over the shares' group)."""
        sums, counts = self._reporter.take()
        if self._combine is not None:
            shares = all_gathered((sums, counts), self._combine)
            names = dict.fromkeys(name for share, _ in shares for name in share)
            sums = {n: _exact_sum(share.get(n, 0.0) for share, _ in shares) for n in names}
            counts = {n: sum(count.get(n, 0) for _, count in shares) for n in names}
        return {name: total / counts[name] for name, total in sums.items()}
