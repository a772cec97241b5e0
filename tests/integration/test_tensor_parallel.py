"""Tensor parallelism inside the stages (`Job.tensor_parallel`, `evtrain.stages.tensor_parallel`)
through `evtrain launch`.

P=2 stages x T=2 tensor ranks (4 processes): a ``layers=`` job split by its own
``tp_plan`` and a Hugging Face Llama split by the model's own plan, both as
written, train as one process does: weights within 1e-5 after several steps,
under 1F1B and zero bubble, with clipping by the global norm. Each rank holds
half of every split linear. A split checkpoint resumes at T=1 and a whole one
at T=2, to the uninterrupted run's weights; it exports as the unsplit model
(the Llama for ``from_pretrained``). What cannot run is refused before any
process starts, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch_helpers import new_marker, run_launch
from test_data_parallel import assert_close, dumped, reference
from test_real_models import dumped as real_dumped
from test_real_models import export, export_command
from test_unmodified_models import train_and_compare, write

from evtrain.checkpoint import list_checkpoints

STEPS = 20
ATOL = 1e-5

HEADER = """\
import functools
import sys

sys.path.insert(0, {tests!r})

import torch
from helpers.mlp_parts import FeedForward, LengthProbe, NormedFeedForward, mae, make_data
from helpers.mlp_parts import accuracy, make_classes, make_sequences, split_cross_entropy
from torch import nn

from evtrain.job import Job, layer

"""

SPEC = (
    HEADER
    + """\
