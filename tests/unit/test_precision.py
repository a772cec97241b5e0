"""Precision and memory building blocks: autocast, the loss scaler, checkpointing, compiling."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from evtrain.stages.precision import (
    PRECISIONS,
    LossScaler,
    autocast,
    checkpoint_layer,
    compile_module,
)

CPU = torch.device("cpu")


# autocast


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_autocast_runs_a_linear_layer_in_the_precision(precision: str, dtype: torch.dtype) -> None:
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with autocast(precision, CPU):
        y = layer(x)
        loss = nn.functional.cross_entropy(y, torch.tensor([0, 1, 2]))
    assert y.dtype == dtype
    assert loss.dtype == torch.float32
    loss.backward()
    assert layer.weight.grad is not None
    assert layer.weight.grad.dtype == torch.float32


def test_fp32_leaves_autocast_off() -> None:
    with autocast("fp32", CPU):
        assert not torch.is_autocast_enabled("cpu")
    assert PRECISIONS == ("fp32", "bf16", "fp16")


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        autocast("fp8", CPU)


# LossScaler


def test_scale_grows_after_growth_interval_clean_steps() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    assert [scaler.update(found_inf=False) for _ in range(2)] == [False, False]
    assert (scaler.scale, scaler.growth_tracker) == (8.0, 2)
    assert scaler.update(found_inf=False) is False
    assert (scaler.scale, scaler.growth_tracker) == (16.0, 0)
    assert scaler.skipped == 0


def test_inf_skips_backs_off_and_resets_the_growth_tracker() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.update(found_inf=True) is True
    assert (scaler.scale, scaler.growth_tracker, scaler.skipped) == (4.0, 0, 1)
    # The two clean steps before the skip no longer count towards growth.
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0


def test_defaults_are_grad_scalers() -> None:
    ours = LossScaler().state_dict()
    theirs = torch.amp.GradScaler("cpu").state_dict()
    assert {k: ours[k] for k in theirs} == theirs


def _grad_scaler_steps(
    scaler: torch.amp.GradScaler, found_infs: list[bool]
) -> Iterator[dict[str, Any]]:
    """GradScaler's state after each step whose one gradient is inf or finite."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler.scale(torch.ones(()))
    for found_inf in found_infs:
        param.grad = torch.full((2,), math.inf if found_inf else 1.0)
        scaler.step(optimizer)
        scaler.update()
        yield scaler.state_dict()


@pytest.mark.parametrize(
    "policy",
    [
        {"init_scale": 1000.0, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3},
        # Growth would overflow float32: the scale stays put, as GradScaler's does.
        {"init_scale": 2.0**126, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 2},
    ],
)
def test_updates_match_grad_scaler_step_for_step(policy: dict[str, Any]) -> None:
    rng = random.Random(7)
    found_infs = [rng.random() < 0.2 for _ in range(60)]
    ours = LossScaler(**policy)
    theirs = torch.amp.GradScaler("cpu", **policy)
    for found_inf, expected in zip(found_infs, _grad_scaler_steps(theirs, found_infs), strict=True):
        assert ours.update(found_inf) is found_inf
        state = ours.state_dict()
        assert {k: state[k] for k in expected} == expected
    assert ours.skipped == sum(found_infs)


def test_unscale_matches_grad_scaler_and_keeps_non_finite_values() -> None:
    grads = [torch.randn(5) * 3e4, torch.tensor([1.0, math.inf, math.nan])]
    param = nn.Parameter(torch.zeros(8))
    param.grad = torch.cat(grads)
    reference = torch.amp.GradScaler("cpu", init_scale=3.0)
    reference.scale(torch.ones(()))
    reference.unscale_(torch.optim.SGD([param], lr=0.0))

    scaler = LossScaler(init_scale=3.0)
    scaler.unscale_(grads)
    torch.testing.assert_close(torch.cat(grads), param.grad, rtol=0, atol=0, equal_nan=True)
    scaler.unscale_([])


def test_state_dict_round_trip_continues_the_same_scale_and_tracker() -> None:
    first = LossScaler(init_scale=64.0, growth_interval=4)
    for found_inf in [False, True, False, False, False]:
        first.update(found_inf)
    resumed = LossScaler()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    for found_inf in [False, False, True, False]:
        assert resumed.update(found_inf) == first.update(found_inf)
        assert resumed.state_dict() == first.state_dict()
    assert (resumed.scale, resumed.skipped) == (32.0, 2)


def test_state_dicts_load_across_grad_scaler_and_loss_scaler() -> None:
    ours = LossScaler(init_scale=128.0, growth_interval=5)
    for found_inf in [False, True, False]:
        ours.update(found_inf)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.scale
    back = LossScaler()
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == {**ours.state_dict(), "skipped": 0}


