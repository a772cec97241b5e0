"""`ShardedReplicas` on a one-rank gloo group: what it refuses and what it checks.

Its numerics (every mode equal to one process, checkpoints, evaluation) are
tested through real launches in tests/integration/test_sharded.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from evtrain.errors import UsageError
from evtrain.stages.sharded import ShardedReplicas


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_parameter_shared_by_two_units_is_refused_naming_it(mesh: DeviceMesh) -> None:
    module = stage()
    module.append(nn.Linear(8, 2))
    module[3].weight = module[2].weight
    with pytest.raises(UsageError, match=r"parameter 'weight' is shared by units 2 and 3"):
        ShardedReplicas(module, [module], list(module), mesh, "optimizer", torch.device("cpu"))


@pytest.mark.parametrize("mode", ["optimizer", "grads", "full"])
def test_a_parameter_without_gradient_fails_the_step_naming_it(mesh: DeviceMesh, mode: str) -> None:
    module = stage()
    replicas = ShardedReplicas(module, [module], list(module), mesh, mode, torch.device("cpu"))
    params = [p for p in module.parameters() if p.requires_grad]
    for unused in (False, True):
        replicas.begin_step()
        for _microbatch in range(2):
            out = replicas.module(torch.randn(3, 4))
            if unused:
                out = out.detach() + 0 * out[:, :1].detach()  # no gradient reaches the stage
                out.requires_grad_(True)
            out.sum().backward()
        if unused:
            with pytest.raises(UsageError, match=r"parameters 0\.weight, 0\.bias, 2\.weight"):
                replicas.check_used(params)
        else:
            replicas.check_used(params)  # every gradient is somewhere: no error
            replicas.reduce(params)
            assert all(p.grad is not None for p in params)
            for p in params:
                p.grad = None


@pytest.mark.parametrize("mode", ["grads", "optimizer"])
def test_grads_mode_reduces_after_each_weight_half_of_a_split_backward(
    mesh: DeviceMesh, mode: str
) -> None:
    """`grads` reduce-scatters each microbatch's gradients once its weight half ran
    (the input half alone would miss the linear weights); `optimizer` only at the
    step's end. Either way the step's gradients are the sum of its backwards."""
    from torch.distributed.tensor import DTensor

    from evtrain.stages.backward import SplitBackward

    reference = stage()
    module = stage()
    xs = [torch.randn(3, 4) for _ in range(2)]
    for x in xs:
        reference(x).sum().backward()
    replicas = ShardedReplicas(
        module, [module], list(module), mesh, mode, torch.device("cpu"), split_backward=True
    )
    sharded = [p for p in module.parameters() if p.requires_grad]
    split = SplitBackward(module, [module])
    replicas.begin_step()
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outputs = [replicas.module(leaf) for leaf in leaves]
    for m, out in enumerate(outputs):
        split.input_half(m, [out], [torch.ones_like(out)], [leaves[m]])
        split.weight_half(m)
        replicas.weight_half_done()
        reduced = [p.grad is not None for p in sharded]
        assert reduced == [mode == "grads"] * len(sharded), (m, reduced)
    replicas.reduce(sharded)
    for p, want in zip(sharded, reference.parameters(), strict=True):
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), want.grad)
