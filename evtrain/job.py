"""The job spec: one training job described as plain data plus factories.

A job spec is a Python file that defines a module-level ``job`` (or a
``make_job()`` returning one); `evtrain.spec.load_job` loads it. Every stage
process loads the spec itself (`evtrain.tools.api` pickles a job only to hand it
to the launcher it starts), and everything heavy is a *factory* called where
it is needed: each stage calls
only its own layer factories, so the rest of the model is never allocated.

Example::

    import functools
    import torch
    from torch import nn
    from evtrain.job import Job, layer

    job = Job(
        name="mlp",
        layers=[layer(nn.Linear, 16, 64), layer(nn.ReLU), layer(nn.Linear, 64, 1)],
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        train_data=lambda: (torch.randn(256, 16), torch.randn(256, 1)),
        batch_size=32,
        num_microbatches=4,
        max_steps=100,
    )

Steps, batches and microbatches: one *step* is one optimizer step. It reads
``grad_accum`` batches of ``batch_size`` samples, each split into
``num_microbatches`` equal microbatches that flow through the pipeline. The
loss of every microbatch is scaled by ``1 / (num_microbatches * grad_accum)``
before its backward, so with a mean-reduced ``loss_fn`` one step equals a
single-process step on all ``batch_size * grad_accum`` samples at once.
``max_steps``, ``eval_every``, the LR scheduler and every hook count steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError
from evtrain.job_checks import MetricFactory, check_job, is_int, named_eval_sets
from evtrain.job_fields import JobFields, LayerFactory

__all__ = [
    "Job",
    "accuracy",
    "layer",
    "metric",
]


def layer(cls: Callable[..., nn.Module], /, *args: Any, **kwargs: Any) -> LayerFactory:
    """A factory for one layer: ``layer(nn.Linear, 4, 8)()`` builds ``nn.Linear(4, 8)``.

    It is a `functools.partial`, so it is picklable when ``cls`` and the
    arguments are.
    """
    return functools.partial(cls, *args, **kwargs)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Classification accuracy: fraction of rows whose arg-max over the last dim equals ``target``.

    A ready metric for `Job.metrics`, e.g. ``metrics={"accuracy": accuracy}``.
    """
    return (output.argmax(dim=-1) == target).float().mean()


