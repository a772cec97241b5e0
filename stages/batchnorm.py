"""BatchNorm across replicas: synchronised, made the replicas' mean, recomputed precisely.

With data parallelism each replica normalises its own share of a microbatch
and its statistics follow its own samples (`evtrain.stages.data_parallel`
syncs buffers only at start); before every evaluation and save the replicas
make them their mean (`average_running_stats`). `Job.sync_batchnorm` instead
normalises over all replicas' samples (`synchronise`: torch's SyncBatchNorm,
CUDA only).

`Job.precise_bn` recomputes them before every evaluation, as detectron2's and
LibAI's PreciseBN hook does: the exponential moving average of training lags
the weights and weighs the last batches most, while evaluation wants the
statistics of the weights being evaluated. Every BatchNorm layer is reset and
set to a cumulative average (``momentum=None``), the N training batches that
follow the evaluated step run forward through the pipeline in training mode
without gradients, and the layers get their momentum and batch count back.
Dropout draws during those passes come from a forked random state, so
training draws what it would have without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from evtrain.stages.data_parallel import average_in_place
from evtrain.stages.standins import is_shadow

__all__ = ["average_running_stats", "recomputing_statistics", "running_stat_layers", "synchronise"]


def running_stat_layers(module: nn.Module) -> list[nn.modules.batchnorm._NormBase]:
    """The layers of ``module`` that keep running statistics (BatchNorm, and
    InstanceNorm with ``track_running_stats``)."""
    return [
        layer
        for layer in module.modules()
        if isinstance(layer, nn.modules.batchnorm._NormBase)
        and layer.track_running_stats
        and not is_shadow(layer)
    ]


def average_running_stats(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every replica's BatchNorm running mean and variance their mean over ``group``
    (blocking, collective over the stage's replicas; nothing without such layers)."""
    stats = [
        buffer
        for layer in running_stat_layers(module)
        for buffer in (layer.running_mean, layer.running_var)
        if buffer is not None
    ]
    average_in_place(stats, group)


def synchronise(modules: Sequence[nn.Module], group: dist.ProcessGroup) -> None:
    """Replace the BatchNorm layers inside ``modules`` by `torch.nn.SyncBatchNorm` over
    ``group``, in place, keeping their parameters and buffers. A layer reachable from
    several of them (a stage and its chunks) becomes one SyncBatchNorm."""
    made: dict[int, nn.SyncBatchNorm] = {}

    def convert(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if is_shadow(child):
                continue
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(
                child, nn.SyncBatchNorm
            ):
                if id(child) not in made:
                    made[id(child)] = nn.SyncBatchNorm.convert_sync_batchnorm(child, group)
                parent._modules[name] = made[id(child)]
            else:
                convert(child)

    for module in modules:
        convert(module)


def _count(layer: nn.modules.batchnorm._NormBase) -> torch.Tensor | None:
    count = layer.num_batches_tracked
    return None if count is None else count.clone()


@contextlib.contextmanager
def recomputing_statistics(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside, forward passes in training mode recompute ``module``'s running statistics
    from scratch as their plain average (see the module docstring)."""
    layers = running_stat_layers(module)
    kept = [(layer.momentum, _count(layer)) for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for layer, (momentum, count) in zip(layers, kept, strict=True):
            layer.momentum = momentum
            if count is not None and layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(count)
