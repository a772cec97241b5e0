"""``evtrain top``: the dashboard's model against a real broker and the fake run; its
drawing; the whole command under a pseudo-terminal; its one-line usage errors.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from helpers.console_helpers import LOG_LINE, Terminal
from helpers.hook_helpers import fake_args, loss_at, run_hooks
from rich.console import Console

from evtrain.bus.address import BusAddress
from evtrain.bus.state_service import fetch_snapshot
from evtrain.cli import main
from evtrain.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequested,
    HookStarted,
    Message,
    RunEnded,
    RunStarted,
    StepEnded,
    StragglerReported,
    TensorRankStepEnded,
)
from evtrain.hooks import Hook, HookRunner, on
from evtrain.launcher.run_record import process_start_ticks, write_run_record
from evtrain.tools.top import (
    CheckpointView,
    HookView,
    RunView,
    StageView,
    TopModel,
    TopView,
    render,
)

MIB = 1024 * 1024
DEADLINE = 30.0


class FailsAtTheEnd(Hook):
    """A hook whose handler raises once, when the run ends."""

    name = "fails_at_end"

    @on(RunEnded)
    def boom(self, ev: RunEnded) -> None:
        raise RuntimeError("boom at the end")


def snapshot_has(bus: BusAddress, wanted: Callable[[list[Message]], bool]) -> None:
    """Poll the broker's state until ``wanted`` holds for it."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if wanted(fetch_snapshot(bus, timeout=1.0)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the broker's state never became what was wanted: {fetch_snapshot(bus)}")


def both_stages_past(step: int) -> Callable[[list[Message]], bool]:
    def wanted(state: list[Message]) -> bool:
        steps = {m.stage: m.step for m in state if isinstance(m, StepEnded)}
        return len(steps) == 2 and min(steps.values()) >= step

    return wanted


def hook_attached(source: str) -> Callable[[list[Message]], bool]:
    return lambda state: any(isinstance(m, HookStarted) and m.source == source for m in state)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never came: {what}"
        await anyio.sleep(0.05)


