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

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import zoo
from safetensors.torch import save_file
from test_real_models import export_command
from test_unmodified_models import chained, train_and_compare, whole, write

from evtrain.cli.ckpt import _write_config
from evtrain.errors import SpecError
from evtrain.stages.partition import (
    build_full_model,
    build_stage_module,
    partition,
    plan_split,
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
    if name == "albert" and stages == 4:
        # One layer group called at every depth stays on one stage.
        with pytest.raises(SpecError) as err:
            plan_split(job)
        assert "\n" not in str(err.value)
        return
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