job = Job(
    name="tp",
    layers=[
        layer(nn.Linear, 8, 16),
        layer(FeedForward, 16, 32),
        layer(FeedForward, 16, 32),
        layer(nn.Linear, 16, 1),
    ],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    train_data=functools.partial(make_data, 256, 1),
    eval_data=functools.partial(make_data, 96, 2),
    metrics={{"mae": mae}},
    batch_size=32,
    num_microbatches=4,
    max_steps={steps},
    seed=7,
    stages=2,
    run_dir={run_dir!r},
    hooks=[{{"type": "helpers.launch_hooks:StageTimesRecorder", "path": {records!r}}}, {hooks}],
    microbatch_spans="off",
    threads=1,
    tensor_parallel={tp},
    tp_plan={plan!r},
    loss_parallel={loss_parallel},
)
"""
)

PLAN = {"*.up": "colwise", "*.down": "rowwise"}


CHECKPOINTS = {"type": "checkpoint", "every_steps": 10}


def spec_file(
    directory: Path,
    tp: int = 2,
    plan: object = PLAN,
    *hooks: object,
    loss_parallel: bool = False,
) -> Path:
    path = directory / "spec.py"
    path.write_text(
        SPEC.format(
            loss_parallel=loss_parallel,
            tests=str(Path(__file__).parents[1]),
            steps=STEPS,
            run_dir=str(directory / "run"),
            records=str(directory / "steps.jsonl"),
            tp=tp,
            plan=plan,
            hooks=", ".join(map(repr, hooks)),
        )
    )
    return path


def launched(spec: Path, *args: str) -> tuple[int, str]:
    proc, leftovers = run_launch(spec, "--quiet", *args, marker=new_marker(), timeout=180)
    assert leftovers == []
    return proc.returncode, proc.stdout + proc.stderr


# Per layer of the spec: (parameters, of which the plan splits): Linear(8, 16), two
# FeedForward(16, 32) (up's weight and bias, down's weight split; down's bias whole),
# Linear(16, 1).
LAYER_PARAMS = [(8 * 16 + 16, 0), *[(16 * 32 + 32 + 32 * 16 + 16, 16 * 32 + 32 + 32 * 16)] * 2]
LAYER_PARAMS.append((16 + 1, 0))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved", "zbv"])
def test_own_plan_trains_as_one_process_on_half_the_split_layers(
    tmp_path: Path, schedule: str
) -> None:
    spec = spec_file(tmp_path)
    chunks = ["--virtual-stages", "2", "--balance", "1,1,1,1"] if "v" in schedule else []
    status, out = launched(
        spec,
        "--schedule",
        schedule,
        *chunks,
        "--grad-clip",
        "0.05",
        "--dump-weights",
        str(tmp_path / "w"),
    )
    assert status == 0, out
    assert "2 stages x 2 tensor ranks" in out
    want_losses, want = reference(spec, 0.05)
    assert_close(dumped(tmp_path / "w"), want, ATOL)
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    # Tensor rank 0 speaks for the stage: one StageStarted and one StepEnded per step each.
    assert sorted(r["stage_started"] for r in rows if "stage_started" in r) == [0, 1]
    losses = [r["loss"] for r in rows if r.get("stage") == 1 and "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=ATOL)
    # Clipping took effect (the norm counted every rank's slice once).
    unclipped = reference(spec, None)[1]
    assert any((unclipped[k] - want[k]).abs().max() > 1e-4 for k in want)
    # Each rank holds half of each split linear's weight and momentum (and all the rest),
    # on every chunk.
    held = {r["stage"]: r["state_bytes"] for r in rows if "state_bytes" in r}
    layers = {r["stage_started"]: r["layers"] for r in rows if "stage_started" in r}
    for stage in (0, 1):
        counts = [LAYER_PARAMS[int(name)] for name in layers[stage]]
        assert held[stage] == 2 * 4 * sum(whole - split // 2 for whole, split in counts)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_hugging_face_llama_as_written_splits_by_its_own_plan(
    tmp_path: Path, schedule: str
) -> None:
    pytest.importorskip("transformers")
    records = tmp_path / "steps.jsonl"
    recorder = {"type": "helpers.launch_hooks:StageTimesRecorder", "path": str(records)}
    final = [{"type": "checkpoint", "on_stop": True}] if schedule == "1f1b" else []
    want = train_and_compare(
        tmp_path,
        "hf_llama_4_heads",
        (2,),
        tensor_parallel=2,
        schedule=schedule,
        hooks=[recorder, *final],
        grad_clip=0.05,
    )
    if final:
        # The split checkpoint exports as the unsplit model, for from_pretrained.
        from transformers import LlamaForCausalLM

        export_command(tmp_path / "run2", "--hf", str(tmp_path / "hf"))
        model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    whole = {r["stage_started"]: 2 * 4 * r["num_params"] for r in rows if "stage_started" in r}
    held = {r["stage"]: r["state_bytes"] for r in rows if "state_bytes" in r}
    # Weights and momentum: the attention and MLP projections (most of a stage) are halved.
    for stage in (0, 1):
        assert held[stage] < 0.8 * whole[stage], (held, whole)


SEQUENCE_SPEC = (
    HEADER
    + """\
job = Job(
    name="sp",
    layers=[
        layer(nn.Linear, 8, 16),
        layer(NormedFeedForward, 16, 32),
        layer(LengthProbe, {probes!r}),  # what the second stage receives
        layer(NormedFeedForward, 16, 32),
        layer(nn.LayerNorm, 16),
        layer(nn.Linear, 16, 2),
    ],
    balance=[2, 4],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    train_data=functools.partial(make_sequences, 256, {length}),
    batch_size=32,
    num_microbatches=4,
    max_steps={steps},
    seed=7,
    stages=2,
    run_dir={run_dir!r},
    microbatch_spans="off",
    threads=1,
    tensor_parallel=2,
    tp_plan={plan!r},
)
"""
)

SEQUENCE_PLAN = {
    "0": "rowwise_rep",  # the whole input in, this rank's slice of the sequence out
    "*.norm": "sequence_parallel",
    "*.up": "colwise",
    "*.down": "rowwise",
    "4": "sequence_parallel",
    "5": "colwise_rep",  # the head gathers the sequence for the loss
}


def sequence_spec(directory: Path, length: int = 8, plan: object = SEQUENCE_PLAN) -> Path:
    path = directory / "spec.py"
    (directory / "lengths").mkdir()
    path.write_text(
        SEQUENCE_SPEC.format(
            tests=str(Path(__file__).parents[1]),
            length=length,
            steps=STEPS,
            run_dir=str(directory / "run"),
            probes=str(directory / "lengths"),
            plan=plan,
        )
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_sequence_parallel_plan_trains_as_one_process_on_sequence_slices(
    tmp_path: Path, schedule: str
) -> None:
    """Norms on each rank's half of the sequence, the split linears' outputs
    reduce-scattered into it and their inputs gathered from it, the stages sending
    each other those halves: one process's weights, with clipping."""
    spec = sequence_spec(tmp_path)
    status, out = launched(
        spec, "--schedule", schedule, "--grad-clip", "0.05", "--dump-weights", str(tmp_path / "w")
    )
    assert status == 0, out
    # Ranks 2 and 3 (the second stage's tensor ranks) each received half the sequence.
    lengths = {p.name: int(p.read_text()) for p in (tmp_path / "lengths").iterdir()}
    assert {lengths["2"], lengths["3"]} == {4}, lengths
    want = reference(spec, 0.05)[1]
    assert_close(dumped(tmp_path / "w"), want, ATOL)
    unclipped = reference(spec, None)[1]
    assert any((unclipped[k] - want[k]).abs().max() > 1e-4 for k in want)


