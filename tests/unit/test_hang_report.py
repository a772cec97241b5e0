"""Where a hung run is stuck: the watch's timeout, the stage holding the others up, stacks.

The stage reports are built by hand here; a real faulthandler dump (of a
thread this test blocks) is parsed. The launches that hang for real are
`tests/integration/test_hang.py`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from evtrain.launcher.hang import (
    HANG_FLOOR_S,
    HANG_STEP_FACTOR,
    Hang,
    HangWatch,
    StageState,
    parse_stacks,
    process_state,
)
from evtrain.stages.worker import StageReport


def report(rank: int, step: int, doing: str, doing_s: float = 30.0, **kw: object) -> StageReport:
    replicas = int(kw.pop("replicas", 1))  # type: ignore[call-overload]
    return StageReport(
        rank=rank,
        stage=rank // replicas,
        replica=rank % replicas,
        pid=1000 + rank,
        status="running",
        step=step,
        doing=doing,
        doing_s=doing_s,
        updated=100.0,
        **kw,  # type: ignore[arg-type]
    )


def state(r: StageReport, *, replicas: int = 1, silent_s: float | None = None) -> StageState:
    return StageState(report=r, replicas=replicas, silent_s=silent_s)


# ------------------------------------------------------------------------ the watch


def test_the_watch_fires_after_the_timeout_without_any_change() -> None:
    watch = HangWatch(5.0)
    reports = {0: report(0, 2, "RecvGrad m1 from stage 1"), 1: report(1, 2, "Forward m2")}
    assert not watch.observe(reports, 0.0)
    assert not watch.observe(reports, 4.9)
    assert watch.observe(reports, 5.0)
    assert watch.still_for(5.0) == 5.0


def test_any_change_of_step_or_instruction_restarts_the_clock() -> None:
    watch = HangWatch(5.0)
    assert not watch.observe({0: report(0, 2, "Forward m1")}, 0.0)
    assert not watch.observe({0: report(0, 2, "Forward m2")}, 4.0)  # the next microbatch
    assert not watch.observe({0: report(0, 2, "Forward m2")}, 8.0)
    assert watch.observe({0: report(0, 2, "Forward m2")}, 9.0)


def test_nothing_is_watched_before_a_stage_runs_or_when_switched_off() -> None:
    starting = {0: StageReport(rank=0, stage=0, pid=1, status="starting", updated=0.0)}
    watch = HangWatch(1.0)
    assert not watch.observe(starting, 0.0)
    assert not watch.observe(starting, 100.0)
    off = HangWatch(0.0)
    still = {0: report(0, 1, "Forward m0")}
    assert not off.observe(still, 0.0) and not off.observe(still, 1e6)


def test_the_default_timeout_grows_with_the_slowest_step() -> None:
    watch = HangWatch(None)
    assert watch.timeout == HANG_FLOOR_S
    watch.observe({0: report(0, 1, "")}, 0.0)
    watch.observe({0: report(0, 2, "")}, 100.0)  # a 100-second step
    assert watch.slowest_step_s == pytest.approx(100.0)
    assert watch.timeout == HANG_STEP_FACTOR * 100.0


# ---------------------------------------------------------------- who holds the others


def test_a_busy_stage_is_the_one_holding_the_others_up() -> None:
    hang = Hang.compose(
        [
            state(report(0, 2, "RecvGrad m1 from stage 1", 31.0)),
            state(report(1, 2, "Forward m2", 30.0)),
            state(report(2, 2, "RecvActivation m2 from stage 1", 29.0)),
        ],
        still_s=30.0,
    )
    assert hang.culprit.report.stage == 1 and hang.step == 3
    assert hang.headline() == "the run hung in step 3: stage 1 has been in Forward m2 for 30 s"
    lines = hang.summary(None).splitlines()
    assert lines[1] == "  stage 0: step 3, RecvGrad m1 from stage 1 for 31 s, waiting on stage 1"
    assert lines[3].endswith("waiting on stage 1")


def test_a_stage_that_stopped_reporting_comes_first() -> None:
    silent = StageState(
        report=report(2, 4, "Forward m0", 2.0), replicas=1, silent_s=12.0, process="stopped"
    )
    hang = Hang.compose(
        [state(report(0, 4, "Backward m3", 40.0)), silent], still_s=10.0
    )  # a busy stage too, but the silent one explains it
    assert hang.culprit is silent
    assert hang.headline() == (
        "the run hung in step 5: stage 2 stopped responding 12 s ago, in Forward m0; "
        "its process is stopped"
    )


def test_the_chain_of_waits_is_followed_to_its_end() -> None:
    # Stage 0 waits on 1, which waits on 2, which waits in the step's control exchange.
    hang = Hang.compose(
        [
            state(report(0, 7, "RecvGrad m3 from stage 1", 50.0)),
            state(report(1, 7, "RecvGrad m3 from stage 2", 45.0)),
            state(report(2, 7, "OptimizerStep", 40.0)),
        ],
        still_s=40.0,
    )
    assert hang.culprit.report.stage == 2
    assert "waiting on every stage (the step's control exchange)" in hang.headline()


def test_stages_waiting_on_each_other_are_a_deadlock() -> None:
    hang = Hang.compose(
        [
            state(report(0, 1, "RecvGrad m0 from stage 1", 20.0)),
            state(report(1, 1, "RecvActivation m1 from stage 0", 20.0)),
        ],
        still_s=20.0,
    )
    assert [s.report.stage for s in hang.cycle] == [0, 1]
    assert "stage 0 and stage 1 wait on each other" in hang.headline()


def test_replicas_wait_on_their_own_replica_of_the_peer_stage() -> None:
    # D=2: rank = stage * 2 + replica; replica 1 of stage 1 is the busy one.
    reports = [
        report(0, 3, "RecvGrad m0 from stage 1", 9.0, replicas=2),
        report(1, 3, "RecvGrad m0 from stage 1", 9.0, replicas=2),
        report(2, 3, "ReduceGrads", 8.0, replicas=2),
        report(3, 3, "Backward m1", 8.0, replicas=2),
    ]
    hang = Hang.compose([state(r, replicas=2) for r in reports], still_s=8.0)
    assert (hang.culprit.report.stage, hang.culprit.report.replica) == (1, 1)
    assert hang.culprit.name == "stage 1 replica 1"
    assert state(reports[1], replicas=2).waits_on_rank() == 3
    assert "waiting on its replicas (the gradient all-reduce)" in hang.summary(None)


def test_tensor_ranks_wait_on_their_own_tensor_rank_of_the_peer_stage() -> None:
    # T=2: rank = stage * 2 + tensor rank; tensor rank 1 of stage 1 is the busy one.
    reports = [
        StageReport(
            rank=rank,
            stage=rank // 2,
            tp=rank % 2,
            tp_size=2,
            pid=1000 + rank,
            status="running",
            step=3,
            doing=doing,
            doing_s=9.0 if rank < 2 else 8.0,
            updated=100.0,
        )
        for rank, doing in enumerate(
            ["RecvGrad m0 from stage 1", "RecvGrad m0 from stage 1", "Forward m1", "Backward m1"]
        )
    ]
    hang = Hang.compose([state(r) for r in reports], still_s=8.0)
    assert state(reports[1]).waits_on_rank() == 3
    assert state(reports[0]).waits_on_rank() == 2
    assert state(reports[1]).waits_on() == "stage 1"
    assert hang.culprit.report.stage == 1
    assert hang.culprit.name.startswith("stage 1 tensor rank ")


def test_phases_between_steps_name_the_completed_step_and_a_hook_wait() -> None:
    saving = state(report(0, 40, "SaveCheckpoint step 40", 99.0))
    assert saving.in_step == 40 and saving.busy
    assert saving.doing_words() == "SaveCheckpoint step 40 (writing a checkpoint)"
    evaluating = state(report(0, 40, "Evaluate step 40: RecvActivation m3 from stage 1"))
    assert evaluating.in_step == 40 and evaluating.waits_on() == "stage 1"
    plan = state(report(0, 0, "AwaitPlan (the checkpoint hook's plan)"))
    hang = Hang.compose([plan, state(report(1, 0, "Boundary 0"))], still_s=300.0)
    assert hang.culprit is plan and "waiting on a hook" in hang.headline()


# ------------------------------------------------------------------------- stacks


def _blocked_in_user_code(release: threading.Event) -> None:
    release.wait()  # THE LINE


def test_a_faulthandler_dump_is_parsed_and_the_user_frame_found() -> None:
    release = threading.Event()
    worker = threading.Thread(target=_blocked_in_user_code, args=(release,))
    worker.start()
    try:
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(dump, all_threads=True)
            dump.seek(0)
            text = dump.read()
    finally:
        release.set()
        worker.join()
    threads = parse_stacks(text)
    assert len(threads) >= 2
    this = state(report(0, 1, "Forward m0"))
    this = StageState(report=this.report, replicas=1, silent_s=None, threads=threads)
    # This test file is user code; threading's frames are not.
    assert "test_hang_report.py" in this.location()
    blocked = next(
        t for t in threads if any(f.function == "_blocked_in_user_code" for f in t.frames)
    )
    assert not blocked.frames[0].user  # threading.Event.wait
    assert any(f.user and f.text().endswith("release.wait()  # THE LINE") for f in blocked.frames)
    text = Hang.compose([this], still_s=1.0).text(flight_recorder=[])
    assert "   > " in text and "== stage 0 (rank 0, pid 1000)" in text


def test_the_state_of_a_stopped_process_is_read_from_proc() -> None:
    assert process_state(2**22 + 12345) == "gone"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "stopped":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert process_state(os.getpid()) == ""
    finally:
        child.kill()
        child.wait()
