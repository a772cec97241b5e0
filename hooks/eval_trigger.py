"""Evaluation every N steps (short name ``eval_every``): sends `EvaluateNow`.

When the last stage reports the end of a step that completes a multiple of
``every`` steps, the hook asks the stages to evaluate at the next step boundary
and waits for their acknowledgements (bounded by ``timeout``; the runner keeps
reading events meanwhile). No trigger after the final step: there is no step
boundary left to evaluate at, and the engine's own end-of-run evaluation covers
it when configured.
"""

from __future__ import annotations

from evtrain.events import RunStarted, StepEnded
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import float_option, int_option
from evtrain.hooks.runner import CommandTimeout
from evtrain.hooks.step_merge import step_problem


class EvalTrigger(Hook):
    """Ask for an evaluation every ``every`` steps.

    Options: ``every`` (steps, required), ``timeout`` (seconds to wait for the
    stages' acknowledgements, default 30).
    """

    name = "eval_every"
    default_priority = 50

    def __init__(self, *, every: int, timeout: float = 30.0, priority: int | None = None) -> None:
        super().__init__(priority=priority)
        self.every = int_option(self.name, "every", every)
        self.timeout = float_option(self.name, "timeout", timeout, strict=True)
        self.requested: list[int] = []
        self._last_requested = -1

    @on(RunStarted)
    def run_started(self, ev: RunStarted) -> None:
        """A new run counts from its own start."""
        self._last_requested = -1

    @on(StepEnded)
    async def step_ended(self, ev: StepEnded) -> None:
        """On the last stage's event of every ``every``-th step, request an evaluation."""
        if step_problem(ev, self.state) is not None or not self._from_last_stage(ev):
            return
        done = ev.step  # steps are 1-based: step k ends with k steps done
        if done % self.every or done <= self._last_requested:
            return
        run = self.state.run
        if run is not None and run.max_steps and done >= run.max_steps:
            return
        if self.state.ended is not None:
            return
        self._last_requested = ev.step
        try:
            acks = await self.evaluate(timeout=self.timeout)
        except CommandTimeout as exc:
            self.log.warning("evaluation request not acknowledged", step=done, error=str(exc))
            return
        self.requested.append(ev.step)
        refused = [a for a in acks if not a.ok]
        if refused:
            self.log.warning(
                "evaluation request refused",
                step=done,
                detail="; ".join(f"stage {a.stage}: {a.detail}" for a in refused),
            )
        else:
            self.log.info("evaluation requested", step=done, acks=len(acks))

    def _from_last_stage(self, ev: StepEnded) -> bool:
        num_stages = self.state.num_stages
        if num_stages is None:
            return ev.loss is not None
        return ev.stage == num_stages - 1
