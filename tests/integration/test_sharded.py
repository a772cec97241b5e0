"""Sharded data parallelism (`Job.shard`, FSDP2 per stage) through `evtrain launch`.

P=2 stages x D=2 replicas, each stage's state split between its two replicas,
must train as one process does on the whole batch: weights within 1e-5 after
20 steps in every mode, with accumulation, clipping, and zero bubble's split
backward. Each process holds about half its stage's parameters and optimizer
state. A sharded checkpoint holds whole tensors: it resumes at D=1, at P=3
and unsharded to within 1e-6 of the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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

from evtrain.checkpoint import list_checkpoints
from evtrain.overrides import apply_overrides
from evtrain.spec import load_job
from evtrain.stages.partition import build_full_model, partition

pytestmark = pytest.mark.slow


def whole_state_bytes(spec: Path) -> dict[int, int]:
    """Bytes of each stage's parameters and SGD momentum, held whole (D=1)."""
    job = apply_overrides(load_job(spec), {"stages": "2"})
    model = build_full_model(job)
    out = {}
    for stage, units in enumerate(partition(job)):
        params = [p for i in units for p in model[i].parameters()]
        out[stage] = 2 * sum(p.numel() * p.element_size() for p in params)
    return out


@pytest.mark.parametrize(
    ("mode", "schedule", "accum", "clip"),
    [
        ("optimizer", "1f1b", 2, 0.05),
        ("grads", "gpipe", 1, 0.05),
        ("full", "1f1b", 2, None),
        ("optimizer", "zb", 2, 0.05),
    ],
)
def test_each_mode_trains_as_one_process_on_half_the_state(
    tmp_path: Path, mode: str, schedule: str, accum: int, clip: float | None
) -> None:
    spec = spec_file(tmp_path, accum=accum)
    args = ["--dp", "2", "--shard", mode, "--schedule", schedule]
    if clip is not None:
        args += ["--grad-clip", str(clip)]
    out = launch(spec, *args, "--dump-weights", str(tmp_path / "weights"))
    assert f"run completed: {STEPS}/{STEPS} steps" in out
    check_against_reference(tmp_path, clip)
    whole = whole_state_bytes(spec)
    held = {(r["stage"], r["replica"]): r["state_bytes"] for r in records(tmp_path) if "step" in r}
    assert sorted(held) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (stage, _replica), state_bytes in held.items():
        # Half, up to FSDP's padding of a dimension that does not split evenly.
        assert 0.45 * whole[stage] <= state_bytes <= 0.6 * whole[stage], (stage, state_bytes)
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
    # Whole tensors, written once per stage.
    assert sorted(p.name for p in committed[0].path.glob("stage-*")) == ["stage-0", "stage-1"]
    resume_and_compare(sharded_run, tmp_path, *layout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard", "full"], "'full' splits a stage's state between its replicas: it needs"),
        (["--dp", "2", "--shard", "half"], "unknown mode 'half'"),
        (
            ["--dp", "2", "--shard", "grads", "--schedule", "zb"],
            "'grads' cannot be combined with schedule 'zb'",
        ),
        (
            [
                "--dp",
                "2",
                "--shard",
                "optimizer",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
            ],
            "cannot be combined with schedule 'interleaved'",
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
