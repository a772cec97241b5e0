"""The checkpoint hook (built-in name ``checkpoint``): decides *when*, delegates *how*.

When the run starts it sends the stages a `CheckpointPlan` — every N steps,
best by an eval metric, on stop — which they carry out themselves, exactly on
their boundaries (the protocol: `evtrain.checkpoint`). Every ``every_seconds``
it asks for one checkpoint at the next boundary. Everything it hears about
checkpoints goes to its `Coordinator`, and it publishes the verdicts
(``CheckpointCommitted``/``CheckpointFailed``) that come back.

Restarted, or attached to a running run, it recovers from disk, commits what
completed while it was away and sends the plan again (the stages replace
theirs; the best value so far is kept).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import anyio

from evtrain.checkpoint import checkpoint_path_template
from evtrain.checkpoint.coordinator import Committed, Coordinator, Verdict
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointNow,
    CheckpointPlan,
    CheckpointRequested,
    CheckpointShardSaved,
    Heartbeat,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
)
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import (
    bool_option,
    choice_option,
    float_option,
    int_option,
    path_option,
    str_option,
)
from evtrain.hooks.runner import CommandTimeout

__all__ = ["CheckpointHook"]

_TICK_S = 0.5


class CheckpointHook(Hook):
    """Checkpoints of a run: when to save; the coordinator commits and prunes.

    Options (``--option key=value`` or the job spec's hook dict):

    Args:
        run_dir: the run directory; default: ``RunStarted.run_dir``.
        every_steps: checkpoint at every boundary that is a multiple of N.
        every_seconds: checkpoint when T seconds passed since the last request.
        best_metric: an eval metric name (``loss``, ``accuracy``...): checkpoint
            the weights of every evaluation that beats the best so far.
        mode: ``min`` or ``max`` for ``best_metric``.
        on_stop: save a final checkpoint when the run ends without failure
            (StopRun, SIGTERM, last step), unless that step is saved already.
        keep_last: keep the K most recent committed checkpoints (None: all).
        keep_best: also keep the best one by ``best_metric``.
        timeout: seconds from request to commit before a checkpoint fails.
        command_timeout: seconds to wait for the stages' acknowledgements.
    """

    name = "checkpoint"
    default_priority = 50

    plans_checkpoints = True

    def __init__(
        self,
        *,
        run_dir: str | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        best_metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        on_stop: bool = False,
        keep_last: int | None = None,
        keep_best: bool = True,
        timeout: float = 600.0,
        command_timeout: float = 30.0,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        hook = self.hook_name()
        self.run_dir: Path | None = path_option(hook, "run_dir", run_dir)
        self._given_dir = self.run_dir
        """The ``run_dir`` option: without it each run's own directory (`RunStarted`)."""
        self.every_steps = (
            None if every_steps is None else int_option(hook, "every_steps", every_steps)
        )
        self.every_seconds = (
            None
            if every_seconds is None
            else float_option(hook, "every_seconds", every_seconds, strict=True)
        )
        self.best_metric = (
            None if best_metric is None else str_option(hook, "best_metric", best_metric)
        )
        self.mode: Literal["min", "max"] = choice_option(  # type: ignore[assignment]
            hook, "mode", mode, ("min", "max")
        )
        self.on_stop = bool_option(hook, "on_stop", on_stop)
        self.keep_last = None if keep_last is None else int_option(hook, "keep_last", keep_last)
        self.keep_best = bool_option(hook, "keep_best", keep_best)
        self.timeout = float_option(hook, "timeout", timeout, strict=True)
        self.command_timeout = float_option(hook, "command_timeout", command_timeout, strict=True)
        self.coordinator: Coordinator | None = None
        self._started_at: float | None = None
        self._last_request = time.time()
        self._last_tick = 0.0

    def watched_metric(self) -> tuple[str, str] | None:
        return None if self.best_metric is None else ("best_metric", self.best_metric)

    @property
    def best(self) -> float | None:
        """The best committed ``best_metric`` value."""
        return None if self.coordinator is None else self.coordinator.best

    @property
    def last_committed_step(self) -> int | None:
        """The step of the newest committed checkpoint."""
        return None if self.coordinator is None else self.coordinator.last_committed_step

    # -- when ------------------------------------------------------------------------

    @on(RunStarted)
    async def run_started(self, ev: RunStarted) -> None:
        """Settle what the last start left, recover, and send the stages the plan."""
        run_dir = self._given_dir or (Path(ev.run_dir) if ev.run_dir else None)
        if run_dir is None:
            self.log.warning("no run directory known; pass run_dir=... to the checkpoint hook")
            return
        if self.coordinator is not None and run_dir != self.run_dir:
            # Another run in another directory (a hook that outlives runs, as
            # under compose): its own checkpoints, its own best value.
            self.coordinator = None
            self._started_at = None
        self.run_dir = run_dir
        coordinator = self.coordinator
        if coordinator is None:
            coordinator = self.coordinator = Coordinator(
                self.run_dir,
                timeout=self.timeout,
                keep_last=self.keep_last,
                keep_best=self.keep_best,
                metric_name=self.best_metric,
                mode=self.mode,
            )
            await self._step(coordinator.recover)
        coordinator.num_stages = ev.num_stages
        coordinator.run_id = ev.run_id
        if self._started_at is None or ev.ts > self._started_at:
            self._started_at = ev.ts
            await self._step(
                lambda: coordinator.run_started(start_step=ev.start_step, started_at=ev.ts)
            )
        ended = self.state.ended
        if ended is not None and self.of_this_run(ended):
            # A replay after the run's end (a restarted host): no stage is left to
            # acknowledge a plan, and awaiting one would hold up the host's hooks.
            return
        plan = CheckpointPlan(
            command_id=uuid.uuid4().hex,
            path=checkpoint_path_template(self.run_dir),
            every_steps=self.every_steps,
            best_metric=self.best_metric,
            mode=self.mode,
            best=coordinator.best,
            on_stop=self.on_stop,
        )
        try:
            await self.send_command(plan, timeout=self.command_timeout)
        except CommandTimeout as exc:
            self.log.warning("checkpoint plan not acknowledged", error=str(exc))

    @on(StepEnded)
    async def step_ended(self, ev: StepEnded) -> None:
        """The ``every_seconds`` trigger; also the coordinator's clock."""
        if (
            self.every_seconds is not None
            and self.coordinator is not None
            and self.state.ended is None
            and time.time() - self._last_request >= self.every_seconds
        ):
            await self._request(f"every {self.every_seconds:g} s")
        await self._tick()

    @on(Heartbeat)
    async def heartbeat(self, ev: Heartbeat) -> None:
        """Timeouts and disk checks also advance while no step ends."""
        await self._tick()

    async def _request(self, reason: str) -> None:
        coordinator, run_dir = self.coordinator, self.run_dir
        assert coordinator is not None and run_dir is not None
        self._last_request = time.time()
        cid = f"{int(self._last_request)}-{uuid.uuid4().hex[:10]}"
        coordinator.issued(cid, reason)  # first: a restarted hook must know the id
        command = CheckpointNow(
            command_id=uuid.uuid4().hex,
            checkpoint_id=cid,
            path=checkpoint_path_template(run_dir),
            reason=reason,
        )
        try:
            acks = await self.send_command(command, timeout=self.command_timeout)
        except CommandTimeout as exc:
            self._publish(coordinator.refused(cid, f"not acknowledged: {exc}"))
            return
        refused = [a for a in acks if not a.ok]
        if refused:
            detail = "; ".join(f"stage {a.stage} refused: {a.detail}" for a in refused)
            self._publish(coordinator.refused(cid, detail))

    # -- what happened -------------------------------------------------------------------

    @on(CheckpointRequested)
    async def requested(self, ev: CheckpointRequested) -> None:
        """The stages began a save (a plan's, or one this hook asked for)."""
        coordinator = self.coordinator
        if coordinator is not None and self.of_this_run(ev):
            await self._step(
                lambda: coordinator.requested(
                    ev.checkpoint_id,
                    step=ev.step,
                    path=ev.path,
                    reason=ev.reason,
                    metric=ev.metric,
                    fulfils=ev.fulfils,
                    at=ev.ts or None,
                )
            )

    @on(CheckpointShardSaved)
    async def shard_saved(self, ev: CheckpointShardSaved) -> None:
        """A shard is durable: commit if it was the last one."""
        coordinator = self.coordinator
        if coordinator is not None and self.of_this_run(ev):
            await self._step(
                lambda: coordinator.shard_saved(ev.checkpoint_id, step=ev.step, path=ev.path)
            )

    @on(CheckpointFailed)
    async def shard_failed(self, ev: CheckpointFailed) -> None:
        """A stage could not save its shard: the checkpoint is abandoned."""
        coordinator = self.coordinator
        if coordinator is not None and ev.stage is not None and self.of_this_run(ev):
            stage = ev.stage
            await self._step(lambda: coordinator.shard_failed(ev.checkpoint_id, stage, ev.error))

    @on(StageFailed)
    async def stage_failed(self, ev: StageFailed) -> None:
        """A stage died: its missing shards will never come."""
        coordinator = self.coordinator
        if coordinator is not None and self.of_this_run(ev):
            await self._step(lambda: coordinator.stage_failed(ev.stage))

    @on(RunEnded)
    async def run_ended(self, ev: RunEnded) -> None:
        """Close the books: every pending checkpoint commits now or fails with a reason."""
        coordinator = self.coordinator
        if coordinator is not None and self.of_this_run(ev):
            await self._step(lambda: coordinator.run_ended(failed=ev.status == "failed"))

    async def _tick(self) -> None:
        now = time.monotonic()
        if self.coordinator is None or now - self._last_tick < _TICK_S:
            return
        self._last_tick = now
        await self._step(self.coordinator.tick)

    async def _step(self, step: Callable[[], list[Verdict]]) -> None:
        """Run a coordinator step in a thread (it touches the disk) and publish its verdicts."""
        verdicts = await anyio.to_thread.run_sync(step)
        self._publish(verdicts)

    def _publish(self, verdicts: list[Verdict]) -> None:
        if not verdicts:
            return
        for verdict in verdicts:
            if isinstance(verdict, Committed):
                self.publish(
                    CheckpointCommitted(
                        checkpoint_id=verdict.checkpoint_id,
                        step=verdict.step,
                        path=verdict.path,
                        bytes=verdict.bytes,
                        duration_s=verdict.duration_s,
                        metric=verdict.metric,
                        reason=verdict.reason,
                    )
                )
            else:
                self.publish(
                    CheckpointFailed(
                        checkpoint_id=verdict.checkpoint_id,
                        step=verdict.step,
                        stage=None,
                        error=verdict.error,
                    )
                )
        if self.coordinator is not None:
            self.coordinator.settle(verdicts)
