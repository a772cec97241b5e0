"""Real-model interfaces through `evtrain launch`: a whole nn.Module split by module name,
layers that pass (hidden, mask) tuples, dict samples, and embeddings tied across stages.

Each run is compared with a plain single-process loop over the same microbatches,
from the same initial weights: the pipelined runs must train the same model.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch_helpers import TESTS_DIR, new_marker, run_launch
from safetensors.torch import load_file, load_model

from evtrain.checkpoint import latest_committed
from evtrain.data import DataStream
from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import build_full_model, partition, plan_split
from evtrain.stages.precision import LossScaler, autocast
from evtrain.stages.pytree import call, split, take

pytestmark = pytest.mark.slow

ATOL = 1e-5


def write(directory: Path, kind: str, stages: int, steps: int, **fields: Any) -> Path:
    spec = directory / f"{kind}_spec.py"
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    run_dir = str(directory / "run")
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from helpers import real_model_spec\n"
        f"job = real_model_spec.make_job({kind!r}, {stages}, {steps}, {run_dir!r}, {args})\n"
    )
    return spec


def reference(job: Job, steps: int) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Weights after ``steps`` single-process steps over the same microbatches, and which
    steps fp16 loss scaling skipped.

    Each microbatch's forward and loss run under the job's autocast and back-propagate
    on their own, as on the stages; fp16 scales the loss and skips a step whose
    gradient norm is not finite; the job's clipping clips by the global norm.
    """
    threads = torch.get_num_threads()
    # The stages' own thread count: another sums in another order, which fp16 shows.
    torch.set_num_threads(job.threads or 1)
    try:
        return _reference(job, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(job: Job, steps: int) -> tuple[dict[str, torch.Tensor], list[bool]]:
    model = build_full_model(job)
    optimizer = job.optimizer(model.parameters())
    data = job_data(job).train_tensors()
    stream = DataStream(data.num_samples, job.batch_size, job.seed, grad_accum=job.grad_accum)
    device = torch.device("cpu")
    scaler = LossScaler() if job.precision == "fp16" else None
    skipped = []
    for step in range(steps):
        optimizer.zero_grad()
        for accum in range(job.grad_accum):
            index = stream.indices(step, accum)
            inputs = split(take(data.inputs, index, device), job.microbatch_size)
            targets = split(take(data.targets, index, device), job.microbatch_size)
            for x, y in zip(inputs, targets, strict=True):
                with autocast(job.precision, device):
                    loss = job.loss(call(model, x), y)
                scale = scaler.scale if scaler is not None else 1.0
                (loss * scale / (len(inputs) * job.grad_accum)).backward()
        if scaler is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            scaler.unscale_(grads)
            norm = float(torch.stack(torch._foreach_norm(grads)).square().sum().sqrt())
            if scaler.update(not math.isfinite(norm)):
                skipped.append(True)
                continue
        skipped.append(False)
        if job.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.grad_clip)
        optimizer.step()
    named = dict(model.named_parameters(remove_duplicate=False))
    weights = {k: v.detach().clone() for k, v in {**model.state_dict(), **named}.items()}
    return weights, skipped


