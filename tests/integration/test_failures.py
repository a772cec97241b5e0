"""Failed runs: the launcher names the root cause, ends fast, and knows the truth without the bus.

Real launches (tiny MLP specs from `launch_helpers`): a stage killed with
SIGKILL, a layer that raises, a launcher killed with SIGKILL, an external
broker killed mid-run, resume and weight paths that do not exist, a stale
``run.json``. Every launch carries a marker in its environment; the tests
check through /proc that no process of it outlives the launcher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import mlp_parts
from helpers.launch_helpers import (
    launch_env,
    read_records,
    run_launch,
    start_launch,
    steps_recorded,
    wait_for_records,
    wait_no_marked,
    write_spec,
)

from evtrain.bus.address import BusAddress
from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.failures import Failure, find_root_cause, is_communication_error, user_frames
from evtrain.launcher.run_record import read_run_record, write_run_record

GLOO_CLOSED = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:23456. This is typically caused by a remote worker crashing."
)


def _recorder(path: Path) -> dict[str, str]:
    return {"type": "helpers.launch_hooks:StepRecorder", "path": str(path)}


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("evtrain launch: error:")]


def _finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---------------------------------------------------------------- the analysis


def test_the_root_cause_is_the_first_failure_that_is_not_a_symptom() -> None:
    # Stage 0's receive failed on the closed connection a moment before the
    # agent saw stage 1's process gone: stage 1 is still the cause.
    symptom = Failure(stage=0, at=10.0, what=GLOO_CLOSED, consequence=True, step=63)
    killed = Failure(stage=1, at=10.01, what="was killed by SIGKILL", consequence=False, died=True)
    later = Failure(stage=2, at=11.0, what="ValueError: later", consequence=False, step=64)
    root = find_root_cause([later, symptom, killed])
    assert root is not None
    assert root.first is killed and root.consequences == [symptom, later]
    assert root.headline() == "stage 1 was killed by SIGKILL"
    assert symptom.headline(brief=True) == (
        "stage 0 failed at step 63: RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
        "pair.cc:553] Connection closed by peer [127.0.0.1]:23456"
    )
    # Only symptoms (a network failure): the earliest is all there is to say.
    assert find_root_cause([symptom]).first is symptom  # type: ignore[union-attr]
    assert find_root_cause([]) is None


def test_communication_errors_are_told_from_the_users_own() -> None:
    assert is_communication_error(GLOO_CLOSED)
    assert is_communication_error("RuntimeError: [pair.cc:537] Read error [127.0.0.1]:45227")
    assert is_communication_error("torch.distributed.DistNetworkError: timed out")
    assert not is_communication_error("RuntimeError: injected failure at step 2")
    assert not is_communication_error("ValueError: Connection string must not be empty")


def test_user_frames_skip_the_library_frames_under_the_error() -> None:
    def parse(text: str) -> object:
        return json.loads(text)  # the error is raised deep inside the stdlib

    try:
        parse("{")
    except ValueError as exc:
        frames = user_frames(exc.__traceback__)
    assert frames and all("json" not in frame.split(":")[0] for frame in frames)
    assert frames[-1].endswith(
        "in parse: return json.loads(text)  # the error is raised deep inside the stdlib"
    )
    assert frames[-1].startswith(("tests/integration/test_failures.py:", __file__))


# ---------------------------------------------------------- a stage that fails


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_a_stage_names_it_and_ends_the_launch_within_seconds(
    tmp_path: Path, marker: str, victim: int
) -> None:
    steps_file = tmp_path / "steps.jsonl"
    # A checkpoint hook too: the end of a failed run must not wait for its requests.
    spec = write_spec(
        tmp_path,
        steps=100_000,
        delay=0.005,
        hooks=[_recorder(steps_file), {"type": "checkpoint", "every_steps": 10, "on_stop": True}],
    )
    proc = start_launch(spec, "--quiet", marker=marker)
    try:
        records = wait_for_records(steps_file, lambda rs: steps_recorded(rs) >= 25, proc)
        pid = next(r["pid"] for r in records if r.get("stage_started") == victim)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = _finish(proc)
        took = time.monotonic() - killed
    finally:
        _finish(proc, timeout=1)
    print(f"kill -9 of stage {victim}: the launch ended {took:.2f} s later")
    assert proc.returncode == 1, stdout + stderr
    assert took < 8, f"the launch ended {took:.1f} s after the kill"
    assert not wait_no_marked(marker, timeout=1.0)

    headline = f"evtrain launch: error: stage {victim} was killed by SIGKILL after step "
    assert [line[: len(headline)] for line in _errors(stderr)] == [headline], stderr
    assert re.search(rf"^  consequence: stage {1 - victim} ", stderr, re.MULTILINE), stderr
    assert "Traceback" not in stderr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "failed" and info["exit_status"] == 1
    assert info["root_cause"].startswith(f"stage {victim} was killed by SIGKILL")
    # The hooks heard it from RunEnded, before they were asked to leave.
    end = read_records(steps_file)[-1]
    assert end["end"] == "failed" and end["source"] == "launcher"
    assert end["root_cause"] == end["reason"]
    # (told before the agent had the exit status when that took over a second)
    assert end["root_cause"].startswith(f"stage {victim} ")


@pytest.mark.slow
def test_a_layer_that_raises_is_named_once_with_the_users_line(tmp_path: Path, marker: str) -> None:
    # Layer 4 (Fault) is on stage 1 with balance [3, 3]; it raises in step 3 and
    # writes the time it did so to `stamp`.
    stamp = tmp_path / "failed_at"
    spec = write_spec(tmp_path, steps=50, fail_at_step=3, balance=[3, 3], stamp=str(stamp))
    proc, leftovers = run_launch(spec, "--quiet", marker=marker, timeout=90)
    took = time.time() - float(stamp.read_text())
    print(f"a raising layer: the launch ended {took:.2f} s after the exception")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not leftovers
    assert took < 8, f"the launch ended {took:.1f} s after the stage failed"

    parts = Path(mlp_parts.__file__).resolve()  # where the spec's failing layer lives
    line = next(
        i for i, text in enumerate(parts.read_text().splitlines(), 1) if "raise Runtime" in text
    )
    # Paths under the working directory are shown relative to it.
    shown = parts.relative_to(Path.cwd()) if parts.is_relative_to(Path.cwd()) else parts
    headline = (
        "evtrain launch: error: stage 1 failed at step 3: RuntimeError: injected failure at "
        f"step 3 ({shown}:{line} in forward)"
    )
    assert _errors(proc.stderr) == [headline], proc.stderr
    output = proc.stdout + proc.stderr
    assert output.count("injected failure at step 3") == 1, output
    assert "Traceback" not in output
    consequences = [x for x in proc.stderr.splitlines() if x.startswith("  consequence:")]
    # Stage 0 notices the broken group itself, or the agent stops it first when the
    # machine is busy: either is the one consequence, named for stage 0.
    assert len(consequences) == 1 and re.match(
        r"  consequence: stage 0 (failed|was killed by SIGTERM)", consequences[0]
    ), consequences
    assert len(consequences[0]) < 200
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["root_cause"] == headline.removeprefix("evtrain launch: error: ")
    report = (Path(info["reports"]) / "failure.txt").read_text()
    assert "Traceback" in report and "injected failure at step 3" in report


# ----------------------------------------------------------- paths and records


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--resume",), "--resume: no committed checkpoint under"),
        (("--resume", "/missing/ckpt"), "--resume: checkpoint path /missing/ckpt does not exist"),
        (("--load-weights", "/missing/w"), "--load-weights: checkpoint path /missing/w does not"),
    ],
)
def test_bad_resume_and_weight_paths_exit_2_before_anything_starts(
    tmp_path: Path, marker: str, args: tuple[str, ...], says: str
) -> None:
    steps_file = tmp_path / "steps.jsonl"
    spec = write_spec(tmp_path, hooks=[_recorder(steps_file)])
    (tmp_path / "run").mkdir()  # a run directory without any checkpoint
    started = time.monotonic()
    proc, leftovers = run_launch(spec, *args, marker=marker, timeout=60)
    took = time.monotonic() - started
    print(f"{' '.join(args)}: exit {proc.returncode} after {took:.2f} s")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"evtrain launch: error: {says}"), lines
    assert not leftovers
    # Nothing started: no hook ran, no record or report was written.
    assert not steps_file.exists()
    assert list((tmp_path / "run").iterdir()) == []


def test_a_bus_on_a_host_that_does_not_resolve_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "evtrain", "bus", "--tcp", "no-such-host.invalid"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("evtrain bus: error: --tcp no-such-host.invalid")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_a_stale_run_record_is_marked_interrupted(tmp_path: Path, marker: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    leftover = BusAddress.new_ipc()
    (Path(leftover.location) / "ev-in").touch()  # a dead broker's socket file
    stale = {
        "run_id": "old-run",
        "status": "running",
        "steps": 7,
        "host": socket.gethostname(),
        "launcher_pid": _dead_pid(),
        "launcher_start": -1,  # never a live process's: a recycled pid is not the launcher
        "owned_bus_dir": leftover.location,
    }
    write_run_record(run_dir, stale)
    listing = subprocess.run(
        [sys.executable, "-m", "evtrain", "ckpt", "list", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    assert "note: run old-run was interrupted" in listing.stderr
    record = read_run_record(run_dir)
    assert record is not None and record["status"] == "interrupted"
    assert not Path(leftover.location).exists()

    # The next launch into the directory notices it just the same (it continues
    # that run: nothing was committed, so from step 0).
    write_run_record(run_dir, stale)
    spec = write_spec(tmp_path, steps=2)
    proc, leftovers = run_launch(spec, "--quiet", "--resume", "auto", marker=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    assert "warning: the previous run old-run in" in proc.stderr
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "completed"
    assert info["previous_run"] == {
        "run_id": "old-run",
        "status": "interrupted",
        "steps": 7,
        "exit_status": None,
    }


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_ipc_dir_and_an_interrupted_record(
    tmp_path: Path, marker: str
) -> None:
    steps_file = tmp_path / "steps.jsonl"
    spec = write_spec(tmp_path, steps=100_000, delay=0.005, hooks=[_recorder(steps_file)])
    proc = start_launch(spec, "--quiet", marker=marker)
    try:
        wait_for_records(steps_file, lambda rs: steps_recorded(rs) >= 1, proc)
        info = json.loads((tmp_path / "run" / "run.json").read_text())
        proc.kill()
        _finish(proc)
    finally:
        _finish(proc, timeout=1)
    # The agent outlives the launcher long enough to stop the workers and clean up.
    assert not wait_no_marked(marker, timeout=30)
    assert not Path(info["bus"].removeprefix("ipc://")).exists()
    record = read_run_record(tmp_path / "run")
    assert record is not None and record["status"] == "interrupted"


# ------------------------------------------------------------------ the bus


@pytest.mark.slow
def test_losing_an_external_bus_is_reported_with_its_consequence(
    tmp_path: Path, marker: str
) -> None:
    address = BusAddress.new_ipc()
    broker = subprocess.Popen(
        [sys.executable, "-m", "evtrain", "bus", "--bus", str(address)],
        env=launch_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    steps_file = tmp_path / "steps.jsonl"
    spec = write_spec(
        tmp_path,
        steps=300,
        delay=0.005,
        hooks=[_recorder(steps_file), {"type": "checkpoint", "every_steps": 20}],
    )
    try:
        assert broker.stdout is not None and broker.stdout.readline().strip() == str(address)
        # With the bus gone no verdict can come back: stage 0 does not wait out
        # the coordinator timeout (an hour here) for them.
        proc = start_launch(
            spec,
            "--external-bus",
            "--bus",
            str(address),
            "--log-level",
            "info",
            marker=marker,
            EVTRAIN_COORDINATOR_TIMEOUT_S="3600",
        )
        try:
            wait_for_records(steps_file, lambda rs: steps_recorded(rs) >= 50, proc)
            broker.kill()
            broker.wait()
            stdout, stderr = _finish(proc, timeout=120)
        finally:
            _finish(proc, timeout=1)
    finally:
        broker.kill()
        broker.wait()
        for leftover in Path(address.location).glob("*"):
            leftover.unlink()
        Path(address.location).rmdir()
    assert proc.returncode == 3, stdout + stderr
    # The count comes from the stages, not from the events that got through.
    assert "run completed: 300/300 steps" in stdout
    lost = re.search(r"the bus was lost at step (\d+): hooks got no events after it", stderr)
    assert lost is not None, stderr
    step = int(lost.group(1))
    assert 50 <= step < 300
    assert "stopped answering" in stderr  # also said while it happened
    assert "the bus is silent: the end does not wait for the coordinator" in stderr
    # What was written after the loss reached no coordinator: the launcher
    # verified and committed it at the end, up to the last step.
    after = list(range(20 * (step // 20 + 1), 301, 20))
    swept = re.search(r"(\d+) complete checkpoint\(s\) written after it were verified and", stderr)
    assert swept is not None and int(swept.group(1)) >= len(after) > 0, stderr
    assert "latest committed: step 300" in stderr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (info["status"], info["exit_status"], info["steps"]) == ("completed", 3, 300)
    assert info["bus_lost"]["step"] == step
    checkpoints = list_checkpoints(tmp_path / "run")
    assert all(c.committed for c in checkpoints)
    assert [c.step for c in checkpoints if c.step > step] == after
    latest = latest_committed(tmp_path / "run")
    assert latest is not None and latest.step == 300
    assert not wait_no_marked(marker, timeout=5)