# -- the model ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_model_joins_mid_run_and_follows_it_to_the_end(
    bus: BusAddress, procs: Any, tmp_path: Path
) -> None:
    other = FailsAtTheEnd()
    other_runner = HookRunner([other], bus)
    model = TopModel(local=True)
    runner = HookRunner([model], bus, name="top-test")
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_runner.run)
            await other_runner.ready.wait()
            # The run pauses before step 8, heartbeats only, until the model has joined.
            resume = tmp_path / "resume"
            fake = procs.start(
                *fake_args(
                    bus,
                    steps=40,
                    step_time=0.02,
                    eval_every=10,
                    pause_at=8,
                    pause_until=resume,
                    drops_at=20,
                    gaps_at=21,
                )
            )
            await anyio.to_thread.run_sync(snapshot_has, bus, both_stages_past(3))
            tg.start_soon(runner.run)
            await runner.ready.wait()

            # Known at once from the broker's state: the run, its stages, the hooks.
            joined = model.view()
            assert joined.run.status == "running"
            assert (joined.run.name, joined.run.num_stages, joined.run.max_steps) == ("fake", 2, 40)
            assert [s.stage for s in joined.stages] == [0, 1]
            assert all(s.step is not None and 3 <= s.step < 40 for s in joined.stages)
            assert [h.source for h in joined.hooks] == [f"hook/{other_runner.name}"]
            resume.touch()

            for ev in (
                CheckpointRequested(checkpoint_id="a", step=20, path="/ck/a"),
                CheckpointCommitted(checkpoint_id="a", step=20, path="/ck/a", bytes=3 * MIB),
                CheckpointRequested(checkpoint_id="b", step=30, path="/ck/b"),
                CheckpointFailed(checkpoint_id="b", step=30, stage=1, error="disk full"),
                CheckpointRequested(checkpoint_id="c", step=40, path="/ck/c"),
            ):
                other.publish(ev)

            _, err = await anyio.to_thread.run_sync(fake.communicate)
            assert fake.returncode == 0, err
            # The other hook's error comes after the run's end: wait for both.
            await until(
                lambda: (
                    model.view().run.status == "completed"
                    and sum(h.errors for h in model.view().hooks) >= 1
                ),
                "the run's end and the hook error",
            )
            view = model.view()
            runner.stop()
            other_runner.stop()

    run = view.run
    assert (run.status, run.step) == ("completed", 40)
    assert run.loss == pytest.approx(loss_at(40))
    assert run.step_time_s is not None and run.samples_per_s is not None
    # Every stage waits 20% of its step in the fake run; 1F1B, 2 stages x 4 microbatches: 1/5.
    assert run.bubble == pytest.approx(0.2)
    assert run.bubble_theory == pytest.approx(0.2)
    assert run.eval_step == 40 and run.eval_metrics["loss"] == 1.0

    assert [s.stage for s in view.stages] == [0, 1]
    for stage in view.stages:
        assert stage.step == 40
        assert stage.status == "stopped"
        assert stage.shares == pytest.approx({"fwd": 0.3, "bwd": 0.4, "wait": 0.2, "other": 0.1})
        assert stage.step_time_s == pytest.approx(0.02 * (1 + 0.01 * stage.stage))
        assert stage.memory_bytes == (100 + 50 * stage.stage) * MIB + 40 * 1024
        assert stage.heartbeat_age_s is not None and stage.heartbeat_age_s < DEADLINE

    (hook,) = view.hooks
    assert hook.hooks == ("fails_at_end",)
    assert (hook.pid, hook.alive) == (os.getpid(), True)
    assert hook.errors == 1 and "boom at the end" in hook.last_error
    assert hook.last_event_age_s is not None

    assert view.drops == {"stage/0": 5}
    assert view.gaps.get("stage/0") == 3

    ckpt = view.checkpoints
    assert (ckpt.last_step, ckpt.last_path, ckpt.last_bytes) == (20, "/ck/a", 3 * MIB)
    assert (ckpt.commits, ckpt.failures, ckpt.saving) == (1, 1, (40,))
    assert ckpt.last_failure == "step 30: stage 1: disk full"

    screen = draw(view)
    assert "completed" in screen and "disk full" in screen
    assert "dropped by publisher: stage/0 5" in screen
    assert re.search(r"^\s*1\s+stopped\s+40\s+20\.2ms\s+30%\s+40%\s+20%\s+10%", screen, re.M)


@pytest.mark.anyio
async def test_model_shows_every_replica_and_counts_each_step_once(
    bus: BusAddress, procs: Any
) -> None:
    """2 stages x 2 replicas: a row per stage process, the run's figures once per step."""
    model = TopModel(local=True)
    await run_hooks([model], bus, procs, steps=20, step_time=0.02, stages=2, dp=2)
    view = model.view()
    run = view.run
    assert (run.status, run.step, run.data_parallel) == ("completed", 20, 2)
    assert run.loss == pytest.approx(loss_at(20))
    assert run.samples_per_s is not None and run.step_time_s is not None
    # 32 samples a step (the global batch), however many replicas report it.
    assert 20 < run.samples_per_s * run.step_time_s < 48
    assert run.bubble == pytest.approx(0.2)

    assert [(s.stage, s.replica) for s in view.stages] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for stage in view.stages:
        assert (stage.step, stage.status) == (20, "stopped")
        assert stage.shares == pytest.approx({"fwd": 0.3, "bwd": 0.4, "wait": 0.2, "other": 0.1})
        # Replica 1 is 10% slower in the fake run, and holds 10 MiB more.
        expected = 0.02 * (1 + 0.01 * stage.stage) * (1 + 0.1 * stage.replica)
        assert stage.step_time_s == pytest.approx(expected)
        megabytes = 100 + 50 * stage.stage + 10 * stage.replica
        assert stage.memory_bytes == megabytes * MIB + 20 * 1024
        assert stage.heartbeat_age_s is not None

    screen = draw(view)
    assert "1f1b, 2 stages x 4 microbatches, 2 replicas" in screen
    assert re.search(r"^\s*stage\s+replica\s+status", screen, re.M)
    assert re.search(r"^\s*1\s+1\s+stopped\s+20\s+22\.2ms\s+30%", screen, re.M), screen


