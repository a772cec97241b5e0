"""Tensor parallelism inside a stage: the stage's layers split over its T tensor ranks.

With `evtrain.job.Job.tensor_parallel` T > 1, every stage of every replica
runs on T processes (the ``tp`` dimension of the mesh, `evtrain.stages.mesh`).
After the stage is built, and before activation checkpointing, compilation
and data parallelism wrap it (torchtitan's order), a *plan* splits its
layers with torch's ``parallelize_module`` over the ``tp`` mesh. A plan maps
module paths to styles, in Hugging Face's vocabulary: ``*`` stands for any
one name of a path, so ``"model.layers.*.self_attn.q_proj"`` matches every
layer's projection.

==================================== ==========================================
style                                what the module becomes
==================================== ==========================================
``colwise``                          a Linear split by output features: its
                                     output is this rank's slice (torch's
                                     ``ColwiseParallel``)
``rowwise``                          a Linear split by input features, taking
                                     the slice a ``colwise`` made; its output is
                                     summed over the ranks (``RowwiseParallel``)
``colwise_rep``,                     ``colwise`` whose output is gathered whole
``colwise_gather_output``
``rowwise_rep``,                     ``rowwise`` that takes a whole input and
``rowwise_split_input``              slices it itself
``embedding_rowwise``                an Embedding split by rows (the vocabulary),
                                     its output summed
``embedding_colwise``                an Embedding split by columns, its output
                                     gathered
``colwise_loss``                     the model's head split by output features
                                     (the vocabulary), its logits left split into
                                     the loss: loss parallelism, below
``sequence_parallel``                a norm or dropout that runs on a sequence
                                     slice (``SequenceParallel``)
``replicate``                        left whole on every rank
``replicated_with_grad_allreduce``   left whole, fed only this rank's slice (a
                                     per-head norm after ``colwise``): its
                                     gradients are summed over the ranks at
                                     ``ReduceGrads``
==================================== ==========================================

The plan comes from `Job.tp_plan` (a mapping, or a callable that gets the
stage module and the ``tp`` mesh and parallelizes it itself), or, for a
Hugging Face model, from the model (`model_plan`). Only the
modules a stage holds take a plan: a layer held by another stage (a stand-in)
has no such module here. Paths the plan does not reach stay whole.

A plan that names a ``sequence_parallel`` module is *sequence-parallel*
(Megatron-LM's sequence parallelism, torchtitan's plans): between the split
layers the activations are sequence slices, dimension 1 of ``(batch,
sequence, ...)``. A ``rowwise`` (and ``embedding_rowwise``) output is then
reduce-scattered into this rank's slice of the sequence instead of summed
whole, a ``colwise`` input all-gathered from the slices, and the norms in
between run on 1/T of the tokens. What crosses a stage boundary is this
rank's slice: 1/T of the activation per tensor rank. Every sequence length
must be a multiple of T (`check_sequence`, refused when the data is first
read), and the model's output must leave the last stage gathered
(``colwise_rep`` on the head; `check_gathered` refuses a slice, which a loss
could otherwise broadcast against the whole targets).

A head named ``colwise_loss`` (for a Hugging Face model's own plan,
`Job.loss_parallel` names its output embeddings so) keeps its logits split
over the vocabulary, a DTensor sharded on its last dimension, and the last
chunk's forward, loss and backward run under torch's ``loss_parallel``: each
rank holds 1/T of the logits, the largest activation of a language model's
last stage, and ``torch.nn.functional.cross_entropy`` (without label
smoothing) computes on them, as a Hugging Face model's own loss does. A
job's own `Job.loss_fn` gets that DTensor. Evaluation gathers the logits for
the metrics. Only a stage that computes the loss may hold such a head.

Otherwise, what a stage sends its neighbour is whole on every rank (a ``rowwise``
output is summed, a ``colwise`` one inside a layer never leaves it), and
tensor rank t sends to tensor rank t: each of a replica's T pipelines
carries the same activations, and every rank of a stage reads the same
batches. So the loss, computed on every rank, is the same everywhere: the
control exchange takes tensor rank 0's. A gradient split over the ranks
counts every rank's slice in the global norm; a whole one counts once
(`TensorParallel.counts`). Sharded replicas (`evtrain.stages.sharded`) then
shard each rank's slices over the ``dp`` dimension of the same mesh: FSDP2
over DTensors, parameters on a 2-D ``(dp, tp)`` mesh, as torchtitan does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._pytree import tree_map_only

from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.stages.job_data import job_data
from evtrain.stages.pytree import BoundarySpec, StandIn
from evtrain.stages.shapes import data_spec
from evtrain.stages.sharded import local_tensor

__all__ = [
    "SEQUENCE_STYLES",
    "STYLES",
    "TensorParallel",
    "check_gathered",
    "check_plan",
    "check_sequence",
    "gathered",
    "model_plan",
    "plan_of",
    "sequence_parallel",
]

log = structlog.get_logger("evtrain.stages.tensor_parallel")

_LINEAR = (nn.Linear,)
_EMBEDDING = (nn.Embedding,)

STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate()
    ),
    "colwise_loss": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "sequence_parallel": lambda: SequenceParallel(),
    "replicate": lambda: None,
    "replicated_with_grad_allreduce": lambda: None,
}
"""Each style of the vocabulary (module docstring) as torch's parallel style; None: the
module stays whole."""

SEQUENCE_STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    **STYLES,
    "colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
    "colwise_rep": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Replicate()
    ),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "rowwise_split_input": lambda: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "embedding_rowwise": lambda: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "embedding_colwise": lambda: ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "colwise_loss": lambda: ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    ),
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
}
"""The styles of a sequence-parallel plan (module docstring): the activations between
them are sequence slices, plain local tensors as in the other plans."""


def sequence_parallel(plan: Mapping[str, str] | Callable[..., Any]) -> bool:
    """Whether ``plan`` is sequence-parallel: it names a ``sequence_parallel`` module."""
    return not callable(plan) and "sequence_parallel" in plan.values()


def check_sequence(spec: BoundarySpec, size: int) -> None:
    """Refuse data whose sequences ``size`` tensor ranks cannot split evenly (dimension
    1 of every input of two or more dimensions)."""
    for leaf in spec.leaves:
        if len(leaf.shape) >= 2 and leaf.shape[1] % size:
            raise SpecError(
                "tensor_parallel",
                f"{size} does not divide a sequence length of {leaf.shape[1]} (an input of "
                f"shape {list(leaf.shape)}), which a sequence-parallel plan splits: pad "
                f"to a multiple of {size}",
            )


def check_gathered(output: Any, target: Any, size: int) -> None:
    """Refuse a last stage's output that is still a sequence slice: 1/``size`` of the
    targets' length."""
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return
    if output.dim() >= 2 and target.dim() >= 2 and output.shape[1] * size == target.shape[1]:
        raise SpecError(
            "tp_plan",
            f"the model's output leaves the last stage as a sequence slice (length "
            f"{output.shape[1]} of {target.shape[1]}): make its head 'colwise_rep'",
        )


