"""The split backward of zero-bubble schedules: I then W give the gradients of one backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evtrain.stages.backward import SplitBackward


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16))


def whole(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad()
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward([model(leaf)], [g])
    return leaf.grad, [p.grad.clone() for p in model.parameters()]


def test_input_half_gives_only_the_input_gradient_and_weight_half_the_rest() -> None:
    model = mlp()
    xs = [torch.randn(4, 8) for _ in range(3)]
    gs = [torch.randn(4, 16) for _ in range(3)]
    expected_inputs = []
    expected_weights = [torch.zeros_like(p) for p in model.parameters()]
    for x, g in zip(xs, gs, strict=True):
        grad_x, grads = whole(model, x, g)
        expected_inputs.append(grad_x)
        expected_weights = [e + w for e, w in zip(expected_weights, grads, strict=True)]
    model.zero_grad(set_to_none=True)

    split = SplitBackward(model, [model])
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outputs = [model(leaf) for leaf in leaves]
    for m in range(3):
        split.input_half(m, [outputs[m]], [gs[m]], [leaves[m]])
        torch.testing.assert_close(leaves[m].grad, expected_inputs[m])
    # I left every linear layer's weight gradient to W; the LayerNorm's it computed.
    assert all(p.grad is None for layer in (model[0], model[2]) for p in layer.parameters())
    norm = model[3]
    torch.testing.assert_close(norm.weight.grad, expected_weights[4])
    for m in (2, 0, 1):  # W runs in any order after its I
        split.weight_half(m)
    for p, e in zip(model.parameters(), expected_weights, strict=True):
        torch.testing.assert_close(p.grad, e)
        assert not p.grad.requires_grad  # a gradient, not a graph


def test_input_half_on_a_loss() -> None:
    model = mlp()
    x, target = torch.randn(4, 8), torch.randn(4, 16)
    leaf = x.clone().requires_grad_(True)
    torch.nn.functional.mse_loss(model(leaf), target).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_x = leaf.grad.clone()
    model.zero_grad(set_to_none=True)

    split = SplitBackward(model, [model])
    leaf = x.clone().requires_grad_(True)
    loss = torch.nn.functional.mse_loss(model(leaf), target)
    split.input_half(0, [loss], None, [leaf])
    torch.testing.assert_close(leaf.grad, expected_x)
    assert model[0].weight.grad is None
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("routed", [False, True], ids=["left-alone", "routed"])
def test_without_input_gradients_the_weight_half_runs_the_whole_backward(routed: bool) -> None:
    model = mlp()
    x, g = torch.randn(4, 8), torch.randn(4, 16)
    _, expected = whole(model, x, g)
    model.zero_grad(set_to_none=True)
    split = SplitBackward(model, [model] if routed else [])
    # What the executor does on a first stage: its linear layers keep their own forward.
    assert ("forward" in vars(model[0])) is routed
    split.input_half(0, [model(x)], [g], [])  # the first stage: its input takes no gradient
    assert all(p.grad is None for p in model.parameters())
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


class Tied(nn.Module):
    """A linear head whose weight is also an embedding's, and a bias that
    reaches an output on no path from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.embed.weight
        self.free = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.arange(x.shape[0]) % 8
        return self.head(x + self.embed(ids)), self.free.tanh().expand(x.shape[0], 8)


def test_weights_reached_other_ways_get_their_gradient_in_the_input_half() -> None:
    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(4, 8)
    grads = [torch.randn(4, 8), torch.randn(4, 8)]
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(list(model(leaf)), grads)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_x = leaf.grad.clone()
    model.zero_grad(set_to_none=True)

    split = SplitBackward(model, [model])
    leaf = x.clone().requires_grad_(True)
    split.input_half(0, list(model(leaf)), grads, [leaf])
    torch.testing.assert_close(leaf.grad, expected_x)
    torch.testing.assert_close(model.free.grad, expected["free"])
    split.weight_half(0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_outside_the_input_half_a_linear_layer_computes_its_gradients_at_once() -> None:
    model = mlp()
    x, g = torch.randn(4, 8), torch.randn(4, 16)
    _, expected = whole(model, x, g)
    model.zero_grad(set_to_none=True)
    SplitBackward(model, [model])
    _, got = whole(model, x, g)  # a plain backward through the routed layers
    for p, e in zip(got, expected, strict=True):
        torch.testing.assert_close(p, e)
    with torch.no_grad():
        torch.testing.assert_close(model(x), mlp()(x))


def test_a_view_output() -> None:
    model = mlp()
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward([model(leaf)[:, :8]], [g])
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    split = SplitBackward(model, [model])
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)[:, :8]
    assert out._is_view()
    split.input_half(0, [out], [g], [leaf])
    assert model[0].weight.grad is None
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_a_stage_sharded_with_fsdp_still_splits_its_backward() -> None:
    """FSDP2 swaps each sharded layer's class for a subclass with hooks around the same
    forward: such a linear layer still defers its weight gradients to W. And it
    registers the gathered parameters in place of the sharded ones while they are in
    use: I differentiates those, so the LayerNorm's gradients are not lost. I then W
    give one backward's gradients. One process on a one-rank gloo group."""
    from torch import distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = mlp()
    xs = [torch.randn(4, 8) for _ in range(2)]
    gs = [torch.randn(4, 16) for _ in range(2)]
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for x, g in zip(xs, gs, strict=True):
        _, grads = whole(reference, x, g)
        expected = [e + w for e, w in zip(expected, grads, strict=True)]

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = mlp()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        assert type(model[0]) is not nn.Linear
        split = SplitBackward(model, [model])
        # How a step of a sharded stage begins: gathered once, reduced once at its end.
        model.set_requires_gradient_sync(False)
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        leaves = [x.clone().requires_grad_(True) for x in xs]
        outputs = [model(leaf) for leaf in leaves]
        for m in range(2):
            split.input_half(m, [outputs[m]], [gs[m]], [leaves[m]])
            assert len(split._deferred[m].linear) == 2  # both layers wait for W
        for m in range(2):
            split.weight_half(m)
        # What a step's reduction does with FSDP: every group reduces once.
        model.set_requires_gradient_sync(True)
        model.set_is_last_backward(True)
        model.set_reshard_after_backward(True)
        state = fully_shard.state(model)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        got = [
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters()
        ]
    finally:
        dist.destroy_process_group()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
