"""What crosses a stage boundary: a pytree of tensors, and how a layer receives it.

A layer (or a stage, or a data sample's input part) may return any nesting of
tuples, lists and dicts with string keys whose leaves are tensors; ``None``
inside a container is allowed and carries nothing. Named tuples travel as
plain tuples. Anything else as a leaf — a Python number, a string, an
object — is refused with `evtrain.errors.SpecError` naming the layer, before
training starts.

The calling convention (`call`), the same between the layers of one stage
and across a stage boundary:

* a tuple or list is passed as positional arguments: ``layer(*value)``;
* a dict is passed as keyword arguments: ``layer(**value)``;
* a tensor (or anything else) is passed as the one argument: ``layer(value)``.

So a layer returning ``(hidden, mask)`` is followed by one whose ``forward``
is ``forward(self, hidden, mask)``, wherever the stage boundary falls.

On the wire a boundary value is its leaves, one message each, into buffers
whose `BoundarySpec` both neighbours agreed on once per microbatch shape: the
tree structure travels once as a small JSON document (`encode_specs`), never
pickled and never per microbatch. Floating leaves that required grad on the
sending side get their gradient back; integer and boolean leaves (ids, masks)
travel forward only.

A `StandIn` leaf (a value another stage computes, `evtrain.stages.standins`)
is no leaf on the wire: the tree holds its shape and dtype, and the receiver
rebuilds it, taking no memory.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError

__all__ = [
    "BoundarySpec",
    "StandIn",
    "StandInUsed",
    "TensorSpec",
    "call",
    "decode_specs",
    "encode_specs",
    "flatten",
    "map_tensors",
    "spec_of",
    "split",
    "stand_in",
    "take",
    "unflatten",
]

# dtype names on the wire; a dtype outside this table cannot cross a boundary.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
_NAMES = {d: n for n, d in _DTYPES.items()}

# Reading a value (a branch, a Python number) rather than computing with it.
READS = frozenset(
    {
        torch.Tensor.__bool__,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.numpy,
        torch.is_nonzero,
    }
)
# Results that depend on a tensor's shape, dtype and device only.
SHAPE_ONLY = frozenset(
    {
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_empty,
        torch.Tensor.new_full,
        torch.Tensor.new_tensor,
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.get_device,
    }
)


def writes_into(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The tensor ``func`` writes into, if it works in place; else None."""
    name = getattr(func, "__name__", "")
    if "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
        return kwargs["out"]
    if (
        args
        and isinstance(args[0], torch.Tensor)
        and (name == "__setitem__" or (name.endswith("_") and not name.startswith("__")))
    ):
        return args[0]
    return None