@pytest.mark.parametrize(
    "policy",
    [
        {"init_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"backoff_factor": 0.0},
        {"growth_interval": 0},
    ],
)
def test_bad_policy_is_refused(policy: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LossScaler(**policy)


# checkpoint_layer


class Block(nn.Module):
    """Takes keyword tensors, returns a dict: the shapes a stage boundary carries."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.5)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.dropout(nn.functional.gelu(self.linear(hidden)))
        return {"hidden": out.masked_fill(~mask, 0.0) + hidden, "mask": mask}


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(width, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        value = {"hidden": self.embed(ids), "mask": ids[..., None] % 3 != 0}
        for block in self.blocks:
            value = block(**value)
        return self.head(value["hidden"])


def _layers(net: Net) -> list[nn.Module]:
    return [net.embed, *net.blocks, net.head]


def _train_step(net: nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(24).reshape(4, 6) % 10
    torch.manual_seed(seed)
    out = net(ids)
    out.square().mean().backward()
    grads = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(count)
    return calls


def _assert_bitwise_equal(
    a: tuple[torch.Tensor, dict[str, torch.Tensor]], b: tuple[torch.Tensor, dict[str, torch.Tensor]]
) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_checkpointed_layers_give_bitwise_equal_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    plain = Net()
    checkpointed = copy.deepcopy(plain)
    for layer in _layers(checkpointed):
        checkpoint_layer(layer)
    recomputed = _count_calls(checkpointed.blocks[0].linear)

    _assert_bitwise_equal(_train_step(plain), _train_step(checkpointed))
    assert recomputed == [2], "the checkpointed block's forward ran again during backward"
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in checkpointed.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]


def test_checkpoint_layer_is_idempotent() -> None:
    layer = Block(8)
    checkpoint_layer(layer)
    forward = layer.forward
    checkpoint_layer(layer)
    assert layer.forward is forward
    calls = _count_calls(layer.linear)
    out = layer(torch.randn(2, 8, requires_grad=True), torch.ones(2, 8, dtype=torch.bool))
    out["hidden"].sum().backward()
    assert calls == [2]


def test_checkpointed_layer_runs_once_without_grad() -> None:
    layer = Block(8)
    checkpoint_layer(layer)
    calls = _count_calls(layer.linear)
    with torch.no_grad():
        out = layer(torch.randn(2, 8), mask=torch.ones(2, 8, dtype=torch.bool))
    assert calls == [1]
    assert out["hidden"].grad_fn is None


def test_a_copy_of_a_checkpointed_layer_uses_its_own_parameters() -> None:
    layer = nn.Linear(4, 3)
    checkpoint_layer(layer)
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.weight.add_(1.0)
    x = torch.randn(2, 4)
    assert torch.equal(clone(x), nn.functional.linear(x, clone.weight, clone.bias))
    assert not torch.equal(clone(x), layer(x))


# compile_module


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_backend(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    return backend


def test_compile_module_false_returns_the_module_as_it_is() -> None:
    module = nn.Linear(3, 3)
    assert compile_module(module, False) is module


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_module_with_the_eager_backend_keeps_outputs_and_keys() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    compiled = compile_module(copy.deepcopy(plain), {"backend": "eager"})
    assert list(compiled.state_dict()) == list(plain.state_dict())
    x = torch.randn(5, 6)
    assert torch.equal(compiled(x), plain(x))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_module_passes_its_options_and_compiles_a_builtin_module_whole() -> None:
    graphs: list[torch.fx.GraphModule] = []
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert compile_module(module, {"backend": _recording_backend(graphs)}) is module
    module(torch.randn(2, 4))
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(ops) == 3, "both linears and the relu in one graph"
    assert list(module.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_compile_module_refuses_an_unknown_option() -> None:
    with pytest.raises(TypeError, match="bakend"):
        compile_module(nn.Linear(2, 2), {"bakend": "eager"})


def test_eager_backend_with_checkpointed_layers_is_refused() -> None:
    net = Net()
    checkpoint_layer(net.blocks[1])
    with pytest.raises(ValueError, match="aot_eager"):
        compile_module(net, {"backend": "eager"})


@pytest.mark.usefixtures("fresh_dynamo")
def test_checkpointed_then_compiled_layers_match_the_plain_model_bitwise() -> None:
    torch.manual_seed(0)
    plain = Net()
    both = copy.deepcopy(plain)
    for layer in _layers(both):
        checkpoint_layer(layer)
    compile_module(both, {"backend": "aot_eager"})
    _assert_bitwise_equal(_train_step(plain), _train_step(both))
    assert list(both.state_dict()) == list(plain.state_dict())
