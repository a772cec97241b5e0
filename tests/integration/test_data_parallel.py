"""Data parallel x pipeline parallel through `evtrain launch`, against plain training.

P=2 stages x D=2 replicas run as four real processes (gloo, a (pp, dp) device
mesh, DDP's reducer per stage). Twenty steps must equal a single-process loop
on the whole batch within 1e-5 — also with gradient accumulation and
clipping — and a D=2 checkpoint must resume at D=1 and at P=3 to within 1e-6
of the uninterrupted run. One replica's process killed with SIGKILL restarts
all four from the last commit to bitwise the same weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import test_resume
import torch
from helpers.launch_helpers import kill_marked, new_marker, run_launch, start_launch, write_spec
from safetensors.torch import load_file

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model

pytestmark = pytest.mark.slow

STEPS = 20
ATOL = 1e-5


def spec_file(
    directory: Path, *, accum: int = 1, hooks: list[dict[str, Any]] | None = None
) -> Path:
    recorder = {
        "type": "helpers.launch_hooks:StageTimesRecorder",
        "path": str(directory / "steps.jsonl"),
    }
    path = write_spec(directory, steps=STEPS, hooks=[recorder, *(hooks or [])])
    text = path.read_text().replace(
        "num_microbatches=4,", f"num_microbatches=4,\n    grad_accum={accum},"
    )
    path.write_text(text)
    return path


def launch(spec: Path, *args: str) -> str:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=new_marker(), timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert leftovers == []
    return out


def dumped(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("stage-*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out), "a parameter appears on two stages"
        out.update(part)
    return out


def reference(spec: Path, grad_clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and weights of one process training on every batch whole."""
    job = apply_overrides(load_job(spec), {"stages": "1"})
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    inputs, targets = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    losses = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        total = 0.0
        for accum in range(job.grad_accum):
            index = stream.indices(step - 1, accum)
            loss = job.loss_fn(model(inputs[index]), targets[index]) / job.grad_accum
            loss.backward()
            total += loss.item()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines()]


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A D=2 run of 20 steps that committed checkpoints at steps 10 and 20."""
    d = tmp_path_factory.mktemp("dp2")
    spec = spec_file(d, hooks=[{"type": "checkpoint", "every_steps": 10}])
    out = launch(spec, "--dp", "2", "--dump-weights", str(d / "weights"))
    assert f"run completed: {STEPS}/{STEPS} steps" in out
    return d


def check_against_reference(d: Path, grad_clip: float | None) -> None:
    ref_losses, ref_weights = reference(d / "spec.py", grad_clip)
    assert_close(dumped(d / "weights"), ref_weights, ATOL)
    rows = records(d)
    started = sorted((r["stage_started"], r["replica"]) for r in rows if "stage_started" in r)
    assert started == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for replica in (0, 1):
        # Each replica's last stage reports the global mean loss: the full batch's.
        losses = [r["loss"] for r in rows if r.get("stage") == 1 and r.get("replica") == replica]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=ATOL
        )


def test_two_replicas_of_two_stages_equal_single_process_training(uninterrupted: Path) -> None:
    check_against_reference(uninterrupted, None)
    assert {r["samples"] for r in records(uninterrupted) if "samples" in r} == {32}
    committed = [c for c in list_checkpoints(uninterrupted / "run") if c.committed]
    assert [c.step for c in committed] == [10, 20]
    # Written once per stage: replica 0's shards only.
    assert sorted(p.name for p in committed[0].path.glob("stage-*")) == ["stage-0", "stage-1"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved", "zbv"])
def test_with_gradient_accumulation_and_clipping(tmp_path: Path, schedule: str) -> None:
    """Also with zero bubble, interleaved 1F1B and zbv (2 chunks per stage), which
    average the replicas' gradients themselves: DDP's reducer never sees them."""
    spec = spec_file(tmp_path, accum=2)
    grad_clip = 0.05
    weights = str(tmp_path / "weights")
    out = launch(
        spec,
        "--dp",
        "2",
        "--schedule",
        schedule,
        "--virtual-stages",
        "2" if schedule in ("interleaved", "zbv") else "1",
        "--grad-clip",
        str(grad_clip),
        "--dump-weights",
        weights,
    )
    assert f"run completed: {STEPS}/{STEPS} steps" in out
    check_against_reference(tmp_path, grad_clip)
    assert {r["samples"] for r in records(tmp_path) if "samples" in r} == {64}
    # The clip really bit: without it the weights differ.
    clipped, unclipped = reference(spec, grad_clip)[1], reference(spec, None)[1]
    assert any((unclipped[k] - clipped[k]).abs().max() > 10 * ATOL for k in clipped)


@pytest.mark.parametrize("layout", [("2", "1"), ("3", "1")], ids=["D=1", "P=3"])
def test_a_two_replica_checkpoint_resumes_at_another_shape(
    tmp_path: Path, uninterrupted: Path, layout: tuple[str, str]
) -> None:
    stages, dp = layout
    resume_and_compare(uninterrupted, tmp_path, "--stages", stages, "--dp", dp)


def resume_and_compare(uninterrupted: Path, directory: Path, *layout: str) -> None:
    """Resume ``uninterrupted``'s step-10 checkpoint in ``layout``: the same end, within 1e-6."""
    checkpoint = next(c for c in list_checkpoints(uninterrupted / "run") if c.step == 10)
    out = launch(
        spec_file(directory),
        *layout,
        "--resume",
        str(checkpoint.path),
        "--log-level",
        "info",
        "--dump-weights",
        str(directory / "weights"),
    )
    assert "step=10" in out  # resumed after step 10, not from scratch
    assert_close(dumped(directory / "weights"), dumped(uninterrupted / "weights"), 1e-6)