_SPLIT_DIM = {
    "colwise": ("out_features", _LINEAR),
    "colwise_rep": ("out_features", _LINEAR),
    "colwise_gather_output": ("out_features", _LINEAR),
    "colwise_loss": ("out_features", _LINEAR),
    "rowwise": ("in_features", _LINEAR),
    "rowwise_rep": ("in_features", _LINEAR),
    "rowwise_split_input": ("in_features", _LINEAR),
    "embedding_rowwise": ("num_embeddings", _EMBEDDING),
    "embedding_colwise": ("embedding_dim", _EMBEDDING),
}
"""The size a style splits over the ranks, and the modules it applies to."""


def model_plan(model: nn.Module, loss_parallel: bool = False) -> dict[str, str] | None:
    """A Hugging Face model's own plan, with paths from ``model``'s root; None when the
    model is not one or its family has none (an empty plan, as GPT-2's).

    The instance's ``_tp_plan``, which transformers merges at construction (the base
    model's, its embedding's included, under its prefix, and the head's) and applies
    itself, where it exists; else the config's and the class's. ``loss_parallel``:
    the head (the model's output embeddings) becomes ``colwise_loss``.
    """
    merged = vars(model).get("_tp_plan")
    if isinstance(merged, dict) and merged:
        plan = {str(k): str(v) for k, v in merged.items()}
    else:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        head = getattr(type(model), "_tp_plan", None)
        if not base and not head:
            return None
        plan = {}
        prefix = getattr(model, "base_model_prefix", "")
        within = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        for path, style in (base or {}).items():
            plan[f"{prefix}.{path}" if within else path] = style
        plan.update(head or {})
    if loss_parallel:
        name = _head_name(model)
        if plan.get(name) not in ("colwise", "colwise_rep", "colwise_gather_output"):
            raise SpecError(
                "loss_parallel",
                f"{type(model).__name__}'s plan does not split its head by the vocabulary "
                f"({name or 'no output embeddings'}: {plan.get(name)!r})",
            )
        plan[name] = "colwise_loss"
    return plan


