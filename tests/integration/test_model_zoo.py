"""Hugging Face families as a new user hands them over: their own loss, no split points.

In process, each family's stages are chained as the pipeline chains them and
compared with the whole model at 1, 2 and 4 stages: the loss and every
parameter's gradient. A MoE model's load-balancing loss reaches the routers of
every stage. Launched, an MoE model trains the same weights as one process and its
checkpoint exports with ``evtrain ckpt export --hf`` to a directory that
``from_pretrained`` loads with the trained weights; every family's stages save
what such an export loads.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import zoo
from safetensors.torch import save_file
from test_real_models import dumped, export_command, launch, reference
from test_unmodified_models import chained, train_and_compare, whole, write

from evtrain.checkpoint import committed_shard_record, read_manifest, resolve_resume
from evtrain.checkpoint.loader import load_stage_shard
from evtrain.cli.ckpt import _write_config
from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.partition import (
    build_full_model,
    build_stage_module,
    partition,
    plan_split,
    unit_names,
)
from evtrain.stages.pytree import StandIn

pytest.importorskip("transformers")

RTOL = 1e-5
FAMILIES = sorted(zoo.FAMILIES)


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-7, msg=what)


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_equals_one_process(name: str, stages: int) -> None:
    job = zoo.make_job(name, stages, 4, "/nonexistent")
    plan = plan_split(job)
    assert len(plan.sizes) == stages
    want_out, want_grads = whole(job)
    got_out, got_grads = chained(job)
    _close(_loss(got_out), _loss(want_out), "loss")
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        _close(got_grads[key], grad, key)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_load_balancing_loss_reaches_every_stages_routers(name: str) -> None:
    """The auxiliary loss alone: its gradient reaches the first stage's router
    only through what the routers' forward hooks collected on that stage."""

    def aux_only(output: Any, _labels: torch.Tensor) -> torch.Tensor:
        return output.aux_loss

    job = zoo.make_job(name, 4, 4, "/nonexistent", loss_fn=aux_only)
    first = "model.layers.0.mlp.gate.weight"
    plan = plan_split(job)
    assert plan.units.index("model.layers.0") < plan.sizes[0] <= plan.units.index("model.norm")
    _, want = whole(job)
    _, got = chained(job)
    assert want[first].abs().sum() > 0
    for key, grad in want.items():
        _close(got[key], grad, key)


@pytest.mark.slow
def test_a_launched_moe_trains_as_one_process_and_exports_for_from_pretrained(
    tmp_path: Path,
) -> None:
    """Mixtral at 4 stages, router logits crossing three boundaries: its weights
    equal one process's, and its ``--hf`` export loads with them."""
    import transformers

    want = train_and_compare(
        tmp_path, "mixtral", (4,), "zoo", hooks=[{"type": "checkpoint", "on_stop": True}]
    )
    export_command(tmp_path / "run4", "--hf", str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for key, value in model.state_dict().items():
        _close(value, want[key], key)


GROUP = "albert.encoder.albert_layer_groups.0"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.linear(h))