def _square(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(i)]), "y": torch.tensor([float(i * i)])}


class Numbers(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _square(i)


class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    def __iter__(self) -> Any:
        return map(_square, range(64))


class ShardedStream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """A stream that reads only the share it is asked for, and records the ask (in the
    file ``log``: workers are processes of their own)."""

    def __init__(self, log: Path, index: int = 0, count: int = 1) -> None:
        self.log, self.index, self.count = log, index, count

    def shard(self, index: int, count: int) -> ShardedStream:
        with self.log.open("a") as f:
            f.write(f"{index} {count}\n")
        return ShardedStream(self.log, index, count)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if self.count == 1 and info is not None:  # read whole: split over the workers
            return map(_square, range(info.id, 64, info.num_workers))
        return map(_square, range(self.index, 64, self.count))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_data_set_with_shard_reads_only_each_replicas_share(
    tmp_path: Path, workers: int
) -> None:
    """Each replica (and each of its workers) asks the data set for its own share and
    reads nothing else; the shares make up the one-replica batches."""
    from evtrain.stages.loading import ReaderOptions, StreamReader

    def reader(replica: int, replicas: int, log: Path) -> StreamReader:
        options = ReaderOptions(
            inputs=True,
            targets=True,
            device=torch.device("cpu"),
            replica=replica,
            replicas=replicas,
            seed=3,
            loader={"num_workers": workers},
            input_keys="x",
            target_keys="y",
        )
        return StreamReader(ShardedStream(log), options, batch_size=16)

    whole = reader(0, 1, tmp_path / "whole")
    logs = [tmp_path / "r0", tmp_path / "r1"]
    halves = [reader(r, 2, logs[r]) for r in (0, 1)]
    for b in (0, 1, 5):  # 5: the second pass
        x, _ = whole.batch(b)
        parts = [h.batch(b)[0] for h in halves]
        torch.testing.assert_close(torch.stack(parts, dim=1).reshape(-1, 1), x, rtol=0, atol=0)
    w = max(workers, 1)
    for r, log in enumerate(logs):
        asked = {tuple(map(int, line.split())) for line in log.read_text().splitlines()}
        assert asked == {(k + w * r, 2 * w) for k in range(w)}


@pytest.mark.parametrize("kind", ["memory", "map-style", "iterable"])
def test_replicas_read_disjoint_shares_that_make_up_the_batch(kind: str) -> None:
    from evtrain.data import DataStream
    from evtrain.stages.loading import (
        LoaderReader,
        MemoryReader,
        Reader,
        ReaderOptions,
        StreamReader,
    )

    stream = DataStream(64, 16, seed=3)
    cpu = torch.device("cpu")

    def reader(replica: int, replicas: int) -> Reader:
        options = ReaderOptions(
            inputs=True,
            targets=True,
            device=cpu,
            replica=replica,
            replicas=replicas,
            seed=3,
            input_keys=None if kind == "memory" else "x",
            target_keys=None if kind == "memory" else "y",
        )
        if kind == "memory":
            data = torch.arange(64.0).unsqueeze(1)
            pair = type("Pair", (), {"inputs": data, "targets": data * data})()
            return MemoryReader(pair, options, stream=stream)
        if kind == "map-style":
            return LoaderReader(Numbers(), options, stream=stream)
        return StreamReader(Stream(), options, batch_size=16)

    def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if kind == "iterable":  # replica r reads the stream's samples r modulo 2
            return torch.stack([a, b], dim=1).reshape(-1, *a.shape[1:])
        return torch.cat([a, b])  # replica r reads the r-th half of the batch

    whole = reader(0, 1)
    halves = [reader(0, 2), reader(1, 2)]
    for b in (0, 1, 5):  # 5: the second epoch (or pass)
        x, y = whole.batch(b)
        parts = [h.batch(b) for h in halves]
        assert [len(p[0]) for p in parts] == [8, 8]
        torch.testing.assert_close(joined(parts[0][0], parts[1][0]), x, rtol=0, atol=0)
        torch.testing.assert_close(joined(parts[0][1], parts[1][1]), y, rtol=0, atol=0)
        assert not set(parts[0][0].flatten().tolist()) & set(parts[1][0].flatten().tolist())


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_a_replica_killed_mid_run_restarts_every_process_to_the_same_weights(
    tmp_path: Path, shard: str
) -> None:
    """Also sharded: the replicas gather every checkpoint whole and cut their shards
    from it again on the restart."""
    hooks = test_resume.ckpt_hook(every_steps=2, keep_last=5)
    ref = tmp_path / "ref"
    ref.mkdir()
    layout = ("--dp", "2", "--shard", shard)
    launch(test_resume.write_spec(ref, hooks=hooks), *layout, "--dump-weights", str(ref / "w"))

    d, pids = tmp_path / "killed", tmp_path / "killed" / "pids"
    d.mkdir()
    spec = test_resume.write_spec(d, delay=0.05, pid_dir=str(pids), hooks=hooks)
    marker = new_marker()
    args = (*layout, "--max-restarts", "1", "--log-level", "info", "--dump-weights")
    proc = start_launch(spec, *args, str(d / "w"), marker=marker)
    try:
        run = d / "run"
        test_resume._wait_for(
            lambda: run.is_dir() and latest_committed(run) is not None, 60, "a checkpoint"
        )
        # Rank 3: stage 1 of replica 1 (its layer records RANK-pid when built).
        victim = int(next(pids.glob("3-*")).name.split("-")[1])
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=90)
        out = stdout + stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(marker)
    assert proc.returncode == 0, out
    assert "stage 1 replica 1 was killed by SIGKILL" in out
    # Every process of both replicas resumed from the commit.
    assert len(re.findall(r"\bresumed\b.*path=", out)) == 4, out
    assert len(list(pids.glob("3-*"))) == 2  # the killed process was started again
    test_resume.assert_bitwise(dumped(d / "w"), dumped(ref / "w"))