def _head_name(model: nn.Module) -> str:
    """The path of a Hugging Face model's output embeddings ('' without)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((n for n, m in model.named_modules() if m is head and n), "")


def plan_of(
    job_plan: Mapping[str, str] | Callable[..., Any] | None,
    model: nn.Module,
    loss_parallel: bool = False,
) -> Mapping[str, str] | Callable[..., Any]:
    """The plan a stage of ``model`` takes: the job's, else the model's own (its head
    ``colwise_loss`` with ``loss_parallel``)."""
    if job_plan is not None:
        return job_plan
    own = model_plan(model, loss_parallel)
    if own is None:
        raise SpecError(
            "tp_plan",
            f"{type(model).__name__} has no tensor-parallel plan of its own; give the job "
            "a tp_plan (module paths to 'colwise', 'rowwise', ...)",
        )
    return own


def check_plan(job: Job) -> None:
    """Before launch: the plan a `Job.model` takes exists and ``tensor_parallel`` divides
    its heads (the model built on the meta device); a `SpecError` otherwise."""
    if isinstance(job.tp_plan, Mapping):
        for path, style in job.tp_plan.items():
            _check_style(path, style)
        if sequence_parallel(job.tp_plan):
            # The first batch's; a later one of another length is refused when read.
            inputs = job_data(job).example_batch(1)[0]
            check_sequence(data_spec(inputs), job.tensor_parallel)
    if job.model is None or callable(job.tp_plan):
        return
    with torch.device("meta"):
        model = job.model()
    _check_heads(model, job.tensor_parallel)
    plan = plan_of(job.tp_plan, model, job.loss_parallel)
    assert not callable(plan)
    if sequence_parallel(plan) and type(model).__module__.startswith("transformers."):
        raise SpecError(
            "tp_plan",
            f"{type(model).__name__}'s decoder layers hand their attention the whole "
            "sequence: a sequence-parallel plan cannot split them (leave out "
            "'sequence_parallel')",
        )
    if not any(True for _ in _resolve(model, plan)):
        raise SpecError(
            "tp_plan",
            f"reaches no module of {type(model).__name__} (its paths look like "
            f"{next((n for n, _ in model.named_modules() if n.count('.') >= 2), '?')!r})",
        )


def _check_style(path: str, style: str) -> None:
    if style not in STYLES:
        raise SpecError(
            "tp_plan", f"{path}: unknown style {style!r}; choose one of {', '.join(STYLES)}"
        )


def _matches(pattern: list[str], path: list[str]) -> bool:
    return len(pattern) == len(path) and all(
        p in ("*", n) for p, n in zip(pattern, path, strict=True)
    )


def _resolve(module: nn.Module, plan: Mapping[str, str]) -> Iterator[tuple[str, nn.Module, str]]:
    """(path, module, style) of each of ``module``'s modules that ``plan`` reaches."""
    patterns = [(pattern.split("."), style) for pattern, style in plan.items()]
    for name, sub in module.named_modules():
        if not name:
            continue
        path = name.split(".")
        for pattern, style in patterns:
            if _matches(pattern, path):
                yield name, sub, style
                break


def _check_heads(model: nn.Module, size: int) -> None:
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise SpecError(
                "tensor_parallel",
                f"{size} does not divide {type(model).__name__}'s {field} ({heads})",
            )


