"""Early stopping (short name ``early_stopping``): stop when an eval metric stops improving.

Follows Lightning's EarlyStopping: after each `EvalEnded` the monitored metric
either improves on the best value by more than ``min_delta`` (in the ``mode``
direction) or counts one more eval without improvement; after ``patience`` of
those the hook sends `StopRun`, whose reason (``early stopping: val loss did
not improve for 3 evals ...``) ends up in the run's `RunEnded`.
"""

from __future__ import annotations

import math

from evtrain.events import EvalEnded, RunStarted
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import choice_option, float_option, int_option, str_option
from evtrain.hooks.runner import CommandTimeout


class EarlyStopping(Hook):
    """Stop the run when ``metric`` did not improve for ``patience`` evaluations.

    Options: ``metric`` (a key of `EvalEnded.metrics`, default ``loss``),
    ``mode`` (``min`` or ``max``, default ``min``), ``patience`` (evals,
    default 3), ``min_delta`` (smallest change that counts as improvement,
    default 0), ``timeout`` (seconds to wait for the stop's acknowledgements).
    """

    name = "early_stopping"
    default_priority = 50

    def __init__(
        self,
        *,
        metric: str = "loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        timeout: float = 30.0,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        self.metric = str_option(self.name, "metric", metric)
        self.mode = choice_option(self.name, "mode", mode, ("min", "max"))
        self.patience = int_option(self.name, "patience", patience)
        self.min_delta = float_option(self.name, "min_delta", min_delta)
        self.timeout = float_option(self.name, "timeout", timeout, strict=True)
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0
        self.stopped_reason: str | None = None
        self._warned_missing = False
        self._run_id: str | None = None

    def watched_metric(self) -> tuple[str, str] | None:
        return "metric", self.metric

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run starts with no history (a resumed one too: Lightning does the same)."""
        if ev.run_id == self._run_id:
            return  # the same run again (a state snapshot after reattaching)
        self._run_id = ev.run_id
        self.best = self.best_step = None
        self.bad_evals = 0
        self.stopped_reason = None

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    @on(EvalEnded)
    async def eval_ended(self, ev: EvalEnded) -> None:
        """Update the best value; stop after ``patience`` evals without improvement."""
        if not self.of_this_run(ev):
            return
        value = ev.metrics.get(self.metric)
        if value is None:
            if not self._warned_missing:
                self._warned_missing = True
                self.log.warning(
                    "monitored metric missing from eval results",
                    metric=self.metric,
                    available=sorted(ev.metrics),
                )
            return
        if math.isnan(value):
            self.bad_evals += 1  # NaN never improves (and must not become the best)
        elif self.improved(value):
            self.best, self.best_step, self.bad_evals = value, ev.step, 0
            return
        else:
            self.bad_evals += 1
        self.log.info(
            "no improvement",
            metric=self.metric,
            value=value,
            best=self.best,
            bad_evals=self.bad_evals,
            patience=self.patience,
        )
        if self.bad_evals < self.patience or self.stopped_reason is not None:
            return
        best_at = "" if self.best_step is None else f" at step {self.best_step}"
        # A named set's metric says its set itself ("test/loss").
        watched = self.metric if "/" in self.metric else f"val {self.metric}"
        reason = (
            f"early stopping: {watched} did not improve for {self.bad_evals} evals "
            f"(best {self.best:.6g}{best_at}, mode {self.mode}, min_delta {self.min_delta:g})"
        )
        self.stopped_reason = reason
        self.log.warning("stopping the run", reason=reason)
        try:
            await self.stop(reason, timeout=self.timeout)
        except CommandTimeout as exc:
            # Let the next eval try again rather than give up silently.
            self.stopped_reason = None
            self.log.error("stop not acknowledged", error=str(exc))