# -- the drawing ---------------------------------------------------------------------------


def draw(view: TopView) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(view, bus="ipc:///tmp/evt-x"))
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def test_event_text_is_shown_literally_never_as_markup_or_escapes() -> None:
    hostile = "\x1b[2J[bold red]pwn[/] \u202e"
    view = TopView(
        run=RunView(status="failed", name=hostile, run_id="r1", schedule="1f1b", reason=hostile),
        stages=(
            StageView(0, "failed", 7, 0.5, {}, None, 12.0, error=hostile),
            StageView(1, "silent", None, None, {}, 2 * MIB, 75.0),
        ),
        hooks=(HookView("hook/x", ("x",), 42, False, 3.0, None, 2, hostile),),
        drops={},
        gaps={},
        checkpoints=CheckpointView(),
    )
    screen = draw(view)
    assert "\x1b" not in screen and "\u202e" not in screen
    assert "\\x1b[2J[bold red]pwn[/] \\u202e" in screen
    assert "no drops, no gaps" in screen and "none committed" in screen
    assert "gone" in screen and "1m15s ago" in screen


def test_a_stage_long_in_one_instruction_is_shown_with_it() -> None:
    """The instruction a stage's heartbeat names shows under the table once the stage has
    been in it for DOING_SHOWN_AFTER_S; a short one does not clutter the screen."""
    stuck = StageView(
        0, "running", 3, 0.5, {}, None, 0.4, doing="RecvGrad m2 from stage 1", doing_s=41.0
    )
    busy = StageView(1, "running", 3, 0.5, {}, None, 0.4, doing="Forward m3", doing_s=0.2)
    view = TopView(
        run=RunView(status="running", name="x", run_id="r1", schedule="1f1b"),
        stages=(stuck, busy),
        hooks=(),
        drops={},
        gaps={},
        checkpoints=CheckpointView(),
    )
    screen = draw(view)
    assert re.search(r"stage 0:\s+in RecvGrad m2 from stage 1 for 41 s", screen), screen
    assert "Forward m3" not in screen


def test_a_straggler_is_shown_while_it_is_one() -> None:
    """The launcher's straggler reports: a whole stage marks each of its replicas, until
    it recovers."""
    from evtrain.tools.replay import ReplayRunner

    started = RunStarted(
        name="x", num_stages=2, num_microbatches=4, schedule="1f1b", max_steps=50,
        batch_size=8, data_parallel=2, run_id="r1", ts=1.0,
    )  # fmt: skip

    def report(straggling: bool) -> StragglerReported:
        return StragglerReported(
            step=20, stage=1, whole_stage=True, slowdown=2.4, straggling=straggling,
            run_id="r1",
        )  # fmt: skip

    model = TopModel()
    runner = ReplayRunner([model])
    anyio.run(runner.replay, [started, report(True)])
    screen = draw(model.view())
    # Replica 0 is named as the stage, replica 1 with its number.
    for where in ("stage 1", "stage 1 replica 1"):
        assert re.search(rf"{where}:\s+straggler: 2.4x as slow as expected", screen), screen
    assert not re.search(r"stage 0[ :].*straggler", screen)
    anyio.run(runner.replay, [report(False)])
    assert "straggler" not in draw(model.view())


