"""A model's pipeline units surveyed on the meta device: parameters, compute, boundary specs.

`survey` runs the units in pipeline order on meta tensors — shapes and dtypes
only, nothing allocated, so a model of any size costs milliseconds per unit —
passing each output to the next unit by the stage boundary's calling
convention (`evtrain.stages.pytree.call`). Per unit it records

* the parameter count (a Parameter shared by several units counted once, at
  the first unit that holds it);
* the FLOPs of its forward and of its backward, counted by torch's
  ``FlopCounterMode`` over one real forward and backward pass on meta;
* the elements its ops write in both passes, the work that FLOP counts miss;
* the training cost derived from those (`training_cost`);
* the `BoundarySpec` of its output, which validates it: a unit returning a
  Python number or an object raises `SpecError` naming the unit, before any
  process starts — as does a unit whose ``forward`` cannot take what the
  previous unit returns.

A unit that cannot run on meta (an op without a meta kernel, a shape that
depends on data, ``.item()``, parameters built on a real device) raises
`SurveyUnavailable`; the caller then balances by parameter counts.

The first survey in a process costs about a second more than later ones:
torch's meta kernels import sympy and torch._dynamo on first use. Importing
this module loads nothing beyond torch (``FlopCounterMode`` is imported
inside `survey`), so only a launch that surveys pays that second.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from evtrain.errors import SpecError
from evtrain.stages.pytree import BoundarySpec, call, flatten, spec_of

__all__ = [
    "ELEMENT_FLOPS",
    "Survey",
    "SurveyUnavailable",
    "UnitSurvey",
    "imbalance",
    "survey",
    "training_cost",
]

ELEMENT_FLOPS = 100
"""FLOP-equivalents charged per tensor element an op writes (see `training_cost`)."""


class SurveyUnavailable(Exception):
    """A unit could not run on the meta device, so no compute estimate exists.

    Not necessarily a mistake in the model: a unit that reads a value
    (``.item()``) or makes a data-dependent shape trains fine on real tensors.
    The caller falls back to balancing by parameter count; a real bug (a
    shape mismatch) fails here too, and again, with its traceback, when the
    stage first runs.
    """

    def __init__(self, unit: str, reason: str) -> None:
        self.unit = unit
        self.reason = reason
        super().__init__(f"{unit} cannot be surveyed on the meta device: {reason}")


@dataclass(frozen=True)
class UnitSurvey:
    """What the survey found for one pipeline unit."""

    name: str
    params: int
    forward_flops: int
    backward_flops: int
    elements: int
    """Tensor elements written by the unit's ops, forward and backward."""
    cost: int
    """Estimated training compute of one microbatch, in FLOP-equivalents."""
    output: BoundarySpec


@dataclass(frozen=True)
class Survey:
    """The surveyed units, in pipeline order."""

    units: tuple[UnitSurvey, ...]

    @property
    def costs(self) -> list[int]:
        return [u.cost for u in self.units]

    @property
    def params(self) -> list[int]:
        return [u.params for u in self.units]


def training_cost(forward_flops: int, backward_flops: int, elements: int) -> int:
    """Training compute of one unit for one microbatch, in FLOP-equivalents.

    ``forward_flops + backward_flops + ELEMENT_FLOPS * elements``.

    The backward is counted, not assumed 2x the forward (the usual "training
    = 3x forward" rule): the survey runs it on meta, so the estimate follows
    what autograd really does. The first unit computes no input gradient
    (its input is data) and a frozen unit no weight gradient, so their
    backward is 1x their forward or less; a unit that recomputes its forward
    in the backward (activation checkpointing) is charged for what it
    recomputes.

    FLOP counts cover matmuls, convolutions and attention: a ReLU, a dropout or a
    BatchNorm counts ~0, yet each takes time in proportion to the elements it
    writes (memory-bound work), and without that term a split would pile
    parameter-free units onto one stage. The same term charges a large
    layer's weight gradient, which at a small microbatch writes many more
    elements than it does FLOPs per element. ``ELEMENT_FLOPS`` weighs one element
    written as that many FLOPs: the ratio of matmul to elementwise throughput
    of one CPU core, fitted on a ResNet's layers' forward and backward times
    (~100 GFLOP/s for the convolutions, ~1 G elements/s for the rest). On an
    accelerator that ratio is higher, so there the term is a floor: it
    underweights memory-bound units rather than overweighting them.
    """
    return forward_flops + backward_flops + ELEMENT_FLOPS * elements


