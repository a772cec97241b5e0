"""Stragglers in real launches: a slowed stage, replica or tensor rank, and a run with none.

A layer does extra work in its training forwards on one stage (from a given
step) or on one replica; the launcher names it on the console once and publishes
``StragglerReported``, which the recorder hook writes down. An un-slowed
run names nobody.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch_helpers import launched, new_marker

from evtrain.events import StragglerReported
from evtrain.exporters.recorder import read_recording

pytestmark = pytest.mark.slow

SPEC = '''\
"""A small pipeline; one layer may do extra work in its training forwards (generated)."""

import functools
import os

import torch
from torch import nn

from evtrain.job import Job, layer


class Slowed(nn.Module):
    """Identity; adds `work` (a count) of CPU work to each training forward from its step
    `start` on, on the rank `rank` (None: every rank it runs on). Work, not a sleep: on
    the CPU, busy time is CPU time."""

    def __init__(self, work, start, rank, microbatches):
        super().__init__()
        self.work, self.start, self.rank, self.m = work, start, rank, microbatches
        self.calls = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            step = (self.calls - 1) // self.m + 1
            mine = self.rank is None or os.environ["RANK"] == str(self.rank)
            if mine and step >= self.start:
                sum(range(self.work))
        return x


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g)


job = Job(
    name="stragglers",
    layers=[
        layer(nn.Linear, 16, 16),
        layer(Slowed, {work}, {start}, {rank}, 4),
        layer(nn.Linear, 16, 16),
        layer(nn.Linear, 16, 1),
    ],
    balance={balance},
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.01),
    train_data=data,
    batch_size=32,
    num_microbatches=4,
    max_steps={steps},
    stages={stages},
    data_parallel={replicas},
    tensor_parallel={tp},
    tp_plan={plan!r},
    run_dir={run_dir!r},
    hooks=[{{"type": "recorder"}}],
    microbatch_spans="off",
    threads=1,
)
'''


WORK = 1_000_000
"""About 10-20 ms of CPU per forward: four times per step, many times a step's own."""


def launch(
    tmp_path: Path,
    *,
    stages: int,
    replicas: int = 1,
    work: int = 0,
    start: int = 1,
    rank: int | None = None,
    steps: int = 40,
    tp: int = 1,
) -> tuple[str, list[StragglerReported]]:
    """Run the job to the end; stderr and the straggler events recorded."""
    balance = [1, 2, 1] if stages == 3 else [2, 2] if stages == 2 else [4]
    spec = tmp_path / "spec.py"
    spec.write_text(
        SPEC.format(
            work=work,
            start=start,
            rank=rank,
            balance=balance,
            steps=steps,
            stages=stages,
            replicas=replicas,
            tp=tp,
            # The first and third layers split, the slowed one between them on both halves.
            plan={"0": "colwise", "2": "rowwise"} if tp > 1 else None,
            run_dir=str(tmp_path / "run"),
        )
    )
    with launched(spec, "--run-id", "s", marker=new_marker()) as proc:
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    recording = tmp_path / "run" / "events.jsonl"
    events = read_recording(recording, types=["run.straggler"])
    return err, [e for e in events if isinstance(e, StragglerReported)]


def test_a_stage_that_slows_down_is_named_within_20_steps(tmp_path: Path) -> None:
    start = 14  # after the warm-up and the steps that set each stage's usual share
    err, reports = launch(tmp_path, stages=3, work=WORK, start=start)
    named = [r for r in reports if r.straggling]
    assert [(r.stage, r.whole_stage) for r in named] == [(1, True)], reports
    assert start < named[0].step <= start + 20
    lines = [line for line in err.splitlines() if "straggler" in line]
    assert len(lines) == 1 and f"stage 1 is a straggler from step {named[0].step}" in lines[0]


def test_a_slow_replica_is_named_against_its_stage(tmp_path: Path) -> None:
    # P=1, D=2: rank 1 is replica 1 of the only stage.
    err, reports = launch(tmp_path, stages=1, replicas=2, work=WORK, rank=1, steps=30)
    named = [(r.stage, r.replica, r.whole_stage) for r in reports if r.straggling]
    assert named == [(0, 1, False)], reports
    assert "stage 0 replica 1 is a straggler" in err, err


def test_a_slow_tensor_rank_is_named_alone(tmp_path: Path) -> None:
    # P=1, D=1, T=2: rank 1 is tensor rank 1 of the only replica.
    err, reports = launch(tmp_path, stages=1, tp=2, work=WORK, rank=1, steps=30)
    named = [(r.stage, r.replica, r.tp, r.whole_stage) for r in reports if r.straggling]
    assert named == [(0, 0, 1, False)], reports
    assert "stage 0 replica 0 tensor rank 1 is a straggler" in err, err


def test_a_run_without_a_slow_stage_or_replica_names_none(tmp_path: Path) -> None:
    err, reports = launch(tmp_path, stages=2, replicas=2, steps=40)
    assert reports == [] and "straggler" not in err, err