def test_every_tensor_rank_has_a_row_and_a_slow_one_is_marked_alone() -> None:
    from evtrain.tools.replay import ReplayRunner

    started = RunStarted(
        name="x", num_stages=2, num_microbatches=4, schedule="1f1b", max_steps=50,
        batch_size=8, data_parallel=2, tensor_parallel=4, run_id="r1", ts=1.0,
    )  # fmt: skip
    own = TensorRankStepEnded(
        step=20, stage=0, replica=1, tp=3, duration_s=0.5, forward_s=0.25, backward_s=0.15,
        comm_wait_s=0.05, peak_memory_bytes=3 * MIB, run_id="r1",
    )  # fmt: skip
    slow = StragglerReported(
        step=20, stage=0, replica=1, tp=3, slowdown=2.2, straggling=True, run_id="r1"
    )
    model = TopModel()
    runner = ReplayRunner([model])
    anyio.run(runner.replay, [started, own, slow])
    view = model.view()
    # P x D x T rows, each replica's tensor ranks under it.
    places = [(s.stage, s.replica, s.tp) for s in view.stages]
    assert places == [(s, d, t) for s in range(2) for d in range(2) for t in range(4)]
    screen = draw(view)
    assert "1f1b, 2 stages x 4 microbatches, 2 replicas, 4 tensor ranks" in screen, screen
    assert re.search(r"^\s*stage\s+replica\s+tp\s+status", screen, re.M), screen
    # Its own step: time, shares (fwd, bwd, wait, other) and memory.
    row = r"^\s*0\s+1\s+3\s+\S+\s+20\s+500\.0ms\s+50%\s+30%\s+10%\s+10%\s+3\.0MiB"
    assert re.search(row, screen, re.M), screen
    assert re.search(r"stage 0 replica 1 tensor rank 3:\s+straggler: 2.2x as slow", screen)
    assert len(re.findall("straggler", screen)) == 1, screen
    anyio.run(runner.replay, [msgspec.structs.replace(slow, straggling=False)])
    assert "straggler" not in draw(model.view())


def test_waiting_for_a_run_names_the_bus() -> None:
    view = TopModel().view()
    assert view.run.status == "waiting" and view.stages == () and view.hooks == ()
    assert "waiting for a run on ipc:///tmp/evt-x" in draw(view)


# -- the command under a pseudo-terminal ------------------------------------------------


class Pty:
    """A pseudo-terminal whose output a thread keeps reading (a full one would block)."""

    def __init__(self, rows: int = 40, columns: int = 160) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def screen(self) -> Terminal:
        """What the terminal shows now."""
        return Terminal(self.output)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while text not in (shown := "\n".join(self.screen().lines())):
            assert time.monotonic() < deadline, f"{text!r} never shown:\n{shown}"
            time.sleep(0.05)

    def start(self, procs: Any, *args: str) -> subprocess.Popen[str]:
        """``evtrain ARGS`` with this terminal as its controlling terminal."""
        return procs.evtrain(
            *args,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            # After the new session: make the pty its terminal, so Ctrl-C is SIGINT.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            # Readline in this process may have exported COLUMNS=80 to the C environment,
            # which a child inherits unless given its own: the pty's size must count.
            env=dict(os.environ),
        )

    def line_mode(self) -> bool:
        """Whether the terminal is back in its usual cooked, echoing mode."""
        lflag = termios.tcgetattr(self.slave)[3]
        return bool(lflag & termios.ICANON and lflag & termios.ECHO)

    def close(self) -> None:
        os.close(self.slave)
        self._reader.join(timeout=5)
        os.close(self.master)


@pytest.fixture
def terminal() -> Iterator[Pty]:
    term = Pty()
    try:
        yield term
    finally:
        term.close()