class Looped(torch.nn.Module):
    """A model of one's own that runs one block at every depth."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.block = Block()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(3):
            h = self.block(h)
        return self.head(h)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation_checkpointing"])
def test_the_calls_of_one_module_split_across_stages(recompute: bool) -> None:
    looped = Job(
        name="looped",
        model=Looped,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.randn(8, 4), torch.randn(8, 2)),
        batch_size=4,
        stages=5,
        max_steps=1,
        activation_checkpointing=recompute,
    )
    albert = zoo.make_job("albert", 4, 4, "/nonexistent", activation_checkpointing=recompute)
    assert plan_split(looped).units == ("embed", "block@0", "block@1", "block@2", "head")
    for job in (looped, albert):
        want_out, want_grads = whole(job)
        got_out, got_grads = chained(job)
        _close(_loss(got_out), _loss(want_out), "loss")
        for key, grad in want_grads.items():
            _close(got_grads[key], grad, key)


@pytest.mark.slow
def test_a_module_called_at_every_depth_is_one_weight_across_stages(tmp_path: Path) -> None:
    """ALBERT's one layer group, called at each of its four depths: one call per model
    chunk of an interleaved 2-stage pipeline, so both stages hold the group (each of
    them for two calls, on two chunks). Every copy trains to one process's weights;
    the checkpoint holds the group once and loads, optimizer state too, at 4 stages."""
    fields: dict[str, Any] = {
        "schedule": "interleaved",
        "virtual_stages": 2,
        "hooks": [{"type": "checkpoint", "on_stop": True}],
    }
    spec = write(tmp_path, "albert", 2, 5, "zoo", **fields)
    job = load_job(spec)
    calls = [f"{GROUP}@{k}" for k in range(4)]
    assert [u for u in plan_split(job).units if u.startswith(GROUP)] == calls
    assert [[unit_names(job)[i] for i in r if i in range(2, 6)] for r in partition(job)] == [
        [u] for u in calls
    ]
    want, _ = reference(load_job(write(tmp_path, "albert", 1, 5, "zoo")), 5)
    launch(spec, "--dump-weights", str(tmp_path / "dump"))
    for shard in dumped(tmp_path / "dump"):
        assert f"{GROUP}.albert_layers.0.ffn.weight" in shard
        for key, value in shard.items():
            _close(value, want[key], key)

    ckpt = resolve_resume(tmp_path / "run2")
    holders = [
        {k for k in committed_shard_record(ckpt, e)[1].model_keys if k.startswith(GROUP)}
        for e in read_manifest(ckpt).stages
    ]
    assert [bool(h) for h in holders] == [True, False]

    four = zoo.make_job("albert", 4, 5, str(tmp_path / "run4"))
    for stage, units in enumerate(partition(four)):
        module = build_stage_module(four, units)
        optimizer = four.optimizer(module.parameters())
        load_stage_shard(ckpt, stage, module, optimizer)
        for key, value in module.state_dict().items():
            _close(value, want[key], key)
        group = module.get_submodule(GROUP)
        for p in group.parameters():
            assert optimizer.state[p]["momentum_buffer"].abs().sum() > 0


@pytest.mark.slow
def test_sharded_replicas_hold_a_module_whose_calls_span_stages(tmp_path: Path) -> None:
    """FSDP2 over each stage's two replicas, each stage calling the layer group twice
    and standing in for the other stage's calls; both chunks of an interleaved stage
    holding calls of it cannot be one sharded module, and are refused before launch."""
    train_and_compare(tmp_path, "albert", (2,), "zoo", data_parallel=2, shard="grads")
    job = zoo.make_job(
        "albert",
        2,
        5,
        "/nonexistent",
        data_parallel=2,
        shard="grads",
        schedule="interleaved",
        virtual_stages=2,
    )
    with pytest.raises(SpecError, match=rf"stage 0 would hold calls of {GROUP} in 2 model"):
        plan_split(job)


EXPORTED = [n for n in FAMILIES if zoo.FAMILIES[n].hf]


@pytest.mark.parametrize("name", EXPORTED)
def test_every_familys_stages_export_for_from_pretrained(tmp_path: Path, name: str) -> None:
    """What 2 stages save, merged and written with the model's config as ``--hf``
    writes them (the launched Mixtral above goes through the command itself):
    ``from_pretrained`` loads the model's own weights, every one, and gives its logits."""
    job = zoo.make_job(name, 2, 1, str(tmp_path / "run"))
    saved: dict[str, torch.Tensor] = {}
    for r in partition(job):
        saved.update(build_stage_module(job, r).state_dict())
    assert not any(isinstance(t, StandIn) for t in saved.values())
    out = tmp_path / "hf"
    out.mkdir()
    save_file({k: t.contiguous() for k, t in saved.items()}, str(out / "model.safetensors"))
    assert "wrote" in _write_config(write(tmp_path, name, 2, 1, "zoo"), out)
    model = build_full_model(job)
    loaded = type(model).from_pretrained(str(out))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    inputs = {k: v[:2] for k, v in zoo.data_of(name).items()}
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits)
