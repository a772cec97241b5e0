"""What a stage builds before its first step, in two blocking calls, and tears down at the end.

1. `build_stage`: join the process groups (`evtrain.stages.mesh`), build this
   stage's slice of the model (its chunks with model chunks), activation
   checkpointing and compilation, tied weights synchronised, the replicas'
   reducer, the mailbox and the step control. The actor announces the stage
   (``StageStarted``) between the two calls.
2. `prepare_stage`: the readers of the data this stage consumes, the boundary
   specs agreed with the pipeline (`evtrain.stages.shapes`), the optimizer
   and LR schedule, the executor, the orders and the stage's checkpointing,
   then a resume or weights load. Returns one frozen `StageRuntime`: what the
   step loop uses, never reassigned.

`finish_stage` is the last collective: the final barrier, the optional weight
dump, leaving the process groups.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from evtrain.bus.commands import CommandReceiver
from evtrain.checkpoint import CheckpointError
from evtrain.checkpoint.loader import agree_on_resume, load_stage_shard, load_weights
from evtrain.checkpoint.state_tree import set_rng_state, stage_aliases
from evtrain.checkpoint.writer import ShardWriter
from evtrain.data import derive_seed, eval_microbatches
from evtrain.events import Event
from evtrain.job import Job
from evtrain.reporting import Reporter
from evtrain.schedule_names import parse_schedule
from evtrain.stages.backward import SplitBackward
from evtrain.stages.batchnorm import average_running_stats, synchronise
from evtrain.stages.checkpointing import REPLICA_RNG, StageCheckpointing
from evtrain.stages.control import StepControl
from evtrain.stages.data_parallel import Replicas
from evtrain.stages.evaluation import (
    EvalSet,
    StageEvaluator,
    replica_share,
    unsyncable_metric,
)
from evtrain.stages.executor import StageExecutor
from evtrain.stages.job_data import job_data
from evtrain.stages.loading import make_reader
from evtrain.stages.mesh import Place, build_groups, pin_socket_interface
from evtrain.stages.orders import Orders
from evtrain.stages.p2p import Mailbox, exchange_shapes, infer_output_spec
from evtrain.stages.partition import (
    build_stage_chunks,
    build_stage_module,
    partition,
    stage_unit_modules,
    stage_units,
    tied_groups,
)
from evtrain.stages.precision import LossScaler, autocast, checkpoint_layer, compile_module
from evtrain.stages.pytree import BoundarySpec
from evtrain.stages.schedules import chunk_place, model_chunk
from evtrain.stages.shapes import ChunkSpecs, ShapeTable
from evtrain.stages.sharded import ShardedReplicas, full_tensor
from evtrain.stages.tensor_parallel import TensorParallel, check_sequence, plan_of
from evtrain.stages.tied import TiedWeights
from evtrain.stages.update import WeightUpdate
from evtrain.stages.worker import restart_count

if TYPE_CHECKING:  # the worker starts the actor, which calls this module
    from evtrain.stages.worker import WorkerConfig

__all__ = [
    "PROCESS_GROUP_TIMEOUT",
    "StageParts",
    "StageRuntime",
    "build_stage",
    "finish_stage",
    "prepare_stage",
]

log = structlog.get_logger("evtrain.stages.setup")

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class StageParts:
    """A stage's device, groups and model slice (`build_stage`)."""

    place: Place
    device: torch.device
    module: nn.Module
    chunks: list[nn.Module]
    """The model chunks this stage runs (``[module]`` without model chunks)."""
    tied: TiedWeights
    replicas: Replicas | ShardedReplicas | None
    """The stage's DDP reducer or FSDP units (None without replicas or trainable
    parameters)."""
    replica_group: dist.ProcessGroup | None
    """The stage's D replicas (None without replicas)."""
    mailbox: Mailbox
    control: StepControl
    shapes_group: dist.ProcessGroup | None
    checkpoint_group: dist.ProcessGroup | None
    """The processes that write the stage's shards together (`StageGroups.checkpoint`)."""
    tensor: TensorParallel | None = None
    """The stage's tensor-parallel plan applied (None: T = 1)."""


@dataclass(frozen=True)
class StageRuntime:
    """Everything the step loop uses (`prepare_stage`)."""

    job: Job
    parts: StageParts
    executor: StageExecutor
    evaluator: StageEvaluator
    orders: Orders
    checkpointing: StageCheckpointing
    total_steps: int
    start_step: int
    """The step a resume continues after (0 for a fresh run)."""


