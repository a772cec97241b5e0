"""Job spec, spec loading, CLI overrides, partitioning, stage building, data streams."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from evtrain.data import DataStream, derive_seed, eval_microbatches, microbatches
from evtrain.errors import SpecError, UsageError
from evtrain.job import Job, accuracy, layer
from evtrain.overrides import add_override_arguments, apply_overrides, overrides_from_args
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import (
    StageModule,
    build_full_model,
    build_stage_chunks,
    build_stage_module,
    layer_param_counts,
    partition,
    stage_units,
    tied_groups,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"


def mlp_layers(width: int = 8, depth: int = 4) -> list[Any]:
    layers: list[Any] = []
    for _ in range(depth):
        layers += [layer(nn.Linear, width, width), layer(nn.ReLU)]
    layers.append(layer(nn.Linear, width, 2))
    return layers


def make_job(**overrides: Any) -> Job:
    fields: dict[str, Any] = dict(
        name="t",
        layers=mlp_layers(),
        loss_fn=nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.randn(40, 8), torch.randint(0, 2, (40,))),
        batch_size=8,
        num_microbatches=4,
        max_steps=5,
    )
    fields.update(overrides)
    return Job(**fields)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(name="has space"), "name"),
        (dict(layers=[]), "layers"),
        (dict(layers=[nn.Linear(8, 8)]), "layers"),
        (dict(layers=nn.Sequential(nn.Linear(8, 8))), "layers"),
        (dict(layers=[layer(nn.Linear, 8, 8), 3]), "layers"),
        (dict(loss_fn="mse"), "loss_fn"),
        (dict(optimizer=None), "optimizer"),
        (dict(lr_scheduler=5), "lr_scheduler"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=10), "num_microbatches"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(max_steps=None), "max_steps"),
        (dict(max_steps=0), "max_steps"),
        (dict(epochs=-1), "epochs"),
        (dict(eval_batch_size=6), "eval_batch_size"),
        (dict(eval_every=10), "eval_every"),
        (dict(metrics={"loss": accuracy}), "metrics"),
        (dict(metrics={"acc": 1}), "metrics"),
        (dict(grad_clip=-1.0), "grad_clip"),
        (dict(grad_accum=0), "grad_accum"),
        (dict(seed=-3), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stages=0), "stages"),
        (dict(stages=True), "stages"),
        (dict(stages=10), "stages"),
        (dict(balance=[4, 4]), "balance"),
        (dict(balance=[9, 0]), "balance"),
        (dict(balance=[2, 2, 5]), "balance"),
        (dict(schedule="zero-bubble"), "schedule"),
        (dict(virtual_stages=2), "virtual_stages"),
        (dict(schedule="interleaved"), "virtual_stages"),
        (dict(schedule="interleaved", virtual_stages=0), "virtual_stages"),
        (dict(schedule="interleaved", virtual_stages=5), "virtual_stages"),  # 10 > 9 layers
        (dict(schedule="interleaved", virtual_stages=2, balance=[1, 2]), "balance"),
        (dict(device="gpu"), "device"),
        (dict(device="cuda:1"), "device"),
        (dict(hooks=[dict(every=3)]), "hooks"),
        (dict(hooks=[42]), "hooks"),
        (dict(microbatch_spans="some"), "microbatch_spans"),
        (dict(threads=0), "threads"),
        (dict(run_dir=""), "run_dir"),
    ],
)
def test_validation_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        make_job(**overrides)
    assert info.value.field == field
    assert f"job spec field '{field}'" in str(info.value)
    assert isinstance(info.value, UsageError)


def test_valid_job_defaults_and_normalization() -> None:
    job = make_job(
        schedule="GPipe",
        hooks=["logging", dict(type="x.y:Z", every=3)],
        grad_clip=1,
        balance=[4, 5],
    )
    assert job.schedule == "gpipe"
    assert job.hook_specs == ({"type": "logging"}, {"type": "x.y:Z", "every": 3})
    assert job.grad_clip == 1.0
    assert job.balance == (4, 5)
    assert job.run_dir == Path("runs/t")
    assert isinstance(job.layers, tuple) and len(job.layers) == 9
    assert job.microbatch_size == 2 and job.samples_per_step == 8
    assert job.effective_eval_batch_size == 8
    assert job.stage_device(0) == torch.device("cpu")


def test_with_overrides_returns_validated_copy() -> None:
    job = make_job()
    other = job.with_overrides(stages=3, num_microbatches=2)
    assert (other.stages, other.num_microbatches) == (3, 2)
    assert (job.stages, job.num_microbatches) == (2, 4)
    with pytest.raises(SpecError, match="'num_microbatches'"):
        job.with_overrides(num_microbatches=3)
    with pytest.raises(SpecError, match="'nonsense'"):
        job.with_overrides(nonsense=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.stages = 3  # type: ignore[misc]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_spec_error() -> None:
    job = make_job(device="cuda")
    with pytest.raises(SpecError, match="'device'"):
        job.stage_device(0)


# ------------------------------------------------------------------------ data


def test_data_forms_normalize_to_stacked_tensors() -> None:
    x, y = torch.randn(12, 3), torch.arange(12)
    as_tuple = job_data(make_job(train_data=(x, y), batch_size=4)).train_tensors()
    as_callable = job_data(
        make_job(train_data=lambda: torch.utils.data.TensorDataset(x, y), batch_size=4)
    ).train_tensors()
    as_pairs = make_job(train_data=lambda: [(x[i], int(y[i])) for i in range(12)], batch_size=4)
    for pair in (as_tuple, as_callable, job_data(as_pairs).train_tensors()):
        assert torch.equal(pair.inputs, x) and torch.equal(pair.targets, y)
        assert pair.num_samples == 12
    # Loaded once, then cached.
    assert job_data(as_pairs).train_tensors() is job_data(as_pairs).train_tensors()


@pytest.mark.parametrize(
    "data",
    [
        (torch.randn(5, 2), torch.randn(4)),
        lambda: 1 / 0,
        lambda: [],
        "data.csv",
    ],
)
def test_bad_data_names_the_field(data: Any) -> None:
    job = make_job(train_data=data, eval_data=data)
    with pytest.raises(SpecError, match="'train_data'"):
        job_data(job).train_tensors()
    with pytest.raises(SpecError, match="'eval_data'"):
        job_data(job).eval_tensors()


def test_total_steps_from_epochs() -> None:
    # 40 samples, batch 8 -> 5 batches per epoch.
    assert job_data(make_job(max_steps=None, epochs=3)).total_steps() == 15
    assert job_data(make_job(max_steps=7, epochs=3)).total_steps() == 7
    assert job_data(make_job(max_steps=None, epochs=3, grad_accum=2)).total_steps() == 7
    assert job_data(make_job(max_steps=100)).total_steps() == 100
    with pytest.raises(SpecError, match="'batch_size'"):
        job_data(make_job(max_steps=None, epochs=1, batch_size=48)).total_steps()
    with pytest.raises(SpecError, match="'epochs'"):
        job_data(make_job(max_steps=None, epochs=1, grad_accum=6)).total_steps()


def test_data_stream_is_deterministic_and_resumable() -> None:
    a = DataStream(50, 8, seed=3)
    b = DataStream(50, 8, seed=3)
    steps = range(20)
    seq_a = [a.indices(s) for s in steps]
    # A fresh stream asked for the later steps only (a resumed run) agrees.
    assert all(torch.equal(b.indices(s), seq_a[s]) for s in reversed(steps))
    assert not torch.equal(DataStream(50, 8, seed=4).indices(0), seq_a[0])
    assert all(t.dtype == torch.int64 and t.shape == (8,) for t in seq_a)


def test_data_stream_epochs() -> None:
    stream = DataStream(50, 8, seed=0)
    assert stream.batches_per_epoch == 6  # 2 samples dropped per epoch
    assert [stream.epoch_of(s) for s in (0, 5, 6, 11, 12)] == [0, 0, 1, 1, 2]
    for epoch in range(3):
        batches = [stream.indices(s) for s in range(epoch * 6, epoch * 6 + 6)]
        seen = torch.cat(batches)
        assert len(set(seen.tolist())) == 48  # no sample twice within an epoch
        assert torch.equal(seen, stream.permutation(epoch)[:48])
    assert not torch.equal(stream.permutation(0), stream.permutation(1))
    assert stream.steps_for_epochs(2) == 12
    keep = DataStream(50, 8, seed=0, drop_last=False)
    assert keep.batches_per_epoch == 7 and len(keep.indices(6)) == 2
    ordered = DataStream(10, 5, seed=0, shuffle=False)
    assert ordered.indices(1).tolist() == [5, 6, 7, 8, 9]


def test_data_stream_grad_accum() -> None:
    stream = DataStream(64, 4, seed=1, grad_accum=3)
    plain = DataStream(64, 4, seed=1)
    assert stream.batch_index(2, 1) == 7
    assert torch.equal(stream.indices(2, 1), plain.indices(7))
    # Step 5 reads batches 15, 16, 17: it straddles epochs 0 and 1.
    assert stream.epoch_of(5) == 0 and stream.batch_index(5, 2) // 16 == 1
    assert stream.steps_for_epochs(1) == 5
    with pytest.raises(ValueError):
        stream.indices(0, 3)


def test_microbatch_split() -> None:
    data = torch.arange(40).reshape(20, 2)
    idx = torch.tensor([5, 1, 9, 3, 0, 7])
    parts = microbatches(data, idx, 3)
    assert [p.shape for p in parts] == [(2, 2)] * 3
    assert torch.equal(torch.cat(parts), data[idx])
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(parts[1], data[torch.tensor([9, 3])])
    with pytest.raises(ValueError, match="equal microbatches"):
        microbatches(data, idx, 4)


def test_eval_plan_reads_every_sample_once() -> None:
    plan = eval_microbatches(23, 8, 4)
    assert [[len(r) for r in batch] for batch in plan] == [[2, 2, 2, 2]] * 2 + [[2, 2, 2, 1]]
    assert [i for batch in plan for r in batch for i in r] == list(range(23))
    assert [[len(r) for r in b] for b in eval_microbatches(18, 8, 4)] == [[2] * 4, [2] * 4, [2]]
    assert eval_microbatches(0, 8, 4) == []
    with pytest.raises(ValueError):
        eval_microbatches(10, 6, 4)


def test_derive_seed_is_stable() -> None:
    # Fixed value: must not change between processes or Python versions.
    assert derive_seed(0, "layer", 3) == derive_seed(0, "layer", 3)
    assert derive_seed(0, "layer", 3) != derive_seed(0, "layer", 4)
    assert 0 <= derive_seed(123, "data", 9) < 2**63


def test_accuracy_metric() -> None:
    out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert accuracy(out, torch.tensor([1, 0, 0, 0])).item() == pytest.approx(0.75)


# ------------------------------------------------------------------- partition


def test_partition_by_balance() -> None:
    job = make_job(stages=3, balance=[2, 3, 4])
    assert partition(job) == [range(0, 2), range(2, 5), range(5, 9)]
    assert partition(job.layers, 2, balance=[8, 1]) == [range(0, 8), range(8, 9)]
    with pytest.raises(SpecError, match="'balance'"):
        partition(job.layers, 2, balance=[3, 3])
    with pytest.raises(SpecError, match="'balance'"):
        partition(job.layers, 2, balance=[9, 0])
    with pytest.raises(SpecError, match="'stages'"):
        partition(job.layers, 10)


def test_partition_by_params_puts_a_huge_layer_alone() -> None:
    layers = [
        layer(nn.Linear, 4, 4),
        layer(nn.Linear, 4, 4),
        layer(nn.Linear, 4, 2000),  # 10k params, more than all the others together
        layer(nn.Linear, 2000, 1),
        layer(nn.ReLU),
        layer(nn.Linear, 1, 4),
    ]
    ranges = partition(layers, 3)
    assert range(2, 3) in ranges
    assert [len(r) for r in ranges] == [2, 1, 3]


def test_partition_spreads_parameter_free_layers() -> None:
    layers = [layer(nn.ReLU) for _ in range(10)]
    assert [len(r) for r in partition(layers, 3)] in ([3, 3, 4], [3, 4, 3], [4, 3, 3])
    # Linear, ReLU pairs: whole pairs per stage.
    assert partition(mlp_layers(depth=4)[:8], 2) == [range(0, 4), range(4, 8)]


def test_partition_is_optimal_against_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 2 + trial % 7
        widths = torch.randint(1, 20, (n,), generator=gen).tolist()
        layers = [layer(nn.Linear, w, 3) if w % 3 else layer(nn.ReLU) for w in widths]
        counts = layer_param_counts(layers)
        for p in range(1, n + 1):
            got = max(sum(counts[i] for i in r) for r in partition(layers, p))
            best = min(
                max(sum(counts[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
                for cuts in itertools.combinations(range(1, n), p - 1)
            )
            assert got == best, (widths, p)


# ---------------------------------------------------------------- stage module


class Recorder:
    """Layer factories that record each call and the device the layer was built on."""

    def __init__(self, n: int) -> None:
        self.calls: list[tuple[int, str]] = []
        self.factories = [functools.partial(self.build, i) for i in range(n)]

    def build(self, index: int) -> nn.Module:
        module = nn.Linear(6, 6)
        self.calls.append((index, module.weight.device.type))
        return module


def test_stage_builds_only_its_own_layers() -> None:
    rec = Recorder(7)
    job = make_job(layers=rec.factories, stages=3)
    ranges = partition(job)
    assert {dev for _, dev in rec.calls} == {"meta"}  # counting allocates nothing
    for r in ranges:
        rec.calls.clear()
        stage = build_stage_module(job, r)
        assert rec.calls == [(i, "cpu") for i in r]
        assert stage.layer_range == r


def test_stage_state_dict_keys_match_the_full_model() -> None:
    job = make_job(stages=3)
    full = build_full_model(job)
    keys: list[str] = []
    for r in partition(job):
        stage = build_stage_module(job, r)
        assert isinstance(stage, StageModule)
        keys += list(stage.state_dict())
    assert keys == list(full.state_dict())
    assert "8.weight" in keys


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_initial_weights_do_not_depend_on_the_partition(num_stages: int) -> None:
    job = make_job(stages=num_stages, seed=7)
    reference = build_full_model(job).state_dict()
    x = torch.randn(5, 8)
    out = x
    merged: dict[str, torch.Tensor] = {}
    for r in partition(job):
        stage = build_stage_module(job, r)
        merged.update(stage.state_dict())
        out = stage(out)
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    assert torch.equal(out, build_full_model(job)(x))
    # Another seed gives other weights.
    other = build_full_model(job.with_overrides(seed=8)).state_dict()
    assert not torch.equal(other["0.weight"], reference["0.weight"])


def test_building_leaves_the_global_rng_alone() -> None:
    job = make_job()
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    partition(job)
    build_full_model(job)
    build_stage_module(job, range(2, 5))
    assert torch.equal(torch.rand(3), expected)


def test_factory_returning_a_non_module_is_a_spec_error() -> None:
    job = make_job(layers=[lambda: 3, layer(nn.ReLU)], stages=1)
    with pytest.raises(SpecError, match="'layers'"):
        build_full_model(job)


# ---------------------------------------------------------------- spec loading


GOOD_SPEC = """
import functools, torch
from torch import nn
from evtrain.job import Job, layer
job = Job(
    name="tmp",
    layers=[layer(nn.Linear, 4, 4), layer(nn.ReLU), layer(nn.Linear, 4, 1)],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    train_data=lambda: (torch.zeros(16, 4), torch.zeros(16, 1)),
    batch_size=8,
    num_microbatches=2,
    epochs=2,
    balance=[2, 1],
)
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_load_good_spec_and_example(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, "good.py", GOOD_SPEC))
    assert job.name == "tmp" and job_data(job).total_steps() == 4
    example = load_job(EXAMPLE)
    assert example.name == "mlp" and example.stages == 2
    job_data(example).train_tensors()
    assert job_data(example).eval_tensors() is not None


