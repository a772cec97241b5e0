"""The state replicas do not share through gradients: BatchNorm statistics and random state.

A small CNN with BatchNorm and dropout trains at P=2 x D=2 (four real
processes, gloo). Each replica's BatchNorm running statistics follow its own
half of every batch; before an evaluation and a save they become the
replicas' mean, so the run's evaluation at step 6 (both replicas evaluating
their shares) equals ``evtrain eval`` of the step-6 checkpoint on one
replica. Each replica draws its own dropout masks; the checkpoint holds every
replica's random state, so resuming it at D=2 ends bit for bit where the
uninterrupted run ended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch_helpers import new_marker, run_eval, run_launch
from safetensors.torch import load_file

from evtrain.checkpoint import list_checkpoints
from evtrain.checkpoint.loader import read_model_tensors

pytestmark = pytest.mark.slow

STEPS = 12

SPEC = '''\
"""A CNN with BatchNorm and dropout (generated)."""

import functools

import torch
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
        layer(nn.Dropout, 0.3),
        layer(nn.Flatten),
        layer(nn.Linear, 6 * 36, 16),
        layer(nn.BatchNorm1d, 16),
        layer(nn.ReLU),
        layer(nn.Dropout, 0.3),
        layer(nn.Linear, 16, 3),
    ],
    balance=[4, 6],
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
    seed=5,
    stages=2,
    run_dir={run_dir!r},
    hooks=[{{"type": "metrics"}}, {{"type": "checkpoint", "every_steps": 6}}],
    microbatch_spans="off",
    threads=1,
)
'''


def write(directory: Path) -> Path:
    path = directory / "spec.py"
    path.write_text(SPEC.format(steps=STEPS, run_dir=str(directory / "run")))
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