def build_stage(
    job: Job, place: Place, local_rank: int, receiver: CommandReceiver | None
) -> StageParts:
    """Join the process groups, build this stage's slice (blocking, collective)."""
    if os.environ.get("EVTRAIN_PIN_CPU") == "1":  # opt-in, see evtrain.stages.actor
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})
    torch.set_num_threads(job.threads or 1)
    device = job.stage_device(local_rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    pin_socket_interface()
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=place.rank,
            world_size=place.world_size,
            timeout=PROCESS_GROUP_TIMEOUT,
            device_id=device if cuda else None,
        )
    V = job.virtual_stages
    groups = build_groups(
        place,
        device,
        backend,
        PROCESS_GROUP_TIMEOUT,
        virtual_stages=V,
        varying_shapes=job.data_loader is not None,
        sharded=job.shard != "none",
    )
    ranges = partition(job)
    # Per-stage RNG for randomness inside layers (dropout); layer init is
    # seeded per layer by build_stage_module, independent of the partition.
    replica_key = () if place.replica == 0 else ("replica", place.replica)
    torch.manual_seed(derive_seed(job.seed, "stage", place.stage, *replica_key))
    if V == 1:
        module = build_stage_module(job, ranges[place.stage], device)
        chunks = [module]
    else:
        # Interleaved: this stage's chunks are the model's chunks stage, stage + P...;
        # zbv: P - 1 - stage and P + stage.
        ids = [model_chunk(job.schedule, place.stage, place.num_stages, v) for v in range(V)]
        module = build_stage_chunks(job, [ranges[c] for c in ids], device)
        chunks = list(vars(module)["chunks"])
    tensor = None
    if groups.tensor_mesh is not None:
        # Before anything wraps the layers (checkpointing, compile, DDP), as torchtitan.
        plan = plan_of(job.tp_plan, module, job.loss_parallel)
        loss_stage, _ = chunk_place(job.schedule, place.num_stages, job.num_chunks - 1)
        tensor = TensorParallel(
            module,
            groups.tensor_mesh,
            plan,
            place.stage,
            computes_loss=place.stage == loss_stage,
            loss_parallel=job.loss_parallel,
        )
    if job.sync_batchnorm and groups.replicas is not None:
        # Before anything wraps the layers (checkpointing, compile, DDP).
        synchronise([module, *chunks], groups.replicas)
    for part in (module, *chunks):
        part.train()
    if job.activation_checkpointing:
        for unit in stage_unit_modules(job, module):
            checkpoint_layer(unit)
    for chunk in chunks:
        compile_module(chunk, job.compile)
    tied = TiedWeights(tied_groups(job, ranges), place, module, backend)
    tied.sync()
    trainable = any(p.requires_grad for p in module.parameters())
    replicas: Replicas | ShardedReplicas | None = None
    if groups.replicas is not None and trainable:
        if job.shard == "none":
            replicas = Replicas(
                module,
                groups.replicas,
                device,
                find_unused=job.find_unused_parameters,
                reducer=tensor is None,
            )
        else:
            assert groups.replica_mesh is not None
            units = stage_unit_modules(job, module)
            replicas = ShardedReplicas(
                module,
                chunks,
                units,
                groups.replica_mesh,
                job.shard,
                device,
                split_backward=parse_schedule(job.schedule).splits_backward,
                find_unused=job.find_unused_parameters,
            )
            tied.rebind(module)
            if tensor is not None:
                tensor.rebind(module)
    mailbox = Mailbox(
        device=device,
        act_group=groups.pipeline,
        grad_group=groups.pipeline_grads,
        chunk_groups=groups.chunks,
    )
    control = StepControl(
        rank=place.rank, world_size=place.world_size, group=groups.control, receiver=receiver
    )
    return StageParts(
        place,
        device,
        module,
        chunks,
        tied,
        replicas,
        groups.replicas,
        mailbox,
        control,
        groups.shapes,
        groups.checkpoint,
        tensor,
    )