def test_load_make_job_and_sibling_import(tmp_path: Path) -> None:
    write(tmp_path, "mylayers.py", "from torch import nn\nWIDTH = 4\nBlock = nn.Linear\n")
    spec = GOOD_SPEC.replace("job = Job(", "def make_job():\n    return Job(").replace(
        "import functools", "import mylayers, functools"
    )
    job = load_job(write(tmp_path, "factory.py", spec))
    assert job.name == "tmp"


def test_spec_named_like_a_package_shadows_nothing(tmp_path: Path) -> None:
    before = sys.modules.get("hooks")
    load_job(write(tmp_path, "hooks.py", GOOD_SPEC))
    assert sys.modules.get("hooks") is before
    import evtrain.hooks

    assert Path(evtrain.hooks.__file__).parent.name == "hooks"
    assert not str(evtrain.hooks.__file__).startswith(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("x = (\n", r"bad\.py:1: syntax error"),
        (
            "import torch\n\nraise RuntimeError('boom')\n",
            r"bad\.py:3: job spec raised RuntimeError: boom",
        ),
        ("x = 1\n", "neither 'job' nor 'make_job"),
        ("job = {'name': 'x'}\n", "'job' is a dict"),
        ("def make_job():\n    return 3\n", "make_job\\(\\) returned a int"),
        (
            "def make_job():\n    return 1 / 0\n",
            r"bad\.py:2: make_job\(\) raised ZeroDivisionError",
        ),
        (GOOD_SPEC + "\ndef make_job():\n    return job\n", "both 'job' and 'make_job'"),
    ],
)
def test_bad_spec_files(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        load_job(write(tmp_path, "bad.py", text))


def test_spec_with_bad_field_raises_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="'balance'"):
        load_job(write(tmp_path, "bad.py", GOOD_SPEC.replace("[2, 1]", "[1, 1]")))


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        load_job(tmp_path / "nope.py")
    with pytest.raises(UsageError, match="not a file"):
        load_job(tmp_path)


