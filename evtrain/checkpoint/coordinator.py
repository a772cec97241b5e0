"""The coordinator's state machine: each checkpoint goes pending -> committed or failed.

`Coordinator` is fed what the coordinator learns (a save began, a shard is
durable or failed, a stage died, the clock, the run started or ended) and
returns the verdicts (`Committed`, `Failed`) for its caller to publish. It is
torch-free and knows no bus, so the checkpoint hook stays a thin adapter and
the rules are testable without processes.

Rules:

* Disk is the truth. A shard counts once its ``SHARD.json`` exists (a stage
  writes it only when the shard is durable), so a shard event that was lost,
  or missed while the coordinator was down, is recovered by looking. A
  checkpoint commits once every stage's record of its id is there.
* Pending checkpoints live in ``RUN_DIR/checkpoints/.coordinator.json``,
  written before a request is sent, so a restarted coordinator knows them.
  `recover` also commits every uncommitted checkpoint whose shards are all
  durable, whoever asked for it.
* A checkpoint fails when a stage reports a failed shard, when a stage dies
  before its shard is durable, after ``timeout`` seconds without commit, when
  the run fails, and when the run ends without its shards.
* A commit writes the manifest, moves ``latest`` and applies retention
  (`evtrain.checkpoint.storage`). Whatever event completes a checkpoint,
  every complete one commits, oldest step first: the stages' events
  interleave, and the shards of step n+1 can be reported before the last
  one of step n, both already on disk; ``latest`` must not move back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import structlog

from evtrain.checkpoint.storage import (
    CheckpointError,
    Manifest,
    ShardRecord,
    atomic_write_bytes,
    best_checkpoint,
    checkpoints_root,
    commit_checkpoint,
    list_checkpoints,
    parse_step_dir,
    prune,
    read_manifest,
    remove_checkpoint,
    set_latest,
    shard_records,
)

__all__ = ["COORDINATOR_FILE", "Committed", "Coordinator", "Failed", "Verdict"]

log = structlog.get_logger("evtrain.checkpoint.coordinator")

COORDINATOR_FILE = ".coordinator.json"
_FAILED_KEPT = 200


@dataclass(frozen=True)
class Committed:
    """A checkpoint was committed (publish it as ``CheckpointCommitted``)."""

    checkpoint_id: str
    step: int
    path: str
    bytes: int
    duration_s: float
    metric: float | None
    reason: str
    pruned: int


@dataclass(frozen=True)
class Failed:
    """A checkpoint will never be committed (publish it as ``CheckpointFailed``)."""

    checkpoint_id: str
    step: int
    error: str


Verdict = Committed | Failed


class _Pending(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    reason: str
    requested_at: float
    metric: float | None = None
    path: str | None = None
    step: int | None = None
    committed: bool = False
    """Committed, but its verdict may not have gone out yet (see `Coordinator.settle`)."""


class _State(msgspec.Struct, kw_only=True):
    pending: list[_Pending] = []
    failed: list[str] = []


class Coordinator:
    """Commits the checkpoints of one run directory (see the module docstring).

    Args:
        run_dir: the run directory.
        timeout: seconds from request to commit before a checkpoint fails.
        keep_last: keep the K most recent committed checkpoints (None: all).
        keep_best: also keep the best one by ``metric_name``.
        metric_name: the metric best checkpoints are chosen by, recorded in
            their manifests (None: no best checkpoints).
        mode: ``min`` or ``max`` for ``metric_name``.
        clock: wall-clock seconds (tests pass their own).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        timeout: float = 600.0,
        keep_last: int | None = None,
        keep_best: bool = True,
        metric_name: str | None = None,
        mode: Literal["min", "max"] = "min",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir = run_dir
        self.timeout = timeout
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.metric_name = metric_name
        self.mode: Literal["min", "max"] = mode
        self.clock = clock
        self.num_stages: int | None = None
        """The run's stage count (None: taken from the shard records)."""
        self.run_id = ""
        self.best: float | None = None
        """The best committed ``metric_name`` value."""
        self.last_committed_step: int | None = None
        self._pending: dict[str, _Pending] = {}
        self._failed: list[str] = []

    # -- what is known ------------------------------------------------------------

    def pending(self) -> list[str]:
        """Ids of the checkpoints neither committed nor failed."""
        return [cid for cid, p in self._pending.items() if not p.committed]

    def settle(self, verdicts: list[Verdict]) -> None:
        """``verdicts`` went out: forget their checkpoints.

        Until then a committed checkpoint stays in the persisted state, so a
        coordinator killed between its commit and the verdict announces the
        verdict again once restarted.
        """
        for verdict in verdicts:
            pending = self._pending.get(verdict.checkpoint_id)
            if pending is not None and pending.committed:
                del self._pending[verdict.checkpoint_id]
        self._persist()

    # -- inputs -----------------------------------------------------------------------

    def recover(self) -> list[Verdict]:
        """Load the persisted pending checkpoints and commit whatever became complete.

        Call once when the run directory is known (a restarted coordinator too).
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        infos = list_checkpoints(self.run_dir)
        committed = [i for i in infos if i.committed]
        if committed:
            self.last_committed_step = max(i.step for i in committed)
        if self.metric_name is not None:
            best = best_checkpoint(committed, self.metric_name, self.mode)
            self.best = None if best is None else best.metric
        state = _State()
        path = self._state_path()
        if path.exists():
            try:
                state = msgspec.json.decode(path.read_bytes(), type=_State)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("unreadable coordinator state ignored", path=str(path), error=str(exc))
        self._failed = list(state.failed)
        self._pending = {
            p.checkpoint_id: p for p in state.pending if p.checkpoint_id not in self._failed
        }
        for pending in self._pending.values():
            pending.committed = False  # announce again: the verdict may never have gone out
        # Checkpoints whose announcement this coordinator missed (it was down).
        for info in infos:
            cid = info.checkpoint_id
            if info.committed or cid is None or cid in self._pending or cid in self._failed:
                continue
            records = self._records_of(info.path, cid)
            first = next(iter(records.values()), None)
            if first is not None:
                self._pending[cid] = _Pending(
                    checkpoint_id=cid,
                    reason=first.reason,
                    requested_at=first.created,
                    metric=first.metric,
                    path=str(info.path),
                    step=first.step,
                )
        self._persist()
        log.debug(
            "checkpoint state recovered",
            committed=len(committed),
            pending=len(self._pending),
            best=self.best,
            last_step=self.last_committed_step,
        )
        return self._commit_ready()

    def issued(self, checkpoint_id: str, reason: str) -> None:
        """The coordinator is about to ask for ``checkpoint_id``: remember it first."""
        self._pending[checkpoint_id] = _Pending(
            checkpoint_id=checkpoint_id, reason=reason, requested_at=self.clock()
        )
        self._persist()

    def requested(
        self,
        checkpoint_id: str,
        *,
        step: int,
        path: str,
        reason: str,
        metric: float | None = None,
        fulfils: list[str] | None = None,
        at: float | None = None,
    ) -> list[Verdict]:
        """The stages began saving ``checkpoint_id`` of ``step`` into ``path``.

        ``fulfils`` are requests this checkpoint stands for: they are answered by it.
        """
        for other in fulfils or ():
            if self._pending.pop(other, None) is not None:
                log.info("request answered by another checkpoint", request=other, by=checkpoint_id)
        known = checkpoint_id in self._failed or checkpoint_id in self._pending
        if known and self._open(checkpoint_id) is None:
            self._persist()
            return []
        pending = self._open(checkpoint_id)
        if pending is None:
            pending = _Pending(
                checkpoint_id=checkpoint_id,
                reason=reason,
                requested_at=self.clock() if at is None else at,
            )
            self._pending[checkpoint_id] = pending
        pending.path, pending.step = path, step
        pending.reason = reason or pending.reason
        if metric is not None:
            pending.metric = metric
        self._persist()
        return self._commit_ready()

    def shard_saved(self, checkpoint_id: str, *, step: int, path: str) -> list[Verdict]:
        """A stage reports its shard of ``checkpoint_id`` durable in ``path``."""
        pending = self._open(checkpoint_id)
        if pending is None:
            if (
                checkpoint_id in self._failed
                or checkpoint_id in self._pending  # committed; its verdict is out
                or self._already_committed(Path(path), checkpoint_id) is not None
            ):
                return []
            # Announced while this coordinator was not listening: the shard
            # records say what it is.
            records = self._records_of(Path(path), checkpoint_id)
            first = next(iter(records.values()), None)
            pending = _Pending(
                checkpoint_id=checkpoint_id,
                reason=first.reason if first else "",
                requested_at=first.created if first else self.clock(),
                metric=first.metric if first else None,
            )
            self._pending[checkpoint_id] = pending
        if pending.path is None:
            pending.path, pending.step = path, step
        self._persist()
        return self._commit_ready()

    def shard_failed(self, checkpoint_id: str, stage: int, error: str) -> list[Verdict]:
        """A stage could not save its shard of ``checkpoint_id``."""
        pending = self._open(checkpoint_id)
        if pending is None:
            return []
        return [self._fail(pending, f"stage {stage}: {error}")]

    def refused(self, checkpoint_id: str, error: str) -> list[Verdict]:
        """The request for ``checkpoint_id`` was refused or never acknowledged."""
        pending = self._open(checkpoint_id)
        if pending is None:
            return []
        return [self._fail(pending, error)]

    def stage_failed(self, stage: int) -> list[Verdict]:
        """Stage ``stage`` died: checkpoints still waiting for its shard never get it."""
        out: list[Verdict] = []
        for pending in self._open_all():
            if stage not in self._records(pending):
                out.append(
                    self._fail(pending, f"stage {stage} failed before its shard was durable")
                )
        return out

    def tick(self) -> list[Verdict]:
        """Commit what became complete on disk; fail what timed out."""
        out = self._commit_ready()
        now = self.clock()
        for pending in self._open_all():
            if now > pending.requested_at + self.timeout:
                out.append(
                    self._fail(pending, f"timed out after {self.timeout:g} s waiting for shards")
                )
        return out

    def run_started(self, *, start_step: int, started_at: float) -> list[Verdict]:
        """A run (or a restart of it) began at ``start_step``; stale work is settled.

        Requests from before the start that are not complete on disk are lost
        with the stages that had them. Checkpoints committed before this run
        at a later step than it starts from belong to an abandoned future
        (the run was resumed from an older one): they are renamed aside, and
        uncommitted ones of that future are removed.
        """
        out = self._commit_ready()
        for pending in self._open_all():
            if pending.requested_at < started_at:
                out.append(
                    self._fail(pending, "the stages restarted before the checkpoint was complete")
                )
        busy = {p.path for p in self._open_all() if p.path}
        for info in list_checkpoints(self.run_dir):
            if info.step <= start_step or info.time >= started_at or str(info.path) in busy:
                continue
            if info.committed:
                target = info.path.with_name(f"{info.path.name}.superseded-{int(started_at)}")
                info.path.rename(target)
                log.warning(
                    "checkpoint from an abandoned future set aside",
                    path=str(info.path),
                    moved_to=str(target),
                )
            else:
                remove_checkpoint(info.path)
                log.info("abandoned uncommitted checkpoint removed", path=str(info.path))
        return out

    def run_ended(self, *, failed: bool) -> list[Verdict]:
        """The run is over: every pending checkpoint commits now or fails with a reason.

        The stages report every shard before they end the run, so nothing
        missing now will come.
        """
        out = self._commit_ready()
        why = "the run failed" if failed else "the run ended"
        for pending in self._open_all():
            out.append(self._fail(pending, f"{why} before every shard was durable"))
        return out

    # -- internals ----------------------------------------------------------------------

    def _open(self, checkpoint_id: str) -> _Pending | None:
        pending = self._pending.get(checkpoint_id)
        return None if pending is None or pending.committed else pending

    def _open_all(self) -> list[_Pending]:
        return [p for p in self._pending.values() if not p.committed]

    def _commit_ready(self) -> list[Verdict]:
        """Commit every checkpoint whose shards are all durable, oldest step first."""
        out: list[Verdict] = []
        for pending in sorted(self._open_all(), key=lambda p: -1 if p.step is None else p.step):
            if not pending.committed:
                out.extend(self._try_commit(pending))
        return out

    def _records_of(self, path: Path, checkpoint_id: str) -> dict[int, ShardRecord]:
        return {k: r for k, r in shard_records(path).items() if r.checkpoint_id == checkpoint_id}

    def _records(self, pending: _Pending) -> dict[int, ShardRecord]:
        path = self._locate(pending)
        return {} if path is None else self._records_of(path, pending.checkpoint_id)

    def _locate(self, pending: _Pending) -> Path | None:
        """The directory of ``pending``: as announced, else found by its shard records."""
        if pending.path is not None:
            return Path(pending.path)
        root = checkpoints_root(self.run_dir)
        if not root.is_dir():
            return None
        for child in root.iterdir():
            step = parse_step_dir(child)
            if step is None or not child.is_dir():
                continue
            if self._records_of(child, pending.checkpoint_id):
                pending.path, pending.step = str(child), step
                self._persist()
                return child
        return None

    def _try_commit(self, pending: _Pending) -> list[Verdict]:
        cid = pending.checkpoint_id
        records = self._records(pending)
        num = self.num_stages
        if num is None:
            first = next(iter(records.values()), None)
            num = None if first is None else first.num_stages
        if num is None or any(k not in records for k in range(num)):
            return []
        path = self._locate(pending)
        assert path is not None
        if pending.metric is None:
            pending.metric = records[0].metric
        is_best = pending.metric is not None and self.metric_name is not None
        try:
            manifest = self._already_committed(path, cid) or commit_checkpoint(
                path,
                checkpoint_id=cid,
                num_stages=num,
                reason=pending.reason,
                run_id=self.run_id,
                metric_name=self.metric_name if is_best else None,
                metric=pending.metric if is_best else None,
                metric_mode=self.mode if is_best else None,
            )
            set_latest(self.run_dir, path)
            pruned = prune(
                self.run_dir,
                keep_last=self.keep_last,
                keep_best=self.keep_best,
                metric_name=self.metric_name,
                mode=self.mode,
                in_progress=[Path(p.path) for p in self._open_all() if p.path and p is not pending],
            )
        except CheckpointError as exc:
            return [self._fail(pending, f"commit refused: {exc}")]
        pending.committed = True
        self._persist()
        self.last_committed_step = manifest.step
        if is_best and pending.metric is not None:
            self.best = pending.metric
        # The logging hook announces the commit (from CheckpointCommitted).
        log.debug(
            "checkpoint committed",
            step=manifest.step,
            path=str(path),
            pruned=len(pruned),
            reason=pending.reason,
        )
        return [
            Committed(
                checkpoint_id=cid,
                step=manifest.step,
                path=str(path),
                bytes=manifest.bytes,
                # Wall clock: never negative, or consumers reject the event as malformed.
                duration_s=max(0.0, self.clock() - pending.requested_at),
                metric=pending.metric if is_best else None,
                reason=pending.reason,
                pruned=len(pruned),
            )
        ]

    def _already_committed(self, path: Path, checkpoint_id: str) -> Manifest | None:
        """The manifest of ``checkpoint_id`` in ``path`` if it is committed already.

        A coordinator killed between writing a manifest and publishing the
        verdict left it pending: recovered, it publishes the verdict now. A
        late shard event of a committed checkpoint changes nothing.
        """
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            return None
        return manifest if manifest.checkpoint_id == checkpoint_id else None

    def _fail(self, pending: _Pending, error: str) -> Failed:
        self._pending.pop(pending.checkpoint_id, None)
        self._failed = [*self._failed, pending.checkpoint_id][-_FAILED_KEPT:]
        self._persist()
        log.error("checkpoint failed", checkpoint_id=pending.checkpoint_id, error=error)
        return Failed(checkpoint_id=pending.checkpoint_id, step=pending.step or 0, error=error)

    def _state_path(self) -> Path:
        return checkpoints_root(self.run_dir) / COORDINATOR_FILE

    def _persist(self) -> None:
        path = self._state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        state = _State(pending=list(self._pending.values()), failed=self._failed)
        atomic_write_bytes(path, msgspec.json.encode(state))
