"""A stage's backward split in two halves, for zero-bubble schedules.

`BackwardInput` (I) computes only the gradient of the stage's input, the one
the previous stage waits for; `BackwardWeight` (W) computes the weight
gradients later, from the gradients I captured at the autograd nodes where
each weight's path joins the input's. Between them the two halves do the
work of one backward, no more. Both are torch's own
(`torch.distributed.pipelining._backward.stage_backward_input` and
`stage_backward_weight`, a private module of torch 2.13 that torch's own
zero-bubble schedules run on): I keeps the autograd graph alive
(``retain_graph``) for W.

The split does not apply everywhere; then one half runs the whole backward,
so the gradients are the same either way:

* the stage's inputs need no gradient (the first stage, or a stage fed only
  integers): I has nothing to compute and W runs the whole backward, as
  torch's stages do on the first stage;
* some weight reached from the stage's outputs joins no path from its
  inputs (a stage output computed from weights alone): I would not capture
  that weight's gradient, so I runs the whole backward and W nothing.
  Checked once, on the first microbatch: a stage's graph has the same shape
  for every microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
    stage_backward_weight,
)

__all__ = ["SplitBackward"]

log = structlog.get_logger("evtrain.stages.backward")


@dataclass
class _Deferred:
    """What W needs for one microbatch: the roots for a whole backward, or I's groups."""

    roots: list[torch.Tensor]
    grads: list[torch.Tensor] | None
    param_groups: list[dict[str, Any]] | None


class SplitBackward:
    """The two halves of one stage's backward, microbatch by microbatch.

    ``params`` are the stage's trainable parameters. `input_half` leaves the
    input gradients in ``inputs[i].grad``; `weight_half` accumulates the
    weight gradients into ``param.grad``.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self._deferred: dict[int, _Deferred] = {}
        self._splits: bool | None = None

    def input_half(
        self,
        microbatch: int,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        inputs: list[torch.Tensor],
    ) -> None:
        """I: the gradient of ``inputs`` from ``roots`` (with ``grads``; None for a loss)."""
        if not roots or not inputs:
            self._deferred[microbatch] = _Deferred(roots, grads, None)
            return
        if self._splits is None:
            self._splits = self._weights_join_inputs(roots, inputs)
        if not self._splits:
            torch.autograd.backward(roots, grads)
            self._deferred[microbatch] = _Deferred([], None, None)
            return
        # stage_backward_input detaches the roots in place, which a view refuses.
        roots = [r.clone() if r._is_view() else r for r in roots]
        _, groups = stage_backward_input(roots, grads, inputs, iter(self.params))
        self._deferred[microbatch] = _Deferred([], None, groups)

    def weight_half(self, microbatch: int) -> None:
        """W: the weight gradients of ``microbatch``, whose I has run."""
        deferred = self._deferred.pop(microbatch)
        if deferred.param_groups is not None:
            stage_backward_weight(iter(self.params), deferred.param_groups)
        elif deferred.roots:
            torch.autograd.backward(deferred.roots, deferred.grads)

    def _weights_join_inputs(self, roots: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
        nodes = [n for n in map(_get_grad_fn_or_grad_acc, roots) if n is not None]
        reverse = construct_reverse_graph(nodes)
        reached = {
            node
            for node in map(_get_grad_fn_or_grad_acc, self.params)
            if node is not None and node in reverse
        }
        input_nodes = [n for n in map(_get_grad_fn_or_grad_acc, inputs) if n is not None]
        covered: set[Any] = set()
        for group in get_param_groups(input_nodes, list(reached), reverse):
            if group["intermediates"]:
                covered |= group["params"]
        if reached <= covered:
            return True
        log.info(
            "split backward off: some weights join no path from the stage's input",
            weights=len(reached - covered),
        )
        return False