@pytest.mark.parametrize(
    ("length", "plan", "message"),
    [
        (
            7,
            SEQUENCE_PLAN,
            "2 does not divide a sequence length of 7 (an input of shape [1, 7, 8]), which "
            "a sequence-parallel plan splits: pad to a multiple of 2",
        ),
        (
            8,
            {k: v for k, v in SEQUENCE_PLAN.items() if k != "5"},
            "the model's output leaves the last stage as a sequence slice (length 4 of 8): "
            "make its head 'colwise_rep'",
        ),
    ],
)
def test_a_sequence_parallel_plan_refuses_what_it_cannot_split_or_left_split(
    tmp_path: Path, length: int, plan: object, message: str
) -> None:
    status, out = launched(sequence_spec(tmp_path, length, plan))
    assert status != 0 and message in out, out
    if length % 2:  # refused before launch, in one line
        assert "run dir:" not in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "replicas", "shard"), [(1, 2, "grads")])
def test_norms_the_plan_keeps_whole_sum_their_gradient_parts(
    tmp_path: Path, stages: int, replicas: int, shard: str
) -> None:
    """Qwen3's own plan splits the query and key projections by heads and keeps their
    per-head norms whole (``replicated_with_grad_allreduce``): each tensor rank
    normalizes its own heads, so holds part of the norms' gradient, which the tensor
    ranks sum before clipping and the step (after the reduce-scatter when sharded)."""
    pytest.importorskip("transformers")
    train_and_compare(
        tmp_path,
        "hf_qwen3_4_heads",
        (stages,),
        tensor_parallel=2,
        data_parallel=replicas,
        shard=shard,
        grad_clip=0.05,
    )


