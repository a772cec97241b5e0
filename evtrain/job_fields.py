"""The fields of a job: what a user sets, with its default and its meaning, and what
follows from them.

`evtrain.job.Job` is the job: these fields, normalised and checked on every new
instance (`evtrain.job_checks` says what each accepts). The checks read a job's
fields as `JobFields`, so that they need not know the class that runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "DataSource",
    "EvalWeight",
    "JobFields",
    "LayerFactory",
    "LossFn",
    "MetricFn",
    "ModelFactory",
    "OptimizerFactory",
    "SchedulerFactory",
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


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class JobFields:
    """Every field of a `evtrain.job.Job`, and the sizes derived from them."""

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

    tensor_parallel: int = 1
    """Tensor-parallel ranks T of every stage of every replica: P x D x T processes on a
    (pp, dp, tp) mesh, tp innermost (a machine's devices). Each stage's layers are split
    over its T ranks by `tp_plan` (or a Hugging Face model's own plan), applied after
    the stage is built; docs/scale.md explains the layout."""

    tp_plan: Mapping[str, str] | Callable[..., Any] | None = None
    """With `tensor_parallel` > 1: how the stage's layers split, as module paths (``*``
    for any one name) to styles — ``"colwise"``, ``"rowwise"``, ``"colwise_rep"``
    (gathered output), ``"rowwise_rep"`` (replicated input), ``"embedding_rowwise"``,
    ``"sequence_parallel"``, ``"replicate"`` — in Hugging Face's vocabulary
    (`evtrain.stages.tensor_parallel`); or a callable ``(stage_module, tp_mesh) ->
    None`` that parallelizes the stage itself. ``None``: the model's own plan (a
    Hugging Face model's ``config.base_model_tp_plan`` and ``_tp_plan``)."""

    loss_parallel: bool = False
    """With `tensor_parallel` > 1: the model's head keeps its logits split over the
    vocabulary into the loss (loss parallelism: 1/T of the logits per rank), for a
    Hugging Face model's own plan, whose head becomes ``"colwise_loss"``. A `tp_plan`
    of the job's own names its head ``"colwise_loss"`` itself; a callable one leaves
    the logits split (``output_layouts=Shard(-1), use_local_output=False``)."""

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

    @property
    def num_chunks(self) -> int:
        """Model chunks: ``stages * virtual_stages`` (the units are split into these)."""
        return self.stages * self.virtual_stages

    @property
    def microbatch_size(self) -> int:
        """Samples per training microbatch of one replica
        (``batch_size // (num_microbatches * data_parallel)``)."""
        return self.batch_size // (self.num_microbatches * self.data_parallel)

    @property
    def world_size(self) -> int:
        """Processes of the run: ``stages * data_parallel * tensor_parallel``."""
        return self.stages * self.data_parallel * self.tensor_parallel

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step (``batch_size * grad_accum``)."""
        return self.batch_size * self.grad_accum

    @property
    def effective_eval_batch_size(self) -> int:
        """`eval_batch_size`, or `batch_size` when unset."""
        return self.eval_batch_size if self.eval_batch_size is not None else self.batch_size
