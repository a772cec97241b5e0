"""Sharded data parallelism (`Job.shard`, FSDP2 per stage) through `evtrain launch`.

P=2 stages x D=2 replicas, each stage's state split between its two replicas,
must train as one process does on the whole batch: weights within 1e-5 after
20 steps in every mode and schedule, with accumulation, clipping, zero
bubble's split backward and two model chunks per stage. Each process holds
about half its stage's parameters and optimizer state. Each replica writes its
own shards of a checkpoint; it resumes at D=1, and at P=3 in another mode, to
within 1e-6 of the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_real_models as real_models
import torch
from helpers.launch_helpers import new_marker, run_launch, write_eval_spec
from test_data_parallel import (
    STEPS,
    check_against_reference,
    launch,
    records,
    reference,
    resume_and_compare,
    spec_file,
)

from evtrain.checkpoint import latest_committed, list_checkpoints
from evtrain.spec import load_job
from evtrain.stages.partition import build_full_model

pytestmark = pytest.mark.slow


def whole_state_bytes(spec: Path, layers: list[int]) -> int:
    """Bytes of ``layers``' parameters and SGD momentum, held whole."""
    model = build_full_model(load_job(spec))
    return 2 * sum(p.numel() * p.element_size() for i in layers for p in model[i].parameters())


@pytest.mark.parametrize(
    ("mode", "schedule", "accum", "clip"),
    [
        # Each mode under two schedules, each schedule at least once, a split backward
        # (zb, zbv) and chunks (interleaved, zbv) among them.
        ("optimizer", "1f1b", 2, 0.05),
        ("grads", "gpipe", 1, 0.05),
        ("full", "1f1b", 2, None),
        ("optimizer", "zb", 2, 0.05),
        ("full", "interleaved", 1, 0.05),
        ("grads", "zbv", 2, None),
    ],
)
def test_each_mode_trains_as_one_process_on_half_the_state(
    tmp_path: Path, mode: str, schedule: str, accum: int, clip: float | None
) -> None:
    spec = spec_file(tmp_path, accum=accum)
    args = ["--dp", "2", "--shard", mode, "--schedule", schedule]
    if schedule in ("interleaved", "zbv"):
        args += ["--virtual-stages", "2"]
    if clip is not None:
        args += ["--grad-clip", str(clip)]
    out = launch(spec, *args, "--dump-weights", str(tmp_path / "weights"))
    assert f"run completed: {STEPS}/{STEPS} steps" in out
    check_against_reference(tmp_path, clip)
    rows = records(tmp_path)
    layers = {r["stage_started"]: r["layers"] for r in rows if "stage_started" in r}
    held = {(r["stage"], r["replica"]): r["state_bytes"] for r in rows if "step" in r}
    assert sorted(held) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for stage, stage_layers in layers.items():
        # Every element is held by one replica (DDP: by both).
        assert held[stage, 0] + held[stage, 1] == whole_state_bytes(spec, stage_layers)
    # Stage 0's tensors split evenly (16 rows each); stage 1's last has 1 row.
    assert held[0, 0] == held[0, 1]
    if clip is not None:
        clipped, unclipped = reference(spec, clip)[1], reference(spec, None)[1]
        assert any((unclipped[k] - clipped[k]).abs().max() > 1e-4 for k in clipped)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded (full) D=2 run of 20 steps that committed checkpoints at steps 10 and 20."""
    d = tmp_path_factory.mktemp("sharded")
    spec = spec_file(d, hooks=[{"type": "checkpoint", "every_steps": 10}])
    launch(spec, "--dp", "2", "--shard", "full", "--dump-weights", str(d / "weights"))
    check_against_reference(d, None)
    return d


@pytest.mark.parametrize(
    "layout",
    [("--dp", "1"), ("--stages", "3", "--dp", "2", "--shard", "optimizer")],
    ids=["D=1", "P=3-optimizer"],
)
def test_a_sharded_checkpoint_resumes_at_another_shape_and_mode(
    tmp_path: Path, sharded_run: Path, layout: tuple[str, ...]
) -> None:
    committed = [c for c in list_checkpoints(sharded_run / "run") if c.committed]
    assert [c.step for c in committed] == [10, 20]
    # One directory per stage, into which each replica wrote its own shards.
    assert sorted(p.name for p in committed[0].path.glob("stage-*")) == ["stage-0", "stage-1"]
    for stage in committed[0].path.glob("stage-*"):
        assert sorted(p.name for p in stage.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resume_and_compare(sharded_run, tmp_path, *layout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard", "full"], "'full' splits a stage's state between its replicas: it needs"),
        (["--dp", "2", "--shard", "half"], "unknown mode 'half'"),
        (
            ["--dp", "2", "--shard", "full", "--schedule", "zbv", "--virtual-stages", "2"],
            "'full' cannot be combined with schedule 'zbv'",
        ),
    ],
)
def test_a_shard_mode_that_cannot_apply_is_one_line_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    spec = spec_file(tmp_path)
    proc, leftovers = run_launch(spec, *args, marker=new_marker(), timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("launches/*"))
    assert leftovers == []


def test_sharded_replicas_evaluate_unequal_shares_as_unsharded_ones_do(tmp_path: Path) -> None:
    """Three eval batches over two replicas: one evaluates two, the other one. Each
    gathers its stage once per evaluation, so neither waits on the other's gathers."""
    evals = {}
    for mode in ("none", "full"):
        directory = tmp_path / mode
        directory.mkdir()
        spec = write_eval_spec(directory, steps=6, hooks=[{"type": "metrics"}])
        launch(spec, "--dp", "2", "--shard", mode, "--eval-every", "3")
        lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
        evals[mode] = [r for r in map(json.loads, lines) if r["type"] == "eval"]
    assert [e["step"] for e in evals["full"]] == [3, 6]
    for sharded, unsharded in zip(evals["full"], evals["none"], strict=True):
        assert sharded["samples"] == unsharded["samples"] == 96
        assert sharded["metrics"] == pytest.approx(unsharded["metrics"], rel=1e-5)