def metric(factory: Callable[..., Any], /, *args: Any, **kwargs: Any) -> MetricFactory:
    """A metric object built where it is used: ``metric(torchmetrics.F1Score, task=...)``.

    For `Job.metrics`. The object has ``update(output, target)``, ``compute()``
    and ``reset()`` (a torchmetrics ``Metric``, or anything with those three);
    it is built on the last stage only, once per evaluation set, instead of in
    every process that loads the spec.
    """
    return MetricFactory(factory, *args, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Job(JobFields):
    """One training job. Construct it in a spec file; it validates itself.

    Every instance is valid: construction and `with_overrides` run
    `validate`, which raises `evtrain.errors.SpecError` naming the bad field.
    A job describes its data; the stages that read it load it
    (`evtrain.stages.job_data`).
    """

    def __post_init__(self) -> None:
        # Normalize containers so later code sees one shape (frozen: bypass setattr).
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if isinstance(self.layers, nn.Module) or isinstance(self.model, nn.Module):
            raise SpecError(
                "layers" if self.model is None else "model",
                "got an nn.Module; give factories, e.g. layers=[layer(nn.Linear, 4, 8), "
                "layer(nn.ReLU)] or model=functools.partial(MyModel, config), so each stage "
                "builds only what it keeps",
            )
        if isinstance(self.layers, Sequence) and not isinstance(self.layers, str):
            put("layers", tuple(self.layers))
        if isinstance(self.balance, Sequence) and not isinstance(self.balance, str):
            put("balance", tuple(self.balance))
        if isinstance(self.split_points, Sequence) and not isinstance(self.split_points, str):
            put("split_points", tuple(self.split_points))
        if isinstance(self.tied, Sequence) and not isinstance(self.tied, str):
            put(
                "tied",
                tuple(
                    tuple(g) if isinstance(g, Sequence) and not isinstance(g, str) else g
                    for g in self.tied
                ),
            )
        for keys in ("input_keys", "target_keys"):
            value = getattr(self, keys)
            if isinstance(value, Sequence) and not isinstance(value, str):
                put(keys, tuple(value))
        if isinstance(self.precision, str):
            put("precision", self.precision.lower())
        if isinstance(self.data_loader, Mapping):
            put("data_loader", dict(self.data_loader))
        if isinstance(self.hooks, Sequence) and not isinstance(self.hooks, str):
            put("hooks", tuple({"type": h} if isinstance(h, str) else h for h in self.hooks))
        if isinstance(self.metrics, Mapping):
            put("metrics", dict(self.metrics))
        if isinstance(self.schedule, str):
            put("schedule", self.schedule.lower())
        if isinstance(self.name, str) and isinstance(self.run_dir, str | Path):
            put("run_dir", Path(str(self.run_dir).replace("{name}", self.name)))
        if is_int(self.grad_clip):
            put("grad_clip", float(self.grad_clip))  # type: ignore[arg-type]
        self.validate()

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Check every field; raise `SpecError` naming the first bad one
        (`evtrain.job_checks`). Cheap: does not load data (`evtrain.stages.job_data`
        checks the data, and `batch_size` against the data set's size, when it
        loads it)."""
        check_job(self)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The microbatch's loss: `loss_fn`, or the one the model returned."""
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
            loss = output
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "loss_fn is None, so the model must return its loss (output.loss, "
                f"output['loss'] or a scalar tensor); it returned a {type(output).__name__} "
                "without one (a Hugging Face model computes it when given labels=)"
            )
        return loss

    # ----------------------------------------------------------------- copies

    def with_overrides(self, **fields: Any) -> Job:
        """A validated copy with ``fields`` replaced (Job field names, typed values)."""
        names = {f.name for f in dataclasses.fields(self) if f.init}
        for key in fields:
            if key not in names:
                raise SpecError(key, "no such field")
        return dataclasses.replace(self, **fields)

    # ---------------------------------------------------------------- derived

    @property
    def hook_specs(self) -> tuple[dict[str, Any], ...]:
        """The hook specs as a tuple of plain dicts (always with a ``"type"``)."""
        return tuple(dict(h) for h in self.hooks)  # type: ignore[arg-type]

    def stage_device(self, local_rank: int = 0) -> torch.device:
        """The device a stage with this ``local_rank`` uses (``cuda:{local_rank}`` for "cuda").

        Raises `SpecError` (field ``device``) when CUDA is asked for but absent.
        """
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise SpecError("device", "'cuda' requested but CUDA is not available here")
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise SpecError(
                    "device", f"local rank {local_rank} needs cuda:{local_rank}, only {count} GPUs"
                )
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    @property
    def eval_sets(self) -> tuple[str, ...]:
        """Names of the evaluation sets, in order: ``()`` without `eval_data`, ``("",)``
        for one unnamed set (its metrics carry no prefix)."""
        if self.eval_data is None:
            return ()
        if named_eval_sets(self.eval_data):
            return tuple(self.eval_data)
        return ("",)

    def eval_metric_names(self) -> tuple[str, ...]:
        """The names an evaluation reports (besides values reported with `evtrain.report`):
        ``loss`` and every metric, prefixed ``SET/`` for named sets."""
        names = ("loss", *self.metrics)
        return tuple(f"{s}/{n}" if s else n for s in self.eval_sets for n in names)

    def eval_source(self, name: str | None) -> tuple[str, Any]:
        """The set ``name`` (None: the only one) and its data source."""
        sets = self.eval_sets
        if name is None:
            if len(sets) > 1:
                raise ValueError(f"the job has several eval sets; name one of {list(sets)}")
            name = sets[0] if sets else ""
        if name not in sets:
            raise ValueError(f"no eval set {name!r}; the job has {list(sets)}")
        return name, (self.eval_data[name] if name else self.eval_data)  # type: ignore[index]
