"""A custom hook: stop the run when the training loss spikes.

A hook is an event subscriber running in its own process. This one listens
to `StepEnded` events (the last stage puts the batch loss in them) and keeps
the mean of the last ``window`` losses. Once ``warmup`` losses were seen, a
loss above ``factor`` times that running mean — or a NaN / infinite loss —
makes it send the stop command; every stage ends the run at the same step
boundary and the reason appears in the `RunEnded` event.

Attach it to a live run (from the repository root, so ``examples`` imports;
the bus address is printed by the launcher)::

    evtrain launch examples/mlp.py
    evtrain hook examples.loss_spike_guard:LossSpikeGuard --bus ADDR -o factor=3 -o window=20

or declare it in a job spec so the launcher starts and supervises it::

    hooks=[dict(type="examples.loss_spike_guard:LossSpikeGuard", factor=3.0, warmup=10)]

The detection itself (`SpikeDetector`) is plain Python, so it is easy to
test without a bus.
"""

from __future__ import annotations

import math
from collections import deque

from evtrain.events import StepEnded
from evtrain.hooks import Hook, on

__all__ = ["LossSpikeGuard", "SpikeDetector"]


class SpikeDetector:
    """Flags a loss above ``factor`` x the mean of the previous ``window`` normal losses.

    The first ``warmup`` losses are never flagged (the loss falls fast at the
    start). Flagged losses stay out of the mean, so one spike does not hide
    the next. A NaN or infinite loss is always flagged.
    """

    def __init__(self, factor: float = 3.0, window: int = 20, warmup: int = 10) -> None:
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup!r}")
        self.factor = float(factor)
        self.warmup = int(warmup)
        self.seen = 0
        self._recent: deque[float] = deque(maxlen=int(window))

    @property
    def mean(self) -> float | None:
        """The running mean of the last ``window`` normal losses (None before any)."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    def check(self, loss: float) -> bool:
        """Record ``loss``; True when it is a spike."""
        if not math.isfinite(loss):
            return True
        mean = self.mean
        if self.seen >= self.warmup and mean is not None and loss > self.factor * mean:
            return True
        self.seen += 1
        self._recent.append(loss)
        return False


class LossSpikeGuard(Hook):
    """Stops the run when a step's loss exceeds ``factor`` x its running mean.

    Options (``-o key=value`` or the spec's hook dict): ``factor`` (default
    3.0), ``window`` (losses in the running mean, 20), ``warmup`` (losses
    before it may act, 10).
    """

    name = "loss_spike_guard"

    def __init__(
        self,
        *,
        factor: float = 3.0,
        window: int = 20,
        warmup: int = 10,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.detector = SpikeDetector(factor, window, warmup)
        self.stopped_at: int | None = None

    @on(StepEnded)
    async def check_loss(self, ev: StepEnded) -> None:
        """Compare the step's loss with the running mean; stop the run on a spike."""
        # With data parallelism every replica's last stage reports the same
        # (global mean) loss: replica 0's stands for the step.
        if ev.loss is None or ev.replica or self.stopped_at is not None:
            return  # only the last stage reports the loss; stop only once
        mean = self.detector.mean
        if not self.detector.check(ev.loss):
            return
        self.stopped_at = ev.step
        running = "none yet" if mean is None else f"{mean:.4g}"
        reason = (
            f"loss spike at step {ev.step}: {ev.loss:.4g} > "
            f"{self.detector.factor:g} x running mean {running}"
        )
        self.log.warning("stopping the run", reason=reason)
        acks = await self.stop(reason=reason)
        self.log.info("stop acknowledged", stages=sorted(a.stage for a in acks))
