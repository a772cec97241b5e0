"""The coordinator's state machine and the stages' calendar, without processes or a bus.

Shards are made on disk by hand here (a data file and its ``SHARD.json``):
the coordinator only ever looks at records, never at tensors.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evtrain.checkpoint import (
    ShardFile,
    ShardRecord,
    commit_checkpoint,
    latest_committed,
    list_checkpoints,
    read_manifest,
    sha256_file,
    stage_dir,
    step_dir,
    write_shard_record,
)
from evtrain.checkpoint.coordinator import Committed, Coordinator, Failed
from evtrain.checkpoint.plan import PlanState
from evtrain.events import CheckpointPlan, EvaluateNow, StopRun
from evtrain.stages.orders import Orders


class Clock:
    """Wall-clock time that moves only when a test moves it (manifests use the real time)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def write_shard(
    run_dir: Path,
    step: int,
    stage: int,
    cid: str,
    *,
    num_stages: int = 2,
    reason: str = "",
    metric: float | None = None,
    created: float | None = None,
) -> Path:
    path = step_dir(run_dir, step)
    spath = stage_dir(path, stage)
    spath.mkdir(parents=True, exist_ok=True)
    data = spath / "data.bin"
    data.write_bytes(b"x" * (10 + stage))
    write_shard_record(
        spath,
        ShardRecord(
            checkpoint_id=cid,
            step=step,
            stage=stage,
            num_stages=num_stages,
            layers=[stage, stage + 1],
            reason=reason,
            metric=metric,
            created=time.time() if created is None else created,
            bytes=data.stat().st_size,
            duration_s=0.1,
            blocked_s=0.01,
            files={"data.bin": ShardFile(size=data.stat().st_size, sha256=sha256_file(data))},
            tensors={},
            model_keys=[],
        ),
    )
    return path


@pytest.fixture
def clock() -> Clock:
    return Clock()


def coordinator(run_dir: Path, clock: Clock, **kwargs: object) -> Coordinator:
    c = Coordinator(run_dir, clock=clock, **kwargs)  # type: ignore[arg-type]
    c.num_stages = 2
    assert c.recover() == []
    return c


def test_commits_once_every_shard_is_durable(tmp_path: Path, clock: Clock) -> None:
    c = coordinator(tmp_path, clock)
    path = step_dir(tmp_path, 7)
    assert c.requested("p-7", step=7, path=str(path), reason="every 7 steps") == []
    write_shard(tmp_path, 7, 0, "p-7")
    assert c.shard_saved("p-7", step=7, path=str(path)) == []
    assert c.pending() == ["p-7"]
    clock.now += 2.5
    write_shard(tmp_path, 7, 1, "p-7")
    (verdict,) = c.shard_saved("p-7", step=7, path=str(path))
    assert isinstance(verdict, Committed)
    assert (verdict.step, verdict.reason, verdict.duration_s) == (7, "every 7 steps", 2.5)
    assert read_manifest(path).checkpoint_id == "p-7"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    assert c.pending() == [] and c.last_committed_step == 7


def test_checkpoints_commit_in_step_order_whatever_order_their_events_come(
    tmp_path: Path, clock: Clock
) -> None:
    # Each stage writes its shards in step order, but the stages' events
    # interleave: stage 1's event for step 5 can come before stage 0's for
    # step 4, when both checkpoints are already whole on disk.
    c = coordinator(tmp_path, clock)
    paths = {step: step_dir(tmp_path, step) for step in (4, 5)}
    for step, path in paths.items():
        c.requested(f"p-{step}", step=step, path=str(path), reason="r")
    write_shard(tmp_path, 4, 1, "p-4")
    assert c.shard_saved("p-4", step=4, path=str(paths[4])) == []
    for step in (4, 5):
        write_shard(tmp_path, step, 0, f"p-{step}")
    write_shard(tmp_path, 5, 1, "p-5")
    verdicts = c.shard_saved("p-5", step=5, path=str(paths[5]))
    assert [v.step for v in verdicts if isinstance(v, Committed)] == [4, 5]
    assert c.shard_saved("p-4", step=4, path=str(paths[4])) == []
    assert c.shard_saved("p-5", step=5, path=str(paths[5])) == []
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == paths[5].name
    assert c.last_committed_step == 5


def test_a_lost_shard_event_is_recovered_from_disk(tmp_path: Path, clock: Clock) -> None:
    c = coordinator(tmp_path, clock)
    path = step_dir(tmp_path, 4)
    c.requested("p-4", step=4, path=str(path), reason="r")
    write_shard(tmp_path, 4, 0, "p-4")
    write_shard(tmp_path, 4, 1, "p-4")  # neither shard event ever arrives
    (verdict,) = c.tick()
    assert isinstance(verdict, Committed) and verdict.step == 4


