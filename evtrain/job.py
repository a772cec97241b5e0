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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError
from evtrain.job_checks import MetricFactory, check_job, is_int, named_eval_sets

__all__ = [
    "Job",
    "accuracy",
    "layer",
    "metric",
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
    convention of `evtrain.stages.pytree` (a tuple becomes positional
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

    loss_weight: EvalWeight | None = None
    """``loss_weight(target) -> count``: how many units `loss_fn` averages over in one
    training microbatch, e.g. the tokens that are not padding, ``lambda y: (y !=
    -100).sum()``. The step's loss and gradients are then the mean over every unit
    of the step's batch (all microbatches, accumulation passes and replicas): what
    one process computes on the whole batch, at any ``num_microbatches``,
    ``data_parallel`` and ``grad_accum``, as Megatron and torchtitan normalise by
    the global token count. ``None``: the mean of the microbatches' losses. The
    total travels in the step boundary's control exchange, so the optimizer step
    waits for it."""

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

    shard: str = "none"
    """With `data_parallel` > 1, what each stage's replicas split between them instead
    of each holding it whole (torch's FSDP2 over the stage's replicas): ``"none"``
    (DDP), ``"optimizer"`` (the optimizer state; parameters and gradients are whole
    during a step), ``"grads"`` (also the gradients, reduced after every
    microbatch) or ``"full"`` (also the parameters, gathered for each microbatch).
    Between steps every mode holds 1/D of the stage's state; docs/scale.md says
    what each costs."""

    precise_bn: int | None = None
    """Recompute the BatchNorm running statistics before every evaluation over this many
    training batches (those that follow the evaluated step), run forward through the
    pipeline as detectron2's and LibAI's PreciseBN does: the statistics become the plain
    average over those batches of the weights evaluated, not a moving average that lags
    them. What is evaluated and saved at that step holds them. ``None``: off."""

    sync_batchnorm: bool = False
    """With `data_parallel` > 1 on CUDA: every BatchNorm layer normalises over the
    microbatch of all the stage's replicas (torch's ``SyncBatchNorm`` on the stage's
    replica group), as one process on the whole batch would. Without it each replica
    normalises its own share and the replicas average their running statistics
    before every evaluation and save."""

    find_unused_parameters: bool = False
    """With `data_parallel` > 1: trainable parameters may get no gradient in a step
    (a branch not taken, an unused head); the replicas then find them in every step's
    last backward (DDP's ``find_unused_parameters``, a walk of the autograd graph)
    and average the rest. Without it such a step fails naming the parameters."""

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

    @property
    def num_chunks(self) -> int:
        """Model chunks: ``stages * virtual_stages`` (the units are split into these)."""
        return self.stages * self.virtual_stages

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
