"""A stage's side of checkpointing: which saves a boundary owes, and handing them to the writer.

The protocol (directories, shards, commits, the coordinator) is
`evtrain.checkpoint`'s; this module decides *what* a stage saves at a
boundary and delegates *how* to its `ShardWriter`:

* at a boundary, the plan's reasons (periodic, a better evaluated metric)
  and the commanded checkpoints; requests for one directory share one save
  (one checkpoint id, the others listed as fulfilled by it), and a directory
  already saved at this step is only announced again;
* the plan's on-stop checkpoint when the run ends without failure;
* replica 0 writes its stage's shard (the replicas' weights are equal); the
  replicas of a sharded stage, and the tensor ranks of replica 0, each write
  their own shards into it, together;
  before a save the replicas make their BatchNorm statistics their mean and
  hand their random states to replica 0, which saves them with its own
  (``REPLICA_RNG``), so a resume at the same D draws what the run would have;
  rank 0 announces every save (``CheckpointRequested``) and, with a plan,
  remembers it until the coordinator's verdict (`awaiting`);
* finished writes are published whenever the stage looks (`publish_done`),
  all of them at the end (`finish`), and a failing stage still completes
  the shard it is writing, bounded by ``FAILURE_WRITE_WAIT_S``: the
  checkpoint was taken steps before the failure and is whole once every
  shard is;
* stage 0 holds boundary 0 until the coordinator's plan arrived
  (`await_plan`), and ends the run only once the coordinator has given its
  verdict on every checkpoint (`await_the_end`), both bounded by
  ``COORDINATOR_TIMEOUT_ENV``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import structlog
import torch.distributed as dist
from torch import nn

from evtrain.bus.commands import CommandReceiver
from evtrain.bus.subscriber import Subscriber
from evtrain.checkpoint import CheckpointError, format_checkpoint_path
from evtrain.checkpoint.plan import ON_STOP, PlanState
from evtrain.checkpoint.state_tree import rng_state
from evtrain.checkpoint.writer import ShardWriter
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointNow,
    CheckpointPlan,
    CheckpointRequested,
    Event,
    StageStopped,
)
from evtrain.stages.batchnorm import average_running_stats
from evtrain.stages.data_parallel import all_gathered
from evtrain.stages.executor import StageExecutor

__all__ = [
    "BUS_SILENT_S",
    "COORDINATOR_TIMEOUT_ENV",
    "FAILURE_WRITE_WAIT_S",
    "REPLICA_RNG",
    "StageCheckpointing",
    "await_plan",
    "await_the_end",
]

log = structlog.get_logger()

FAILURE_WRITE_WAIT_S = 60.0
"""Seconds a failing stage waits for its shard write in flight before it reports."""

BUS_SILENT_S = 5.0
"""Seconds without any message back from the broker (stage 0's own heartbeats come
every second) after which stage 0 stops waiting for the end's verdicts."""

REPLICA_RNG = "replica_rng"
"""The key in a shard's extra state of replicas 1..D-1's random states, in order."""

COORDINATOR_TIMEOUT_ENV = "EVTRAIN_COORDINATOR_TIMEOUT_S"
"""Seconds stage 0 waits for the checkpoint coordinator, at most: for its plan before
the first step, for its verdicts (and every stage's last events) at the end (default 30)."""


@dataclass
class _Save:
    """One checkpoint directory to save at a boundary, and every request it answers."""

    checkpoint_id: str
    path: Path
    reasons: list[str]
    metric: float | None
    fulfils: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return ", ".join(dict.fromkeys(r for r in self.reasons if r))

    def requested(self, step: int, checkpoint_id: str, fulfils: list[str]) -> CheckpointRequested:
        return CheckpointRequested(
            checkpoint_id=checkpoint_id,
            step=step,
            path=str(self.path),
            reason=self.reason,
            metric=self.metric,
            fulfils=fulfils,
        )