@pytest.mark.parametrize(
    ("model", "fields", "message"),
    [
        (None, {"plan": None}, "tensor_parallel=2 with layers= needs a tp_plan"),
        (None, {"plan": {"*.up": "diagonal"}}, "*.up: unknown style 'diagonal'"),
        (
            None,
            {"loss_parallel": True},
            "field 'loss_parallel': with a tp_plan of the job's own, name its head 'colwise_loss'",
        ),
        ("hf_llama", {}, "2 does not divide LlamaForCausalLM's num_key_value_heads (1)"),
        ("hf_gpt2", {}, "GPT2LMHeadModel has no tensor-parallel plan of its own"),
        (
            "hf_llama_4_heads",
            {"tp_plan": {"model.layers.*.input_layernorm": "sequence_parallel"}},
            "LlamaForCausalLM's decoder layers hand their attention the whole sequence",
        ),
    ],
)
def test_what_cannot_split_is_refused_before_launch(
    tmp_path: Path, model: str | None, fields: dict[str, object], message: str
) -> None:
    if model is None:
        spec = spec_file(tmp_path, **fields)  # type: ignore[arg-type]
    else:
        pytest.importorskip("transformers")
        spec = write(tmp_path, model, 2, STEPS, tensor_parallel=2, **fields)
    status, out = launched(spec)
    assert status != 0
    assert message in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "run" / "launches").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "shard", "accum"),
    [("1f1b", "none", 2), ("zb", "grads", 1)],
    ids=["1f1b", "zb-grads"],
)
def test_hugging_face_llama_on_two_replicas_of_two_tensor_ranks_trains_as_one_process(
    tmp_path: Path, schedule: str, shard: str, accum: int
) -> None:
    """P=2 x D=2 x T=2: 8 processes, the replicas averaging (or, sharded, reduce-scattering)
    each rank's slices, with clipping and gradient accumulation."""
    pytest.importorskip("transformers")
    want = train_and_compare(
        tmp_path,
        "hf_llama_4_heads",
        (2,),
        tensor_parallel=2,
        data_parallel=2,
        grad_accum=accum,
        schedule=schedule,
        shard=shard,
        grad_clip=0.05,
    )
    if shard == "none":
        # The clipping took effect.
        (tmp_path / "unclipped").mkdir()
        unclipped = train_and_compare(
            tmp_path / "unclipped", "hf_llama_4_heads", (), grad_accum=accum
        )
        assert any((unclipped[k] - want[k]).abs().max() > 1e-4 for k in want)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "schedule"), [("grads", "zb"), ("full", "1f1b")])
def test_sharded_replicas_of_tensor_ranks_train_as_one_process(
    tmp_path: Path, mode: str, schedule: str
) -> None:
    """P=2 x D=2 x T=2 with FSDP2 over the replicas of each tensor rank's slices (2-D
    DTensors, as torchtitan): one process's weights, with clipping; each element of a
    tensor rank's slices held by one replica; a checkpoint every process wrote its part
    of resumes on one process per stage."""
    spec = spec_file(tmp_path, 2, PLAN, CHECKPOINTS)
    status, out = launched(
        spec,
        *("--dp", "2", "--shard", mode, "--schedule", schedule, "--grad-clip", "0.05"),
        *("--dump-weights", str(tmp_path / "w")),
    )
    assert status == 0, out
    assert "2 stages x 2 replicas x 2 tensor ranks" in out
    assert_close(dumped(tmp_path / "w"), reference(spec, 0.05)[1], ATOL)
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    held = {(r["stage"], r["replica"]): r["state_bytes"] for r in rows if "state_bytes" in r}
    layers = {r["stage_started"]: r["layers"] for r in rows if "stage_started" in r}
    for stage in (0, 1):
        counts = [LAYER_PARAMS[int(name)] for name in layers[stage]]
        tensor_rank = 2 * 4 * sum(whole - split // 2 for whole, split in counts)
        assert held[stage, 0] + held[stage, 1] == tensor_rank, held
    ckpt = step_checkpoint(tmp_path, 10)
    for stage in ("stage-0", "stage-1"):
        files = sorted(p.name for p in (ckpt / stage).glob("*.distcp"))
        assert files == [f"__{i}_0.distcp" for i in range(4)], files
    (tmp_path / "one").mkdir()
    got = resumed(tmp_path / "one", ckpt, "--tp", "1", "--grad-clip", "0.05")
    assert_close(got, dumped(tmp_path / "w"), 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "fields"),
    [
        ("hf_llama_tied", {"grad_clip": 0.05}),
        ("hf_llama_tied_own_loss", {"data_parallel": 2, "shard": "optimizer", "grad_clip": 0.05}),
        ("hf_llama_4_heads", {"activation_checkpointing": True, "schedule": "zb"}),
    ],
    ids=["tied-across-stages", "own-loss-tied-sharded", "checkpointed-zb"],
)
def test_what_a_stage_may_be_composes_with_tensor_parallelism(
    tmp_path: Path, model: str, fields: dict[str, object]
) -> None:
    """A head tied to the embedding of another stage, split alike on both (the model's
    own loss on it, sharded replicas), and activation checkpointing under zero bubble:
    one process's weights."""
    pytest.importorskip("transformers")
    train_and_compare(tmp_path, model, (2,), tensor_parallel=2, **fields)