# ------------------------------------------------------------------- overrides


def test_overrides_parse_and_apply() -> None:
    job = make_job(epochs=2, balance=[4, 5])
    new = apply_overrides(
        job,
        {
            "stages": "3",
            "microbatches": "2",
            "schedule": "gpipe",
            "steps": "11",
            "batch_size": "16",
            "seed": "5",
            "run_dir": "/tmp/x",
            "device": "cpu",
            "eval_every": "none",
            "grad_clip": "0.5",
            "spans": "all",
            "threads": "1",
        },
    )
    assert (new.stages, new.num_microbatches, new.schedule) == (3, 2, "gpipe")
    assert (new.max_steps, new.epochs, new.batch_size, new.seed) == (11, None, 16, 5)
    assert new.balance is None  # the spec's [4, 5] no longer fits 3 stages
    assert (new.run_dir, new.grad_clip, new.microbatch_spans, new.threads) == (
        Path("/tmp/x"),
        0.5,
        "all",
        1,
    )
    assert apply_overrides(job, {"balance": "2,7"}).balance == (2, 7)
    assert apply_overrides(job, {"balance": "auto"}).balance is None
    assert apply_overrides(job, {"num_microbatches": "8"}).num_microbatches == 8
    assert apply_overrides(make_job(), {"epochs": "3"}).max_steps is None
    assert apply_overrides(job, {"stages": None}).stages == 2