@pytest.fixture
def run_dir(bus: BusAddress) -> Iterator[Path]:
    """A run directory whose run.json says a launch (this test process) runs on ``bus``."""
    directory = Path(tempfile.mkdtemp(prefix="evt-top-"))
    write_run_record(
        directory,
        {
            "status": "running",
            "bus": str(bus),
            "host": socket.gethostname(),
            "launcher_pid": os.getpid(),
            "launcher_start": process_start_ticks(os.getpid()),
        },
    )
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_top_of_a_run_directory_shows_both_stages_and_exits_at_the_end(
    bus: BusAddress, run_dir: Path, procs: Any, terminal: Pty
) -> None:
    top = terminal.start(procs, "top", str(run_dir), "--exit-on-run-end", "--interval", "0.25")
    snapshot_has(bus, hook_attached(f"hook/top-{top.pid}"))
    fake = procs.start(*fake_args(bus, steps=30, step_time=0.01, stages=2))
    summary = json.loads(fake.communicate(timeout=DEADLINE)[0].strip().splitlines()[-1])
    assert summary["status"] == "completed"
    assert top.wait(timeout=DEADLINE) == 0

    screen = terminal.screen()
    shown = "\n".join(screen.lines())
    assert "fake" in shown and "completed" in shown and "step 30/30" in shown
    for stage in (0, 1):
        assert re.search(rf"^\s*{stage}\s+stopped\s+30\s", shown, re.M), shown
    assert "\x1b[?25h" in terminal.output[-200:]  # the cursor is back
    assert terminal.line_mode()
    # Its own log lines print above the dashboard, each on a line of its own.
    logs = [line for line in screen.finished if LOG_LINE.search(line)]
    assert any("hooks attached" in line for line in logs), screen.finished
    for line in logs:
        assert LOG_LINE.match(line) and "evtrain top" not in line and "%" not in line, line


@pytest.mark.parametrize("key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_q_and_ctrl_c_leave_the_dashboard_cleanly(
    bus: BusAddress, procs: Any, terminal: Pty, key: bytes
) -> None:
    top = terminal.start(procs, "top", "--bus", str(bus))
    snapshot_has(bus, hook_attached(f"hook/top-{top.pid}"))
    terminal.wait_for("q quits")
    assert not terminal.line_mode()  # keys arrive one by one, unechoed
    os.write(terminal.master, key)
    assert top.wait(timeout=DEADLINE) == 0
    assert "waiting for a run on" in "\n".join(terminal.screen().lines())
    assert terminal.line_mode()


# -- usage errors ---------------------------------------------------------------------------


@pytest.fixture
def dirs() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="evt-top-"))
    (directory / "empty").mkdir()
    (directory / "done").mkdir()
    write_run_record(directory / "done", {"status": "completed", "bus": "ipc:///tmp/evt-gone"})
    (directory / "dead").mkdir()
    write_run_record(
        directory / "dead",
        {
            "status": "running",
            "bus": "ipc:///tmp/evt-gone",
            "host": socket.gethostname(),
            "launcher_pid": 2**22 + 1,  # above the largest pid Linux allows (2**22)
        },
    )
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{dirs}/missing"], "no such directory"),
        (["{dirs}/empty"], "no run.json there"),
        (["{dirs}/done"], "is not running (run.json: status completed)"),
        (["{dirs}/dead"], "its launcher (pid 4194305) is gone"),
        (["--bus", "ipc:///tmp/evt-top-nowhere"], "no bus at ipc:///tmp/evt-top-nowhere"),
        (["--bus", "tcp://nohost"], "bad bus address"),
        (["--bus", "ipc:///tmp/x", "--interval", "0.1"], "--interval must be at least 0.25 s"),
        ([], "give RUN_DIR or --bus ADDRESS"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    args: list[str],
    message: str,
    dirs: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("EVTRAIN_BUS", raising=False)
    assert main(["top", *(a.format(dirs=dirs) for a in args)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("evtrain top: error: ") and "\n" not in err, err
    assert message in err


def test_top_of_a_run_directory_takes_the_launchs_curve_keys(tmp_path: Path) -> None:
    from evtrain.cli.top import bus_of_run_dir
    from evtrain.launcher.run_record import write_run_record

    record = {"status": "running", "bus": "tcp://127.0.0.1:5999", "launcher_pid": os.getpid()}
    write_run_record(tmp_path, {**record, "curve_dir": "/keys"})
    assert bus_of_run_dir(str(tmp_path)) == ("tcp://127.0.0.1:5999", "/keys")
    write_run_record(tmp_path, {**record, "curve_dir": None})
    assert bus_of_run_dir(str(tmp_path)) == ("tcp://127.0.0.1:5999", None)