@pytest.mark.slow
def test_reduced_precision_rounds_as_reduced_precision_does(tmp_path: Path) -> None:
    """bf16 under tensor parallelism: each rank's matmul rounds its slice and the sums
    over the ranks round again, so the weights differ from one bf16 process by
    roundings (as one bf16 process differs from fp32), not by a gradient."""
    pytest.importorskip("transformers")
    fp32 = train_and_compare(tmp_path, "hf_llama_tied", ())
    bf16 = train_and_compare(tmp_path, "hf_llama_tied", (), precision="bf16")
    spec = write(tmp_path, "hf_llama_tied", 2, 5, tensor_parallel=2, precision="bf16")
    status, out = launched(spec, "--dump-weights", str(tmp_path / "w"))
    assert status == 0, out
    got = {k: v for part in real_dumped(tmp_path / "w") for k, v in part.items()}
    rounding = max(float((fp32[k] - bf16[k]).abs().max()) for k in got)
    assert rounding > 1e-4  # bf16 really ran
    assert max(float((got[k] - bf16[k]).abs().max()) for k in got) < 3 * rounding


@pytest.mark.slow
def test_evaluation_is_exact_on_split_stages(tmp_path: Path) -> None:
    """Three eval batches, on T=1 and on two replicas of T=2 (one evaluates two batches,
    the other one): the same metrics."""
    evals = {}
    for name, args in {"1": ["--tp", "1"], "2x2": ["--dp", "2"]}.items():
        directory = tmp_path / name
        directory.mkdir()
        spec = spec_file(directory, 2, PLAN, {"type": "metrics"})
        status, out = launched(spec, *args, "--eval-every", "10")
        assert status == 0, out
        lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
        evals[name] = [r for r in map(json.loads, lines) if r["type"] == "eval"]
    assert [e["step"] for e in evals["2x2"]] == [10, 20]
    for one, both in zip(evals["1"], evals["2x2"], strict=True):
        assert one["samples"] == both["samples"] == 96
        assert both["metrics"] == pytest.approx(one["metrics"], rel=1e-5)


CLASS_PLAN = {**PLAN, "3": "colwise_loss"}
"""The spec's layers as a classifier whose head leaves its logits split into the loss."""


def class_spec(directory: Path, plan: object, loss: str) -> Path:
    spec = spec_file(directory, 2, plan, {"type": "metrics"})
    text = spec.read_text()
    for old, new in [
        ("loss_fn=nn.functional.mse_loss", f"loss_fn={loss}"),
        ("make_data", "make_classes"),
        ('"mae": mae', '"accuracy": accuracy'),
        ("layer(nn.Linear, 16, 1)", "layer(nn.Linear, 16, 6)"),
    ]:
        assert old in text
        text = text.replace(old, new)
    spec.write_text(text)
    return spec


