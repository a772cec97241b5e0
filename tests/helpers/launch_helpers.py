"""Shared by the launch tests: tiny job specs, launching them, finding leftover processes."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
MARKER_ENV = "EVTRAIN_TEST_MARKER"

SPEC_TEMPLATE = '''\
"""A tiny MLP job for the launch tests (generated)."""

import functools
import sys

sys.path.insert(0, {tests_dir!r})

import torch
from helpers.mlp_parts import Fault, make_data
from torch import nn

from evtrain.job import Job, layer

job = Job(
    name="launchtest",
    layers=[
        layer(nn.Linear, 8, 16),
        layer(nn.Tanh),
        layer(nn.Linear, 16, 16),
        layer(nn.Tanh),
        layer(Fault, {fail_at_step!r}, 4, {marker!r}, {delay!r}, {stamp!r}),
        layer(nn.Linear, 16, 1),
    ],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr={lr!r}, momentum=0.9),
    train_data=functools.partial(make_data, 256, 1),
    batch_size=32,
    num_microbatches=4,
    max_steps={steps!r},
    seed=7,
    stages={stages!r},
    balance={balance!r},
    schedule={schedule!r},
    run_dir={run_dir!r},
    hooks={hooks!r},
    microbatch_spans="off",
    threads=1,
)
'''


EVAL_SPEC_TEMPLATE = '''\
"""A small MLP with eval data and an extra metric (generated)."""

import functools
import sys

sys.path.insert(0, {tests_dir!r})

import torch
from helpers.mlp_parts import Slow, mae, make_data
from torch import nn

from evtrain.job import Job, layer

job = Job(
    name={name!r},
    layers=[
        layer(nn.Linear, 8, 32),
        layer(Slow, {delay!r}),
        layer(nn.Tanh),
        layer(nn.Linear, 32, 16),
        layer(nn.Tanh),
        layer(nn.Linear, 16, 1),
    ],
    loss_fn=nn.functional.mse_loss,
    metrics={{"mae": mae}},
    optimizer=functools.partial(torch.optim.Adam, lr=0.02),
    train_data=functools.partial(make_data, 256, 1),
    eval_data=functools.partial(make_data, 96, 2),
    batch_size=32,
    num_microbatches=4,
    max_steps={steps!r},
    seed=7,
    stages=2,
    run_dir={run_dir!r},
    hooks={hooks!r},
    microbatch_spans="off",
    threads=1,
)
'''


def write_eval_spec(
    directory: Path,
    *,
    steps: int,
    hooks: list[dict[str, Any]],
    delay: float = 0.0,
    name: str = "evaltest",
) -> Path:
    """A spec with eval data (loss and ``mae``) in ``directory``; its run directory is ``run``.

    ``delay`` seconds of sleep in every training forward of layer 1 slow the steps down.
    """
    path = directory / "spec.py"
    path.write_text(
        EVAL_SPEC_TEMPLATE.format(
            tests_dir=str(TESTS_DIR),
            steps=steps,
            hooks=hooks,
            delay=delay,
            name=name,
            run_dir=str(directory / "run"),
        )
    )
    return path


def write_spec(directory: Path, name: str = "spec.py", **fields: Any) -> Path:
    """A spec file in ``directory``; ``fields`` override the template's defaults."""
    values: dict[str, Any] = dict(
        fail_at_step=None,
        marker=None,
        delay=0.0,
        stamp=None,
        lr=0.05,
        steps=4,
        stages=2,
        balance=None,
        schedule="1f1b",
        run_dir=str(directory / "run"),
        hooks=[],
    )
    values.update(fields)
    path = directory / name
    path.write_text(SPEC_TEMPLATE.format(tests_dir=str(TESTS_DIR), **values))
    return path


def new_marker() -> str:
    """A token that every process of one launch carries in its environment."""
    return "evt" + secrets.token_hex(6)


def launch_env(marker: str, **extra: str) -> dict[str, str]:
    """Environment for ``evtrain launch``: test hooks importable, the marker set."""
    env = dict(os.environ)
    paths = [str(TESTS_DIR), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[MARKER_ENV] = marker
    env.update(extra)
    return env


def launch_cmd(spec: Path, *args: str) -> list[str]:
    """The ``evtrain launch`` command line."""
    return [sys.executable, "-m", "evtrain", "launch", str(spec), *args]


def marked_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``marker``.

    Every process a launch starts inherits the launcher's environment (the
    elastic agent, the workers it spawns, the hooks), so this finds them all,
    even ones that were re-parented, without psutil.
    """
    needle = f"{MARKER_ENV}={marker}".encode()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def wait_no_marked(marker: str, timeout: float = 5.0) -> list[int]:
    """Wait until no process carries ``marker``; the pids still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = marked_pids(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_marked(marker: str) -> None:
    """SIGKILL every process carrying ``marker`` (test cleanup)."""
    for pid in marked_pids(marker):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def run_launch(
    spec: Path, *args: str, marker: str, timeout: float = 60.0, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run ``evtrain launch`` to the end; returns it and the pids it left behind.

    Whatever carries the marker afterwards is killed, so nothing outlives the test.
    """
    try:
        proc = subprocess.run(
            launch_cmd(spec, *args),
            env=launch_env(marker, **env),
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        kill_marked(marker)
        raise
    leftovers = wait_no_marked(marker, timeout=5.0)
    kill_marked(marker)
    return proc, leftovers


def run_eval(
    spec: Path, checkpoint: Path, output: Path, *args: str, timeout: float = 90.0, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run ``evtrain eval SPEC --checkpoint CKPT --output FILE [ARGS]``; returns it and its
    leftovers."""
    marker = new_marker()
    cmd = [sys.executable, "-m", "evtrain", "eval", str(spec)]
    cmd += ["--checkpoint", str(checkpoint), "--output", str(output), *args]
    try:
        done = subprocess.run(
            cmd, env=launch_env(marker, **env), capture_output=True, text=True, timeout=timeout
        )
    finally:
        left = wait_no_marked(marker, timeout=10.0)
        kill_marked(marker)
    return done, left


def start_launch(spec: Path, *args: str, marker: str, **env: str) -> subprocess.Popen[str]:
    """Start ``evtrain launch`` in the background (its own session, output captured)."""
    return subprocess.Popen(
        launch_cmd(spec, *args),
        env=launch_env(marker, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def launched(spec: Path, *args: str, marker: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """`start_launch` for the block; after it (also when it fails) the launch is killed
    if it still runs, and a block that ended normally asserts that no process of the
    launch (its ``marker``) was left behind."""
    proc = start_launch(spec, *args, marker=marker, **env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        left = wait_no_marked(marker, timeout=10.0)
        kill_marked(marker)
    assert left == []


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a `launch_hooks.StepRecorder` wrote so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_records(
    path: Path,
    done: Callable[[list[dict[str, Any]]], bool],
    proc: subprocess.Popen[str],
    timeout: float = 60.0,
) -> list[dict[str, Any]]:
    """Poll ``path`` until ``done(records)``; fail if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(path)
        if done(records):
            return records
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the launch ended early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no such records within {timeout} s: {records[-5:]}")
        time.sleep(0.05)


def steps_recorded(records: list[dict[str, Any]]) -> int:
    """How many loss-carrying steps a `launch_hooks.StepRecorder` saw."""
    return sum("step" in r for r in records)