class TensorParallel:
    """The plan applied to one stage over its ``tp`` mesh (module docstring).

    ``partial`` are the parameters whose gradients are summed over the ranks at
    ``ReduceGrads`` (``replicated_with_grad_allreduce``); `counts` says whether a
    parameter's gradient counts in this rank's part of the global norm. ``computes_loss``:
    the stage holds the model's last chunk; ``loss_parallel``: a callable plan leaves
    the logits split itself (`Job.loss_parallel`).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        plan: Mapping[str, str] | Callable[..., Any],
        stage: int,
        *,
        computes_loss: bool,
        loss_parallel: bool = False,
    ) -> None:
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group: dist.ProcessGroup = mesh.get_group()
        self._partial_names: set[str] = set()
        self.sequence = sequence_parallel(plan)
        """Whether activations between the split layers are sequence slices."""
        self.loss_parallel = computes_loss and loss_parallel and callable(plan)
        """Whether the last chunk's logits reach the loss split (module docstring)."""
        _check_heads(module, self.size)
        if callable(plan):
            plan(module, mesh)
        else:
            self._apply(module, plan, stage, computes_loss)
        self.rebind(module)

    def rebind(self, module: nn.Module) -> None:
        """Find ``partial`` in ``module`` again, by name, after sharding replaced the
        parameter objects (as `evtrain.stages.tied.TiedWeights.rebind`)."""
        self.partial: list[nn.Parameter] = [
            p for n, p in module.named_parameters() if n in self._partial_names
        ]

    def _apply(
        self, module: nn.Module, plan: Mapping[str, str], stage: int, computes_loss: bool
    ) -> None:
        styles: dict[str, ParallelStyle] = {}
        for name, sub, style in _resolve(module, plan):
            if any(isinstance(v, StandIn) for v in vars(sub).values()):
                continue  # held by another stage: its weights are stand-ins here
            _check_style(name, style)
            if style == "colwise_loss":
                if not computes_loss:
                    raise SpecError(
                        "tp_plan",
                        f"{name} is 'colwise_loss' but stage {stage} computes no loss: "
                        "only the model's head, on the last stage, keeps its logits split",
                    )
                self.loss_parallel = True
            split = _SPLIT_DIM.get(style)
            if split is not None:
                field, kinds = split
                if not isinstance(sub, kinds):
                    continue  # what the stage holds in the layer's place
                if getattr(sub, field) % self.size:
                    raise SpecError(
                        "tensor_parallel",
                        f"{self.size} does not divide {name}'s {field} ({getattr(sub, field)}) "
                        f"for {style!r}",
                    )
            if style == "replicated_with_grad_allreduce":
                self._partial_names.update(
                    f"{name}.{n}" if name else n
                    for n, p in sub.named_parameters()
                    if p.requires_grad
                )
            made = (SEQUENCE_STYLES if self.sequence else STYLES)[style]()
            if made is not None:
                styles[name] = made
        if not styles:
            log.warning("the tensor-parallel plan splits nothing on this stage", stage=stage)
            return
        parallelize_module(module, self.mesh, styles, src_data_rank=None)

    def counts(self, param: torch.Tensor) -> bool:
        """Whether this rank counts ``param``'s gradient in the global norm: its slice of a
        split parameter, a whole one on tensor rank 0 only."""
        return self.rank == 0 or _split_over_tp(param)

    def align_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Lay each gradient out as its parameter: torch's backward of a split Embedding
        leaves the whole gradient on every rank (``Replicate``), which would count in
        the norm T times and not match the slices the optimizer steps. Cutting one's
        slice of a replicated gradient communicates nothing."""
        for p in params:
            grad = p.grad
            if (
                isinstance(grad, DTensor)
                and isinstance(p, DTensor)
                and grad.placements != p.placements
            ):
                p.grad = grad.redistribute(p.device_mesh, p.placements)

    def reduce_grads(self) -> None:
        """Sum the gradients of ``partial`` parameters over the ranks (each saw its slice;
        sharded over the replicas, each its shard of them)."""
        for p in self.partial:
            if p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=self.group)


def gathered(output: Any) -> Any:
    """``output`` with every DTensor in it whole: split logits, for the metrics."""
    return tree_map_only(DTensor, lambda t: t.full_tensor(), output)


def _split_over_tp(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the ``tp`` dimension of its mesh (alone, or with
    FSDP's ``dp`` beside it)."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(param.placements[names.index("tp")], Shard)
