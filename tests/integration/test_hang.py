"""A run that hangs is reported and ended: where each stage is, what it waits on, its stack.

Three real 3-stage launches with ``--hang-timeout 5``: a layer on stage 1
that never returns from one forward; a data set that never returns one
sample to the stages that read it (the first and the last); stage 2's
process stopped with SIGSTOP, so that its connections stay open and
nothing fails. Each time the launcher prints the report within the timeout
and a few seconds, writes every stack to ``hang.txt``, publishes
``HangReported``, exits with status 4, marks ``run.json`` "hung" and leaves
no process behind. A fourth launch hangs in its first attempt only: with a
restart left, elastic restarts the workers and the run completes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.launch_helpers import launched, new_marker

from evtrain.events import HangReported, RunEnded
from evtrain.exporters.recorder import read_recording
from evtrain.launcher import EXIT_HUNG
from evtrain.stages.worker import StageReport, read_stage_reports

pytestmark = pytest.mark.slow

SPEC = '''\
"""Three stages; stage 1's layer or stage 0's data may block forever (generated)."""

import functools
import os
import time

import torch
from torch import nn

from evtrain.job import Job, layer


def blocked_here():
    while True:
        time.sleep(0.05)  # BLOCKS


class Block(nn.Module):
    """Identity; its training forward number `at` never returns."""

    def __init__(self, at):
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                blocked_here()
        return x


class Data(torch.utils.data.Dataset):
    """64 samples; the read number `at` never returns."""

    def __init__(self, at):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        self.at = at
        self.reads = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.at:
            blocked_here()
        return self.x[i], self.y[i]


job = Job(
    name="hang",
    layers=[
        layer(nn.Linear, 8, 8),
        layer(Block, {block_at}),
        layer(nn.Linear, 8, 8),
        layer(nn.Linear, 8, 1),
    ],
    balance=[1, 2, 1],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.01),
    train_data=functools.partial(Data, {data_at}),
    data_loader={{"num_workers": 0}},
    batch_size=16,
    num_microbatches=4,
    max_steps={steps},
    stages=3,
    run_dir={run_dir!r},
    hooks={hooks!r},
    microbatch_spans="off",
    threads=1,
)
'''

STEP, MICROBATCH, M = 3, 2, 4
TIMEOUT = 5.0


def write_spec(
    tmp_path: Path,
    *,
    block_at: int = 0,
    data_at: int = -1,
    steps: int = 6,
    hooks: tuple[dict[str, str], ...] = (),
) -> Path:
    spec = tmp_path / "spec.py"
    run_dir = str(tmp_path / "run")
    spec.write_text(
        SPEC.format(
            block_at=block_at, data_at=data_at, steps=steps, run_dir=run_dir, hooks=list(hooks)
        )
    )
    return spec


def blocking_line(spec: Path) -> str:
    """``spec.py:LINE`` of the line every hang here blocks in."""
    lines = spec.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if line.endswith("# BLOCKS"))
    return f"spec.py:{number} in blocked_here"


def hung_line(err: str) -> str:
    """The report's headline on stderr, without the launcher's prefix."""
    line = next((line for line in err.splitlines() if "the run hung" in line), err)
    return line.removeprefix("evtrain launch: error: ")


def hang_report(tmp_path: Path, run_id: str) -> tuple[dict[str, Any], str]:
    """``run.json`` and ``hang.txt`` of the run."""
    run = tmp_path / "run"
    record = json.loads((run / "run.json").read_text())
    text = (run / "launches" / run_id / "hang.txt").read_text()
    return record, text


def launch_until_hung(spec: Path, run_id: str, **env: str) -> tuple[int, str, str, float]:
    """Launch, wait for the end; the exit status, stdout, stderr and when the hang began
    (the last time a stage report changed, as far as the test saw)."""
    marker = new_marker()
    args = ("--run-id", run_id, "--hang-timeout", str(TIMEOUT))
    reports_dir = spec.parent / "run" / "launches" / run_id
    with launched(spec, *args, marker=marker, **env) as proc:
        seen: dict[int, tuple[int, str]] = {}
        changed = time.monotonic()
        while proc.poll() is None:
            now = {r: (s.step, s.doing) for r, s in read_stage_reports(reports_dir, 0).items()}
            if now != seen:
                seen, changed = now, time.monotonic()
            time.sleep(0.1)
        ended = time.monotonic()
        out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, ended - changed


def test_a_layer_that_never_returns_is_reported_and_the_run_ends_hung(tmp_path: Path) -> None:
    at = (STEP - 1) * M + MICROBATCH + 1  # stage 1's forwards come in microbatch order
    spec = write_spec(tmp_path, block_at=at, hooks=({"type": "recorder"},))
    status, out, err, waited = launch_until_hung(spec, "hung")
    assert status == EXIT_HUNG, out + err
    assert waited < TIMEOUT + 10, err
    headline = hung_line(err)
    assert f"the run hung in step {STEP}: stage 1 has been in Forward m{MICROBATCH}" in headline
    assert blocking_line(spec) in headline, headline
    # What the others wait on: stage 0 for stage 1's gradient, stage 2 for its activation.
    assert "stage 0: step 3, RecvGrad m" in err and "waiting on stage 1" in err, err
    assert f"stage 2: step 3, RecvActivation m{MICROBATCH} from stage 1" in err, err
    record, text = hang_report(tmp_path, "hung")
    assert record["status"] == "hung" and record["exit_status"] == EXIT_HUNG
    hang = record["hang"]
    assert (hang["stage"], hang["step"], hang["doing"]) == (1, STEP, f"Forward m{MICROBATCH}")
    # The hooks heard it, and then that the run ended.
    events = list(read_recording(tmp_path / "run" / "events.jsonl"))
    reported = [e for e in events if isinstance(e, HangReported)]
    assert len(reported) == 1 and reported[0].stage == 1 and not reported[0].restarting
    assert blocking_line(spec) in reported[0].location
    assert reported[0].summary.split("\n", 1)[0] == headline
    ended = [e for e in events if isinstance(e, RunEnded)]
    assert ended[-1].status == "failed" and ended[-1].root_cause == headline
    # Every stage's stack; the user's frames marked, the block's own line among them.
    assert text.count("== stage ") == 3
    marked = [line for line in text.splitlines() if line.startswith("   > ")]
    assert any(
        line.endswith(f"{blocking_line(spec)}: time.sleep(0.05)  # BLOCKS") for line in marked
    ), text
    assert "in forward: blocked_here()" in text
    assert "run hung: 2/6 steps" in out, out


def test_a_data_set_that_never_returns_a_sample_is_reported(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, data_at=(STEP - 1) * 16 + 6)  # in step 3's batch
    status, out, err, waited = launch_until_hung(spec, "loader")
    assert status == EXIT_HUNG, out + err
    assert waited < TIMEOUT + 10, err
    headline = hung_line(err)
    # The first and the last stage read the data (inputs, targets): both block in it.
    assert "has been in LoadBatch (reading the data)" in headline, headline
    assert blocking_line(spec) in headline
    for stage in (0, 2):
        line = next(line for line in err.splitlines() if line.startswith(f"  stage {stage}:"))
        assert "step 3, LoadBatch (reading the data)" in line and blocking_line(spec) in line
    # Stage 1 waits for the batch's shapes, which its neighbours have not read yet.
    assert "stage 1: step 3, AgreeShapes" in err and "waiting on every stage" in err, err
    record, text = hang_report(tmp_path, "loader")
    assert record["status"] == "hung"
    assert "in __getitem__: blocked_here()" in text, text


def test_a_stopped_peer_is_named_as_not_responding(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=100_000)
    marker, run_id = new_marker(), "stopped"
    reports_dir = tmp_path / "run" / "launches" / run_id
    args = ("--run-id", run_id, "--hang-timeout", str(TIMEOUT))
    with launched(spec, *args, marker=marker) as proc:
        deadline = time.monotonic() + 120
        reports: dict[int, StageReport] = {}
        while not (len(reports) == 3 and min(r.step for r in reports.values()) >= STEP):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, reports
            time.sleep(0.1)
            reports = read_stage_reports(reports_dir, 0)
        os.kill(reports[2].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=TIMEOUT + 60)
        waited = time.monotonic() - stopped
    assert proc.returncode == EXIT_HUNG, out + err
    assert waited < TIMEOUT + 12, err
    headline = hung_line(err)
    assert "stage 2 stopped responding" in headline and "its process is stopped" in headline
    assert "waiting on stage 2" in err or "waiting on stage 1" in err, err
    record, text = hang_report(tmp_path, run_id)
    assert record["status"] == "hung" and record["hang"]["stage"] == 2
    assert "no stack: its process is stopped" in text, text


def test_with_a_restart_left_a_hang_restarts_the_workers(tmp_path: Path) -> None:
    # The layer blocks only in the first attempt (TORCHELASTIC_RESTART_COUNT 0).
    spec = write_spec(tmp_path, block_at=(STEP - 1) * M + 1)
    marker = new_marker()
    args = ("--run-id", "again", "--hang-timeout", str(TIMEOUT), "--max-restarts", "1")
    with launched(spec, *args, marker=marker) as proc:
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert "the run hung in step 3: stage 1 has been in Forward m0" in err, err
    assert "elastic restarts the workers (restart 1 of 1)" in err, err
    assert "run completed: 6/6 steps" in out, out
    run = tmp_path / "run"
    assert (run / "launches" / "again" / "hang-attempt-0.txt").exists()
    assert json.loads((run / "run.json").read_text())["status"] == "completed"
