"""Resume and fault recovery through real ``evtrain launch`` runs.

Every run trains the same tiny MLP on CPU in fp32 with the ``checkpoint`` hook;
an uninterrupted 8-step run is the reference its final weights are compared to.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.launch_helpers import TESTS_DIR, launch_cmd, launch_env, new_marker, run_launch
from safetensors.torch import load_file

from evtrain.checkpoint import MANIFEST_FILE, latest_committed, list_checkpoints

STEPS = 8

SPEC = '''\
"""A tiny MLP job for the resume tests (generated)."""

import functools
import sys

sys.path.insert(0, {tests_dir!r})

import torch
from helpers.mlp_parts import Slow, make_data
from torch import nn

from evtrain.job import Job, layer

job = Job(
    name="resumetest",
    layers=[
        layer(nn.Linear, 8, 16),
        layer(Slow, {delay!r}, {pid_dir!r}),
        layer(nn.Tanh),
        layer(nn.Linear, 16, 16),
        layer(nn.Tanh),
        layer(nn.Linear, 16, 1),
    ],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.Adam, lr=0.01),
    lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
    train_data=functools.partial(make_data, 256, 1),
    batch_size=32,
    num_microbatches=4,
    max_steps={steps!r},
    seed=7,
    stages={stages!r},
    run_dir={run_dir!r},
    hooks={hooks!r},
    microbatch_spans="off",
    threads=1,
)
'''


def write_spec(
    directory: Path,
    *,
    name: str = "spec.py",
    steps: int = STEPS,
    stages: int = 2,
    delay: float = 0.01,
    pid_dir: str | None = None,
    hooks: list[dict[str, object]] | None = None,
) -> Path:
    """A spec in ``directory`` whose run directory is ``directory/run``."""
    path = directory / name
    path.write_text(
        SPEC.format(
            tests_dir=str(TESTS_DIR),
            steps=steps,
            stages=stages,
            delay=delay,
            pid_dir=pid_dir,
            run_dir=str(directory / "run"),
            hooks=hooks if hooks is not None else [],
        )
    )
    return path


def ckpt_hook(**options: object) -> list[dict[str, object]]:
    return [{"type": "checkpoint", "on_stop": True, **options}]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """The unsplit model's parameters from a ``--dump-weights`` directory."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("stage-*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


QUIET = ("--quiet", "--log-level", "info")
"""No progress lines, but the stages' info lines ("resumed ... step=N"), which tests read."""