class _ElementCounter(TorchDispatchMode):
    """Adds up the elements of every op's outputs; views write nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _received(leaves: Sequence[torch.Tensor], spec: BoundarySpec) -> Any:
    """A boundary value as the next unit receives it: meta leaves detached from the
    producer's graph, each requiring grad as its spec says."""
    return spec.unflatten(
        [
            t.detach().to("meta").requires_grad_(s.requires_grad)
            for t, s in zip(leaves, spec.leaves, strict=True)
        ],
        torch.device("meta"),
    )


def _check_on_meta(name: str, unit: nn.Module) -> None:
    for tensor in (*unit.parameters(), *unit.buffers()):
        if tensor.device.type != "meta":
            raise SurveyUnavailable(name, f"it holds tensors on {tensor.device}, not on meta")


def _check_accepts(name: str, unit: nn.Module, value: Any, source: str) -> None:
    """Refuse a unit whose ``forward`` cannot bind what the calling convention passes."""
    try:
        signature = inspect.signature(unit.forward)
    except (TypeError, ValueError):
        return  # no introspectable signature: the call itself will tell
    try:
        if isinstance(value, tuple | list):
            signature.bind(*value)
        elif isinstance(value, dict):
            signature.bind(**value)
        else:
            signature.bind(value)
    except TypeError as exc:
        raise SpecError(
            "layers", f"{name} cannot take what {source} returns ({_shape(value)}): {exc}"
        ) from None


def _shape(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    return f"a {type(value).__name__}"


def _unique_params(unit: nn.Module, seen: set[int]) -> int:
    count = 0
    for p in unit.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            count += p.numel()
    return count


def survey(units: Sequence[tuple[str, nn.Module]], example: Any) -> Survey:
    """Survey ``units`` (built on meta, in pipeline order, with display names).

    ``example`` is the first unit's input for one microbatch, a pytree of
    tensors on any device (converted to meta). Each unit runs in training
    mode (BatchNorm uses batch statistics, dropout is active) and is left in
    the mode it had; the parameter gradients computed on meta are dropped.

    Raises `SpecError` naming the unit whose output cannot cross a stage
    boundary or whose ``forward`` cannot take the previous output, and
    `SurveyUnavailable` naming the unit that cannot run on meta.
    """
    from torch.utils.flop_counter import FlopCounterMode

    source = "the example input"
    spec = spec_of(example, where=source)
    value = _received(flatten(example, where=source)[1], spec)
    seen: set[int] = set()
    found = []
    for name, unit in units:
        _check_on_meta(name, unit)
        _check_accepts(name, unit, value, source)
        modes = [(m, m.training) for m in unit.modules()]
        unit.train()
        forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
        written = _ElementCounter()
        try:
            # Tensors a forward makes itself (a causal mask) are made on meta too.
            with torch.device("meta"), forward, written:
                out = call(unit, value)
            spec = spec_of(out, where=name)
            _, leaves = flatten(out, where=name)
            roots = [t for t in leaves if t.requires_grad]
            # The gradients a unit receives come from its successor: made outside the count.
            grads = [torch.ones_like(t) for t in roots]
            if roots:
                with torch.device("meta"), backward, written:
                    torch.autograd.backward(roots, grads)
        except SpecError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise SurveyUnavailable(name, reason) from exc
        finally:
            for m, training in modes:
                m.training = training
            for p in unit.parameters():
                p.grad = None
        found.append(
            UnitSurvey(
                name=name,
                params=_unique_params(unit, seen),
                forward_flops=forward.get_total_flops(),
                backward_flops=backward.get_total_flops(),
                elements=written.elements,
                cost=training_cost(
                    forward.get_total_flops(), backward.get_total_flops(), written.elements
                ),
                output=spec,
            )
        )
        value, source = _received(leaves, spec), name
    return Survey(tuple(found))


def imbalance(costs: Sequence[float], sizes: Sequence[int]) -> float:
    """Largest stage cost over the mean stage cost of the contiguous split ``sizes``.

    1.0 is a perfect balance; at P stages the pipeline's step time grows with
    the largest stage, so ``imbalance`` is the slowdown against a perfect split.
    """
    if sum(sizes) != len(costs) or any(s < 1 for s in sizes):
        raise ValueError(f"split {list(sizes)} does not cover {len(costs)} units")
    totals, start = [], 0
    for size in sizes:
        totals.append(sum(costs[start : start + size]))
        start += size
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0