def prepare_stage(
    job: Job,
    parts: StageParts,
    config: WorkerConfig,
    publish: Callable[[Event], None],
    reporter: Reporter,
) -> StageRuntime:
    """Load data, agree on boundary shapes, build the optimizer and executor, restore
    (blocking, collective)."""
    place, device, module = parts.place, parts.device, parts.module
    P, V = place.num_stages, len(parts.chunks)
    ids = [model_chunk(job.schedule, place.stage, P, v) for v in range(V)]
    # This stage reads the inputs (it holds the model's first chunk), the targets (its last).
    first, last = 0 in ids, P * V - 1 in ids
    data = job_data(job)
    stream = data.train_stream()
    total = data.total_steps()
    eval_sizes: set[int] = set()
    evaluations: list[EvalSet] = []
    unsyncable = unsyncable_metric(job) if place.replicas > 1 else None
    shared = place.replicas > 1 and unsyncable is None
    if unsyncable is not None and place.rank == 0:
        log.warning(
            "replica 0 evaluates every set whole: a metric object cannot combine the "
            "replicas' shares (it is no torchmetrics Metric)",
            metric=unsyncable,
        )
    for name in job.eval_sets:
        num = data.num_eval_samples(name)
        plan = eval_microbatches(num, job.effective_eval_batch_size, job.num_microbatches)
        eval_sizes.update(len(r) for batch in plan for r in batch)
        share = replica_share(plan, place.replica, place.replicas, shared)
        reader = make_reader(data, "eval", first, last, device, eval_plan=share, eval_set=name)
        evaluations.append(EvalSet(name, reader, num, share))
    sizes = sorted({job.microbatch_size, *eval_sizes})
    train_reader = make_reader(
        data, "train", first, last, device, stream=stream, replica=place.replica
    )
    shapes = ShapeTable(
        functools.partial(_agree, job, parts, ids),
        first=first,
        varying=job.data_loader is not None,
        group=parts.shapes_group,
        src=place.rank_of(chunk_place(job.schedule, P, 0)[0]),
    )
    shapes.setup(sizes, data.example_batch(1)[0] if first else None)
    if parts.replicas is not None:
        # Inference ran forwards: sharded, the optimizer must see the shards.
        parts.replicas.release()

    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = job.optimizer(params) if params else None
    scheduler = data.build_scheduler(optimizer) if optimizer is not None else None
    split = None
    if parse_schedule(job.schedule).splits_backward:
        # A chunk whose input takes no gradient has no I to do: its layers stay as they are.
        takes_grad = [any(act.carries_grad for act, _ in shapes.chunk_specs(v)) for v in range(V)]
        split = SplitBackward(
            module, [c for c, grad in zip(parts.chunks, takes_grad, strict=True) if grad]
        )
    update = WeightUpdate(
        params=params,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        scaler=LossScaler() if job.precision == "fp16" else None,
        control=parts.control,
        place=place,
        grad_clip=job.grad_clip,
        tied=parts.tied or None,
        replicas=parts.replicas,
        tensor=parts.tensor,
        # The replicas average at ReduceGrads rather than in DDP's last backward.
        average_at_reduce=split is not None or V > 1 or parts.tensor is not None,
        weight_scale=None
        if job.loss_weight is None
        else float(job.data_parallel * job.num_microbatches * job.grad_accum),
    )
    executor = StageExecutor(
        job=job,
        stage=place.stage,
        num_stages=P,
        device=device,
        module=module,
        update=update,
        split=split,
        mailbox=parts.mailbox,
        control=parts.control,
        replicas=parts.replicas,
        place=place,
        stream=stream,
        shapes=shapes,
        chunks=parts.chunks,
        train=train_reader,
        sequence_split=parts.tensor.size if parts.tensor and parts.tensor.sequence else 1,
        loss_parallel=parts.tensor is not None and parts.tensor.loss_parallel,
    )
    evaluator = StageEvaluator(
        executor=executor,
        sets=evaluations,
        last=last,
        replica=place.replica,
        group=parts.replica_group,
        shared=shared,
        publish=publish,
        reporter=reporter,
    )
    writer = None
    sharded = parts.replicas is not None and parts.replicas.sharded
    if not config.evaluate_only and (place.replica == 0 or sharded):
        writer = ShardWriter(place.stage, P, device=device, group=parts.checkpoint_group)
    checkpointing = StageCheckpointing(
        stage=place.stage,
        lead=place.rank == 0,
        writer=writer,
        module=module,
        executor=executor,
        replicas=parts.replica_group,
        publish=publish,
    )
    orders = Orders(
        last_step=total,
        batches_per_step=stream.grad_accum,
        batches_per_epoch=stream.batches_per_epoch,
    )
    start_step = _restore(job, place, module, executor, config)
    return StageRuntime(job, parts, executor, evaluator, orders, checkpointing, total, start_step)


