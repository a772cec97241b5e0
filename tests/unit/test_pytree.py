"""Pytree stage boundaries: specs, the wire format, the calling convention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evtrain.errors import SpecError
from evtrain.stages.pytree import (
    BoundarySpec,
    TensorSpec,
    call,
    decode_specs,
    encode_specs,
    flatten,
    spec_of,
    split,
)


def test_specs_round_trip_through_the_wire_format() -> None:
    value = (
        torch.zeros(4, 7, requires_grad=True) * 2,
        {"mask": torch.ones(4, 7, dtype=torch.bool), "none": None},
        [torch.zeros((), dtype=torch.float64), torch.zeros(4, dtype=torch.bfloat16)],
    )
    spec = spec_of(value)
    assert [leaf.carries_grad for leaf in spec.leaves] == [True, False, False, False]
    assert spec.leaves[1] == TensorSpec((4, 7), torch.bool)
    (back,) = decode_specs(encode_specs([spec]))
    assert back == spec
    _tree, leaves = flatten(value)
    rebuilt = back.unflatten(leaves, torch.device("cpu"))
    assert isinstance(rebuilt, tuple) and isinstance(rebuilt[2], list)
    assert rebuilt[1]["none"] is None and rebuilt[1]["mask"] is leaves[1]


def test_unsupported_leaves_name_the_producer() -> None:
    with pytest.raises(SpecError, match=r"layer 3 \(Foo\) produced a int at \[1\]"):
        spec_of((torch.zeros(1), 3), "layer 3 (Foo)")
    with pytest.raises(SpecError, match="non-string key"):
        spec_of({1: torch.zeros(1)}, "layer 0")


def test_calling_convention() -> None:
    class Two(nn.Module):
        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return h * mask

    h, m = torch.ones(2), torch.tensor([0.0, 1.0])
    assert torch.equal(call(Two(), (h, m)), m)
    assert torch.equal(call(Two(), {"h": h, "mask": m}), m)
    assert torch.equal(call(nn.Identity(), h), h)


def test_split_cuts_every_leaf() -> None:
    value = {"ids": torch.arange(8), "mask": torch.ones(8, 3)}
    parts = split(value, 4)
    assert len(parts) == 2 and torch.equal(parts[1]["ids"], torch.arange(4, 8))
    assert parts[0]["mask"].shape == (4, 3)


def test_pytree_spec_knows_when_gradients_flow() -> None:
    ints = BoundarySpec(0, (TensorSpec((2,), torch.int64),))
    assert not ints.carries_grad


def test_flattening_keeps_no_reference_to_the_leaves() -> None:
    import gc
    import weakref

    gc.disable()  # only reference counting may free it
    try:
        t = torch.zeros(1000)
        ref = weakref.ref(t)
        parts = split({"x": t, "y": (t, None)}, 250)
        del t, parts
        assert ref() is None
    finally:
        gc.enable()