class StageCheckpointing:
    """The saves of one stage process (see the module docstring).

    ``writer`` is None where the stage saves nothing (evaluation only, and
    replicas other than 0 of a stage that is not sharded); ``lead`` is global
    rank 0, which announces the
    saves; ``replicas`` is the stage's replica group (None without replicas);
    ``publish`` puts an event on the bus.
    """

    def __init__(
        self,
        *,
        stage: int,
        lead: bool,
        writer: ShardWriter | None,
        module: nn.Module,
        executor: StageExecutor,
        replicas: dist.ProcessGroup | None,
        publish: Callable[[Event], None],
    ) -> None:
        self._stage = stage
        self._lead = lead
        self._writer = writer
        self._module = module
        self._executor = executor
        self._replicas = replicas
        self._publish = publish
        self._saved: dict[tuple[int, str], str] = {}
        """(step, directory) already saved -> the checkpoint id that saved it."""
        self.awaiting: set[str] = set()
        """Rank 0, with a plan: checkpoint ids whose verdict has not come back yet."""

    async def save_due(
        self,
        step: int,
        commanded: list[CheckpointNow],
        plan: PlanState | None,
        metric: float | None,
        *,
        periodic: bool,
    ) -> None:
        """Save what boundary ``step`` owes: the plan's reasons and the commanded checkpoints."""
        saves: dict[Path, _Save] = {}
        if plan is not None:
            reasons = [r for r in (periodic and plan.periodic(step), plan.evaluated(metric)) if r]
            if reasons:
                path = format_checkpoint_path(plan.plan.path, step)
                saves[path] = _Save(plan.checkpoint_id(step), path, reasons, metric)
        for command in commanded:
            path = format_checkpoint_path(command.path, step)
            save = saves.get(path)
            if save is None:
                saves[path] = _Save(command.checkpoint_id, path, [command.reason], None)
            else:
                save.fulfils.append(command.checkpoint_id)
                save.reasons.append(command.reason)
        if saves:
            replica_rng = await anyio.to_thread.run_sync(self._agree_replicas)
        for save in saves.values():
            await self._save(step, save, replica_rng, planned=plan is not None)

    async def save_on_stop(self, step: int, plan: PlanState | None) -> None:
        """The plan's on-stop checkpoint after ``step`` (nothing when this step is saved)."""
        if plan is None or not plan.plan.on_stop:
            return
        path = format_checkpoint_path(plan.plan.path, step)
        replica_rng = await anyio.to_thread.run_sync(self._agree_replicas)
        save = _Save(plan.checkpoint_id(step), path, [ON_STOP], None)
        await self._save(step, save, replica_rng, planned=True)

    def _agree_replicas(self) -> list[dict[str, Any]]:
        """Every replica (blocking, collective): BatchNorm statistics made their mean;
        replicas 1..D-1's random states, for replica 0 to save."""
        if self._replicas is None:
            return []
        average_running_stats(self._module, self._replicas)
        return all_gathered(rng_state(self._executor.device), self._replicas)[1:]

    async def _save(
        self, step: int, save: _Save, replica_rng: list[dict[str, Any]], *, planned: bool
    ) -> None:
        """Start (or, when this directory holds this step already, re-announce) one save."""
        if self._writer is None:
            return
        key = (step, str(save.path))
        done = self._saved.get(key)
        if done is not None:
            if self._lead and (save.fulfils or save.checkpoint_id != done):
                self._publish(save.requested(step, done, [save.checkpoint_id, *save.fulfils]))
            return
        self._saved[key] = save.checkpoint_id
        if self._lead:
            self._publish(save.requested(step, save.checkpoint_id, save.fulfils))
            if planned:
                self.awaiting.add(save.checkpoint_id)
        error = await anyio.to_thread.run_sync(self._write, self._writer, step, save, replica_rng)
        if error is not None:
            for cid in (save.checkpoint_id, *save.fulfils):
                self._publish(
                    CheckpointFailed(checkpoint_id=cid, step=step, stage=self._stage, error=error)
                )

    def _write(
        self, writer: ShardWriter, step: int, save: _Save, replica_rng: list[dict[str, Any]]
    ) -> str | None:
        """Capture this stage's shard and hand it to the writer (blocking, short); the
        write continues in the writer's thread. The error of a refused save, or None."""
        executor = self._executor
        extra: dict[str, Any] = {}
        if executor.scaler is not None:
            extra["loss_scaler"] = executor.scaler.state_dict()
        if replica_rng:
            extra[REPLICA_RNG] = replica_rng
        try:
            writer.save(
                save.path,
                checkpoint_id=save.checkpoint_id,
                step=step,
                module=self._module,
                optimizer=executor.optimizer,
                scheduler=executor.lr_scheduler,
                data_position=executor.stream.batch_index(step),
                reason=save.reason,
                metric=save.metric,
                extra=extra or None,
            )
        except CheckpointError as exc:
            log.error("checkpoint refused", stage=self._stage, error=str(exc))
            return str(exc)
        return None

    def publish_done(self) -> None:
        """Publish the shard writes that finished since the last call (never blocks)."""
        if self._writer is not None:
            for done in self._writer.poll():
                self._publish(done.to_event())

    async def finish(self) -> None:
        """Wait for every shard in flight and publish each."""
        if self._writer is not None:
            for done in await anyio.to_thread.run_sync(self._writer.wait):
                self._publish(done.to_event())

    def finish_failing(self) -> None:
        """A failing stage: complete the shard being written (bounded) and publish it."""
        if self._writer is not None and self._writer.busy():
            for done in self._writer.wait(FAILURE_WRITE_WAIT_S):
                self._publish(done.to_event())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _coordinator_timeout_s() -> float:
    return float(os.environ.get(COORDINATOR_TIMEOUT_ENV, "30") or 0)


