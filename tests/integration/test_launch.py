"""`evtrain launch` end to end: real launcher, broker, elastic agent, stage workers, hooks.

Every launch runs with a unique marker in its environment, which every
process it starts inherits; a test checks through /proc that none of them
outlives the launcher, and kills any that do.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest
import structlog
from helpers.console_helpers import LOG_LINE, PROGRESS_TEXT, Terminal
from helpers.launch_helpers import (
    launch_env,
    new_marker,
    read_records,
    run_launch,
    start_launch,
    steps_recorded,
    wait_for_records,
    wait_no_marked,
    write_spec,
)

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.cli import build_parser, main, resolve_log_level
from evtrain.events import (
    CheckpointCommitted,
    EvalEnded,
    EvalStarted,
    Message,
    RunEnded,
    RunStarted,
    StageFailed,
    StageStopped,
    StepEnded,
)
from evtrain.launcher.hook_supervisor import HookSupervisor, hook_command
from evtrain.launcher.progress import Progress, RunConsole
from evtrain.logs import LAUNCHER_CONSOLE_ENV, LOG_STREAM, configure_logging


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    return lines[0]


# ---------------------------------------------------------------- in-process parts


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _step(
    step: int, ts: float, loss: float | None = 0.5, stage: int = 1, memory: int | None = None
) -> StepEnded:
    return StepEnded(step=step, stage=stage, loss=loss, samples=32, ts=ts, peak_memory_bytes=memory)


def _started(max_steps: int = 10) -> RunStarted:
    return RunStarted(
        name="t",
        num_stages=2,
        num_microbatches=4,
        schedule="1f1b",
        max_steps=max_steps,
        batch_size=32,
    )


def test_progress_line_rates_eta_and_summary() -> None:
    progress = Progress()
    progress.update(_started())
    for i in range(1, 5):
        progress.update(_step(i, ts=100.0 + 0.5 * i, loss=1.0 / i, memory=3 << 20))
        progress.update(_step(i, ts=100.0 + 0.5 * i, loss=None, stage=0, memory=i << 20))
    line = progress.line()
    assert line.startswith("step 4/10  loss 0.25  ")
    assert "64.0 samples/s" in line and "2.0 steps/s" in line and "ETA 0:03" in line
    progress.update(EvalEnded(step=4, stage=1, metrics={"loss": 0.3, "acc": 0.9}))
    assert progress.eval_text() == "eval@4 loss 0.3 acc 0.9"
    progress.update(RunEnded(status="completed", step=4))
    summary = progress.summary(status="completed", wall_s=75)
    assert summary.splitlines()[0] == "run completed: 4/10 steps in 1:15 (2.0 steps/s)"
    assert "final loss: 0.25" in summary
    assert "last eval (step 4): loss 0.3 acc 0.9" in summary
    assert summary.endswith("peak memory: s0=4.0MiB s1=3.0MiB")


def test_plain_console_a_line_per_tenth_and_per_eval_no_control_codes() -> None:
    out, err = _Stream(tty=False), _Stream(tty=False)
    console = RunConsole(out, err, interval=1000.0)
    assert not console.live and console.child_output is None
    console.start()
    console.update(_started(max_steps=20))
    for i in range(1, 21):
        console.update(_step(i, ts=float(i)))
        if i == 10:
            console.update(EvalEnded(step=10, stage=1, metrics={"loss": 0.3, "acc": 0.9}))
    console.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == [
        f"{i}/20" for i in range(2, 21, 2)
    ]
    assert lines[5] == "eval at step 10: loss 0.3 acc 0.9"  # right after step 10's line
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert err.getvalue() == ""


def test_plain_console_a_line_at_least_every_interval() -> None:
    out = _Stream(tty=False)
    console = RunConsole(out, _Stream(tty=False), interval=5.0)
    console.update(_started(max_steps=1000))
    for i in range(1, 4):
        console.update(_step(i, ts=float(i)))
    now = time.monotonic()
    console.tick(now=now)
    assert out.getvalue() == ""
    console.tick(now=now + 6)
    assert out.getvalue().startswith("step 3/1000  loss 0.5")
    console.tick(now=now + 12)  # no step since: nothing new to say
    console.close()
    assert len(out.getvalue().splitlines()) == 1


def test_a_stalled_run_says_since_when_instead_of_a_rate_no_longer_true() -> None:
    """No step for far longer than a step: the line says so instead of the old rate and
    ETA, live and plain (a line a minute, not one per interval)."""
    out = _Stream(tty=False)
    console = RunConsole(out, _Stream(tty=False), interval=5.0)
    console.update(_started(max_steps=1000))
    for i in range(1, 4):
        console.update(_step(i, ts=100.0 + 0.1 * i))  # 10 steps/s
    arrived = console.progress.stats.last_step_arrived
    assert arrived is not None
    assert "steps/s" in console.progress.rates_text(arrived + 9)
    assert console.progress.stats.stalled_s(arrived + 9) is None
    assert console.progress.rates_text(arrived + 75) == "loss 0.5  no step for 1:15"
    console.tick(now=arrived + 75)
    console.tick(now=arrived + 100)  # less than a minute after the last line
    console.tick(now=arrived + 140)
    assert out.getvalue().splitlines() == [
        "step 3/1000  loss 0.5  no step for 1:15",
        "step 3/1000  loss 0.5  no step for 2:20",
    ]
    console.update(EvalStarted(step=3, stage=1, num_batches=4))
    assert console.progress.stats.stalled_s(arrived + 200) is None  # evaluating is no stall
    console.close()


def test_quiet_console_shows_only_the_story_and_warnings() -> None:
    out, err = _Stream(tty=True), _Stream(tty=True)
    console = RunConsole(out, err, quiet=True)
    assert not console.live and console.child_output is None and console.child_env() == {}
    console.start()
    console.update(_started())
    console.update(_step(1, ts=1.0))
    console.update(EvalEnded(step=1, stage=1, metrics={"loss": 0.3}))
    console.say("run completed")
    console.warn("careful")
    console.close()
    assert out.getvalue() == "run completed\n"
    assert err.getvalue() == "evtrain launch: warning: careful\n"


def test_live_console_prints_log_lines_and_child_output_above_the_bar() -> None:
    terminal = _Stream(tty=True)
    console = RunConsole(terminal, terminal)
    assert console.live and console.shares_terminal
    assert console.child_env() == {LAUNCHER_CONSOLE_ENV: "1"}
    fd = console.child_output
    assert fd is not None
    console.say("header")
    console.start()
    console.update(_started(max_steps=4))
    console.update(_step(1, ts=1.0))
    console.update(_step(2, ts=2.0))
    LOG_STREAM.write("12:00:00 [info     ] from the launcher\n")
    os.write(fd, b"12:00:01 [info     ] from a ")  # a child's line in two writes
    os.write(fd, b"hook\n")
    deadline = time.monotonic() + 10
    while "from a hook" not in terminal.getvalue():  # the relay reads in its own thread
        assert time.monotonic() < deadline, "the child's line never reached the terminal"
        time.sleep(0.01)
    console.update(EvalEnded(step=2, stage=1, metrics={"loss": 0.25}))
    console.warn("careful")
    console.close()
    assert console.child_output is None
    screen = Terminal(terminal.getvalue())
    assert screen.lines() == [
        "header",
        "12:00:00 [info     ] from the launcher",
        "12:00:01 [info     ] from a hook",
        "eval at step 2: loss 0.25",
        "evtrain launch: warning: careful",
    ]  # the bar is gone at the end: the summary says what it said
    assert any("2/4" in line and "ETA" in line for line in screen.finished)  # it was drawn
    mixed = [x for x in screen.finished if LOG_LINE.search(x) and PROGRESS_TEXT.search(x)]
    assert not mixed
    # With stderr elsewhere, log lines stay there and children write to it directly.
    err = _Stream(tty=False)
    console = RunConsole(_Stream(tty=True), err)
    assert console.live and not console.shares_terminal and console.child_output is None
    console.start()
    LOG_STREAM.write("12:00:02 [info     ] to the file\n")
    console.close()
    assert err.getvalue() == ""  # LOG_STREAM writes to sys.stderr, not to the console


def test_progress_restarted_run_times_the_new_attempt() -> None:
    progress = Progress()
    progress.update(_started())
    progress.update(_step(1, ts=0.0))
    progress.update(_step(2, ts=100.0))  # slow first attempt, then elastic restarts
    progress.update(_started())
    progress.update(_step(1, ts=200.0))
    progress.update(_step(2, ts=200.5))
    assert progress.stats.steps_done == 2
    assert progress.stats.steps_per_s() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("argv", "level", "quiet"),
    [
        (["-q", "launch", "s.py"], "warning", True),
        (["launch", "s.py", "-q"], "warning", True),
        (["launch", "-v", "s.py"], "debug", False),
        (["-v", "launch", "s.py", "--log-level", "error"], "error", False),
        (["--log-level", "warning", "launch", "s.py"], "warning", False),
        (["launch", "s.py"], "info", False),
    ],
)
def test_console_options_before_or_after_the_subcommand(
    argv: list[str], level: str, quiet: bool
) -> None:
    args = build_parser().parse_args(argv)
    assert resolve_log_level(args) == level and args.log_level == level
    assert args.quiet is quiet and args.spec == "s.py"


def test_quiet_and_verbose_together_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["-q", "launch", "s.py", "-v"]) == 2
    assert capsys.readouterr().err == "evtrain launch: error: -q and -v contradict each other\n"


def test_json_log_lines_on_request() -> None:
    lines: list[str] = []
    try:
        configure_logging("json", "info")
        with LOG_STREAM.redirect(lines.append):
            structlog.get_logger("t").debug("hidden")
            structlog.get_logger("t").info("shown", step=3)
    finally:
        structlog.reset_defaults()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "shown" and record["step"] == 3 and record["level"] == "info"


def _console_log_events() -> list[Message]:
    return [
        _started(max_steps=2),
        _step(1, ts=1.0, stage=0),
        _step(1, ts=1.0),
        _step(2, ts=2.0, stage=0),
        _step(2, ts=2.0),
        EvalEnded(step=2, stage=1, metrics={"loss": 0.3}),
        CheckpointCommitted(checkpoint_id="c", step=2, path="/r/c", reason="every 2 steps"),
        StageStopped(stage=0, status="completed"),
        StageFailed(stage=1, step=2, error="ValueError: late", traceback="Traceback\n  x\n"),
        RunEnded(status="completed", step=2),
    ]


@pytest.mark.parametrize("under_launcher", [False, True])
def test_logging_hook_leaves_the_run_to_the_launchers_console(
    under_launcher: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evtrain.hooks.console_log import ConsoleLog
    from evtrain.tools.replay import ReplayRunner

    if under_launcher:
        monkeypatch.setenv(LAUNCHER_CONSOLE_ENV, "1")
    lines: list[str] = []
    try:
        configure_logging("json", "info")
        with LOG_STREAM.redirect(lines.append):
            anyio.run(ReplayRunner([ConsoleLog(every=1)]).replay, _console_log_events())
    finally:
        structlog.reset_defaults()
    events = [json.loads(line)["event"] for line in lines]
    # The console shows the run's start, progress, evaluations, failures and end
    # itself; a stage that completed is no news either way.
    if under_launcher:
        assert events == ["checkpoint committed"]
    else:
        assert events == [
            "run started",
            "progress",
            "progress",
            "eval",
            "checkpoint committed",
            "stage failed",
            "run ended",
        ]


def test_hook_command_encodes_options_as_json() -> None:
    bus = BusAddress.parse("ipc:///tmp/evt-x")
    cmd = hook_command({"type": "m:C", "every": 10, "path": "a b", "on": True}, bus, python="py")
    assert cmd == [
        "py",
        "-m",
        "evtrain",
        "hook",
        "m:C",
        "--bus",
        "ipc:///tmp/evt-x",
        "--option",
        "every=10",
        "--option",
        'path="a b"',
        "--option",
        "on=true",
        "--exit-on-run-end",
    ]


def test_supervisor_restarts_with_backoff_then_gives_up(ipc_bus: BusAddress) -> None:
    env = launch_env(new_marker())
    supervisor = HookSupervisor(
        [{"type": "helpers.launch_hooks:CrashAtSetup"}],
        ipc_bus,
        max_restarts=2,
        backoff=0.05,
        env=env,
    )
    with Broker(ipc_bus):
        try:
            supervisor.start_all()
            first_pid = supervisor.hooks[0].pid
            deadline = time.monotonic() + 120  # three hook processes start, one after another
            while not supervisor.hooks[0].done:
                assert time.monotonic() < deadline, "the supervisor never gave up"
                supervisor.poll()
                time.sleep(0.02)
        finally:
            supervisor.kill()
    hook = supervisor.hooks[0]
    assert hook.gave_up and hook.restarts == 2
    assert len(hook.exit_codes) == 3 and 0 not in hook.exit_codes
    assert first_pid is not None and supervisor.running() == []
    # Nobody reported it attached (the launcher does that from HookStarted).
    assert "exited before attaching" in (supervisor.startup_problem() or "")


# ---------------------------------------------------------------- real launches


@pytest.mark.slow
def test_two_stage_run_completes_with_summary_and_run_json(tmp_path: Path, marker: str) -> None:
    steps_file = tmp_path / "steps.jsonl"
    spec = write_spec(
        tmp_path,
        steps=8,
        hooks=[{"type": "helpers.launch_hooks:StepRecorder", "path": str(steps_file)}],
    )
    proc, leftovers = run_launch(spec, "--steps", "3", marker=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers

    out = proc.stdout
    assert "bus: ipc://" in out
    assert "run completed: 3/3 steps" in out
    assert "final loss:" in out
    run_dir = tmp_path / "run"
    assert f"run dir: {run_dir}" in out

    info = json.loads((run_dir / "run.json").read_text())
    assert info["spec"] == str(spec)
    assert info["overrides"] == {"steps": "3"}
    assert info["bus"].startswith("ipc://")
    assert info["status"] == "completed" and info["exit_status"] == 0
    assert info["steps"] == 3 and info["stages"] == 2
    assert info["run_id"] in out

    records = read_records(steps_file)
    assert [r["step"] for r in records if "step" in r] == [1, 2, 3]
    assert all(r["stage"] == 1 for r in records if "step" in r)
    assert records[-1]["end"] == "completed"
    # The private ipc bus directory is gone with the launcher.
    assert not Path(info["bus"][len("ipc://") :]).exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_run_cleanly(tmp_path: Path, marker: str, signum: int) -> None:
    steps_file = tmp_path / "steps.jsonl"
    # ~0.1 s per step, far more steps than the test waits for.
    spec = write_spec(
        tmp_path,
        steps=100_000,
        delay=0.025,
        hooks=[{"type": "helpers.launch_hooks:StepRecorder", "path": str(steps_file)}],
    )
    proc = start_launch(spec, "--quiet", marker=marker)
    try:
        # A bound against a hang, not a timing: a loaded machine starts a launch slowly.
        wait_for_records(steps_file, lambda records: steps_recorded(records) > 0, proc, 240)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    assert not wait_no_marked(marker)
    assert "run stopped" in stdout
    records = read_records(steps_file)
    assert records[-1]["end"] == "stopped"
    assert records[-1]["reason"] == f"launcher got {signal.Signals(signum).name}"
    assert 1 <= len([r for r in records if "step" in r]) < 100_000


@pytest.mark.slow
def test_bad_override_is_one_line_and_status_2(tmp_path: Path, marker: str) -> None:
    spec = write_spec(tmp_path)
    proc, leftovers = run_launch(spec, "--stages", "0", marker=marker, timeout=30)
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert line.startswith("evtrain launch: error:") and "'stages'" in line
    assert not leftovers
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_bad_hook_name_is_one_line_and_status_2(tmp_path: Path, marker: str) -> None:
    spec = write_spec(tmp_path, hooks=[{"type": "no_such_hook"}])
    proc, leftovers = run_launch(spec, marker=marker, timeout=30)
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "no_such_hook" in line
    assert not leftovers


@pytest.mark.slow
def test_crashing_hook_is_restarted_and_the_run_completes(tmp_path: Path, marker: str) -> None:
    crashed = tmp_path / "crashed"
    done = tmp_path / "done.json"
    # ~3 s of training, so the restarted hook (after 0.5 s backoff) sees the end live.
    spec = write_spec(
        tmp_path,
        steps=30,
        delay=0.025,
        hooks=[
            {"type": "helpers.launch_hooks:CrashOnce", "marker": str(crashed), "done": str(done)}
        ],
    )
    proc, leftovers = run_launch(spec, "--quiet", marker=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    assert "run completed: 30/30 steps" in proc.stdout
    assert "hook crashed; restarting" in proc.stderr
    first_pid = int(crashed.read_text())
    final = json.loads(done.read_text())
    assert final["status"] == "completed"
    assert final["pid"] != first_pid


@pytest.mark.slow
def test_max_restarts_passes_through_to_elastic(tmp_path: Path, marker: str) -> None:
    # Stage 1 fails in step 2 of the first attempt only (the marker file).
    spec = write_spec(
        tmp_path, steps=4, fail_at_step=2, balance=[3, 3], marker=str(tmp_path / "failed")
    )
    proc, leftovers = run_launch(spec, "--max-restarts", "1", "--quiet", marker=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    assert (tmp_path / "failed").exists()
    assert "run completed: 4/4 steps" in proc.stdout
    # The failed attempt is a warning naming its root cause, not an error.
    assert (
        "warning: stage 1 failed at step 2: RuntimeError: injected failure at step 2" in proc.stderr
    )
    assert "elastic restarts the workers (restart 1 of 1)" in proc.stderr
    assert "error:" not in proc.stderr