@pytest.mark.parametrize(
    ("overrides", "field", "flag"),
    [
        ({"stages": "two"}, "stages", "--stages two"),
        ({"stages": "0"}, "stages", "--stages 0"),
        ({"microbatches": "3"}, "num_microbatches", "--microbatches 3"),
        ({"steps": "1.5"}, "max_steps", "--steps 1.5"),
        ({"schedule": "pipedream"}, "schedule", "--schedule pipedream"),
        ({"balance": "3,x"}, "balance", "--balance 3,x"),
        ({"balance": "3,3"}, "balance", "--balance 3,3"),
        ({"grad_clip": "big"}, "grad_clip", "--grad-clip big"),
        ({"device": "tpu"}, "device", "--device tpu"),
        ({"spans": "many"}, "microbatch_spans", "--spans many"),
        ({"stages": "12"}, "stages", "--stages 12"),
    ],
)
def test_bad_overrides_name_field_and_flag(
    overrides: dict[str, str], field: str, flag: str
) -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides(make_job(), overrides)
    assert info.value.field == field
    assert flag.split()[0] in str(info.value)


def test_unknown_override_key() -> None:
    with pytest.raises(SpecError, match="'lr'"):
        apply_overrides(make_job(), {"lr": "0.1"})


def test_argparse_round_trip() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    add_override_arguments(parser)
    ns = parser.parse_args(
        ["s.py", "--stages", "3", "--batch-size", "16", "--run-dir", "r", "--spans", "off",
         "--balance", "3,3,3", "--eval-every", "2", "--grad-clip", "1", "--steps", "4",
         "--epochs", "none", "--microbatches", "2", "--schedule", "gpipe", "--seed", "1",
         "--device", "cpu", "--threads", "2"]
    )  # fmt: skip
    overrides = overrides_from_args(ns)
    assert overrides["batch_size"] == "16" and overrides["spans"] == "off"
    assert len(overrides) == 14
    job = apply_overrides(make_job(eval_data=(torch.randn(8, 8), torch.zeros(8).long())), overrides)
    assert (job.stages, job.balance, job.eval_every, job.run_dir) == (3, (3, 3, 3), 2, Path("r"))
    assert overrides_from_args(parser.parse_args(["s.py"])) == {}


