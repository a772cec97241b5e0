"""A stage's backward split in two halves, for zero-bubble schedules.

`BackwardInput` (I) computes the gradient of the stage's input, the one the
previous stage waits for, and every weight gradient except those of the
stage's ``nn.Linear`` layers; `BackwardWeight` (W) computes those later. That
is the split of zero-bubble pipelines (Qi et al.'s WeightGradStore): a linear
layer's backward is two matrix products, ``dX = dY W`` on the critical path
and ``dW = dYᵀ X`` off it, and in a transformer or an MLP the linear layers
hold nearly all the weights. `SplitBackward` routes every ``nn.Linear`` of the
stage through `_DeferredLinear`, whose backward during I computes ``dX`` and
keeps ``(X, dY)``; W then computes ``dW`` (and the bias's ``dY`` sum) from
them, without autograd. Outside I (evaluation, a whole backward) the layer
computes its gradients as usual.

Why not torch's own split (`torch.distributed.pipelining._backward`, which
captures the gradients at the nodes where weight paths join the input path
and runs one autograd pass per group of weights in W): on a small stage its
I + W cost more than the whole backward — W's autograd passes cost more than
the products they compute, more than zero bubble saves (figures:
docs/benchmarks.md, "Measurements behind design choices").

On a stage whose input needs no gradient (the first stage, or one fed only
integers) I has nothing to send: it does nothing and W runs the whole
backward, as torch's stages do on the first stage. The linear layers of such
a stage (or model chunk) are left as they are: routing them too adds to
their forward and backward time for no gain (figures: docs/benchmarks.md,
"Measurements behind design choices").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SplitBackward"]


@dataclass
class _Store:
    """Where `_DeferredLinear` keeps ``(layer, X, dY)`` while an I runs; None otherwise."""

    active: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] | None = None


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradients wait for W while an I is running."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: nn.Linear,
        store: _Store,
    ) -> torch.Tensor:
        # The weights are inputs so that the output requires a gradient when
        # they do; their gradients are this function's own business (None below).
        ctx.save_for_backward(x)
        ctx.layer, ctx.store = layer, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        (x,) = ctx.saved_tensors
        layer: nn.Linear = ctx.layer
        weight = layer.weight
        dx = (dy @ weight.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        if ctx.store.active is not None:
            ctx.store.active.append((layer, x, dy))
        else:
            _weight_grads(layer, x, dy)
        return dx, None, None, None, None


@torch.no_grad()
def _weight_grads(layer: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Accumulate ``dW = dYᵀ X`` (and the bias's ``dY`` sum) into ``layer``'s grads.

    Without grad: ``X`` is an activation with a history, which a gradient must not keep.
    """
    weight, bias = layer.weight, layer.bias
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if weight.requires_grad:
        grad = weight.grad
        if grad is not None and dy2.dtype == x2.dtype == grad.dtype:
            # Accumulated by the product itself: no temporary to zero, fill and add
            # (a quarter less time for 32 x 512 rows into a 512 x 512 weight on a CPU).
            grad.addmm_(dy2.t(), x2)
        else:
            dw = (dy2.t() @ x2.to(dy.dtype)).to(weight.dtype)
            weight.grad = dw if grad is None else grad.add_(dw)
    if bias is not None and bias.requires_grad:
        db = dy2.sum(0).to(bias.dtype)
        bias.grad = db if bias.grad is None else bias.grad.add_(db)


def _routable(layer: nn.Module) -> TypeGuard[nn.Linear]:
    """Whether ``layer`` computes ``nn.Linear``'s forward: a subclass may compute
    something else, but one that only wraps it (FSDP swaps a layer's class for a
    subclass with hooks around the same forward) does not."""
    return isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward


def _linear_forward(layer: nn.Linear, store: _Store, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (layer.weight.requires_grad or x.requires_grad):
        out: torch.Tensor = _DeferredLinear.apply(x, layer.weight, layer.bias, layer, store)
        return out
    return F.linear(x, layer.weight, layer.bias)


@dataclass
class _Deferred:
    """What W has to do for one microbatch: a whole backward, or the kept linear products."""

    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None
    linear: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class SplitBackward:
    """The two halves of one stage's backward, microbatch by microbatch.

    Construct it before the stage's first forward: it routes every linear
    layer (`_routable`) of the ``deferring`` modules (the parts of ``module``
    whose input takes a gradient: ``module`` itself or some of its model
    chunks) through `_DeferredLinear`. `input_half` leaves the input gradients in
    ``inputs[i].grad`` and every gradient of the parameters that are not
    linear weights; `weight_half` adds the rest.
    """

    def __init__(self, module: nn.Module, deferring: Sequence[nn.Module]) -> None:
        self.module = module
        self._store = _Store()
        self._deferred: dict[int, _Deferred] = {}
        for part in deferring:
            for layer in part.modules():
                if _routable(layer):
                    layer.forward = functools.partial(_linear_forward, layer, self._store)  # type: ignore[method-assign]

    def input_half(
        self,
        microbatch: int,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        inputs: Sequence[torch.Tensor],
    ) -> None:
        """I: the gradient of ``inputs`` from ``roots`` (with ``grads``; None for a loss)."""
        if not roots or not inputs:
            self._deferred[microbatch] = _Deferred(roots, grads)
            return
        kept: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = []
        self._store.active = kept
        try:
            # Every parameter too: those reached other than through a linear layer
            # (a weight tied to an embedding) get their gradient here.
            # The parameters as registered now, not at construction: a wrapper that
            # shards them (FSDP) registers the gathered ones while they are in use.
            params = [p for p in self.module.parameters() if p.requires_grad]
            torch.autograd.backward(roots, grads, inputs=[*inputs, *params])
        finally:
            self._store.active = None
        self._deferred[microbatch] = _Deferred(linear=kept)

    def weight_half(self, microbatch: int) -> None:
        """W: the rest of ``microbatch``'s weight gradients, once its I has run."""
        deferred = self._deferred.pop(microbatch)
        if deferred.roots:
            torch.autograd.backward(deferred.roots, deferred.grads)
        for layer, x, dy in deferred.linear:
            _weight_grads(layer, x, dy)
