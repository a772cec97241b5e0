"""What each `evtrain.job.Job` field accepts: the allowed values, and the checks
`Job.validate` runs on every new job (`check_job`), each raising
`evtrain.errors.SpecError` that names the field.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError, UsageError
from evtrain.events import SPAN_MODES
from evtrain.job_fields import JobFields
from evtrain.schedule_names import Schedule, check_virtual_stages

__all__ = [
    "BALANCE_MODES",
    "DEVICES",
    "LOADER_OPTIONS",
    "PRECISIONS",
    "SCHEDULES",
    "MetricFactory",
    "check_int",
    "check_job",
    "is_int",
    "is_metric_object",
    "named_eval_sets",
]

SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)
SHARD_MODES: tuple[str, ...] = ("none", "optimizer", "grads", "full")
"""Pipeline schedule names (``"gpipe"``, ``"1f1b"``, ``"zb"``, ``"interleaved"``, ``"zbv"``)."""

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Values of `Job.precision`."""

BALANCE_MODES: tuple[str, ...] = ("params", "compute")
"""Automatic `Job.balance` modes."""


DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""Values of `Job.device`."""

LOADER_OPTIONS: frozenset[str] = frozenset(
    {
        "num_workers",
        "collate_fn",
        "pin_memory",
        "prefetch_factor",
        "persistent_workers",
        "multiprocessing_context",
        "timeout",
        "in_order",
    }
)
"""`torch.utils.data.DataLoader` options a job may set (`Job.data_loader`); the batch
order, batch size and shuffling are evtrain's."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class MetricFactory(functools.partial[Any]):
    """A factory of a metric object, as `metric` makes it: called once per evaluation set
    on the last stage, so no two sets (and no two processes) share one object's state."""


def is_metric_object(value: object) -> bool:
    """Whether ``value`` accumulates over a whole evaluation: ``update``/``compute``/``reset``."""
    return not isinstance(value, type) and all(
        callable(getattr(value, name, None)) for name in ("update", "compute", "reset")
    )


