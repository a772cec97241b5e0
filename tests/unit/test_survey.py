"""The model survey on meta: parameters, FLOP-based training costs, boundary checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from evtrain.errors import SpecError
from evtrain.stages.survey import (
    ELEMENT_FLOPS,
    SurveyUnavailable,
    imbalance,
    survey,
)

BATCH = 16


class Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.skip(x))


def resnet_units() -> list[tuple[str, nn.Module]]:
    with torch.device("meta"):
        layers: list[nn.Module] = [
            nn.Conv2d(3, 32, 3, 1, 1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            Residual(32, 32, 1),
            Residual(32, 64, 2),
            Residual(64, 64, 1),
            Residual(64, 128, 2),
            nn.Flatten(),
            # Many parameters, little compute: 8192 x 1000 weights used once per sample.
            nn.Linear(128 * 8 * 8, 1000),
        ]
    return [(f"layer {i} ({type(m).__name__})", m) for i, m in enumerate(layers)]


def best_two_stage_split(weights: list[int]) -> list[int]:
    cut = min(range(1, len(weights)), key=lambda c: max(sum(weights[:c]), sum(weights[c:])))
    return [cut, len(weights) - cut]


def image() -> torch.Tensor:
    return torch.randn(BATCH, 3, 32, 32)


def test_resnet_costs_follow_compute_not_parameters() -> None:
    units = resnet_units()
    result = survey(units, image())
    assert [u.name for u in result.units] == [name for name, _ in units]
    assert result.params == [sum(p.numel() for p in m.parameters()) for _, m in units]
    stem, head = result.units[0], result.units[-1]
    # Stem: 2 FLOPs per multiply-add; its input is data, so its backward is the
    # weight gradient alone, one forward's worth.
    assert stem.forward_flops == 2 * BATCH * 32 * 32 * 32 * 3 * 3 * 3
    assert stem.backward_flops == stem.forward_flops
    # Head: input and weight gradients, twice its forward.
    assert head.forward_flops == 2 * BATCH * 8192 * 1000
    assert head.backward_flops == 2 * head.forward_flops
    assert head.output.leaves[0].shape == (BATCH, 1000)
    assert head.output.leaves[0].requires_grad

    param_share = head.params / sum(result.params)
    cost_share = head.cost / sum(result.costs)
    assert param_share > 0.9
    assert cost_share < 0.2
    # By parameters the head gets a stage without a residual block; by compute
    # it shares a stage with some.
    by_params = best_two_stage_split(result.params)
    by_cost = best_two_stage_split(result.costs)
    assert by_params[0] >= 7
    assert by_cost[0] <= 6
    assert imbalance(result.costs, by_params) > 1.5
    assert imbalance(result.costs, by_cost) < 1.2


def test_parameter_free_units_cost_their_elements() -> None:
    with torch.device("meta"):
        units = [("linear", nn.Linear(64, 64)), ("relu", nn.ReLU()), ("bn", nn.BatchNorm1d(64))]
    small = survey(units, torch.randn(8, 64))
    large = survey(units, torch.randn(16, 64))
    for s, big in zip(small.units[1:], large.units[1:], strict=True):
        assert s.forward_flops == s.backward_flops == 0
        assert s.cost >= ELEMENT_FLOPS * 8 * 64 * 2  # written forward and backward
        # Per-channel statistics and gradients aside, in proportion to the batch.
        assert big.cost == pytest.approx(2 * s.cost, rel=0.15)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def test_backward_flops_follow_what_autograd_computes() -> None:
    with torch.device("meta"):
        first, plain, frozen, recomputed = (
            nn.Linear(32, 32),
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
            nn.Linear(32, 32).requires_grad_(False),
            Checkpointed(),
        )
    result = survey(
        [("first", first), ("plain", plain), ("frozen", frozen), ("recomputed", recomputed)],
        torch.randn(8, 32),
    )
    flops = {u.name: (u.forward_flops, u.backward_flops) for u in result.units}
    forward = 2 * 8 * 32 * 32
    assert flops["first"] == (forward, forward)  # weight gradient only: the input is data
    assert flops["plain"] == (4 * forward, 8 * forward)  # input and weight gradients
    assert flops["frozen"] == (forward, forward)  # input gradient only
    # Charged for the recomputation: as much of the forward again as the
    # backward needs (torch stops recomputing once it has what is saved).
    assert flops["recomputed"][0] == 4 * forward
    assert 8 * forward < flops["recomputed"][1] <= 12 * forward


def test_units_run_in_training_mode_and_keep_their_own() -> None:
    with torch.device("meta"):
        linear, dropout = nn.Linear(16, 16), nn.Dropout(0.5)
    dropout.eval()  # as a dropout in eval mode, it would be an identity writing nothing
    result = survey([("linear", linear), ("dropout", dropout)], torch.randn(4, 16))
    assert result.units[1].elements > 0
    assert not dropout.training and linear.training
    assert all(p.grad is None for p in linear.parameters())


def test_shared_parameter_counted_once() -> None:
    with torch.device("meta"):
        embed, norm, head = nn.Embedding(100, 32), nn.LayerNorm(32), nn.Linear(32, 100, bias=False)
    head.weight = embed.weight
    result = survey(
        [("embed", embed), ("norm", norm), ("head", head)], torch.randint(0, 100, (2, 5))
    )
    assert result.params == [3200, 64, 0]
    assert result.units[2].forward_flops == 2 * 2 * 5 * 32 * 100


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(x), x[..., 0] > 0


class Keyed(nn.Module):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": hidden * mask[..., None], "mask": mask}


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).masked_fill(~mask[..., None], 0.0)


def test_tuple_and_dict_outputs_reach_the_next_unit_by_the_calling_convention() -> None:
    with torch.device("meta"):
        units = [("with mask", WithMask()), ("keyed", Keyed()), ("masked", Masked())]
    result = survey(units, torch.randn(4, 6, 8))
    first, keyed, last = (u.output for u in result.units)
    assert [(s.shape, s.dtype, s.requires_grad) for s in first.leaves] == [
        ((4, 6, 8), torch.float32, True),
        ((4, 6), torch.bool, False),
    ]
    assert set(keyed.tree["d"]) == {"hidden", "mask"}
    assert last.leaves[0].shape == (4, 6, 3)
    assert result.units[2].forward_flops == 2 * 4 * 6 * 8 * 3


class ReturnsNumber(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x, 3


class ReturnsObject(nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return object()


@pytest.mark.parametrize(("bad", "kind"), [(ReturnsNumber(), "int"), (ReturnsObject(), "object")])
def test_unit_returning_a_non_tensor_is_a_spec_error_naming_it(bad: nn.Module, kind: str) -> None:
    with torch.device("meta"):
        units = [("layer 0 (Linear)", nn.Linear(4, 4)), ("layer 1 (Bad)", bad)]
    with pytest.raises(SpecError) as err:
        survey(units, torch.randn(2, 4))
    assert err.value.field == "layers"
    assert "layer 1 (Bad)" in str(err.value)
    assert kind in str(err.value)
    assert "\n" not in str(err.value)


def test_forward_that_cannot_take_the_previous_output_is_a_spec_error() -> None:
    with torch.device("meta"):
        units = [("layer 0 (WithMask)", WithMask()), ("layer 1 (Linear)", nn.Linear(8, 8))]
    with pytest.raises(SpecError, match=r"layer 1 \(Linear\) cannot take what layer 0"):
        survey(units, torch.randn(2, 8))


def test_example_with_a_non_tensor_leaf_is_a_spec_error() -> None:
    with torch.device("meta"):
        units = [("layer 0", nn.Linear(4, 4))]
    with pytest.raises(SpecError, match="example input"):
        survey(units, (torch.randn(2, 4), "text"))


class ReadsAScalar(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.abs().max().item()


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


@pytest.mark.parametrize("unit", [ReadsAScalar(), DataDependent()])
def test_unit_that_cannot_run_on_meta_is_unavailable_not_a_spec_error(unit: nn.Module) -> None:
    with torch.device("meta"):
        units = [("layer 0", nn.Linear(4, 4)), ("layer 1 (Odd)", unit)]
    with pytest.raises(SurveyUnavailable) as err:
        survey(units, torch.randn(2, 4))
    assert not isinstance(err.value, SpecError)
    assert err.value.unit == "layer 1 (Odd)"
    assert "\n" not in str(err.value)


def test_unit_built_on_a_real_device_is_unavailable() -> None:
    with pytest.raises(SurveyUnavailable, match="cpu"):
        survey([("layer 0", nn.Linear(4, 4))], torch.randn(2, 4))


def test_imbalance_of_known_splits() -> None:
    costs = [1.0, 1.0, 1.0, 3.0]
    assert imbalance(costs, [3, 1]) == 1.0
    assert imbalance(costs, [2, 2]) == pytest.approx(4 / 3)
    assert imbalance(costs, [1, 1, 2]) == pytest.approx(4 / 2)
    assert imbalance([0.0, 0.0], [1, 1]) == 1.0
    with pytest.raises(ValueError):
        imbalance(costs, [2, 1])
    with pytest.raises(ValueError):
        imbalance(costs, [4, 0])