async def await_plan(receiver: CommandReceiver) -> None:
    """Stage 0: hold boundary 0 until the coordinator's `CheckpointPlan` arrived (bounded)."""
    timeout = _coordinator_timeout_s()
    found = await anyio.to_thread.run_sync(receiver.wait_for, CheckpointPlan, timeout)
    if not found:
        log.warning(
            "no checkpoint plan from the coordinator; training starts without it",
            waited_s=timeout,
        )


async def await_the_end(
    subscriber: Subscriber, run_id: str, everyone: set[tuple[int, int]], awaiting: set[str]
) -> None:
    """Stage 0: wait for every (stage, replica)'s `StageStopped` and the coordinator's
    verdicts on ``awaiting`` (`StageCheckpointing.awaiting`).

    The StageStopped events, read back from the broker, prove that every
    stage's earlier events are through it. Verdicts (committed or failed) are
    awaited only with a checkpoint plan: that a coordinator sent one is how
    the stages know there is a coordinator to wait for. Either wait is
    bounded (``COORDINATOR_TIMEOUT_ENV``); what comes later still comes, but
    hooks that exit on `RunEnded` would not see it. Stage 0's heartbeats come
    back through the broker every second: when nothing has for
    ``BUS_SILENT_S``, the bus is lost and nobody can answer, so the wait ends
    (the launcher commits what the coordinator could not).
    """
    stopped: set[tuple[int, int]] = set()
    start = heard = time.monotonic()
    deadline = start + _coordinator_timeout_s()
    while time.monotonic() < deadline and (awaiting or stopped < everyone):
        if time.monotonic() - heard > BUS_SILENT_S:
            log.warning(
                "the bus is silent: the end does not wait for the coordinator",
                silent_s=round(time.monotonic() - heard, 1),
                unanswered=sorted(awaiting),
            )
            return
        messages = await subscriber.receive(timeout=0.2)
        if messages:
            heard = time.monotonic()
        for msg in messages:
            if isinstance(msg, StageStopped) and msg.run_id == run_id:
                stopped.add((msg.stage, msg.replica))
            elif isinstance(msg, CheckpointCommitted) or (
                isinstance(msg, CheckpointFailed) and msg.stage is None
            ):
                awaiting.discard(msg.checkpoint_id)
    if awaiting:
        log.warning(
            "no verdict on checkpoints at the end of the run",
            checkpoint_ids=sorted(awaiting),
            waited_s=_coordinator_timeout_s(),
        )
    if stopped < everyone:
        log.warning(
            "not every stage's last events came back from the bus",
            missing=sorted(everyone - stopped),
        )