def takes_output_and_target(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(output, target)`` binds (a builtin without a signature passes)."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: nothing to check
        return True
    return True


def named_eval_sets(value: object) -> bool:
    """Whether `Job.eval_data` ``value`` names several sets (a dict of data sources).

    A dict of stacked tensors by key (`Job.input_keys`) is one set; a dict
    whose values are not tensors maps set names to data sources.
    """
    return isinstance(value, Mapping) and not any(
        isinstance(v, torch.Tensor) for v in value.values()
    )


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    # bool is an int subclass; `stages=True` is a bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(field: str, value: object, *, minimum: int, optional: bool = False) -> None:
    """`SpecError` on ``field`` unless ``value`` is an integer >= ``minimum``."""
    if value is None and optional:
        return
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise SpecError(field, f"expected an integer >= {minimum}, got {value!r}")


def check_job(job: JobFields) -> None:
    """Check every field; raise `SpecError` naming the first bad one.

    Cheap: does not load data (`evtrain.stages.job_data.JobData` checks the
    data, and `batch_size` against the data set's size, when it loads it).
    """
    if not isinstance(job.name, str) or not _NAME_RE.match(job.name):
        raise SpecError(
            "name", f"expected letters, digits, '.', '_' or '-' (no spaces), got {job.name!r}"
        )
    _layers(job)
    if job.loss_fn is not None and not callable(job.loss_fn):
        raise SpecError(
            "loss_fn",
            f"expected a callable (output, target) -> loss, or None, got {job.loss_fn!r}",
        )
    if not callable(job.optimizer) or isinstance(job.optimizer, torch.optim.Optimizer):
        raise SpecError(
            "optimizer",
            "expected a factory params -> Optimizer, e.g. "
            f"functools.partial(torch.optim.SGD, lr=0.1); got {job.optimizer!r}",
        )
    if job.lr_scheduler is not None and not callable(job.lr_scheduler):
        raise SpecError(
            "lr_scheduler",
            f"expected a factory optimizer -> LRScheduler, got {job.lr_scheduler!r}",
        )
    if job.train_data is None:
        raise SpecError("train_data", "is required")
    check_int("batch_size", job.batch_size, minimum=1)
    check_int("num_microbatches", job.num_microbatches, minimum=1)
    if job.batch_size % job.num_microbatches:
        raise SpecError(
            "num_microbatches",
            f"{job.num_microbatches} does not divide batch_size {job.batch_size}",
        )
    check_int("data_parallel", job.data_parallel, minimum=1)
    check_int("precise_bn", job.precise_bn, minimum=1, optional=True)
    if job.sync_batchnorm and job.data_parallel > 1 and job.device != "cuda":
        raise SpecError(
            "sync_batchnorm",
            "torch's SyncBatchNorm trains on CUDA devices only; on CPU leave it off "
            "(the replicas average their statistics before every evaluation and save)",
        )
    if job.batch_size % (job.num_microbatches * job.data_parallel):
        raise SpecError(
            "data_parallel",
            f"batch_size {job.batch_size} does not split into {job.data_parallel} "
            f"replicas x {job.num_microbatches} microbatches",
        )
    check_int("max_steps", job.max_steps, minimum=1, optional=True)
    check_int("epochs", job.epochs, minimum=1, optional=True)
    if job.max_steps is None and job.epochs is None:
        raise SpecError("max_steps", "set max_steps or epochs (or both)")
    check_int("eval_batch_size", job.eval_batch_size, minimum=1, optional=True)
    if job.effective_eval_batch_size % job.num_microbatches:
        raise SpecError(
            "eval_batch_size",
            f"{job.effective_eval_batch_size} is not a multiple of "
            f"num_microbatches {job.num_microbatches}",
        )
    check_int("eval_every", job.eval_every, minimum=1, optional=True)
    if job.eval_every is not None and job.eval_data is None:
        raise SpecError("eval_every", "is set but eval_data is not")
    _metrics(job)
    _eval_data(job)
    _data_loader(job)
    if job.grad_clip is not None and (
        not isinstance(job.grad_clip, float) or not job.grad_clip > 0
    ):
        raise SpecError("grad_clip", f"expected a number > 0 or None, got {job.grad_clip!r}")
    check_int("grad_accum", job.grad_accum, minimum=1)
    check_int("seed", job.seed, minimum=0)
    if not isinstance(job.run_dir, Path) or str(job.run_dir) in ("", "."):
        raise SpecError("run_dir", f"expected a directory path, got {job.run_dir!r}")
    check_int("stages", job.stages, minimum=1)
    check_int("virtual_stages", job.virtual_stages, minimum=1)
    if job.schedule not in SCHEDULES:
        raise SpecError(
            "schedule",
            f"unknown schedule {job.schedule!r}; choose one of {', '.join(SCHEDULES)}",
        )
    _virtual_stages(job)
    _shard(job)
    _tensor_parallel(job)
    if job.layers is not None and job.num_chunks > len(job.layers):
        what = "stages" if job.virtual_stages == 1 else "model chunks"
        raise SpecError(
            "stages" if job.virtual_stages == 1 else "virtual_stages",
            f"{job.num_chunks} {what} but only {len(job.layers)} layers to place",
        )
    _balance(job)
    _model_options(job)
    if job.device not in DEVICES:
        hint = (
            "; use 'cuda': each stage takes cuda:{local_rank}"
            if isinstance(job.device, str) and job.device.startswith("cuda:")
            else ""
        )
        raise SpecError("device", f"expected one of {', '.join(DEVICES)}, got {job.device!r}{hint}")
    _hooks(job)
    if job.microbatch_spans not in SPAN_MODES:
        raise SpecError(
            "microbatch_spans",
            f"expected one of {', '.join(SPAN_MODES)}, got {job.microbatch_spans!r}",
        )
    check_int("threads", job.threads, minimum=1, optional=True)


def _layers(job: JobFields) -> None:
    if (job.layers is None) == (job.model is None):
        raise SpecError(
            "layers",
            "give either layers (one factory per layer) or model (a factory of the whole "
            "model, split by module name)" + (", not both" if job.layers is not None else ""),
        )
    if job.model is not None:
        if not callable(job.model):
            raise SpecError("model", f"expected a zero-argument factory, got {job.model!r}")
        return
    if not isinstance(job.layers, tuple) or not job.layers:
        raise SpecError("layers", "expected a non-empty list of layer factories")
    for i, factory in enumerate(job.layers):
        if isinstance(factory, nn.Module):
            raise SpecError(
                "layers",
                f"layer {i} is an nn.Module instance; give a factory instead, e.g. "
                f"layer({type(factory).__name__}, ...), so only its stage builds it",
            )
        if not callable(factory):
            raise SpecError("layers", f"layer {i} is not callable: {factory!r}")


def _virtual_stages(job: JobFields) -> None:
    try:
        check_virtual_stages(job.schedule, job.stages, job.num_microbatches, job.virtual_stages)
    except UsageError as exc:
        raise SpecError("virtual_stages", str(exc)) from None


def _shard(job: JobFields) -> None:
    if job.shard not in SHARD_MODES:
        raise SpecError(
            "shard", f"unknown mode {job.shard!r}; choose one of {', '.join(SHARD_MODES)}"
        )
    if job.shard == "none":
        return
    if job.data_parallel == 1:
        raise SpecError(
            "shard",
            f"{job.shard!r} splits a stage's state between its replicas: it needs "
            "data_parallel > 1",
        )
    refused = None
    if job.shard == "full" and Schedule(job.schedule).splits_backward:
        refused = (
            f"schedule {job.schedule!r}: 'full' frees the parameters between the halves "
            "of its split backward; use shard='grads'"
        )
    elif job.shard == "full" and job.data_loader is not None:
        refused = (
            "a data_loader: shapes met during a step are agreed by forwards on some "
            "replicas only, which 'full' would gather for; use shard='grads'"
        )
    if refused is not None:
        raise SpecError("shard", f"{job.shard!r} cannot be combined with {refused}")


def _tensor_parallel(job: JobFields) -> None:
    check_int("tensor_parallel", job.tensor_parallel, minimum=1)
    plan = job.tp_plan
    named = isinstance(plan, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    )
    if plan is not None and not callable(plan) and not named:
        raise SpecError(
            "tp_plan", f"expected module paths to style names, or a callable, got {plan!r}"
        )
    if not isinstance(job.loss_parallel, bool):
        raise SpecError("loss_parallel", f"expected True or False, got {job.loss_parallel!r}")
    if job.loss_parallel and isinstance(plan, Mapping) and "colwise_loss" not in plan.values():
        raise SpecError(
            "loss_parallel", "with a tp_plan of the job's own, name its head 'colwise_loss'"
        )
    if job.tensor_parallel == 1:
        return  # a plan waits unused: the same job runs (and resumes) at T = 1
    if plan is None and job.model is None:
        raise SpecError(
            "tp_plan",
            f"tensor_parallel={job.tensor_parallel} with layers= needs a tp_plan "
            "(module paths to 'colwise', 'rowwise', ...)",
        )


def _balance(job: JobFields) -> None:
    if job.balance is None:
        return
    if isinstance(job.balance, str):
        if job.balance not in BALANCE_MODES:
            raise SpecError(
                "balance",
                f"expected a list of sizes or one of {', '.join(BALANCE_MODES)}, "
                f"got {job.balance!r}",
            )
        return
    if not isinstance(job.balance, tuple) or not all(is_int(b) for b in job.balance):
        raise SpecError("balance", f"expected a list of integers, got {job.balance!r}")
    if len(job.balance) != job.num_chunks:
        per = "stages is" if job.virtual_stages == 1 else "stages x virtual_stages is"
        raise SpecError("balance", f"has {len(job.balance)} entries but {per} {job.num_chunks}")
    if any(b < 1 for b in job.balance):
        raise SpecError("balance", f"every stage needs at least one layer, got {list(job.balance)}")
    if job.layers is not None and sum(job.balance) != len(job.layers):
        raise SpecError(
            "balance",
            f"{list(job.balance)} places {sum(job.balance)} layers but there are {len(job.layers)}",
        )


def _model_options(job: JobFields) -> None:
    if job.pruned_forward is not False and (
        job.model is None or not isinstance(job.pruned_forward, bool)
    ):
        raise SpecError("pruned_forward", "expected True or False, with model=")
    if job.split_points is not None:
        if job.model is None:
            raise SpecError("split_points", "applies to model=, not to layers=")
        points = job.split_points
        if not isinstance(points, tuple) or not all(isinstance(p, str) and p for p in points):
            raise SpecError("split_points", f"expected module names, got {points!r}")
        if len(points) != job.stages - 1:
            raise SpecError(
                "split_points",
                f"{len(points)} split point(s) make {len(points) + 1} stages, but stages "
                f"is {job.stages}",
            )
        if len(set(points)) != len(points):
            raise SpecError("split_points", f"names a module twice: {list(points)}")
        if job.balance is not None:
            raise SpecError("balance", "give split_points or balance, not both")
    if not isinstance(job.tied, tuple) or not all(
        isinstance(g, tuple) and len(g) >= 2 and all(isinstance(n, str) and n for n in g)
        for g in job.tied
    ):
        raise SpecError(
            "tied",
            f"expected groups of two or more parameter names, got {job.tied!r}",
        )
    names = [n for g in job.tied for n in g]
    if len(set(names)) != len(names):
        raise SpecError("tied", "a parameter name appears in more than one place")
    if (job.input_keys is None) != (job.target_keys is None):
        raise SpecError(
            "input_keys" if job.input_keys is None else "target_keys",
            "dict samples need both input_keys and target_keys",
        )
    for field in ("input_keys", "target_keys"):
        keys = getattr(job, field)
        if keys is None or (isinstance(keys, str) and keys):
            continue
        if (
            not isinstance(keys, tuple)
            or not keys
            or not all(isinstance(k, str) and k for k in keys)
        ):
            raise SpecError(field, f"expected a key or a tuple of keys, got {keys!r}")
    if job.precision not in PRECISIONS:
        raise SpecError(
            "precision",
            f"expected one of {', '.join(PRECISIONS)}, got {job.precision!r}",
        )
    if not isinstance(job.activation_checkpointing, bool):
        raise SpecError(
            "activation_checkpointing",
            f"expected True or False, got {job.activation_checkpointing!r}",
        )
    if not isinstance(job.compile, bool | Mapping) or (
        isinstance(job.compile, Mapping) and not all(isinstance(k, str) for k in job.compile)
    ):
        raise SpecError(
            "compile",
            f"expected True, False or a dict of torch.compile options, got {job.compile!r}",
        )
    if (
        job.activation_checkpointing
        and isinstance(job.compile, Mapping)
        and job.compile.get("backend") == "eager"
    ):
        raise SpecError(
            "compile",
            "the 'eager' backend does not recompute checkpointed layers faithfully; "
            "use backend 'aot_eager' with activation_checkpointing",
        )


def _data_loader(job: JobFields) -> None:
    if job.data_loader is None:
        return
    if not isinstance(job.data_loader, dict):
        raise SpecError(
            "data_loader", f"expected a dict of DataLoader options, got {job.data_loader!r}"
        )
    bad = sorted(set(job.data_loader) - LOADER_OPTIONS)
    if bad:
        raise SpecError(
            "data_loader",
            f"{', '.join(map(repr, bad))} cannot be set (batches, their size and order are "
            f"evtrain's); allowed: {', '.join(sorted(LOADER_OPTIONS))}",
        )


def _metrics(job: JobFields) -> None:
    if not isinstance(job.metrics, dict):
        raise SpecError(
            "metrics", f"expected a dict name -> fn(output, target), got {job.metrics!r}"
        )
    for key, fn in job.metrics.items():
        if not isinstance(key, str) or not key:
            raise SpecError("metrics", f"metric names must be non-empty strings, got {key!r}")
        if key == "loss":
            raise SpecError("metrics", "'loss' is always reported; use another name")
        if isinstance(fn, type):
            name = fn.__name__
            raise SpecError(
                "metrics",
                f"metric {key!r} is the class {name}; give an instance, {name}(...), or "
                f"metric({name}, ...)",
            )
        if isinstance(fn, MetricFactory) or is_metric_object(fn):
            continue
        methods = ("update", "compute", "reset")
        missing = [m for m in methods if not callable(getattr(fn, m, None))]
        if len(missing) < 3:
            raise SpecError(
                "metrics",
                f"metric {key!r} has no {'/'.join(f'{m}()' for m in missing)}; a metric "
                "object needs update(output, target), compute() and reset()",
            )
        if not callable(fn):
            raise SpecError("metrics", f"metric {key!r} is not callable: {fn!r}")
        if not takes_output_and_target(fn):
            raise SpecError(
                "metrics",
                f"metric {key!r} cannot be called as fn(output, target); a factory of a "
                "metric object is given as metric(factory, ...)",
            )
    for name in ("eval_weight", "loss_weight"):
        weight = getattr(job, name)
        if weight is not None and not callable(weight):
            raise SpecError(name, f"expected a callable target -> count, got {weight!r}")


def _eval_data(job: JobFields) -> None:
    sets = job.eval_data
    if not named_eval_sets(sets):
        return
    assert isinstance(sets, Mapping)
    if not sets:
        raise SpecError("eval_data", "an empty dict names no evaluation set")
    for name, source in sets.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise SpecError(
                "eval_data",
                f"set names are letters, digits, '.', '_' or '-' (they prefix the "
                f"metric names, as in 'val/loss'); got {name!r}",
            )
        if source is None:
            raise SpecError("eval_data", f"set {name!r} has no data")


def _hooks(job: JobFields) -> None:
    if not isinstance(job.hooks, tuple):
        raise SpecError("hooks", f"expected a list of hook specs, got {job.hooks!r}")
    for i, hook in enumerate(job.hooks):
        if not isinstance(hook, Mapping):
            raise SpecError(
                "hooks", f"hook {i} must be a dict like dict(type='logging'), got {hook!r}"
            )
        kind = hook.get("type")
        if not isinstance(kind, str) or not kind:
            raise SpecError("hooks", f"hook {i} needs a string 'type', got {hook!r}")
        if not all(isinstance(k, str) for k in hook):
            raise SpecError("hooks", f"hook {i} has non-string keys: {hook!r}")