def _agree(
    job: Job, parts: StageParts, ids: Sequence[int], data_specs: Sequence[BoundarySpec] | None
) -> list[list[ChunkSpecs]]:
    """Agree with the pipeline on the specs of new data shapes, chunk by chunk
    (`evtrain.stages.shapes.Agree`; ``ids`` are this stage's model chunks)."""
    place = parts.place
    P = place.num_stages
    if data_specs is not None and parts.tensor is not None and parts.tensor.sequence:
        for spec in data_specs:
            check_sequence(spec, parts.tensor.size)
    input_specs = data_specs
    agreed: list[list[ChunkSpecs]] = []
    for v, chunk in enumerate(parts.chunks):
        # Each chunk's input spec comes from model chunk c - 1: the data's on
        # chunk 0, this stage's own previous chunk at a hand-off (zbv's turn),
        # else the stage holding it, which sent it first (the chunks' order
        # runs from the data to the loss, so nothing waits in a circle).
        c = ids[v]
        src = None if c == 0 else chunk_place(job.schedule, P, c - 1)[0]
        dst = None if c == P * len(parts.chunks) - 1 else chunk_place(job.schedule, P, c + 1)[0]
        if src == place.stage:
            handed = agreed[ids.index(c - 1)]
            input_specs = [out for _, out in handed if out is not None]
        units = stage_units(chunk)
        where = f"stage {place.stage} (units {units[0]}..{units[-1]})"
        in_specs, out_specs = exchange_shapes(
            prev=None if src in (None, place.stage) else place.rank_of(src),
            next=None if dst in (None, place.stage) else place.rank_of(dst),
            input_specs=input_specs,
            output_spec_of=functools.partial(_infer, job, parts.device, chunk, where=where),
            last=dst is None,
            group=parts.mailbox.act_group,
            device=parts.device if parts.device.type == "cuda" else torch.device("cpu"),
        )
        agreed.append(list(zip(in_specs, out_specs, strict=True)))
    return agreed


def _infer(
    job: Job, device: torch.device, chunk: nn.Module, spec: BoundarySpec, *, where: str
) -> BoundarySpec:
    # Under the run's autocast: the agreed dtypes are those training sends.
    with autocast(job.precision, device):
        return infer_output_spec(chunk, spec, device, where)


def _restore(
    job: Job, place: Place, module: nn.Module, executor: StageExecutor, config: WorkerConfig
) -> int:
    """Resume from a checkpoint or load weights, as the config says (blocking,
    collective); the step training continues after."""
    path = None
    if restart_count() > 0:
        # An elastic restart: continue from the last committed checkpoint.
        try:
            path = agree_on_resume(job.run_dir)
        except CheckpointError as exc:
            log.warning("restart: no committed checkpoint to resume", error=str(exc))
    if path is None and config.resume is not None:
        resume = job.run_dir if config.resume == "latest" else config.resume
        path = agree_on_resume(resume)
    if path is not None:
        state = load_stage_shard(
            path,
            place.stage,
            module,
            executor.optimizer,
            executor.lr_scheduler,
            restore_rng=place.replica == 0,
        )
        if place.replica:
            same_stages = state.saved_num_stages == place.num_stages
            saved = state.extra.get(REPLICA_RNG) if same_stages else None
            _restore_replica_rng(job, place, state.step, saved, executor.device)
        if executor.scaler is not None and "loss_scaler" in state.extra:
            executor.scaler.load_state_dict(state.extra["loss_scaler"])
        log.info("resumed", stage=place.stage, path=str(path), step=state.step)
        return state.step
    if config.load_weights is not None:
        load_weights(config.load_weights, module)
        log.info("weights loaded", stage=place.stage, path=config.load_weights)
    return 0


def _restore_replica_rng(
    job: Job, place: Place, step: int, saved: list[Any] | None, device: torch.device
) -> None:
    """Replica r > 0 of a resume: the random state it had when the checkpoint was
    taken, when it was taken at this P and D; else its own, seeded by the step
    (dropout masks independent of replica 0's either way)."""
    if saved is not None and len(saved) == place.replicas - 1:
        set_rng_state(saved[place.replica - 1], device)
        return
    seed = derive_seed(job.seed, "stage", place.stage, "replica", place.replica)
    torch.manual_seed(derive_seed(seed, "resumed", step))


def finish_stage(runtime: StageRuntime, dump_weights_dir: str | None) -> None:
    """Final barrier, optional weight dump, leave the process groups (blocking, collective)."""
    parts = runtime.parts
    parts.control.barrier()
    if dump_weights_dir and parts.replica_group is not None:
        average_running_stats(parts.module, parts.replica_group)
    if dump_weights_dir:
        # Every copy of a tied weight too, so that their equality can be checked;
        # an alias held with its canonical name here is the same tensor, which
        # safetensors refuses to write twice: a copy of it, then. Sharded, every
        # replica takes part in gathering each tensor whole.
        named = dict(parts.module.named_parameters(remove_duplicate=False))
        aliases = {a: named[a].detach().clone() for a in stage_aliases(parts.module)}
        state = {
            k: full_tensor(v.detach()).cpu().contiguous()
            for k, v in {**parts.module.state_dict(), **aliases}.items()
        }
    if dump_weights_dir and parts.place.replica == 0 and parts.place.tp == 0:
        from safetensors.torch import save_file

        directory = Path(dump_weights_dir)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(state, str(directory / f"stage-{parts.place.stage}.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()
