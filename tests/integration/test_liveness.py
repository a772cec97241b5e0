"""Where each stage is: the instruction a stage executes or waits in, in its heartbeats
and its stage report.

A layer on stage 1 blocks in the forward of microbatch 2 of step 3 until the
test lets it go. Meanwhile stage 1's report says ``Forward m2`` for longer and
longer, and stage 0's says it waits on stage 1; released, the run completes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.launch_helpers import launched, new_marker

from evtrain.stages.worker import StageReport, read_stage_reports

pytestmark = pytest.mark.slow

SPEC = '''\
"""Stage 1 blocks in one forward until a file exists (generated)."""

import functools
import os
import time

import torch
from torch import nn

from evtrain.job import Job, layer


class Block(nn.Module):
    """Identity; its training forward number `at` waits for the file $EVTRAIN_TEST_GATE."""

    def __init__(self, at):
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                while not os.path.exists(os.environ["EVTRAIN_TEST_GATE"]):
                    time.sleep(0.01)
        return x


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)


job = Job(
    name="liveness",
    layers=[layer(nn.Linear, 8, 8), layer(nn.Linear, 8, 1), layer(Block, {at})],
    balance=[1, 2],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    train_data=data,
    batch_size=16,
    num_microbatches=4,
    max_steps=5,
    stages=2,
    run_dir={run_dir!r},
    microbatch_spans="off",
    threads=1,
)
'''

STEP, MICROBATCH, M = 3, 2, 4


def test_a_blocked_stage_reports_its_instruction_and_its_peer_what_it_waits_on(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "spec.py"
    at = (STEP - 1) * M + MICROBATCH + 1  # stage 1 runs its forwards in microbatch order
    spec.write_text(SPEC.format(at=at, run_dir=str(tmp_path / "run")))
    gate, marker = tmp_path / "gate", new_marker()
    reports_dir = tmp_path / "run" / "launches" / "live"

    def blocked(reports: dict[int, StageReport]) -> bool:
        one, zero = reports.get(1), reports.get(0)
        return (
            one is not None
            and zero is not None
            and one.doing == f"Forward m{MICROBATCH}"
            and one.doing_s >= 2.0
            and "from stage 1" in zero.doing
        )

    args = ("--quiet", "--run-id", "live")
    with launched(spec, *args, marker=marker, EVTRAIN_TEST_GATE=str(gate)) as proc:
        deadline = time.monotonic() + 120
        reports: dict[int, StageReport] = {}
        while not blocked(reports):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, reports
            time.sleep(0.1)
            reports = read_stage_reports(reports_dir, 0)
        # Stage 0 sent its activations ahead and waits for a gradient from stage 1.
        assert reports[0].doing.startswith("RecvGrad m"), reports[0]
        assert reports[1].step == STEP - 1 and reports[0].step == STEP - 1
        gate.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    done = read_stage_reports(reports_dir, 0)
    assert {r.doing for r in done.values()} == {""}  # between steps at the end