UNUSED_SPEC = '''\
"""A layer with a head it never calls (generated)."""

import functools

import torch
from torch import nn

from evtrain.job import Job, layer


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)


job = Job(
    name="unused",
    layers=[layer(nn.Linear, 8, 8), layer(nn.Tanh), layer(Unused), layer(nn.Linear, 8, 8)],
    balance=[2, 2],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    train_data=data,
    batch_size=16,
    num_microbatches=2,
    max_steps=6,
    stages=2,
    seed=1,
    run_dir={run_dir!r},
    find_unused_parameters={find_unused!r},
    threads=1,
)
'''


@pytest.mark.parametrize(
    ("schedule", "shard"), [("1f1b", "none"), ("zb", "none"), ("zb", "grads"), ("1f1b", "full")]
)
def test_a_parameter_without_gradient_is_named_or_handled(
    tmp_path: Path, schedule: str, shard: str
) -> None:
    """Without `find_unused_parameters` the run fails in one line naming the head's
    parameters (not DDP's traceback); with it, the replicas train as one process does
    (sharded, they reduce the unused parameters' zeros)."""
    spec = tmp_path / "spec.py"
    spec.write_text(UNUSED_SPEC.format(run_dir=str(tmp_path / "run"), find_unused=False))
    args = ("--quiet", "--dp", "2", "--schedule", schedule, "--shard", shard)
    proc, leftovers = run_launch(spec, *args, marker=new_marker(), timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert leftovers == []
    assert "parameters 2.head.weight, 2.head.bias got no gradient in this step: set " in out
    assert "Job(find_unused_parameters=True) or freeze them (requires_grad=False)" in out, out
    assert "Expected to have finished reduction" not in out

    spec.write_text(UNUSED_SPEC.format(run_dir=str(tmp_path / "run2"), find_unused=True))
    weights = tmp_path / "weights"
    launch(spec, *args, "--dump-weights", str(weights))
    job = load_job(spec)
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    inputs, targets = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    for step in range(6):
        optimizer.zero_grad()
        index = stream.indices(step, 0)
        job.loss_fn(model(inputs[index]), targets[index]).backward()
        optimizer.step()
    assert_close(dumped(weights), model.state_dict(), ATOL)
