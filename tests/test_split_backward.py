"""The split backward of zero-bubble schedules: I then W give the gradients of one backward."""

from __future__ import annotations

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

    split = SplitBackward(list(model.parameters()))
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outputs = [model(leaf) for leaf in leaves]
    for m in range(3):
        split.input_half(m, [outputs[m]], [gs[m]], [leaves[m]])
        torch.testing.assert_close(leaves[m].grad, expected_inputs[m])
    # I computed no weight gradient: W of every microbatch still has all of them to do.
    assert all(p.grad is None for p in model.parameters())
    for m in (2, 0, 1):  # W runs in any order after its I
        split.weight_half(m)
    for p, e in zip(model.parameters(), expected_weights, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_input_half_on_a_loss() -> None:
    model = mlp()
    x, target = torch.randn(4, 8), torch.randn(4, 16)
    leaf = x.clone().requires_grad_(True)
    torch.nn.functional.mse_loss(model(leaf), target).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_x = leaf.grad.clone()
    model.zero_grad(set_to_none=True)

    split = SplitBackward(list(model.parameters()))
    leaf = x.clone().requires_grad_(True)
    loss = torch.nn.functional.mse_loss(model(leaf), target)
    split.input_half(0, [loss], None, [leaf])
    torch.testing.assert_close(leaf.grad, expected_x)
    assert all(p.grad is None for p in model.parameters())
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_without_input_gradients_the_weight_half_runs_the_whole_backward() -> None:
    model = mlp()
    x, g = torch.randn(4, 8), torch.randn(4, 16)
    _, expected = whole(model, x, g)
    model.zero_grad(set_to_none=True)
    split = SplitBackward(list(model.parameters()))
    split.input_half(0, [model(x)], [g], [])  # the first stage: its input takes no gradient
    assert all(p.grad is None for p in model.parameters())
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


class WithAFreeOutput(nn.Module):
    """Returns (f(x), g(bias)): ``bias`` reaches an output on no path from ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.f(x), self.bias.tanh().expand(x.shape[0], 8)


def test_a_weight_off_the_input_path_makes_the_input_half_whole() -> None:
    torch.manual_seed(0)
    model = WithAFreeOutput()
    x = torch.randn(4, 8)
    grads = [torch.randn(4, 8), torch.randn(4, 8)]
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(list(model(leaf)), grads)
    expected = [p.grad.clone() for p in model.parameters()]
    expected_x = leaf.grad.clone()
    model.zero_grad(set_to_none=True)

    split = SplitBackward(list(model.parameters()))
    leaf = x.clone().requires_grad_(True)
    split.input_half(0, list(model(leaf)), grads, [leaf])
    torch.testing.assert_close(leaf.grad, expected_x)
    # The split would have lost bias's gradient: the whole backward ran in I.
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_a_view_output_is_split_too() -> None:
    model = mlp()
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward([model(leaf)[:, :8]], [g])
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    split = SplitBackward(list(model.parameters()))
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)[:, :8]
    assert out._is_view()
    split.input_half(0, [out], [g], [leaf])
    assert all(p.grad is None for p in model.parameters())
    split.weight_half(0)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)
