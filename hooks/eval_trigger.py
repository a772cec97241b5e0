"""Evaluation every N steps or epochs (short name ``eval_every``).

When the run starts, the hook sends the stages one standing `EvaluateNow`
(``every`` steps, or ``every_epochs``): they evaluate exactly at each of
those boundaries, however late the hook hears of the steps. A hook that
restarts, or attaches to a running run, sends it again; the stages evaluate
once per boundary whatever number of orders name it.
"""

from __future__ import annotations

import uuid

from evtrain.errors import UsageError
from evtrain.events import EvaluateNow, RunStarted
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, int_option
from evtrain.hooks.runner import CommandTimeout


class EvalTrigger(Hook):
    """Evaluate every ``every`` steps, or after every ``every_epochs`` epochs.

    Options: ``every`` (steps) or ``every_epochs`` (one of them is required),
    ``timeout`` (seconds to wait for the stages' acknowledgements, default 30).
    """

    name = "eval_every"
    default_priority = 50

    def __init__(
        self,
        *,
        every: int | None = None,
        every_epochs: int | None = None,
        timeout: float = 30.0,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        if (every is None) == (every_epochs is None):
            raise UsageError(f"hook {self.name}: give exactly one of 'every' or 'every_epochs'")
        self.every = None if every is None else int_option(self.name, "every", every)
        self.every_epochs = (
            None if every_epochs is None else int_option(self.name, "every_epochs", every_epochs)
        )
        self.timeout = float_option(self.name, "timeout", timeout, strict=True)

    @on(RunStarted)
    async def run_started(self, ev: RunStarted) -> None:
        """Give the stages the standing order."""
        order = EvaluateNow(
            command_id=uuid.uuid4().hex, every=self.every, every_epochs=self.every_epochs
        )
        try:
            acks = await self.send_command(order, timeout=self.timeout)
        except CommandTimeout as exc:
            self.log.warning("evaluation order not acknowledged", error=str(exc))
            return
        refused = [a for a in acks if not a.ok]
        if refused:
            self.log.warning(
                "evaluation order refused",
                detail="; ".join(f"stage {a.stage}: {a.detail}" for a in refused),
            )
        else:
            self.log.info(
                "evaluation ordered",
                every=self.every,
                every_epochs=self.every_epochs,
                from_step=acks[0].step if acks else None,
            )
