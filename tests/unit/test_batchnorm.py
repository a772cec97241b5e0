"""BatchNorm helpers of a stage: precise recomputation, SyncBatchNorm conversion, the
spec check that keeps SyncBatchNorm off CPU."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from evtrain.errors import SpecError
from evtrain.job import Job, layer
from evtrain.job_checks import check_job
from evtrain.stages.batchnorm import recomputing_statistics, synchronise


def test_recomputed_statistics_are_the_plain_average_and_leave_the_rest_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Dropout(0.5))
    model.train()
    for _ in range(3):  # a moving average with momentum 0.1 and a batch count of 3
        model(torch.randn(8, 4))
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d)
    batches = [torch.randn(8, 4) for _ in range(4)]
    state = torch.get_rng_state()
    with torch.no_grad(), recomputing_statistics(model, torch.device("cpu")):
        for x in batches:
            model(x)
    with torch.no_grad():
        hidden = [model[0](x) for x in batches]
    want_mean = torch.stack([h.mean(0) for h in hidden]).mean(0)
    want_var = torch.stack([h.var(0, unbiased=True) for h in hidden]).mean(0)
    torch.testing.assert_close(norm.running_mean, want_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(norm.running_var, want_var, rtol=0, atol=1e-6)
    assert norm.momentum == 0.1
    assert norm.num_batches_tracked is not None and int(norm.num_batches_tracked) == 3
    assert torch.equal(torch.get_rng_state(), state)  # the dropout draws were forked


@pytest.fixture
def one_process_group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def test_synchronise_converts_shared_layers_once_keeping_their_tensors(
    one_process_group: dist.ProcessGroup,
) -> None:
    norm = nn.BatchNorm2d(4)
    stage = nn.Sequential(nn.Conv2d(2, 4, 3), norm, nn.ModuleList([nn.BatchNorm1d(2)]))
    chunk = nn.Sequential(norm)  # a chunk's own container around the same layer
    weight, mean = norm.weight, norm.running_mean
    synchronise([stage, chunk], one_process_group)
    sync = stage[1]
    assert isinstance(sync, nn.SyncBatchNorm) and chunk[0] is sync
    assert sync.process_group is one_process_group
    assert sync.weight is weight and sync.running_mean is mean
    assert isinstance(stage[2][0], nn.SyncBatchNorm)


def test_sync_batchnorm_with_replicas_on_cpu_is_refused_with_the_way_out() -> None:
    job = Job(
        name="bn",
        layers=[layer(nn.Linear, 2, 2), layer(nn.BatchNorm1d, 2)],
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.zeros(8, 2), torch.zeros(8, 2)),
        batch_size=8,
        num_microbatches=2,
        max_steps=1,
        sync_batchnorm=True,
    )
    check_job(job)  # one replica: nothing to synchronise
    with pytest.raises(SpecError, match="SyncBatchNorm trains on CUDA devices only"):
        check_job(dataclasses.replace(job, data_parallel=2))
    check_job(dataclasses.replace(job, data_parallel=2, device="cuda"))
