"""`evtrain.report` (defined here): attach values from model or loss code to the step's event.

The module is ``evtrain.reporting``, not ``evtrain.report``: a submodule of
that name would become the package attribute ``evtrain.report`` as soon as
anything imported it, shadowing the function. It imports no torch, so
``evtrain`` can re-export `report` cheaply.

Like pytorch-pfn-extras' ``ppe.reporting.report``: call it anywhere in code
that runs inside a stage worker (a layer's ``forward``, the loss function, a
metric)::

    import evtrain

    def loss_fn(output, target):
        loss = F.cross_entropy(output, target)
        evtrain.report({"ce": loss, "logit_max": output.max()})
        return loss

Values reported during one training step are averaged over the calls within
that step and published in that stage's ``StepEnded.metrics``; values
reported during evaluation end up in the last stage's ``EvalEnded.metrics``
(the other stages' evaluation reports are dropped). Outside a run `report`
does nothing, so the same model code works in a plain script.

Tensors are kept detached on their device and turned into floats once, at the
end of the step, so reporting does not force a device synchronization per
call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Reporter", "current_reporter", "report", "reporting"]


class Reporter:
    """Accumulates reported values: per name, the sum and the number of calls."""

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, values: Mapping[str, float | int | torch.Tensor]) -> None:
        """Add one observation per name."""
        with self._lock:
            for name, value in values.items():
                if not isinstance(value, float | int):  # a tensor; no isinstance: keeps torch out
                    if value.numel() != 1:
                        raise ValueError(
                            f"evtrain.report: {name!r} must be a scalar, got shape "
                            f"{tuple(value.shape)}"
                        )
                    value = value.detach().reshape(()).double()
                else:
                    value = float(value)
                previous = self._sums.get(name)
                self._sums[name] = value if previous is None else previous + value
                self._counts[name] = self._counts.get(name, 0) + 1

    def collect(self) -> dict[str, float]:
        """The mean of every name since the last `collect`, then start afresh."""
        sums, counts = self.take()
        return {name: total / counts[name] for name, total in sums.items()}

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The sum and the number of calls of every name since the last `collect`, then
        start afresh."""
        with self._lock:
            sums, counts = self._sums, self._counts
            self._sums, self._counts = {}, {}
        return {name: float(total) for name, total in sums.items()}, counts

    def clear(self) -> None:
        """Forget everything reported so far."""
        with self._lock:
            self._sums, self._counts = {}, {}


# Process-wide, not thread-local: a stage runs its step in a worker thread.
_current: Reporter | None = None


def current_reporter() -> Reporter | None:
    """The reporter receiving `report` calls in this process, if any."""
    return _current


@contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Route `report` calls in this process to ``reporter`` inside the block."""
    global _current
    previous, _current = _current, reporter
    try:
        yield reporter
    finally:
        _current = previous


def report(values: Mapping[str, float | int | torch.Tensor]) -> None:
    """Report scalar values for the current step (a no-op outside a run)."""
    reporter = _current
    if reporter is not None:
        reporter.add(values)
