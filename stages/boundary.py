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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evtrain.errors import SpecError

__all__ = [
    "BoundarySpec",
    "TensorSpec",
    "call",
    "decode_specs",
    "encode_specs",
    "flatten",
    "map_tensors",
    "spec_of",
    "split",
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

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Rebuild the value from its leaves (the inverse of `flatten`)."""
        return _build(self.tree, tensors)

    @property
    def carries_grad(self) -> bool:
        return any(leaf.carries_grad for leaf in self.leaves)

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


def flatten(value: Any, where: str = "the layer") -> tuple[_Tree, list[torch.Tensor]]:
    """The structure of ``value`` and its tensor leaves, depth first.

    ``where`` names the producer in the `SpecError` for an unsupported leaf.
    """
    leaves: list[torch.Tensor] = []
    tree = _walk(value, "", where, leaves)
    return tree, leaves


def _walk(node: Any, path: str, where: str, leaves: list[torch.Tensor]) -> _Tree:
    # A module-level function, not a closure over ``leaves``: a recursive
    # closure is a reference cycle that would keep every leaf (activations,
    # whole batches) alive until the cyclic garbage collector runs.
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
                _walk(v, f"{path}[{i}]", where, leaves) for i, v in enumerate(node)
            ]
        }
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str):
                raise SpecError("layers", f"{where} returned a dict with a non-string key {key!r}")
        return {"d": {k: _walk(v, f"{path}[{k!r}]", where, leaves) for k, v in node.items()}}
    raise SpecError(
        "layers",
        f"{_describe(where, node)} at {path or 'the top'}; only tensors, or tuples, "
        "lists and dicts of tensors, can cross a stage boundary",
    )


def unflatten(tree: _Tree, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild a value from the structure and leaves `flatten` returned."""
    return _build(tree, tensors)


def _build(tree: _Tree, tensors: Sequence[torch.Tensor]) -> Any:
    if tree is None:
        return None
    if isinstance(tree, int):
        return tensors[tree]
    if "t" in tree:
        return tuple(_build(t, tensors) for t in tree["t"])
    if "l" in tree:
        return [_build(t, tensors) for t in tree["l"]]
    return {k: _build(t, tensors) for k, t in tree["d"].items()}


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
    return _build(tree, [fn(t) for t in leaves])


def split(value: Any, size: int) -> list[Any]:
    """``value`` cut along the first dimension of every leaf into pieces of ``size``."""
    tree, leaves = flatten(value)
    parts = [t.split(size) for t in leaves]
    return [_build(tree, [p[i] for p in parts]) for i in range(len(parts[0]) if parts else 0)]


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
