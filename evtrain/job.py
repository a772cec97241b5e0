"""The job spec: one training job described as plain data plus factories.

A job spec is a Python file that defines a module-level ``job`` (or a
``make_job()`` returning one); `evtrain.spec.load_job` loads it. Every stage
process loads the spec itself (`evtrain.api` pickles a job only to hand it
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
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError, UsageError
from evtrain.schedule_names import Schedule, check_virtual_stages

__all__ = [
    "BALANCE_MODES",
    "DEVICES",
    "LOADER_OPTIONS",
    "PRECISIONS",
    "SCHEDULES",
    "SPAN_MODES",
    "Job",
    "MetricFactory",
    "accuracy",
    "is_metric_object",
    "layer",
    "metric",
    "named_eval_sets",
]

LayerFactory = Callable[[], nn.Module]
"""A zero-argument callable that builds one pipeline layer."""

ModelFactory = Callable[[], nn.Module]
"""A zero-argument callable that builds the whole model (see `Job.model`)."""

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
MetricFn = Callable[[Any, Any], "float | torch.Tensor"]
EvalWeight = Callable[[Any], "int | float | torch.Tensor"]
DataSource = Any
"""``(inputs, targets)`` tensors; with `Job.input_keys`, a dict of stacked
tensors by key; or a zero-argument callable returning one of those, or a
map-style dataset of ``(input, target)`` pairs (of dicts, with `Job.input_keys`)."""


SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)
"""Pipeline schedule names (``"gpipe"``, ``"1f1b"``, ``"zb"``, ``"interleaved"``, ``"zbv"``)."""

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Values of `Job.precision`."""

BALANCE_MODES: tuple[str, ...] = ("params", "compute")
"""Automatic `Job.balance` modes."""

SPAN_MODES: tuple[str, ...] = ("all", "sampled", "off")
"""Values of `Job.microbatch_spans`."""

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


class MetricFactory(functools.partial[Any]):
    """A factory of a metric object, as `metric` makes it: called once per evaluation set
    on the last stage, so no two sets (and no two processes) share one object's state."""


def metric(factory: Callable[..., Any], /, *args: Any, **kwargs: Any) -> MetricFactory:
    """A metric object built where it is used: ``metric(torchmetrics.F1Score, task=...)``.

    For `Job.metrics`. The object has ``update(output, target)``, ``compute()``
    and ``reset()`` (a torchmetrics ``Metric``, or anything with those three);
    it is built on the last stage only, once per evaluation set, instead of in
    every process that loads the spec.
    """
    return MetricFactory(factory, *args, **kwargs)


def is_metric_object(value: object) -> bool:
    """Whether ``value`` accumulates over a whole evaluation: ``update``/``compute``/``reset``."""
    return not isinstance(value, type) and all(
        callable(getattr(value, name, None)) for name in ("update", "compute", "reset")
    )


def _takes_output_and_target(fn: Callable[..., Any]) -> bool:
    import inspect

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