@pytest.mark.slow
def test_a_head_that_leaves_its_logits_split_trains_and_evaluates_as_one_process(
    tmp_path: Path,
) -> None:
    """A classifier's ``colwise_loss`` head: each tensor rank holds half the logits (the
    loss refuses whole ones), the cross entropy of the halves under zero bubble with
    clipping gives one process's weights, and evaluation, gathering them for the
    metrics, gives the metrics of a head that gathers them itself."""
    evals = {}
    for name, plan, loss in [
        ("split", CLASS_PLAN, "split_cross_entropy"),
        ("whole", {**PLAN, "3": "colwise_rep"}, "nn.functional.cross_entropy"),
    ]:
        directory = tmp_path / name
        directory.mkdir()
        spec = class_spec(directory, plan, loss)
        status, out = launched(
            spec,
            *("--schedule", "zb", "--grad-clip", "0.05", "--eval-every", "10"),
            *("--dump-weights", str(directory / "w")),
        )
        assert status == 0, out
        lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
        evals[name] = [r for r in map(json.loads, lines) if r["type"] == "eval"]
        if name == "split":
            assert_close(dumped(directory / "w"), reference(spec, 0.05)[1], ATOL)
    assert [e["step"] for e in evals["split"]] == [10, 20]
    for split, whole in zip(evals["split"], evals["whole"], strict=True):
        assert split["metrics"] == pytest.approx(whole["metrics"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "model", "layout"),
    [
        ("1f1b", "hf_llama_split_logits_own_loss", {}),
        ("zb", "hf_llama_split_logits", {"data_parallel": 2, "shard": "grads"}),
    ],
    ids=["1f1b-own-loss", "zb-job-loss-sharded"],
)
def test_hugging_face_llama_with_loss_parallel_trains_as_one_process(
    tmp_path: Path, schedule: str, model: str, layout: dict[str, object]
) -> None:
    """``loss_parallel=True`` makes the Llama's own head leave its logits split (the
    model refuses whole ones on a split head); its own loss, or the job's, of the
    halves, also on sharded replicas: one process's weights, with clipping."""
    pytest.importorskip("transformers")
    train_and_compare(
        tmp_path,
        model,
        (2,),
        tensor_parallel=2,
        loss_parallel=True,
        schedule=schedule,
        grad_clip=0.05,
        **layout,
    )


def test_a_split_head_where_no_loss_is_computed_is_refused(tmp_path: Path) -> None:
    status, out = launched(spec_file(tmp_path, 2, {**PLAN, "0": "colwise_loss"}))
    assert status != 0
    assert "0 is 'colwise_loss' but stage 0 computes no loss" in out, out


def checkpointed_run(directory: Path, tp: int) -> Path:
    """20 steps at ``tp`` tensor ranks, committing checkpoints at steps 10 and 20."""
    spec = spec_file(directory, tp, PLAN, CHECKPOINTS)
    status, out = launched(spec, "--dump-weights", str(directory / "w"))
    assert status == 0, out
    return directory


@pytest.fixture(scope="module")
def split_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpointed_run(tmp_path_factory.mktemp("tp2"), 2)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpointed_run(tmp_path_factory.mktemp("tp1"), 1)


def resumed(directory: Path, checkpoint: Path, *args: str) -> dict[str, torch.Tensor]:
    """The weights after resuming ``checkpoint`` (the spec at T=2, then ``args``) to
    step 20."""
    status, out = launched(
        spec_file(directory),
        *args,
        "--resume",
        str(checkpoint),
        "--log-level",
        "info",
        "--dump-weights",
        str(directory / "w"),
    )
    assert status == 0, out
    assert "step=10" in out  # resumed after step 10, not from scratch
    return dumped(directory / "w")


def step_checkpoint(run: Path, step: int) -> Path:
    return next(c.path for c in list_checkpoints(run / "run") if c.step == step and c.committed)


@pytest.mark.slow
def test_a_split_checkpoint_resumes_whole_and_exports_the_unsplit_model(
    tmp_path: Path, split_run: Path
) -> None:
    ckpt = step_checkpoint(split_run, 10)
    # Each tensor rank wrote its own slices into its stage's directory.
    for stage in ("stage-0", "stage-1"):
        files = sorted(p.name for p in (ckpt / stage).glob("*.distcp"))
        assert files == ["__0_0.distcp", "__1_0.distcp"], files
    assert_close(resumed(tmp_path, ckpt, "--tp", "1"), dumped(split_run / "w"), 1e-6)
    exported = export(step_checkpoint(split_run, 20), tmp_path / "model.safetensors")
    final = dumped(split_run / "w")
    assert exported.keys() == final.keys()
    for key, value in exported.items():
        assert torch.equal(value, final[key]), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [(), ("--dp", "2", "--shard", "full")], ids=["T=2", "D=2-full-T=2"]
)
def test_a_whole_checkpoint_resumes_split(
    tmp_path: Path, whole_run: Path, layout: tuple[str, ...]
) -> None:
    got = resumed(tmp_path, step_checkpoint(whole_run, 10), *layout)
    assert_close(got, dumped(whole_run / "w"), 1e-6)