# --------------------------------------------------------------------- example


def test_example_spec_trains_single_process() -> None:
    """The example learns: 60 plain steps of its full model cut the training loss."""
    job = load_job(EXAMPLE)
    model = build_full_model(job)
    opt = job.optimizer(model.parameters())
    data = job_data(job).train_tensors()
    stream = job_data(job).train_stream()
    losses = []
    for step in range(60):
        idx = stream.indices(step)
        loss = job.loss_fn(model(data.inputs[idx]), data.targets[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


def test_another_process_builds_the_same_weights_and_data(tmp_path: Path) -> None:
    """Each stage process loads the spec itself: weights and batches agree across processes."""
    out = tmp_path / "stage1.pt"
    code = textwrap.dedent(
        f"""
        import torch
        from evtrain.spec import load_job
        from evtrain.stages.job_data import job_data
        from evtrain.stages.partition import build_stage_module, partition
        job = load_job({str(EXAMPLE)!r})
        stage = build_stage_module(job, partition(job)[1])
        torch.save({{"sd": stage.state_dict(), "idx": job_data(job).train_stream().indices(17),
                    "x": job_data(job).train_tensors().inputs}}, {str(out)!r})
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    theirs = torch.load(out, weights_only=True)
    job = load_job(EXAMPLE)
    ours = build_full_model(job).state_dict()
    assert theirs["sd"].keys() <= ours.keys() and len(theirs["sd"]) == 4
    assert all(torch.equal(v, ours[k]) for k, v in theirs["sd"].items())
    assert torch.equal(theirs["idx"], job_data(job).train_stream().indices(17))
    assert torch.equal(theirs["x"], job_data(job).train_tensors().inputs)


def test_model_options_are_checked() -> None:
    base = dict(
        name="t",
        layers=[layer(nn.Linear, 2, 2)],
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.zeros(4, 2), torch.zeros(4, 2)),
        batch_size=2,
        num_microbatches=1,
        max_steps=1,
        stages=1,
    )
    bad: list[tuple[dict[str, object], str]] = [
        ({"precision": "fp8"}, "precision"),
        ({"activation_checkpointing": True, "compile": {"backend": "eager"}}, "compile"),
        ({"compile": "yes"}, "compile"),
        ({"input_keys": "x"}, "target_keys"),
        ({"tied": [("0.weight",)]}, "tied"),
        ({"split_points": ["0"]}, "split_points"),
        ({"balance": "flops"}, "balance"),
        ({"model": lambda: nn.Linear(2, 2)}, "layers"),
    ]
    for fields, field in bad:
        with pytest.raises(SpecError) as err:
            Job(**{**base, **fields})  # type: ignore[arg-type]
        assert err.value.field == field, (fields, err.value)
    job = Job(**{**base, "precision": "BF16", "balance": "compute"})  # type: ignore[arg-type]
    assert job.precision == "bf16" and job.balance == "compute"


def cosine_to_the_end(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - 1)


def test_scheduler_is_told_the_run_length_after_overrides() -> None:
    job = Job(
        name="t",
        layers=[layer(nn.Linear, 2, 2)],
        loss_fn=nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        lr_scheduler=cosine_to_the_end,
        train_data=(torch.zeros(40, 2), torch.zeros(40, 2)),
        batch_size=4,
        num_microbatches=1,
        max_steps=200,
        stages=1,
    )
    for overrides, steps in (({"steps": "6"}, 6), ({"epochs": "2"}, 20)):
        run = apply_overrides(job, overrides)
        model = nn.Linear(2, 2)
        optimizer = run.optimizer(model.parameters())
        scheduler = job_data(run).build_scheduler(optimizer)
        assert scheduler is not None
        used = []
        for _ in range(steps):
            used.append(optimizer.param_groups[0]["lr"])  # the lr each step trains with
            optimizer.step()
            scheduler.step()
        assert used[0] == 0.1 and used[-1] == pytest.approx(0.0, abs=1e-12), (overrides, used)
    plain = job.with_overrides(
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)
    )
    optimizer = plain.optimizer(nn.Linear(2, 2).parameters())
    assert isinstance(job_data(plain).build_scheduler(optimizer), torch.optim.lr_scheduler.StepLR)


class Chain(nn.Module):
    """Four linear blocks and a root buffer, written to the split contract."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.register_buffer("scale", torch.full((8,), 0.5))
        if tie:
            self.blocks[3].weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * self.scale
        return x


def test_model_chunks_are_views_of_one_pruned_stage_model() -> None:
    """A model= stage of two chunks keeps both chunks' units in one model (what it
    optimizes and saves) and runs each chunk through a view sharing its tensors."""
    job = make_job(
        layers=None, model=Chain, schedule="zbv", virtual_stages=2, stages=2, pruned_forward=True
    )
    module = build_stage_chunks(job, [range(1, 2), range(2, 3)])
    assert sorted(module.state_dict()) == [
        "blocks.1.bias", "blocks.1.weight", "blocks.2.bias", "blocks.2.weight", "scale"
    ]  # fmt: skip
    assert stage_units(module) == [1, 2]
    first, second = vars(module)["chunks"]
    assert sorted(first.state_dict()) == ["blocks.1.bias", "blocks.1.weight", "scale"]
    assert first.blocks["1"] is module.blocks["1"] and first.scale is module.scale
    x = torch.randn(3, 8)
    torch.testing.assert_close(first(x), module.blocks["1"](x) * 0.5)
    torch.testing.assert_close(second(x), module.blocks["2"](x) * 0.5)
    with torch.no_grad():
        module.scale.fill_(2.0)  # a buffer update reaches every chunk
    torch.testing.assert_close(second(x), module.blocks["2"](x) * 2.0)


@pytest.mark.parametrize(("schedule", "stages"), [("interleaved", (0, 1)), ("zbv", (1,))])
def test_ties_between_chunks_resolve_to_the_stages_holding_them(
    schedule: str, stages: tuple[int, ...]
) -> None:
    """Blocks 0 and 3 share their weight: interleaved puts chunks 0 and 3 on two
    stages (a tie to keep equal over the pipeline), zbv both on the last stage,
    where they are one parameter."""
    job = make_job(
        layers=None,
        model=functools.partial(Chain, tie=True),
        schedule=schedule,
        virtual_stages=2,
        stages=2,
        pruned_forward=True,
    )
    (group,) = tied_groups(job, partition(job))
    assert group.names == ("blocks.0.weight", "blocks.3.weight")
    assert group.stages == stages
    if schedule == "zbv":
        module = build_stage_chunks(job, [range(0, 1), range(3, 4)])
        assert module.blocks["0"].weight is module.blocks["3"].weight
        assert "blocks.3.weight" not in module.state_dict()  # kept once, canonical
        # The same for layers= with an explicit tie: the chunks' layers share it.
        layers = make_job(
            schedule="zbv", virtual_stages=2, stages=2, tied=[("0.weight", "6.weight")]
        )
        chunks = build_stage_chunks(layers, [range(0, 2), range(6, 9)])
        assert chunks["0"].weight is chunks["6"].weight
        assert "6.weight" not in chunks.state_dict()
