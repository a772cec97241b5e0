"""The state replicas do not share through gradients: BatchNorm statistics and random state.

A small CNN with BatchNorm and dropout trains at P=2 x D=2 (four real
processes, gloo). Each replica's BatchNorm running statistics follow its own
half of every batch; before an evaluation and a save they become the
replicas' mean, so the run's evaluation at step 6 (both replicas evaluating
their shares) equals ``evtrain eval`` of the step-6 checkpoint on one
replica. Each replica draws its own dropout masks; the checkpoint holds every
replica's random state, so resuming it at D=2 ends bit for bit where the
uninterrupted run ended, and so does one whose replica is killed with SIGKILL
and restarted from the commit. With `Job.precise_bn` the statistics evaluated and
saved are those detectron2's PreciseBN computes from the weights evaluated.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch_helpers import (
    TESTS_DIR,
    launched,
    new_marker,
    run_eval,
    run_launch,
)
from safetensors.torch import load_file

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.checkpoint.loader import read_model_tensors
from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model

pytestmark = pytest.mark.slow

STEPS = 12

SPEC = '''\
"""A CNN with BatchNorm and dropout (generated)."""

import functools
import sys

sys.path.insert(0, {tests_dir!r})

import torch
from helpers.mlp_parts import Slow
from torch import nn

from evtrain.job import Job, accuracy, layer


def images(n, offset):
    gen = torch.Generator().manual_seed(300 + offset)
    y = torch.randint(0, 3, (n,), generator=gen)
    x = torch.randn(n, 2, 6, 6, generator=gen) + y.view(-1, 1, 1, 1) * 0.5
    return x, y


job = Job(
    name="bn",
    layers=[
        layer(nn.Conv2d, 2, 6, 3, padding=1),
        layer(nn.BatchNorm2d, 6),
        layer(nn.ReLU),
        layer(nn.Dropout, {dropout}),
        layer(nn.Flatten),
        layer(nn.Linear, 6 * 36, 16),
        layer(nn.BatchNorm1d, 16),
        layer(nn.ReLU),
        layer(nn.Dropout, {dropout}),
        layer(nn.Linear, 16, 3),
        layer(Slow, {delay!r}, {pid_dir!r}),
    ],
    balance=[4, 7],
    loss_fn=nn.functional.cross_entropy,
    metrics={{"accuracy": accuracy}},
    optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    train_data=functools.partial(images, 128, 1),
    eval_data=functools.partial(images, 48, 2),
    eval_batch_size=8,
    batch_size=32,
    num_microbatches=2,
    max_steps={steps},
    eval_every=6,
    precise_bn={precise_bn},
    seed=5,
    stages=2,
    run_dir={run_dir!r},
    hooks=[{{"type": "metrics"}}, {{"type": "checkpoint", "every_steps": 6}}],
    microbatch_spans="off",
    threads=1,
)
'''


def write(
    directory: Path,
    *,
    dropout: float = 0.3,
    precise_bn: int | None = None,
    delay: float = 0.0,
    pid_dir: str | None = None,
) -> Path:
    path = directory / "spec.py"
    text = SPEC.format(
        steps=STEPS,
        run_dir=str(directory / "run"),
        dropout=dropout,
        precise_bn=precise_bn,
        delay=delay,
        pid_dir=pid_dir,
        tests_dir=str(TESTS_DIR),
    )
    path.write_text(text)
    return path


def launch(spec: Path, *args: str) -> None:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=new_marker(), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert leftovers == []


def dumped(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("stage-*.safetensors")):
        out.update(load_file(str(f)))
    return out


def evals(run: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["metrics"] for r in records if r["type"] == "eval"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bn")
    launch(write(directory), "--dp", "2", "--dump-weights", str(directory / "weights"))
    return directory


def step_6(run: Path) -> Path:
    return next(c.path for c in list_checkpoints(run) if c.step == 6 and c.committed)


def test_replicas_evaluate_and_save_the_mean_of_their_batchnorm_statistics(
    uninterrupted: Path, tmp_path: Path
) -> None:
    output = tmp_path / "eval.json"
    done, left = run_eval(
        uninterrupted / "spec.py",
        step_6(uninterrupted / "run"),
        output,
        "--dp",
        "1",
        "--eval-dir",
        str(tmp_path / "eval"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert left == []
    # What the two replicas evaluated at step 6 is what was saved there.
    assert json.loads(output.read_text())["metrics"] == evals(uninterrupted / "run")[6]
    saved = read_model_tensors(step_6(uninterrupted / "run"))
    assert saved["1.running_mean"].abs().sum() > 0  # the statistics moved in training


def test_a_two_replica_run_with_dropout_resumes_bit_for_bit(
    uninterrupted: Path, tmp_path: Path
) -> None:
    spec = write(tmp_path)
    weights = tmp_path / "weights"
    launch(
        spec,
        "--dp",
        "2",
        "--resume",
        str(step_6(uninterrupted / "run")),
        "--dump-weights",
        str(weights),
    )
    want, got = dumped(uninterrupted / "weights"), dumped(weights)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert evals(tmp_path / "run")[12] == evals(uninterrupted / "run")[12]


def test_precise_bn_recomputes_the_statistics_from_the_training_batches_after_the_step(
    tmp_path: Path,
) -> None:
    """Three training batches after step 6 run forward through both replicas' pipelines;
    the saved statistics are the plain average over their microbatches (PreciseBN's),
    not the moving average of training, and training itself is untouched."""
    plain = tmp_path / "plain"
    plain.mkdir()
    launch(write(plain, dropout=0.0), "--dp", "2", "--steps", "6")
    moving = read_model_tensors(step_6(plain / "run"))
    spec = write(tmp_path, dropout=0.0, precise_bn=3)
    launch(spec, "--dp", "2", "--steps", "6")
    saved = read_model_tensors(step_6(tmp_path / "run"))
    for key, value in moving.items():
        if "running" not in key:
            assert torch.equal(saved[key], value), key
    job = apply_overrides(load_job(spec), {"stages": "1"})
    model = build_full_model(job)
    model.load_state_dict({k: saved[k] for k in model.state_dict()})
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    inputs, _ = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    model.train()
    with torch.no_grad():
        for step in (6, 7, 8):  # 0-based: the batches steps 7, 8 and 9 would train on
            index = stream.indices(step, 0)
            for replica in index.chunk(2):  # each replica's share, in 2 microbatches
                for microbatch in replica.chunk(2):
                    model(inputs[microbatch])
    for key, value in model.state_dict().items():
        if "running" in key:
            torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-6, msg=key)
            assert not torch.allclose(moving[key], value, atol=1e-3), key


def test_a_replica_killed_with_sigkill_restarts_to_the_uninterrupted_weights(
    uninterrupted: Path, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    spec = write(tmp_path, delay=0.1, pid_dir=str(pids))
    weights, marker = tmp_path / "weights", new_marker()
    args = ("--dp", "2", "--max-restarts", "1", "--log-level", "info")
    with launched(spec, *args, "--dump-weights", str(weights), marker=marker) as proc:
        run, deadline = tmp_path / "run", time.monotonic() + 120
        while not (run.is_dir() and latest_committed(run) is not None):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.02)
        # Rank 3: stage 1 of replica 1 (its Slow layer records RANK-pid when built).
        os.kill(int(next(pids.glob("3-*")).name.split("-")[1]), signal.SIGKILL)
        out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, out + err
    assert "stage 1 replica 1 was killed by SIGKILL" in out + err
    assert len(list(pids.glob("3-*"))) == 2  # started again
    want, got = dumped(uninterrupted / "weights"), dumped(weights)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