def _is_int(value: object) -> bool:
    # bool is an int subclass; `stages=True` is a bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise SpecError(field, f"expected an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Job:
    """One training job. Construct it in a spec file; it validates itself.

    Every instance is valid: construction and `with_overrides` run
    `validate`, which raises `evtrain.errors.SpecError` naming the bad field.
    A job describes its data; the stages that read it load it
    (`evtrain.stages.job_data`).
    """

    name: str
    """Job name: letters, digits, ``.``, ``_``, ``-``. Used in the default run directory."""

    layers: Sequence[LayerFactory] | None = None
    """One zero-argument factory per pipeline layer, in order (see `layer`); or give `model`.

    The model is the chain of the layers; a stage builds only its own slice.
    A layer passes the next one any pytree of tensors, by the calling
    convention of `evtrain.stages.boundary` (a tuple becomes positional
    arguments, a dict keyword arguments). Factories are called with the CPU
    RNG seeded from (`seed`, layer index), so the initial weights do not
    depend on the partition."""

    model: ModelFactory | None = None
    """A zero-argument factory of the whole model, split by module name instead of `layers`.

    Every stage builds the model on the CPU with the RNG seeded from `seed`
    (so the initial weights do not depend on the stage count), keeps the
    modules of its own units and frees the rest; see
    `evtrain.stages.partition` for the units and the contract the model's
    ``forward`` follows. Parameters shared between modules (tied
    embeddings) are found and kept equal across stages."""

    split_points: Sequence[str] | None = None
    """With `model`: the fully qualified names of the modules that begin stages 1..P-1,
    at any depth, e.g. ``["transformer.h.4"]``; ``None`` balances automatically (see
    `balance`)."""

    pruned_forward: bool = False
    """With `model`: the model's ``forward`` follows the pruned-model rules (skip a
    unit that is ``None``, iterate containers, return the boundary value when the head
    is absent; see docs/models.md), so stages drop other stages' units instead of
    standing in for them. Any ``forward`` runs as written without it."""

    tied: Sequence[Sequence[str]] = ()
    """Groups of parameter names of the unsplit model that are one weight, e.g.
    ``[("0.weight", "7.weight")]`` (the first name is the one checkpoints keep). The
    first name's initialization is used; gradients are summed over the group before
    clipping and the optimizer step. With `model`, shared parameters are found without this."""

    loss_fn: LossFn | None
    """``loss_fn(output, target) -> scalar tensor``, mean-reduced over the microbatch;
    ``None`` when the model computes its own loss and returns it as ``output.loss``,
    ``output["loss"]`` or a scalar (a Hugging Face model given ``labels``)."""

    optimizer: OptimizerFactory
    """``optimizer(params) -> torch.optim.Optimizer``, e.g.
    ``functools.partial(torch.optim.SGD, lr=0.1)``. Each stage builds one over its own
    parameters."""

    train_data: DataSource
    """``(inputs, targets)`` tensors, or a zero-argument callable returning those
    or a map-style data set of ``(input, target)`` pairs; with `input_keys`, samples are
    dicts (a dict of stacked tensors, or a data set of dicts). Kept stacked in memory."""

    data_loader: Mapping[str, Any] | None = None
    """Read `train_data` and `eval_data` as map-style data sets through a
    `torch.utils.data.DataLoader` with these options (``num_workers``,
    ``collate_fn``, ``prefetch_factor``, ...; see `evtrain.stages.loading`) instead of
    stacking them in memory: only the stages that consume data read it, and
    randomness in ``dataset[i]`` (augmentation) is seeded per sample and epoch.
    ``{}`` uses the DataLoader's defaults (no workers)."""

    input_keys: str | Sequence[str] | None = None
    """For dict samples: the key whose tensor feeds the first stage, or a tuple of keys
    passed to it as keyword arguments. Keys a later stage needs (a padding mask) are
    passed along by the earlier stages' outputs."""

    target_keys: str | Sequence[str] | None = None
    """For dict samples: the key given to ``loss_fn`` and metrics as ``target``, or a
    tuple of keys given as a dict."""

    batch_size: int
    """Samples per batch; a multiple of `num_microbatches`."""

    num_microbatches: int = 4
    """Microbatches per batch (M); must divide `batch_size`. M < `stages` is allowed."""

    max_steps: int | None = None
    """Optimizer steps to train. With `epochs` too, training stops at whichever comes first."""

    epochs: int | None = None
    """Passes over the training set (incomplete last batch dropped). At least one of
    `max_steps` and `epochs` is required."""

    lr_scheduler: SchedulerFactory | None = None
    """``lr_scheduler(optimizer) -> LRScheduler``, stepped once after every optimizer step.

    A factory with a ``total_steps`` parameter, ``lr_scheduler(optimizer,
    total_steps=N)``, is told the optimizer steps of the whole run (after
    ``--steps`` / ``--epochs``, counted from step 0 also when resuming), so a
    cosine or one-cycle schedule ends where the run ends (see `build_scheduler`)."""

    eval_data: DataSource | Mapping[str, DataSource] | None = None
    """Evaluation data, same forms as `train_data`; read in order, every sample once.

    Or several named sets, ``{"val": data, "test": data}`` (each in any form
    `train_data` takes, with the same `input_keys`/`target_keys`): every
    evaluation runs each set in turn and reports its values as ``val/loss``,
    ``val/accuracy``, ``test/loss``... A single unnamed set reports plain
    ``loss``, ``accuracy``. Set names are letters, digits, ``.``, ``_``, ``-``."""

    eval_batch_size: int | None = None
    """Eval batch size (default `batch_size`); a multiple of `num_microbatches`. The last
    eval batch holds the remainder (see `evtrain.data.eval_microbatches`)."""

    eval_every: int | None = None
    """Evaluate every this many steps (and hooks may ask for more). Needs `eval_data`."""

    metrics: Mapping[str, MetricFn | Any] = dataclasses.field(default_factory=dict)
    """Extra eval metrics by name, computed on the last stage; ``loss`` (`loss_fn`) is
    always reported and is a reserved name. Two kinds:

    * a metric object with ``update(output, target)``, ``compute()`` and
      ``reset()`` — a torchmetrics ``Metric`` such as ``F1Score(task="multiclass",
      num_classes=10, average="macro")``, or `metric` ``(F1Score, ...)`` to build it
      on the last stage only. It sees every microbatch of a set and is computed
      once per set, so F1, AUROC or perplexity are exact. Each set gets its own
      copy; it never synchronizes across processes (the other processes are
      the pipeline's other stages, which hold no part of the evaluation).
    * a plain function ``fn(output, target) -> float | tensor``: additive by
      contract — a mean over the microbatch (like `accuracy`, MAE) that the
      stage averages over the set weighted by microbatch size (`eval_weight`).
      A metric that is not such a mean must be an object, or it is wrong.

    A class (``F1Score`` instead of ``F1Score(...)``), an object with only some
    of the three methods and a callable that cannot take ``(output, target)``
    are refused with the fix."""

    eval_weight: EvalWeight | None = None
    """``eval_weight(target) -> count``: how many units `loss_fn` and the plain metrics
    average over in one microbatch, e.g. the tokens that are not padding,
    ``lambda y: (y != -100).sum()``. Evaluation weights each microbatch's values
    by it, so a token-level loss is the mean over every token of the set (what
    one process computes on the whole set), not a mean of microbatch means.
    ``None`` weights by the samples in the microbatch. A microbatch of weight 0
    adds nothing. Metric objects are not weighted: they see every microbatch."""

    grad_clip: float | None = None
    """Clip the global L2 norm of all gradients (across stages) to this value."""

    grad_accum: int = 1
    """Batches per optimizer step: step k reads batches ``k*a .. k*a + a - 1`` (a = grad_accum)."""

    seed: int = 0
    """Seeds layer initialization (per layer) and data shuffling (per epoch)."""

    run_dir: str | Path = "runs/{name}"
    """Where logs, metrics and checkpoints go; ``{name}`` is replaced by `name`. Always a
    `Path` after construction (relative paths are relative to the launcher's cwd)."""

    stages: int = 2
    """Number of pipeline stages P (at most the number of layers)."""

    virtual_stages: int = 1
    """Model chunks V per stage: >= 2 for ``schedule="interleaved"`` (the model is
    split into P x V chunks and stage s holds chunks s, s + P, s + 2P, ...:
    Megatron's interleaved placement), exactly 2 for ``"zbv"`` (stage s holds chunks
    P - 1 - s and P + s: the V), 1 for every other schedule. `balance` then has one
    entry per chunk, in model order."""

    data_parallel: int = 1
    """Replicas D of the pipeline (data parallelism): P x D processes on a (pp, dp)
    device mesh. Every replica reads its own ``batch_size / D`` samples of each batch
    and each stage's replicas average their gradients with DDP's reducer, so a step
    equals one on the whole batch; `batch_size` is the global batch and must be a
    multiple of ``num_microbatches * data_parallel``."""

    balance: Sequence[int] | str | None = None
    """Layers (or units of `model`) per stage, e.g. ``[3, 2]``; or ``"params"`` to balance
    the parameter count, ``"compute"`` to balance estimated training FLOPs (measured on
    the meta device with one microbatch of the data). ``None`` is ``"params"``."""

    schedule: str = "1f1b"
    """Pipeline schedule: ``"1f1b"``, ``"gpipe"``, ``"zb"`` (zero bubble: the
    backward split into input and weight halves), ``"interleaved"`` (interleaved
    1F1B over `virtual_stages` chunks per stage) or ``"zbv"`` (zero bubble over two
    chunks per stage placed in a V, ``virtual_stages=2``); see
    `evtrain.stages.schedules`."""

    device: str = "cpu"
    """``"cpu"`` or ``"cuda"`` (each stage then uses ``cuda:{local_rank}``, NCCL)."""

    hooks: Sequence[Mapping[str, Any] | str] = ()
    """Hooks the launcher starts, as plain data: ``dict(type="logging", every=10)`` or
    ``dict(type="mypkg.mod:MyHook", priority=50, ...)``; a bare string is ``dict(type=s)``."""

    microbatch_spans: str = "sampled"
    """Publish microbatch forward/backward spans: ``"all"``, ``"sampled"`` or ``"off"``."""

    threads: int | None = None
    """``torch.set_num_threads`` in each stage process; ``None`` keeps torch's default."""

    precision: str = "fp32"
    """``"fp32"``; ``"bf16"`` (autocast); ``"fp16"`` (autocast with dynamic loss scaling,
    every stage skipping the same overflowing steps). Weights and optimizer stay fp32."""

    activation_checkpointing: bool = False
    """Recompute each layer's (or unit's) activations in the backward instead of storing
    them (`torch.utils.checkpoint`, non-reentrant, RNG preserved)."""

    compile: bool | Mapping[str, Any] = False
    """``torch.compile`` each stage's layers: ``True``, or a dict of its keyword arguments."""

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
        if _is_int(self.grad_clip):
            put("grad_clip", float(self.grad_clip))  # type: ignore[arg-type]
        self.validate()

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Check every field; raise `SpecError` naming the first bad one.

        Cheap: does not load data (`evtrain.stages.job_data.JobData` checks the
        data, and `batch_size` against the data set's size, when it loads it).
        """
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise SpecError(
                "name", f"expected letters, digits, '.', '_' or '-' (no spaces), got {self.name!r}"
            )
        self._validate_layers()
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise SpecError(
                "loss_fn",
                f"expected a callable (output, target) -> loss, or None, got {self.loss_fn!r}",
            )
        if not callable(self.optimizer) or isinstance(self.optimizer, torch.optim.Optimizer):
            raise SpecError(
                "optimizer",
                "expected a factory params -> Optimizer, e.g. "
                f"functools.partial(torch.optim.SGD, lr=0.1); got {self.optimizer!r}",
            )
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise SpecError(
                "lr_scheduler",
                f"expected a factory optimizer -> LRScheduler, got {self.lr_scheduler!r}",
            )
        if self.train_data is None:
            raise SpecError("train_data", "is required")
        _check_int("batch_size", self.batch_size, minimum=1)
        _check_int("num_microbatches", self.num_microbatches, minimum=1)
        if self.batch_size % self.num_microbatches:
            raise SpecError(
                "num_microbatches",
                f"{self.num_microbatches} does not divide batch_size {self.batch_size}",
            )
        _check_int("data_parallel", self.data_parallel, minimum=1)
        if self.batch_size % (self.num_microbatches * self.data_parallel):
            raise SpecError(
                "data_parallel",
                f"batch_size {self.batch_size} does not split into {self.data_parallel} "
                f"replicas x {self.num_microbatches} microbatches",
            )
        _check_int("max_steps", self.max_steps, minimum=1, optional=True)
        _check_int("epochs", self.epochs, minimum=1, optional=True)
        if self.max_steps is None and self.epochs is None:
            raise SpecError("max_steps", "set max_steps or epochs (or both)")
        _check_int("eval_batch_size", self.eval_batch_size, minimum=1, optional=True)
        if self.effective_eval_batch_size % self.num_microbatches:
            raise SpecError(
                "eval_batch_size",
                f"{self.effective_eval_batch_size} is not a multiple of "
                f"num_microbatches {self.num_microbatches}",
            )
        _check_int("eval_every", self.eval_every, minimum=1, optional=True)
        if self.eval_every is not None and self.eval_data is None:
            raise SpecError("eval_every", "is set but eval_data is not")
        self._validate_metrics()
        self._validate_eval_data()
        self._validate_data_loader()
        if self.grad_clip is not None and (
            not isinstance(self.grad_clip, float) or not self.grad_clip > 0
        ):
            raise SpecError("grad_clip", f"expected a number > 0 or None, got {self.grad_clip!r}")
        _check_int("grad_accum", self.grad_accum, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.run_dir, Path) or str(self.run_dir) in ("", "."):
            raise SpecError("run_dir", f"expected a directory path, got {self.run_dir!r}")
        _check_int("stages", self.stages, minimum=1)
        _check_int("virtual_stages", self.virtual_stages, minimum=1)
        if self.schedule not in SCHEDULES:
            raise SpecError(
                "schedule",
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}",
            )
        self._validate_virtual_stages()
        if self.layers is not None and self.num_chunks > len(self.layers):
            what = "stages" if self.virtual_stages == 1 else "model chunks"
            raise SpecError(
                "stages" if self.virtual_stages == 1 else "virtual_stages",
                f"{self.num_chunks} {what} but only {len(self.layers)} layers to place",
            )
        self._validate_balance()
        self._validate_model_options()
        if self.device not in DEVICES:
            hint = (
                "; use 'cuda': each stage takes cuda:{local_rank}"
                if isinstance(self.device, str) and self.device.startswith("cuda:")
                else ""
            )
            raise SpecError(
                "device", f"expected one of {', '.join(DEVICES)}, got {self.device!r}{hint}"
            )
        self._validate_hooks()
        if self.microbatch_spans not in SPAN_MODES:
            raise SpecError(
                "microbatch_spans",
                f"expected one of {', '.join(SPAN_MODES)}, got {self.microbatch_spans!r}",
            )
        _check_int("threads", self.threads, minimum=1, optional=True)

    def _validate_layers(self) -> None:
        if (self.layers is None) == (self.model is None):
            raise SpecError(
                "layers",
                "give either layers (one factory per layer) or model (a factory of the whole "
                "model, split by module name)" + (", not both" if self.layers is not None else ""),
            )
        if self.model is not None:
            if not callable(self.model):
                raise SpecError("model", f"expected a zero-argument factory, got {self.model!r}")
            return
        if not isinstance(self.layers, tuple) or not self.layers:
            raise SpecError("layers", "expected a non-empty list of layer factories")
        for i, factory in enumerate(self.layers):
            if isinstance(factory, nn.Module):
                raise SpecError(
                    "layers",
                    f"layer {i} is an nn.Module instance; give a factory instead, e.g. "
                    f"layer({type(factory).__name__}, ...), so only its stage builds it",
                )
            if not callable(factory):
                raise SpecError("layers", f"layer {i} is not callable: {factory!r}")

    def _validate_virtual_stages(self) -> None:
        try:
            check_virtual_stages(
                self.schedule, self.stages, self.num_microbatches, self.virtual_stages
            )
        except UsageError as exc:
            raise SpecError("virtual_stages", str(exc)) from None

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

    @property
    def num_chunks(self) -> int:
        """Model chunks: ``stages * virtual_stages`` (the units are split into these)."""
        return self.stages * self.virtual_stages

    def _validate_balance(self) -> None:
        if self.balance is None:
            return
        if isinstance(self.balance, str):
            if self.balance not in BALANCE_MODES:
                raise SpecError(
                    "balance",
                    f"expected a list of sizes or one of {', '.join(BALANCE_MODES)}, "
                    f"got {self.balance!r}",
                )
            return
        if not isinstance(self.balance, tuple) or not all(_is_int(b) for b in self.balance):
            raise SpecError("balance", f"expected a list of integers, got {self.balance!r}")
        if len(self.balance) != self.num_chunks:
            per = "stages is" if self.virtual_stages == 1 else "stages x virtual_stages is"
            raise SpecError(
                "balance", f"has {len(self.balance)} entries but {per} {self.num_chunks}"
            )
        if any(b < 1 for b in self.balance):
            raise SpecError(
                "balance", f"every stage needs at least one layer, got {list(self.balance)}"
            )
        if self.layers is not None and sum(self.balance) != len(self.layers):
            raise SpecError(
                "balance",
                f"{list(self.balance)} places {sum(self.balance)} layers but there are "
                f"{len(self.layers)}",
            )

    def _validate_model_options(self) -> None:
        if self.pruned_forward is not False and (
            self.model is None or not isinstance(self.pruned_forward, bool)
        ):
            raise SpecError("pruned_forward", "expected True or False, with model=")
        if self.split_points is not None:
            if self.model is None:
                raise SpecError("split_points", "applies to model=, not to layers=")
            points = self.split_points
            if not isinstance(points, tuple) or not all(isinstance(p, str) and p for p in points):
                raise SpecError("split_points", f"expected module names, got {points!r}")
            if len(points) != self.stages - 1:
                raise SpecError(
                    "split_points",
                    f"{len(points)} split point(s) make {len(points) + 1} stages, but stages "
                    f"is {self.stages}",
                )
            if len(set(points)) != len(points):
                raise SpecError("split_points", f"names a module twice: {list(points)}")
            if self.balance is not None:
                raise SpecError("balance", "give split_points or balance, not both")
        if not isinstance(self.tied, tuple) or not all(
            isinstance(g, tuple) and len(g) >= 2 and all(isinstance(n, str) and n for n in g)
            for g in self.tied
        ):
            raise SpecError(
                "tied",
                f"expected groups of two or more parameter names, got {self.tied!r}",
            )
        names = [n for g in self.tied for n in g]
        if len(set(names)) != len(names):
            raise SpecError("tied", "a parameter name appears in more than one place")
        if (self.input_keys is None) != (self.target_keys is None):
            raise SpecError(
                "input_keys" if self.input_keys is None else "target_keys",
                "dict samples need both input_keys and target_keys",
            )
        for field in ("input_keys", "target_keys"):
            keys = getattr(self, field)
            if keys is None or (isinstance(keys, str) and keys):
                continue
            if (
                not isinstance(keys, tuple)
                or not keys
                or not all(isinstance(k, str) and k for k in keys)
            ):
                raise SpecError(field, f"expected a key or a tuple of keys, got {keys!r}")
        if self.precision not in PRECISIONS:
            raise SpecError(
                "precision",
                f"expected one of {', '.join(PRECISIONS)}, got {self.precision!r}",
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise SpecError(
                "activation_checkpointing",
                f"expected True or False, got {self.activation_checkpointing!r}",
            )
        if not isinstance(self.compile, bool | Mapping) or (
            isinstance(self.compile, Mapping) and not all(isinstance(k, str) for k in self.compile)
        ):
            raise SpecError(
                "compile",
                f"expected True, False or a dict of torch.compile options, got {self.compile!r}",
            )
        if (
            self.activation_checkpointing
            and isinstance(self.compile, Mapping)
            and self.compile.get("backend") == "eager"
        ):
            raise SpecError(
                "compile",
                "the 'eager' backend does not recompute checkpointed layers faithfully; "
                "use backend 'aot_eager' with activation_checkpointing",
            )

    def _validate_data_loader(self) -> None:
        if self.data_loader is None:
            return
        if not isinstance(self.data_loader, dict):
            raise SpecError(
                "data_loader", f"expected a dict of DataLoader options, got {self.data_loader!r}"
            )
        bad = sorted(set(self.data_loader) - LOADER_OPTIONS)
        if bad:
            raise SpecError(
                "data_loader",
                f"{', '.join(map(repr, bad))} cannot be set (batches, their size and order are "
                f"evtrain's); allowed: {', '.join(sorted(LOADER_OPTIONS))}",
            )

    def _validate_metrics(self) -> None:
        if not isinstance(self.metrics, dict):
            raise SpecError(
                "metrics", f"expected a dict name -> fn(output, target), got {self.metrics!r}"
            )
        for key, fn in self.metrics.items():
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
            if not _takes_output_and_target(fn):
                raise SpecError(
                    "metrics",
                    f"metric {key!r} cannot be called as fn(output, target); a factory of a "
                    "metric object is given as metric(factory, ...)",
                )
        if self.eval_weight is not None and not callable(self.eval_weight):
            raise SpecError(
                "eval_weight", f"expected a callable target -> count, got {self.eval_weight!r}"
            )

    def _validate_eval_data(self) -> None:
        sets = self.eval_data
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

    def _validate_hooks(self) -> None:
        if not isinstance(self.hooks, tuple):
            raise SpecError("hooks", f"expected a list of hook specs, got {self.hooks!r}")
        for i, hook in enumerate(self.hooks):
            if not isinstance(hook, Mapping):
                raise SpecError(
                    "hooks", f"hook {i} must be a dict like dict(type='logging'), got {hook!r}"
                )
            kind = hook.get("type")
            if not isinstance(kind, str) or not kind:
                raise SpecError("hooks", f"hook {i} needs a string 'type', got {hook!r}")
            if not all(isinstance(k, str) for k in hook):
                raise SpecError("hooks", f"hook {i} has non-string keys: {hook!r}")

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
    def microbatch_size(self) -> int:
        """Samples per training microbatch of one replica
        (``batch_size // (num_microbatches * data_parallel)``)."""
        return self.batch_size // (self.num_microbatches * self.data_parallel)

    @property
    def world_size(self) -> int:
        """Processes of the run: ``stages * data_parallel``."""
        return self.stages * self.data_parallel

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step (``batch_size * grad_accum``)."""
        return self.batch_size * self.grad_accum

    @property
    def effective_eval_batch_size(self) -> int:
        """`eval_batch_size`, or `batch_size` when unset."""
        return self.eval_batch_size if self.eval_batch_size is not None else self.batch_size

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