def launch(spec: Path, *args: str, timeout: float = 60.0, **env: str) -> str:
    """Run a launch that must succeed; its output."""
    marker = new_marker()
    proc, leftovers = run_launch(spec, *QUIET, *args, marker=marker, timeout=timeout, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert leftovers == []
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of an uninterrupted run (no hooks)."""
    d = tmp_path_factory.mktemp("reference")
    launch(write_spec(d), "--dump-weights", str(d / "weights"))
    return weights(d / "weights")


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of a run stopped after 4 of 8 steps, with its on-stop checkpoint."""
    d = tmp_path_factory.mktemp("stopped")
    launch(write_spec(d, hooks=ckpt_hook()), "--steps", "4")
    latest = latest_committed(d / "run")
    assert latest is not None and latest.step == 4 and latest.reason == "on stop"
    return d


def copy_run(source: Path, dest: Path) -> Path:
    """A copy of a stopped run (its run directory) in ``dest``, with a fresh spec."""
    shutil.copytree(source / "run", dest / "run")
    return dest


def test_resume_is_bitwise_exact(
    tmp_path: Path, stopped_at_4: Path, reference: dict[str, torch.Tensor]
) -> None:
    d = copy_run(stopped_at_4, tmp_path)
    spec = write_spec(d, hooks=ckpt_hook(every_steps=3))
    out = launch(spec, "--resume", "--dump-weights", str(d / "weights"))
    assert "step=4" in out  # resumed after step 4, not from scratch
    assert_bitwise(weights(d / "weights"), reference)
    # The resumed run checkpointed on its own, past the resume point.
    latest = latest_committed(d / "run")
    assert latest is not None and latest.step == STEPS


def test_resume_with_another_number_of_stages(
    tmp_path: Path, stopped_at_4: Path, reference: dict[str, torch.Tensor]
) -> None:
    ckpt = latest_committed(stopped_at_4 / "run")
    assert ckpt is not None and ckpt.num_stages == 2
    spec = write_spec(tmp_path, stages=3)
    launch(spec, "--resume", str(ckpt.path), "--dump-weights", str(tmp_path / "weights"))
    got = weights(tmp_path / "weights")
    assert sorted(got) == sorted(reference)
    for key, want in reference.items():
        torch.testing.assert_close(got[key], want, rtol=0, atol=1e-6)


def test_load_weights_starts_at_step_zero(tmp_path: Path, stopped_at_4: Path) -> None:
    ckpt = latest_committed(stopped_at_4 / "run")
    assert ckpt is not None
    spec = write_spec(tmp_path, steps=1)
    # One step from the loaded weights with a fresh optimizer: weights differ from
    # the checkpoint's, but by at most one Adam step (lr 0.01).
    launch(spec, "--load-weights", str(ckpt.path), "--dump-weights", str(tmp_path / "w"))
    from evtrain.checkpoint.loader import read_model_tensors

    saved = read_model_tensors(ckpt.path)
    got = weights(tmp_path / "w")
    for key, value in saved.items():
        assert (got[key] - value).abs().max() <= 0.0101, key


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stage_pids(pids: Path) -> list[int]:
    """Process ids of the stage-0 workers (first, restarted) that recorded themselves."""
    return [int(p.name.split("-")[1]) for p in sorted(pids.glob("0-*"), key=os.path.getmtime)]


def test_kill_9_mid_run_restarts_and_resumes(
    tmp_path: Path, marker: str, reference: dict[str, torch.Tensor]
) -> None:
    pids = tmp_path / "pids"
    spec = write_spec(
        tmp_path, delay=0.05, pid_dir=str(pids), hooks=ckpt_hook(every_steps=2, keep_last=5)
    )
    proc = subprocess.Popen(
        launch_cmd(spec, *QUIET, "--max-restarts", "1", "--dump-weights", str(tmp_path / "w")),
        env=launch_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        run = tmp_path / "run"
        _wait_for(lambda: run.is_dir() and latest_committed(run) is not None, 40, "a checkpoint")
        first = latest_committed(run)
        assert first is not None and first.step < STEPS
        victim = stage_pids(pids)[0]  # the stage holding layer 1
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert len(stage_pids(pids)) == 2  # the stage was started again
    assert "resumed" in out
    assert_bitwise(weights(tmp_path / "w"), reference)


def test_kill_9_during_a_write_never_commits_it(
    tmp_path: Path, stopped_at_4: Path, marker: str, reference: dict[str, torch.Tensor]
) -> None:
    d = copy_run(stopped_at_4, tmp_path)
    pids = tmp_path / "pids"
    spec = write_spec(d, delay=0.02, pid_dir=str(pids), hooks=ckpt_hook(every_steps=2))
    proc = subprocess.Popen(
        launch_cmd(spec, "--quiet", "--resume"),
        # The data files are written, then the shard record waits: kill now.
        env=launch_env(marker, EVTRAIN_CKPT_RECORD_DELAY_S="30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        root = d / "run" / "checkpoints"
        data = lambda: [  # noqa: E731
            p for p in root.glob("step-*/stage-*/*.distcp") if "step-00000004" not in str(p)
        ]
        _wait_for(lambda: bool(data()), 40, "a shard being written")
        victim = stage_pids(pids)[0]
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    partial = data()[0].parent.parent
    assert not (partial / MANIFEST_FILE).exists()
    latest = latest_committed(d / "run")
    assert latest is not None and latest.step == 4
    assert [c.step for c in list_checkpoints(d / "run") if c.committed] == [4]
    # A resume takes the previous checkpoint and still ends where the reference does.
    spec = write_spec(d, delay=0.0, hooks=[])
    out = launch(spec, "--resume", "--dump-weights", str(d / "w"))
    assert "step-00000004" in out
    assert_bitwise(weights(d / "w"), reference)


def test_sigterm_on_a_checkpoint_step_commits_it_and_exits_0_promptly(
    tmp_path: Path, marker: str
) -> None:
    # Every step is a checkpoint step: the stop lands on one, and on-stop adds nothing.
    spec = write_spec(tmp_path, steps=10_000, delay=0.005, hooks=ckpt_hook(every_steps=1))
    proc = subprocess.Popen(
        launch_cmd(spec, "--quiet"),
        env=launch_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        run = tmp_path / "run"
        _wait_for(lambda: run.is_dir() and latest_committed(run) is not None, 60, "a commit")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        exit_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    # No grace period to sit out: the last step's checkpoint commits and everything exits.
    print(f"exit {exit_s:.2f} s after SIGTERM")
    assert exit_s < 5.0, (exit_s, out)
    latest = latest_committed(tmp_path / "run")
    assert latest is not None, out
    assert 0 < latest.step < 10_000
    assert latest.step == max(i.step for i in list_checkpoints(tmp_path / "run"))
    assert "[error" not in out


def test_corrupted_shard_is_named_on_resume(tmp_path: Path, stopped_at_4: Path) -> None:
    d = copy_run(stopped_at_4, tmp_path)
    victim = next((d / "run" / "checkpoints" / "step-00000004" / "stage-1").glob("*.distcp"))
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    spec = write_spec(d)
    proc, leftovers = run_launch(spec, "--quiet", "--resume", marker=new_marker(), timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert str(victim) in out or f"stage-1/{victim.name}" in out, out
    assert leftovers == []