def test_a_model_tied_across_stages_with_activation_checkpointing(tmp_path: Path) -> None:
    """An nn.Module split by name, its embedding and head one weight on two stages:
    replica r holds shard r of both copies, and their gradients are summed shard by
    shard. Its sharded checkpoint exports as the plain model's weights."""
    steps = 10
    spec = real_models.write(
        tmp_path,
        "model",
        2,
        steps,
        split_points=["blocks.2"],
        activation_checkpointing=True,
        hooks=[{"type": "checkpoint", "on_stop": True}],
    )
    real_models.launch(spec, "--dp", "2", "--shard", "full", "--dump-weights", str(tmp_path / "w"))
    stage0, stage1 = real_models.dumped(tmp_path / "w")
    assert torch.equal(stage0["embed.tok.weight"], stage1["head.out.weight"])
    want, _ = real_models.reference(load_job(spec).with_overrides(data_parallel=2), steps)
    for part in (stage0, stage1):
        for key, value in part.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5, msg=key)
    ckpt = latest_committed(tmp_path / "run")
    assert ckpt is not None and ckpt.step == steps
    exported = real_models.export(ckpt.path, tmp_path / "model.safetensors")
    assert exported.keys() == {**stage0, **stage1}.keys() - {"head.out.weight"}
    for key, value in exported.items():
        assert torch.equal(value, {**stage0, **stage1}[key]), key


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_as_unsharded_replicas_do(tmp_path: Path, precision: str) -> None:
    """Autocast and fp16's loss scaling (it unscales each replica's shards; an overflow
    in any shard, which the global norm sums, skips the step everywhere) as with DDP.
    With replicas each microbatch's scaled gradient is D times one process's, so
    their overflows, and bf16's roundings, are DDP's and not one process's."""
    fields: dict[str, Any] = {"precision": precision}
    if precision == "fp16":
        fields["loss_gain"] = 50.0  # overflows the first steps' scaled gradients
    spec = real_models.write(tmp_path, "layers", 2, 8, **fields)
    dumps = {}
    for shard in ("none", "grads"):
        dumps[shard] = tmp_path / f"w-{shard}"
        args = ["--dp", "2", "--shard", shard, "--run-dir", str(tmp_path / f"run-{shard}")]
        real_models.launch(spec, *args, "--dump-weights", str(dumps[shard]))
    ddp, got = (
        {k: v for part in real_models.dumped(d) for k, v in part.items()} for d in dumps.values()
    )
    for key, value in ddp.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    fp32, _ = real_models.reference(
        load_job(spec).with_overrides(data_parallel=2, precision="fp32"), 8
    )
    # It really ran in reduced precision: its weights are not fp32's (which the loss gain
    # may drive to NaN, depending on the CPU's roundings), and they are finite.
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    assert any(not torch.allclose(got[k], fp32[k], rtol=0, atol=1e-4) for k in got)