def test_best_checkpoint_records_its_metric(tmp_path: Path, clock: Clock) -> None:
    c = coordinator(tmp_path, clock, metric_name="accuracy", mode="max")
    path = step_dir(tmp_path, 9)
    write_shard(tmp_path, 9, 0, "b-9", metric=0.75)
    write_shard(tmp_path, 9, 1, "b-9", metric=0.75)
    (verdict,) = c.requested("b-9", step=9, path=str(path), reason="best accuracy", metric=0.75)
    assert isinstance(verdict, Committed) and verdict.metric == 0.75
    manifest = read_manifest(path)
    assert (manifest.metric_name, manifest.metric, manifest.metric_mode) == (
        "accuracy",
        0.75,
        "max",
    )
    assert c.best == 0.75


def test_failures_each_have_a_reason(tmp_path: Path, clock: Clock) -> None:
    c = coordinator(tmp_path, clock, timeout=60)
    for step in (1, 2):
        c.requested(f"c{step}", step=step, path=str(step_dir(tmp_path, step)), reason="r")
    write_shard(tmp_path, 2, 0, "c2")
    (failed,) = c.shard_failed("c1", 1, "disk full")
    assert isinstance(failed, Failed) and failed.error == "stage 1: disk full"
    (died,) = c.stage_failed(1)
    assert isinstance(died, Failed) and died.checkpoint_id == "c2" and "stage 1" in died.error
    c.requested("c3", step=3, path=str(step_dir(tmp_path, 3)), reason="r")
    clock.now += 61
    (late,) = c.tick()
    assert isinstance(late, Failed) and late.checkpoint_id == "c3" and "timed out" in late.error
    assert c.pending() == []
    # A failed id never commits, even if its shards appear afterwards.
    write_shard(tmp_path, 2, 1, "c2")
    assert c.shard_saved("c2", step=2, path=str(step_dir(tmp_path, 2))) == []


def test_run_end_closes_the_books(tmp_path: Path, clock: Clock) -> None:
    c = coordinator(tmp_path, clock)
    done, missing = step_dir(tmp_path, 5), step_dir(tmp_path, 6)
    c.requested("d", step=5, path=str(done), reason="r")
    c.requested("m", step=6, path=str(missing), reason="r")
    write_shard(tmp_path, 5, 0, "d")
    write_shard(tmp_path, 5, 1, "d")
    write_shard(tmp_path, 6, 0, "m")
    verdicts = {v.checkpoint_id: v for v in c.run_ended(failed=False)}
    assert isinstance(verdicts["d"], Committed)
    assert isinstance(verdicts["m"], Failed) and "the run ended" in verdicts["m"].error
    assert c.pending() == []


def test_a_restarted_coordinator_commits_what_completed_meanwhile(
    tmp_path: Path, clock: Clock
) -> None:
    first = coordinator(tmp_path, clock)
    first.issued("own", "every 5 s")  # asked for, then the coordinator was killed
    write_shard(tmp_path, 3, 0, "own")
    write_shard(tmp_path, 3, 1, "own")
    # A plan checkpoint it never heard of at all:
    write_shard(tmp_path, 8, 0, "plan-8", reason="every 8 steps")
    write_shard(tmp_path, 8, 1, "plan-8", reason="every 8 steps")
    # ... and one still being written:
    write_shard(tmp_path, 9, 0, "plan-9")
    second = Coordinator(tmp_path, clock=clock)
    second.num_stages = 2
    verdicts = {v.checkpoint_id: v for v in second.recover()}
    assert set(verdicts) == {"own", "plan-8"}
    assert all(isinstance(v, Committed) for v in verdicts.values())
    assert read_manifest(step_dir(tmp_path, 8)).reason == "every 8 steps"
    assert second.pending() == ["plan-9"]
    write_shard(tmp_path, 9, 1, "plan-9")
    (verdict,) = second.shard_saved("plan-9", step=9, path=str(step_dir(tmp_path, 9)))
    assert isinstance(verdict, Committed)


def test_a_commit_whose_verdict_was_lost_is_announced_after_a_restart(
    tmp_path: Path, clock: Clock
) -> None:
    first = coordinator(tmp_path, clock)
    path = step_dir(tmp_path, 6)
    first.requested("c6", step=6, path=str(path), reason="r")
    write_shard(tmp_path, 6, 0, "c6")
    write_shard(tmp_path, 6, 1, "c6")
    # Killed right after writing the manifest: the id is still pending in its file.
    commit_checkpoint(path, checkpoint_id="c6", num_stages=2)
    second = Coordinator(tmp_path, clock=clock)
    (verdict,) = second.recover()
    assert isinstance(verdict, Committed) and verdict.checkpoint_id == "c6"
    assert second.pending() == []


def test_a_request_answered_by_another_checkpoint_is_not_pending(
    tmp_path: Path, clock: Clock
) -> None:
    c = coordinator(tmp_path, clock)
    c.issued("mine", "every 5 s")
    c.requested("plan-4", step=4, path=str(step_dir(tmp_path, 4)), reason="r", fulfils=["mine"])
    assert c.pending() == ["plan-4"]