def leaves_of(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nesting of tuples, lists and dicts (`ModelOutput` too)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from leaves_of(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from leaves_of(v)


class StandInUsed(RuntimeError):
    """A stage computed with a value that another stage holds."""


class StandIn(torch.Tensor):
    """Zeros standing in for a value that another stage computes.

    Whatever is computed from a StandIn is a StandIn again, so model-level code
    runs on it (for its shapes) while its value can never silently reach real
    computation: reading it, writing it into a real tensor, or handing it to a
    unit this stage holds raises `StandInUsed`.
    """

    _z: list[Any] | None = None
    """Its wire form (shape, dtype name), set by `stand_in`: read without dispatch."""
    _of: str | None = None
    """What it stands in for, when that has a name (an absent unit's parameter)."""

    def __deepcopy__(self, _memo: Any) -> StandIn:
        # Holds no value that could be written: a copy is the same stand-in.
        return self

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in READS:
            of = next((a._of for a in args if isinstance(a, StandIn) and a._of), None)
            raise StandInUsed(
                "the model's forward reads a value that another stage computes "
                f"({getattr(func, '__name__', func)} of "
                f"{f'{of}, held by another stage' if of else 'a stand-in'})"
            )
        target = writes_into(func, args, kwargs)
        if target is not None and not isinstance(target, StandIn):
            raise StandInUsed(
                "the model's forward writes a value that another stage computes into a "
                "tensor of this stage"
            )
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in SHAPE_ONLY or target is not None:
            return target if target is not None else out
        return _as_stand_ins(out)


def _as_stand_ins(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, StandIn):
        return value.as_subclass(StandIn)
    if isinstance(value, tuple | list):
        return type(value)(_as_stand_ins(v) for v in value)
    return value


def stand_in(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, of: str | None = None
) -> StandIn:
    """A StandIn of ``shape`` and ``dtype`` on ``device``; it takes no memory.
    ``of`` names what it stands in for, in the error a read of its value raises."""
    if of is None:
        return _stand_in(tuple(shape), dtype, device)
    with torch._C.DisableTorchFunctionSubclass():
        value = torch.zeros((), dtype=dtype, device=device).expand(shape).as_subclass(StandIn)
    value._z = _stand_in(tuple(shape), dtype, device)._z
    value._of = of
    return value


@functools.lru_cache(maxsize=4096)
def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StandIn:
    # One object per spec: nothing can write into a StandIn (its elements share
    # one memory location), so every stage's stand-ins of a shape may be it.
    with torch._C.DisableTorchFunctionSubclass():
        value = torch.zeros((), dtype=dtype, device=device).expand(shape).as_subclass(StandIn)
    if dtype in _NAMES:
        value._z = [list(shape), _NAMES[dtype]]  # its wire form, read without dispatch
    return value


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and gradient flag of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    """Whether a gradient flows back for it: a floating leaf that required grad
    where it was produced."""

    @property
    def carries_grad(self) -> bool:
        return self.requires_grad

    def empty(self, device: torch.device) -> torch.Tensor:
        """An uninitialized buffer of this spec."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


# The tree structure: a nested JSON value where each leaf tensor is replaced
# by its index in `BoundarySpec.leaves`.
_Tree = Any


@dataclass(frozen=True)
class BoundarySpec:
    """A boundary value's structure and its leaves' specs, in flattening order."""

    tree: _Tree
    leaves: tuple[TensorSpec, ...]

    def unflatten(self, tensors: Sequence[torch.Tensor], device: torch.device) -> Any:
        """Rebuild the value from its leaves (the inverse of `flatten`), its
        StandIns on ``device``."""
        return _build(self.tree, tensors, device)

    @property
    def carries_grad(self) -> bool:
        return any(leaf.carries_grad for leaf in self.leaves)

    def leaves_of(self, value: Any, where: str) -> list[torch.Tensor]:
        """``value``'s leaves, checked against this spec (`RuntimeError` naming
        ``where`` when the structure, a shape or a dtype differs)."""
        _tree, leaves = flatten(value, where)
        if len(leaves) != len(self.leaves) or any(
            t.shape != s.shape or t.dtype != s.dtype
            for t, s in zip(leaves, self.leaves, strict=False)
        ):
            got = [(tuple(t.shape), t.dtype) for t in leaves]
            want = [(s.shape, s.dtype) for s in self.leaves]
            raise RuntimeError(
                f"{where} has leaves {got}, but {want} were agreed for its input: a stage's "
                "output structure, shapes and dtypes may depend only on the shapes of the "
                "data, not on its values"
            )
        return leaves

    def to_json(self) -> Any:
        return {
            "tree": self.tree,
            "leaves": [[list(s.shape), _NAMES[s.dtype], s.requires_grad] for s in self.leaves],
        }

    @classmethod
    def from_json(cls, doc: Any) -> BoundarySpec:
        leaves = tuple(
            TensorSpec(tuple(int(d) for d in shape), _DTYPES[dtype], bool(grad))
            for shape, dtype, grad in doc["leaves"]
        )
        return cls(doc["tree"], leaves)


def _describe(where: str, value: object) -> str:
    return f"{where} produced a {type(value).__name__}"


def flatten(
    value: Any, where: str = "the layer", *, wire: bool = True
) -> tuple[_Tree, list[torch.Tensor]]:
    """The structure of ``value`` and its tensor leaves, depth first.

    ``where`` names the producer in the `SpecError` for an unsupported leaf.
    On the ``wire`` a `StandIn` is part of the structure, not a leaf.
    """
    leaves: list[torch.Tensor] = []
    tree = _walk(value, "", where, leaves, wire)
    return tree, leaves


def _walk(node: Any, path: str, where: str, leaves: list[torch.Tensor], wire: bool) -> _Tree:
    # A module-level function, not a closure over ``leaves``: a recursive
    # closure is a reference cycle that would keep every leaf (activations,
    # whole batches) alive until the cyclic garbage collector runs.
    if wire and isinstance(node, StandIn):
        z = getattr(node, "_z", None)
        if z is None:  # made by model-level code, not by `stand_in`
            with torch._C.DisableTorchFunctionSubclass():
                if node.dtype not in _NAMES:
                    raise SpecError("layers", f"{where} returned a {node.dtype} tensor at {path}")
                z = [list(node.shape), _NAMES[node.dtype]]
        return {"z": z}
    if isinstance(node, torch.Tensor):
        if node.dtype not in _NAMES:
            raise SpecError(
                "layers",
                f"{where} returned a {node.dtype} tensor at {path or 'the top'}; "
                "it cannot cross a stage boundary",
            )
        leaves.append(node)
        return len(leaves) - 1
    if node is None:
        return None
    if isinstance(node, tuple | list):
        return {
            "t" if isinstance(node, tuple) else "l": [
                _walk(v, f"{path}[{i}]", where, leaves, wire) for i, v in enumerate(node)
            ]
        }
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str):
                raise SpecError("layers", f"{where} returned a dict with a non-string key {key!r}")
        return {"d": {k: _walk(v, f"{path}[{k!r}]", where, leaves, wire) for k, v in node.items()}}
    raise SpecError(
        "layers",
        f"{_describe(where, node)} at {path or 'the top'}; only tensors, or tuples, "
        "lists and dicts of tensors, can cross a stage boundary",
    )


def unflatten(
    tree: _Tree, tensors: Sequence[torch.Tensor], device: torch.device | None = None
) -> Any:
    """Rebuild a value from the structure and leaves `flatten` returned
    (StandIns on ``device``, by default the first leaf's, else the CPU)."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    return _build(tree, tensors, device)


def _build(tree: _Tree, tensors: Sequence[torch.Tensor], device: torch.device) -> Any:
    if tree is None:
        return None
    if isinstance(tree, int):
        return tensors[tree]
    if "t" in tree:
        return tuple(_build(t, tensors, device) for t in tree["t"])
    if "l" in tree:
        return [_build(t, tensors, device) for t in tree["l"]]
    if "z" in tree:
        shape, dtype = tree["z"]
        return stand_in(shape, _DTYPES[dtype], device)
    return {k: _build(t, tensors, device) for k, t in tree["d"].items()}


def spec_of(value: Any, where: str = "the layer") -> BoundarySpec:
    """The `BoundarySpec` of a value (leaves' requires_grad as they are now)."""
    tree, leaves = flatten(value, where)
    return BoundarySpec(
        tree,
        tuple(
            TensorSpec(
                tuple(t.shape),
                t.dtype,
                bool(t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)),
            )
            for t in leaves
        ),
    )


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor leaf, the structure kept."""
    tree, leaves = flatten(value)
    mapped = [fn(t) for t in leaves]
    return unflatten(tree, mapped)


def split(value: Any, size: int) -> list[Any]:
    """``value`` cut along the first dimension of every leaf into pieces of ``size``."""
    tree, leaves = flatten(value)
    parts = [t.split(size) for t in leaves]
    return [unflatten(tree, [p[i] for p in parts]) for i in range(len(parts[0]) if parts else 0)]


def take(value: Any, indices: torch.Tensor, device: torch.device) -> Any:
    """The rows ``indices`` of every leaf of ``value``, on ``device``."""
    return map_tensors(lambda t: t.index_select(0, indices).to(device, non_blocking=True), value)


def call(module: nn.Module | Callable[..., Any], value: Any) -> Any:
    """Apply ``module`` to ``value`` by the calling convention (see the module docstring)."""
    if isinstance(value, tuple | list):
        return module(*value)
    if isinstance(value, dict):
        return module(**value)
    return module(value)


def encode_specs(specs: Sequence[BoundarySpec]) -> torch.Tensor:
    """The specs as one uint8 tensor (UTF-8 JSON), to send once before training."""
    data = json.dumps([s.to_json() for s in specs], separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_specs(data: torch.Tensor) -> list[BoundarySpec]:
    """Inverse of `encode_specs`."""
    doc = json.loads(bytes(data.cpu().tolist()).decode())
    return [BoundarySpec.from_json(d) for d in doc]
