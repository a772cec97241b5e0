"""`evtrain launch` end to end: real launcher, broker, elastic agent, stage workers, hooks.

Every launch runs with a unique marker in its environment, which every
process it starts inherits; a test checks through /proc that none of them
outlives the launcher, and kills any that do.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import (
    launch_cmd,
    launch_env,
    new_marker,
    read_records,
    run_launch,
    wait_no_marked,
    write_spec,
)

from evtrain.bus.address import BusAddress
from evtrain.bus.broker import Broker
from evtrain.events import EvalEnded, RunEnded, RunStarted, StepEnded
from evtrain.hook_supervisor import HookSupervisor, hook_command
from evtrain.progress import Progress


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


def _step(step: int, ts: float, loss: float | None = 0.5, stage: int = 1) -> StepEnded:
    return StepEnded(step=step, stage=stage, loss=loss, samples=32, ts=ts)


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
    progress = Progress(_Stream(tty=False), interval=0.0)
    progress.update(_started())
    for i in range(1, 5):
        progress.update(_step(i, ts=100.0 + 0.5 * i, loss=1.0 / i))
        progress.update(_step(i, ts=100.0 + 0.5 * i, loss=None, stage=0))  # ignored
    line = progress.line()
    assert line.startswith("step 4/10  loss 0.25  ")
    assert "64.0 samples/s" in line and "2.0 steps/s" in line and "ETA 0:03" in line
    progress.update(EvalEnded(step=4, stage=1, metrics={"loss": 0.3, "acc": 0.9}))
    progress.update(RunEnded(status="completed", step=4))
    summary = progress.summary(status="completed", wall_s=75, run_dir="/r")
    assert summary.splitlines()[0] == "run completed: 4/10 steps in 1:15 (2.0 steps/s)"
    assert "final loss: 0.25" in summary
    assert "last eval (step 4): loss 0.3 acc 0.9" in summary
    assert summary.endswith("run dir: /r")


def test_progress_tty_rewrites_one_line_and_plain_output_prints_lines() -> None:
    tty, plain = _Stream(tty=True), _Stream(tty=False)
    for stream in (tty, plain):
        progress = Progress(stream, interval=0.0, tty_interval=0.0)
        progress.update(_started())
        for i in range(1, 4):
            progress.update(_step(i, ts=float(i)))
            progress.tick(now=float(i))
        progress.close()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().count("\n") == 1
    assert plain.getvalue().count("\n") == 3 and "\r" not in plain.getvalue()
    quiet = _Stream(tty=False)
    progress = Progress(quiet, enabled=False)
    progress.update(_started())
    progress.update(_step(1, ts=1.0))
    progress.tick()
    progress.close()
    assert quiet.getvalue() == ""


def test_progress_restarted_run_times_the_new_attempt() -> None:
    progress = Progress(_Stream(tty=False))
    progress.update(_started())
    progress.update(_step(1, ts=0.0))
    progress.update(_step(2, ts=100.0))  # slow first attempt, then elastic restarts
    progress.update(_started())
    progress.update(_step(1, ts=200.0))
    progress.update(_step(2, ts=200.5))
    assert progress.stats.steps_done == 2
    assert progress.stats.steps_per_s() == pytest.approx(2.0)


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
        [{"type": "launch_hooks:CrashAtSetup"}], ipc_bus, max_restarts=2, backoff=0.05, env=env
    )
    with Broker(ipc_bus):
        try:
            supervisor.start_all()
            first_pid = supervisor.hooks[0].pid
            deadline = time.monotonic() + 30
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
        tmp_path, steps=8, hooks=[{"type": "launch_hooks:StepRecorder", "path": str(steps_file)}]
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
        hooks=[{"type": "launch_hooks:StepRecorder", "path": str(steps_file)}],
    )
    proc = subprocess.Popen(
        launch_cmd(spec, "--quiet"),
        env=launch_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 40
        while not any("step" in r for r in read_records(steps_file)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step within 40 s"
            time.sleep(0.1)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=30)
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
        hooks=[{"type": "launch_hooks:CrashOnce", "marker": str(crashed), "done": str(done)}],
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
