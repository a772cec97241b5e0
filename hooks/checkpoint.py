"""The checkpoint coordinator hook (built-in name ``checkpoint``).

It decides *when* (every N steps, every T seconds, on a new best eval metric,
when the run stops), asks every stage to save at the same step boundary
(``CheckpointNow``, path ``RUN_DIR/checkpoints/step-{step:08d}``), collects
the shards, and commits: ``MANIFEST.json`` atomically once every stage's
shard record is durable on disk, then ``latest`` moves, then retention
prunes, then ``CheckpointCommitted`` is published. A ``CheckpointFailed``
from any stage, a refused command or a timeout means the checkpoint is never
committed.

Disk is the source of truth: a shard counts when its ``SHARD.json`` exists
(the stage writes it only once the shard is durable), so shard events lost on
the bus, or missed while this hook was down, are recovered by looking. The
hook keeps its pending requests in ``RUN_DIR/checkpoints/.coordinator.json``;
restarted, it re-reads that file and the committed manifests (best metric,
last step) and commits whatever completed meanwhile.

One request is in flight at a time; triggers that fire meanwhile are merged
into one request issued when it finishes, so saves never queue up on the
stages (a stage blocks training if asked to save while still writing).

On stop (``on_stop=True``): at run start the hook sends a ``CheckpointNow``
with ``on_stop`` set; stages keep it armed and save when the run
ends without failure (StopRun, SIGTERM, last step), then report the shard
before ``RunEnded``. On ``RunEnded`` the hook waits (``stop_timeout``) for
pending checkpoints and commits them before it exits.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import msgspec

from evtrain.checkpoint import (
    ON_STOP_REASON,
    CheckpointError,
    ShardRecord,
    atomic_write_bytes,
    best_checkpoint,
    checkpoint_path_template,
    checkpoints_root,
    commit_checkpoint,
    format_checkpoint_path,
    list_checkpoints,
    parse_step_dir,
    prune,
    remove_checkpoint,
    set_latest,
    shard_records,
)
from evtrain.errors import UsageError
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequested,
    CheckpointShardSaved,
    EvalEnded,
    Heartbeat,
    RunEnded,
    RunStarted,
    StageFailed,
    StepEnded,
)
from evtrain.hooks.hook import Hook, on
from evtrain.hooks.options import (
    choice_option,
    float_option,
    int_option,
    path_option,
    str_option,
)
from evtrain.hooks.runner import CommandTimeout

__all__ = ["COORDINATOR_FILE", "CheckpointHook"]

COORDINATOR_FILE = ".coordinator.json"
_TICK_S = 0.5
_STOP_GRACE_S = 10.0
_FINAL_COMMAND_TIMEOUT_S = 2.0
_FAILED_KEPT = 200


def _bool_option(hook: str, option: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise UsageError(f"hook {hook}: option '{option}' must be true or false, got {value!r}")


class _PendingRecord(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    reason: str
    requested_at: float
    on_stop: bool = False
    metric: float | None = None
    path: str | None = None
    step: int | None = None


class _CoordinatorState(msgspec.Struct, kw_only=True):
    pending: list[_PendingRecord] = []
    failed: list[str] = []


@dataclass
class _Pending:
    record: _PendingRecord
    deadline: float | None
    """Wall-clock time after which it fails; None while an on-stop request is only armed."""


class CheckpointHook(Hook):
    """Coordinates checkpoints of a run: when to save, collect shards, commit, prune.

    Options (``--option key=value`` or the job spec's hook dict):

    Args:
        run_dir: the run directory; default: ``RunStarted.run_dir``.
        every_steps: checkpoint every N optimizer steps.
        every_seconds: checkpoint when T seconds passed since the last request.
        best_metric: an eval metric name (``loss``, ``accuracy``...): checkpoint on
            every new best value seen in ``eval.ended``.
        mode: ``min`` or ``max`` for ``best_metric``.
        on_stop: save a final checkpoint when the run stops (StopRun, SIGTERM,
            last step) — needs stages that honour armed requests.
        keep_last: keep the K most recent committed checkpoints (None: all).
        keep_best: also keep the best one by ``best_metric``.
        timeout: seconds from request to commit before a checkpoint fails.
        command_timeout: seconds to wait for the stages' acknowledgements.
        stop_timeout: seconds to wait at run end for pending checkpoints.
    """

    name = "checkpoint"
    default_priority = 50

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
        command_timeout: float = 60.0,
        stop_timeout: float = 120.0,
        priority: int | None = None,
    ) -> None:
        super().__init__(priority=priority)
        hook = self.hook_name()
        self.run_dir: Path | None = path_option(hook, "run_dir", run_dir)
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
        self.on_stop = _bool_option(hook, "on_stop", on_stop)
        self.keep_last = None if keep_last is None else int_option(hook, "keep_last", keep_last)
        self.keep_best = _bool_option(hook, "keep_best", keep_best)
        self.timeout = float_option(hook, "timeout", timeout, strict=True)
        self.command_timeout = float_option(hook, "command_timeout", command_timeout, strict=True)
        self.stop_timeout = float_option(hook, "stop_timeout", stop_timeout, strict=True)

        self.best: float | None = None
        self.last_committed_step: int | None = None
        self._pending: dict[str, _Pending] = {}
        self._failed: list[str] = []
        self._in_flight: str | None = None
        self._queued: tuple[set[str], float | None] | None = None
        self._recovered = False
        self._last_step: int | None = None
        self._last_request = time.time()
        self._last_tick = 0.0
        self._run_started_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def setup(self) -> None:
        """Recover from disk now when the run directory is known (else at `RunStarted`)."""
        if self.run_dir is not None:
            await self._recover()

    # -- triggers ------------------------------------------------------------------

    @on(RunStarted)
    async def run_started(self, ev: RunStarted) -> None:
        """Learn the run directory, recover, set aside stale checkpoints, arm on-stop."""
        if self.run_dir is None and ev.run_dir:
            self.run_dir = Path(ev.run_dir)
        if self.run_dir is None:
            self.log.warning("no run directory known; pass run_dir=... to the checkpoint hook")
            return
        await self._recover()
        new_start = self._run_started_at is None or ev.ts > self._run_started_at
        if not new_start:
            return
        self._run_started_at = ev.ts
        self._supersede(ev)
        # Stages (re)started after these requests: what they had not written is lost.
        for pending in list(self._pending.values()):
            rec = pending.record
            if rec.requested_at < ev.ts and not self._complete_on_disk(pending):
                if rec.on_stop:
                    self._forget(rec.checkpoint_id)
                else:
                    self._fail(pending, "the stages restarted before the checkpoint was complete")
        if self.on_stop:
            # Also for a replayed RunStarted (this hook restarted mid-run): a new
            # arming replaces whatever the stages held.
            await self._arm_on_stop()

    @on(StepEnded)
    async def step_ended(self, ev: StepEnded) -> None:
        """Periodic triggers (steps, seconds); also the hook's clock."""
        previous = self._last_step
        if previous is None or ev.step > previous:
            self._last_step = ev.step
            reasons: set[str] = set()
            if (
                self.every_steps is not None
                and previous is not None
                and (ev.step // self.every_steps > previous // self.every_steps)
            ):
                reasons.add(f"every {self.every_steps} steps")
            if (
                self.every_steps is not None
                and previous is None
                and ev.step > 0
                and ev.step % self.every_steps == 0
            ):
                reasons.add(f"every {self.every_steps} steps")
            if (
                self.every_seconds is not None
                and time.time() - self._last_request >= self.every_seconds
            ):
                reasons.add(f"every {self.every_seconds:g} s")
            if reasons:
                await self._trigger(reasons, None)
        await self._tick()

    @on(Heartbeat)
    async def heartbeat(self, ev: Heartbeat) -> None:
        """Timeouts and disk checks also advance while no step ends."""
        await self._tick()

    @on(EvalEnded)
    async def eval_ended(self, ev: EvalEnded) -> None:
        """Checkpoint on a new best ``best_metric``."""
        if self.best_metric is None:
            return
        value = ev.metrics.get(self.best_metric)
        if value is None or math.isnan(value):
            return
        if self.best is not None and not (
            value < self.best if self.mode == "min" else value > self.best
        ):
            return
        self.best = float(value)
        await self._trigger({f"best {self.best_metric}"}, float(value))

    # -- shard events -----------------------------------------------------------------

    @on(CheckpointShardSaved)
    async def shard_saved(self, ev: CheckpointShardSaved) -> None:
        """A shard is durable: commit if it was the last one."""
        pending = self._pending.get(ev.checkpoint_id)
        if pending is None:
            return
        if pending.record.path is None:
            pending.record.path = ev.path
            pending.record.step = ev.step
            self._persist()
        if pending.deadline is None:  # an armed on-stop save has begun
            pending.deadline = time.time() + self.timeout
            self.publish(
                CheckpointRequested(
                    checkpoint_id=ev.checkpoint_id,
                    step=ev.step,
                    path=ev.path,
                    reason=pending.record.reason,
                )
            )
        await self._try_commit(pending)

    @on(CheckpointFailed)
    async def shard_failed(self, ev: CheckpointFailed) -> None:
        """A stage could not save: the checkpoint is abandoned."""
        pending = self._pending.get(ev.checkpoint_id)
        if pending is not None and ev.source != self._source():
            self._fail(pending, f"stage {ev.stage}: {ev.error}", publish=False)
            await self._next()

    @on(StageFailed)
    async def stage_failed(self, ev: StageFailed) -> None:
        """A stage died: its missing shards will never come."""
        for pending in list(self._pending.values()):
            if pending.deadline is None:
                continue
            records = self._records(pending)
            if ev.stage not in records:
                self._fail(pending, f"stage {ev.stage} failed before its shard was durable")
        await self._next()

    @on(RunEnded)
    async def run_ended(self, ev: RunEnded) -> None:
        """Wait (``stop_timeout``) for pending checkpoints, the on-stop one included.

        Stages report their last shards before they announce the end, so a
        pending checkpoint with no shard on disk after a short grace is not
        coming (never armed, or a stage that cannot save on stop) and is dropped.
        """
        start = time.monotonic()
        deadline = start + (0.0 if ev.status == "failed" else self.stop_timeout)
        grace = start + min(self.stop_timeout, _STOP_GRACE_S)
        while True:
            for pending in list(self._pending.values()):
                if await self._try_commit(pending):
                    continue
                if time.monotonic() > grace and not self._records(pending):
                    self.log.info(
                        "pending checkpoint dropped at run end",
                        checkpoint_id=pending.record.checkpoint_id,
                    )
                    self._forget(pending.record.checkpoint_id)
            if not self._pending or time.monotonic() >= deadline:
                break
            await anyio.sleep(0.1)
        for pending in list(self._pending.values()):
            self.log.warning(
                "checkpoint still pending at run end", checkpoint_id=pending.record.checkpoint_id
            )

    # -- requests ----------------------------------------------------------------------

    async def _trigger(self, reasons: set[str], metric: float | None) -> None:
        if self.run_dir is None:
            self.log.warning("checkpoint trigger ignored: run directory unknown", reasons=reasons)
            return
        if self._in_flight is not None:
            # Merge into one follow-up request.
            queued_reasons, queued_metric = self._queued or (set(), None)
            self._queued = (
                queued_reasons | reasons,
                metric if metric is not None else queued_metric,
            )
            return
        await self._request(", ".join(sorted(reasons)), metric)

    async def _next(self) -> None:
        if self._in_flight is None and self._queued is not None:
            reasons, metric = self._queued
            self._queued = None
            await self._request(", ".join(sorted(reasons)), metric)

    async def _request(self, reason: str, metric: float | None, *, on_stop: bool = False) -> None:
        assert self.run_dir is not None
        cid = f"{int(time.time())}-{uuid.uuid4().hex[:10]}"
        record = _PendingRecord(
            checkpoint_id=cid,
            reason=reason,
            requested_at=time.time(),
            on_stop=on_stop,
            metric=metric,
        )
        pending = _Pending(
            record=record, deadline=None if on_stop else record.requested_at + self.timeout
        )
        self._pending[cid] = pending
        if not on_stop:
            self._in_flight = cid
            self._last_request = record.requested_at
        self._persist()  # before asking: a restarted hook must know the id
        template = checkpoint_path_template(self.run_dir)
        try:
            acks = await self.checkpoint(
                cid, template, reason=reason, on_stop=on_stop, timeout=self._command_timeout()
            )
        except CommandTimeout as exc:
            self._fail(pending, f"not acknowledged: {exc}")
            await self._next()
            return
        refused = [a for a in acks if not a.ok]
        if refused:
            self._fail(pending, "; ".join(f"stage {a.stage} refused: {a.detail}" for a in refused))
            await self._next()
            return
        if on_stop:
            self.log.info("on-stop checkpoint armed", checkpoint_id=cid)
            return
        steps = sorted({a.step for a in acks})
        if len(steps) > 1:
            self.log.warning("stages acknowledged at different steps", steps=steps)
        step = steps[-1] if steps else (self._last_step or 0)
        if record.path is None:
            self.publish(
                CheckpointRequested(
                    checkpoint_id=cid,
                    step=step,
                    path=str(format_checkpoint_path(template, step)),
                    reason=reason,
                )
            )
        else:  # shards already reported during the wait
            self.publish(
                CheckpointRequested(
                    checkpoint_id=cid, step=record.step or step, path=record.path, reason=reason
                )
            )
        await self._try_commit(pending)

    def _command_timeout(self) -> float:
        # After the last step the stages apply commands at one final boundary and
        # then leave: a request they never acknowledge must not keep this hook
        # (whose handlers run one at a time) from handling run.ended for long.
        run = self.state.run
        if run is not None and self._last_step is not None and self._last_step >= run.max_steps:
            return min(self.command_timeout, _FINAL_COMMAND_TIMEOUT_S)
        return self.command_timeout

    async def _arm_on_stop(self) -> None:
        for pending in list(self._pending.values()):
            if pending.record.on_stop and pending.deadline is None:
                self._forget(pending.record.checkpoint_id)
        await self._request(ON_STOP_REASON, None, on_stop=True)

    # -- commit ------------------------------------------------------------------------

    def _records(self, pending: _Pending) -> dict[int, ShardRecord]:
        path = self._locate(pending)
        if path is None:
            return {}
        cid = pending.record.checkpoint_id
        return {k: r for k, r in shard_records(path).items() if r.checkpoint_id == cid}

    def _locate(self, pending: _Pending) -> Path | None:
        """The checkpoint directory of ``pending``: from its shard events, else from disk."""
        if pending.record.path is not None:
            return Path(pending.record.path)
        if self.run_dir is None:
            return None
        root = checkpoints_root(self.run_dir)
        if not root.is_dir():
            return None
        cid = pending.record.checkpoint_id
        for child in root.iterdir():
            if parse_step_dir(child) is None or not child.is_dir():
                continue
            if any(r.checkpoint_id == cid for r in shard_records(child).values()):
                pending.record.path = str(child)
                pending.record.step = parse_step_dir(child)
                self._persist()
                return child
        return None

    def _num_stages(self, records: dict[int, ShardRecord]) -> int | None:
        known = self.state.num_stages
        if known is not None:
            return known
        first = next(iter(records.values()), None)
        return None if first is None else first.num_stages

    def _complete_on_disk(self, pending: _Pending) -> bool:
        records = self._records(pending)
        num = self._num_stages(records)
        return num is not None and all(k in records for k in range(num))

    async def _try_commit(self, pending: _Pending) -> bool:
        cid = pending.record.checkpoint_id
        if cid not in self._pending or not self._complete_on_disk(pending):
            return False
        path = self._locate(pending)
        assert path is not None and self.run_dir is not None
        num = self._num_stages(self._records(pending))
        assert num is not None
        rec = pending.record
        run_dir = self.run_dir
        run_id = self.state.run.run_id if self.state.run is not None else ""

        def commit() -> tuple[int, int, list[Path]]:
            manifest = commit_checkpoint(
                path,
                checkpoint_id=cid,
                num_stages=num,
                reason=rec.reason,
                run_id=run_id,
                metric_name=self.best_metric if rec.metric is not None else None,
                metric=rec.metric,
                metric_mode=self.mode if rec.metric is not None else None,
            )
            set_latest(run_dir, path)
            pruned = prune(
                run_dir,
                keep_last=self.keep_last,
                keep_best=self.keep_best,
                metric_name=self.best_metric,
                mode=self.mode,
                in_progress=[p for p in self._pending_paths() if p != path],
            )
            return manifest.step, manifest.bytes, pruned

        try:
            step, nbytes, pruned = await anyio.to_thread.run_sync(commit)
        except CheckpointError as exc:
            self._fail(pending, f"commit refused: {exc}")
            await self._next()
            return False
        self._pending.pop(cid, None)
        if self._in_flight == cid:
            self._in_flight = None
        self._persist()
        self.last_committed_step = step
        self.publish(
            CheckpointCommitted(
                checkpoint_id=cid,
                step=step,
                path=str(path),
                bytes=nbytes,
                # Wall clock: never negative, or consumers reject the event as malformed.
                duration_s=max(0.0, time.time() - rec.requested_at),
                metric=rec.metric,
                reason=rec.reason,
            )
        )
        self.log.info(
            "checkpoint committed", step=step, path=str(path), pruned=len(pruned), reason=rec.reason
        )
        await self._next()
        return True

    def _pending_paths(self) -> list[Path]:
        return [Path(p.record.path) for p in self._pending.values() if p.record.path]

    def _fail(self, pending: _Pending, error: str, *, publish: bool = True) -> None:
        rec = pending.record
        self._pending.pop(rec.checkpoint_id, None)
        if self._in_flight == rec.checkpoint_id:
            self._in_flight = None
        self._failed = [*self._failed, rec.checkpoint_id][-_FAILED_KEPT:]
        self._persist()
        self.log.error("checkpoint failed", checkpoint_id=rec.checkpoint_id, error=error)
        if publish:
            self.publish(
                CheckpointFailed(
                    checkpoint_id=rec.checkpoint_id, step=rec.step or 0, stage=None, error=error
                )
            )

    def _forget(self, cid: str) -> None:
        self._pending.pop(cid, None)
        self._persist()

    async def _tick(self) -> None:
        now = time.time()
        if now - self._last_tick < _TICK_S:
            return
        self._last_tick = now
        for pending in list(self._pending.values()):
            if await self._try_commit(pending):
                continue
            if (
                pending.deadline is not None
                and now > pending.deadline
                and (pending.record.checkpoint_id in self._pending)
            ):
                self._fail(pending, f"timed out after {self.timeout:g} s waiting for shards")
                await self._next()

    # -- persistence and recovery ----------------------------------------------------------

    def _source(self) -> str:
        try:
            return f"hook/{self.runner.name}"
        except RuntimeError:
            return ""

    def _state_path(self) -> Path | None:
        return None if self.run_dir is None else checkpoints_root(self.run_dir) / COORDINATOR_FILE

    def _persist(self) -> None:
        path = self._state_path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        state = _CoordinatorState(
            pending=[p.record for p in self._pending.values()], failed=self._failed
        )
        atomic_write_bytes(path, msgspec.json.encode(state))

    async def _recover(self) -> None:
        if self._recovered or self.run_dir is None:
            return
        self._recovered = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        infos = list_checkpoints(self.run_dir)
        committed = [i for i in infos if i.committed]
        if committed:
            self.last_committed_step = max(i.step for i in committed)
        if self.best_metric is not None:
            best = best_checkpoint(committed, self.best_metric, self.mode)
            if best is not None and best.metric is not None:
                self.best = best.metric
        path = self._state_path()
        assert path is not None
        state = _CoordinatorState()
        if path.exists():
            try:
                state = msgspec.json.decode(path.read_bytes(), type=_CoordinatorState)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.log.warning(
                    "unreadable coordinator state ignored", path=str(path), error=str(exc)
                )
        self._failed = list(state.failed)
        now = time.time()
        for rec in state.pending:
            if rec.checkpoint_id in self._failed:
                continue
            deadline = (now + self.timeout) if rec.on_stop else rec.requested_at + self.timeout
            self._pending[rec.checkpoint_id] = _Pending(record=rec, deadline=deadline)
            if not rec.on_stop:
                self._in_flight = rec.checkpoint_id
        self.log.info(
            "checkpoint state recovered",
            committed=len(committed),
            pending=len(self._pending),
            best=self.best,
            last_step=self.last_committed_step,
        )
        self._last_tick = 0.0
        await self._tick()

    def _supersede(self, ev: RunStarted) -> None:
        """Set aside checkpoints committed before this run started at a later step.

        Resuming from an older checkpoint forks the run: the newer ones belong to
        an abandoned future, and their directories would collide with the new
        saves. They are renamed (kept, but no longer listed or resumed).
        """
        assert self.run_dir is not None
        busy = self._pending_paths()
        for info in list_checkpoints(self.run_dir):
            if info.step <= ev.start_step or info.time >= ev.ts or info.path in busy:
                continue
            if info.committed:
                target = info.path.with_name(f"{info.path.name}.superseded-{int(ev.ts)}")
                info.path.rename(target)
                self.log.warning(
                    "checkpoint from an abandoned future set aside",
                    path=str(info.path),
                    moved_to=str(target),
                )
            else:
                remove_checkpoint(info.path)
                self.log.info("abandoned uncommitted checkpoint removed", path=str(info.path))