def test_run_start_settles_stale_requests_and_abandoned_futures(
    tmp_path: Path, clock: Clock
) -> None:
    c = coordinator(tmp_path, clock)
    for step in (10, 20):
        write_shard(tmp_path, step, 0, f"s{step}", created=clock.now)
        write_shard(tmp_path, step, 1, f"s{step}", created=clock.now)
        c.requested(f"s{step}", step=step, path=str(step_dir(tmp_path, step)), reason="r")
    c.issued("lost", "every 5 s")
    clock.now += 100
    # The run is resumed from step 10: step 20 belongs to an abandoned future.
    (lost,) = c.run_started(start_step=10, started_at=clock.now)
    assert isinstance(lost, Failed) and "restarted" in lost.error
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-00000010" in names
    assert any(n.startswith("step-00000020.superseded-") for n in names)
    assert [i.step for i in list_checkpoints(tmp_path)] == [10]


# ------------------------------------------------------------------ the stage calendar


def test_commands_apply_at_their_boundary_late_or_refused() -> None:
    orders = Orders(last_step=100)
    ahead = StopRun(command_id="a", at_step=14)
    now = StopRun(command_id="n")
    late = StopRun(command_id="l", at_step=3)
    beyond = StopRun(command_id="b", at_step=101)
    assert orders.accept(ahead, 7).step == 14 and orders.pending() == 1
    taken = orders.accept(now, 7)
    assert (taken.step, taken.ok, taken.late) == (7, True, False)
    taken = orders.accept(late, 7)
    assert (taken.step, taken.ok, taken.late) == (7, True, True)
    taken = orders.accept(beyond, 7)
    assert not taken.ok and "last step (100)" in taken.detail
    assert orders.due(7, [now, late]) == [now, late]
    assert orders.due(13, []) == []
    assert orders.due(14, []) == [ahead] and orders.pending() == 0


def test_standing_evaluations_by_steps_and_epochs() -> None:
    # 10 batches per epoch, 3 batches per step: epochs end within steps 4, 7, 10.
    orders = Orders(last_step=20, batches_per_step=3, batches_per_epoch=10)
    assert [b for b in range(1, 21) if orders.epochs_ended(b)] == [4, 7, 10, 14, 17, 20]
    assert orders.epochs_ended(10) == [2]
    assert not orders.add_evaluation(EvaluateNow(command_id="s", every=5), 2)
    assert orders.add_evaluation(EvaluateNow(command_id="e", every_epochs=2), 7)
    due = [b for b in range(1, 21) if orders.evaluation_due(b)]
    assert due == [5, 7, 10, 14, 15, 20]
    assert orders.add_evaluation(EvaluateNow(command_id="once"), 3)  # a one-off evaluates now


def test_plan_decides_alike_on_every_stage() -> None:
    plan = CheckpointPlan(
        command_id="0123456789abcdef-rest",
        path="/r/step-{step:08d}",
        every_steps=7,
        best_metric="accuracy",
        mode="max",
        best=0.5,
    )
    state = PlanState(plan)
    assert [s for s in range(1, 22) if state.periodic(s)] == [7, 14, 21]
    assert state.evaluated(0.4) is None
    assert state.evaluated(math.nan) is None
    assert state.evaluated(0.6) == "best accuracy" and state.best == 0.6
    assert state.evaluated(0.6) is None  # equal is not better
    assert state.checkpoint_id(14) == "0123456789abcdef-00000014"
    orders = Orders(last_step=10)
    orders.set_plan(plan)
    assert orders.plan is not None
    orders.plan.evaluated(0.9)
    orders.set_plan(plan)  # a restarted hook sends its plan again, with an older best
    assert orders.plan.best == 0.9


def test_ckpt_commit_verifies_and_commits_what_no_coordinator_did(tmp_path: Path) -> None:
    """`evtrain ckpt commit`: complete checkpoints after the latest committed one are
    committed and the newest becomes the resume point; an incomplete one, one whose
    file does not match its hash and one older than the latest stay uncommitted."""
    for stage in (0, 1):
        write_shard(tmp_path, 10, stage, "c10")
    commit_checkpoint(step_dir(tmp_path, 10), checkpoint_id="c10", num_stages=2)
    for step in (5, 20, 30, 40):
        for stage in (0, 1):
            write_shard(tmp_path, step, stage, f"c{step}")
    write_shard(tmp_path, 50, 0, "c50")  # stage 1 never finished
    (stage_dir(step_dir(tmp_path, 40), 1) / "data.bin").write_bytes(b"y" * 11)  # same size
    done = subprocess.run(
        [sys.executable, "-m", "evtrain", "ckpt", "commit", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    committed = {c.step for c in list_checkpoints(tmp_path) if c.committed}
    assert committed == {10, 20, 30}
    assert "2 checkpoint(s) committed; latest committed:" in done.stdout
    assert "(step 30)" in done.stdout
    latest = latest_committed(tmp_path)
    assert latest is not None and latest.step == 30