def launch(spec: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=new_marker(), timeout=180, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not leftovers
    return proc


def export_command(ckpt: Path, *args: str) -> str:
    """``evtrain ckpt export CKPT ARGS...``, which must succeed: what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "evtrain", "ckpt", "export", str(ckpt), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def export(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """``evtrain ckpt export CKPT -o OUT``: the tensors it wrote."""
    export_command(ckpt, "-o", str(out))
    return load_file(str(out))


def dumped(directory: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(f)) for f in sorted(directory.glob("stage-*.safetensors"))]


def test_model_split_by_name_with_tied_embeddings_and_dict_samples(tmp_path: Path) -> None:
    spec = write(
        tmp_path,
        "model",
        2,
        4,
        split_points=["blocks.2"],
        hooks=[{"type": "checkpoint", "on_stop": True}],
    )
    job = load_job(spec)
    assert [len(r) for r in partition(job)] == [3, 3]  # embed, blocks.0-1 | blocks.2-3, head
    launch(spec, "--dump-weights", str(tmp_path / "weights"))
    stage0, stage1 = dumped(tmp_path / "weights")
    # Each stage holds its own copy of the tied weight; they stayed equal.
    assert "head.out.weight" not in stage0 and "embed.tok.weight" not in stage1
    assert torch.equal(stage0["embed.tok.weight"], stage1["head.out.weight"])
    want, _ = reference(job, 4)
    for part in (stage0, stage1):
        for key, value in part.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=ATOL, msg=key)

    # The checkpoint and its export hold the tied weight once; the export loads into
    # the plain unsplit model class.
    ckpt = latest_committed(tmp_path / "run")
    assert ckpt is not None and ckpt.step == 4
    out = tmp_path / "model.safetensors"
    exported = export(ckpt.path, out)
    assert "embed.tok.weight" in exported and "head.out.weight" not in exported
    sys.path.insert(0, str(TESTS_DIR))
    from helpers.real_model_spec import TinyGPT

    plain = TinyGPT()
    load_model(plain, str(out))
    assert plain.head is not None and plain.embed is not None
    assert plain.head.out.weight is plain.embed.tok.weight
    torch.testing.assert_close(plain.embed.tok.weight, want["embed.tok.weight"], rtol=0, atol=ATOL)

    # Resumed at three stages, automatically balanced: the stage holding only the
    # head restores the tied weight and its optimizer state from the canonical name.
    spec3 = (
        write(tmp_path / "three", "model", 3, 6) if (tmp_path / "three").mkdir() is None else spec
    )
    launch(spec3, "--resume", str(ckpt.path), "--dump-weights", str(tmp_path / "w3"))
    want6, _ = reference(job.with_overrides(max_steps=6), 6)
    parts = dumped(tmp_path / "w3")
    assert len(parts) == 3
    for part in parts:
        for key, value in part.items():
            torch.testing.assert_close(value, want6[key], rtol=0, atol=ATOL, msg=key)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_whole_model_runs_in_chunks(tmp_path: Path, schedule: str) -> None:
    """model= under the chunked schedules: each stage holds two of the model's four
    chunks (embed + block 0 | block 1 | block 2 | block 3 + head), runs each through
    a view of its pruned model, and trains the model a single process trains. The
    tied embedding spans two stages under interleaved (chunks 0 and 3 on stages 0
    and 1) and stays on one under zbv (both on stage 1)."""
    hooks = [{"type": "checkpoint", "on_stop": True}]
    spec = write(tmp_path, "model", 2, 3, schedule=schedule, virtual_stages=2, hooks=hooks)
    job = load_job(spec)
    assert [len(r) for r in partition(job)] == [2, 1, 1, 2]
    launch(spec, "--dump-weights", str(tmp_path / "weights"))
    parts = dumped(tmp_path / "weights")
    want, _ = reference(job, 3)
    tied = {"embed.tok.weight", "head.out.weight"}
    held = [tied & set(part) for part in parts]
    # Dumps hold every copy of a tied weight: each stage's own, or both names on one.
    split = [{"embed.tok.weight"}, {"head.out.weight"}]
    assert held == (split if schedule == "interleaved" else [set(), tied])
    for part in parts:
        for key, value in part.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=ATOL, msg=key)
    if schedule != "zbv":
        return
    # The chunked checkpoint (stage 1 holds chunks 0 and 3) resumes as plain 1F1B.
    ckpt = latest_committed(tmp_path / "run")
    assert ckpt is not None and ckpt.step == 3
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    plain = write(resumed, "model", 3, 5)
    launch(plain, "--resume", str(ckpt.path), "--dump-weights", str(resumed / "weights"))
    want5, _ = reference(job.with_overrides(max_steps=5), 5)
    for part in dumped(resumed / "weights"):
        for key, value in part.items():
            torch.testing.assert_close(value, want5[key], rtol=0, atol=ATOL, msg=key)


@pytest.fixture(scope="module")
def layers_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers passing (hidden, mask) tuples with an explicit tie, at 3 stages, 4 steps."""
    d = tmp_path_factory.mktemp("layers")
    launch(
        write(d, "layers", 3, 4),
        "--dump-weights",
        str(d / "weights"),
        EVTRAIN_TEST_BLOCK_CALLS=str(d / "calls"),
    )
    return d


def test_layers_passing_tuples_with_explicit_ties(layers_run: Path) -> None:
    job = load_job(layers_run / "layers_spec.py")
    parts = dumped(layers_run / "weights")
    assert len(parts) == 3
    first, last = parts[0], parts[-1]
    assert torch.equal(first["0.tok.weight"], last["5.out.weight"])
    want, _ = reference(job, 4)
    for part in parts:
        for key, value in part.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=ATOL, msg=key)


def test_activation_checkpointing_is_bitwise_equal(layers_run: Path, tmp_path: Path) -> None:
    launch(
        write(tmp_path, "layers", 3, 4, activation_checkpointing=True),
        "--dump-weights",
        str(tmp_path / "weights"),
        EVTRAIN_TEST_BLOCK_CALLS=str(tmp_path / "calls"),
    )
    for a, b in zip(dumped(layers_run / "weights"), dumped(tmp_path / "weights"), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # The blocks' forwards ran again in the backward: 4 blocks x 4 microbatches x 4 steps.
    runs = [len((d / "calls").read_text().splitlines()) for d in (layers_run, tmp_path)]
    assert runs[1] - runs[0] == 4 * 4 * 4, runs


def test_bad_model_input_is_refused_before_any_process(tmp_path: Path) -> None:
    # Through the CLI: one line, exit 2, before any process starts.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evtrain",
            "launch",
            str(write(tmp_path, "model", 2, 2, split_points=["blocks.9"])),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'blocks.9' names no unit" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
    # The same check, in process, for the other mistakes.
    for kind, fields, says in (
        ("layers", {"tied": [("0.nope.weight", "5.out.weight")]}, "'0.nope.weight' is not a"),
        (
            "unaware",
            {"split_points": ["blocks.2"], "pruned_forward": True},
            "this stage does not hold",
        ),
        ("bad_leaf", {}, r"layer 1 \(CountingBlock\) produced a int at \[1\]"),
    ):
        with pytest.raises(SpecError, match=says):
            plan_split(load_job(write(tmp_path, kind, 2, 2, **fields)))
    with pytest.raises(SpecError, match="split_points"):
        load_job(write(tmp_path, "layers", 2, 2, split_points=["1"]))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_equals_single_process(tmp_path: Path, precision: str) -> None:
    # fp16: a loss 50 times larger overflows the scaled fp16 gradients of the first
    # steps; the scale backs off until steps apply, and every stage skips the same ones.
    fields: dict[str, Any] = {"precision": precision}
    if precision == "fp16":
        fields["loss_gain"] = 50.0
    spec = write(tmp_path, "layers", 2, 8, **fields)
    launch(spec, "--dump-weights", str(tmp_path / "w"))
    job = load_job(spec)
    want, skipped = reference(job, 8)
    got = {k: v for part in dumped(tmp_path / "w") for k, v in part.items()}
    if precision == "fp16":
        assert any(skipped) and not all(skipped), skipped
    else:
        fp32, _ = reference(job.with_overrides(precision="fp32"), 8)
        assert max(float((got[k] - fp32[k]).abs().max()) for k in got) > 1e-5  # it really ran
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5, msg=key)
