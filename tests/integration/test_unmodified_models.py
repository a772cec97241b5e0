"""Models as their authors wrote them, split across stages with nothing changed.

In process, each model's stages are chained as the pipeline chains them (each
boundary's leaves detached and their gradients handed back) and compared with
the whole model: outputs and every parameter's gradient. Through
`evtrain launch`, runs at 1, 2 and 4 stages train the same weights as one
process does.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import unmodified_models as um
from helpers.launch_helpers import TESTS_DIR
from structlog.testing import capture_logs
from test_real_models import ATOL, dumped, launch, reference

from evtrain.errors import SpecError
from evtrain.job import Job
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import (
    _model_costs,
    build_full_model,
    build_stage_chunks,
    build_stage_module,
    partition,
    plan_split,
    stage_unit_modules,
    tied_groups,
    unit_costs,
    unit_names,
)
from evtrain.stages.precision import autocast, checkpoint_layer
from evtrain.stages.pytree import StandInUsed, call, flatten, stand_in, unflatten
from evtrain.stages.schedules import model_chunk
from evtrain.stages.survey import SurveyUnavailable

pytest.importorskip("transformers")

ALL = [name for name in um.MODELS if name != "aux_list"]


def job_of(name: str, stages: int, **fields: Any) -> Job:
    return um.make_job(name, stages, 5, "/nonexistent", **fields)


def first_microbatch(job: Job) -> tuple[Any, Any]:
    x, y = job_data(job).example_batch(job.microbatch_size)
    return x, y


def chained(
    job: Job, stages: list[torch.nn.Module] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The last stage's output and every stage's parameter gradients (by unsplit
    name, tied copies summed) for the first microbatch, stage by stage."""
    x, y = first_microbatch(job)
    if stages is None:
        stages = [build_stage_module(job, r) for r in partition(job)]
    if job.activation_checkpointing:  # as the stage actor does
        for stage in stages:
            for unit in stage_unit_modules(job, stage):
                checkpoint_layer(unit)
    value, sent = x, []
    for i, stage in enumerate(stages):
        out = call(stage, value)
        if i < len(stages) - 1:
            tree, leaves = flatten(out)
            received = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
            sent.append((leaves, received))
            value = unflatten(tree, received)
    job.loss(out, y).backward()
    for leaves, received in reversed(sent):
        pairs = [(t, r.grad) for t, r in zip(leaves, received, strict=True) if r.grad is not None]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return out, _grads(job, stages)


def _grads(job: Job, modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    canonical = {n: g.names[0] for g in tied_groups(job) for n in g.names}
    for module in modules:
        seen: set[int] = set()
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen or p.grad is None:
                continue
            seen.add(id(p))
            key = canonical.get(name, name)
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
    return grads


def whole(job: Job) -> tuple[Any, dict[str, torch.Tensor]]:
    x, y = first_microbatch(job)
    model = build_full_model(job)
    out = call(model, x)
    job.loss(out, y).backward()
    return out, _grads(job, [model])


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ALL)
def test_stages_chained_equal_the_whole_model(name: str, stages: int) -> None:
    job = job_of(name, stages)
    want_out, want_grads = whole(job)
    got_out, got_grads = chained(job)
    torch.testing.assert_close(um.logits_of(got_out), um.logits_of(want_out), atol=ATOL, rtol=0)
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_model_chunks_chained_in_model_order_equal_the_whole_model(schedule: str) -> None:
    """Two chunks per stage (interleaved: chunks s and s + P; zbv: the V), each a
    view of its stage's model running the model's own forward."""
    job = job_of("hf_llama", 2, schedule=schedule, virtual_stages=2, num_microbatches=4)
    want_out, want_grads = whole(job)
    ranges = partition(job)
    views: dict[int, torch.nn.Module] = {}
    for stage in range(job.stages):
        ids = [model_chunk(schedule, stage, job.stages, v) for v in range(2)]
        module = build_stage_chunks(job, [ranges[c] for c in ids])
        views.update(zip(ids, vars(module)["chunks"], strict=True))
    got_out, got_grads = chained(job, [views[c] for c in sorted(views)])
    torch.testing.assert_close(got_out.logits, want_out.logits, atol=ATOL, rtol=0)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)


def test_units_reach_into_nested_models_and_split_points_at_any_depth() -> None:
    names = unit_names(job_of("hf_llama", 2))
    assert names[:2] == ["model.embed_tokens", "model.layers.0"]
    assert names[-3:] == ["model.norm", "model.rotary_emb", "lm_head"]
    bert = unit_names(job_of("hf_bert", 2))
    assert "bert.encoder.layer.3" in bert and "classifier" in bert
    # A split point inside a unit opens it up.
    job = job_of("nanogpt", 2, split_points=["transformer.h.1.mlp"])
    names = unit_names(job)
    assert "transformer.h.1.attn" in names and "transformer.h.1" not in names
    assert plan_split(job).sizes[1] == len(names) - names.index("transformer.h.1.mlp")
    # Hugging Face registers a decoder layer's norms after the parts they feed:
    # units follow the order the forward calls them, so a split inside one works.
    job = job_of("hf_llama", 2, split_points=["model.layers.1.mlp"])
    names = unit_names(job)
    at = names.index("model.layers.1.input_layernorm")
    assert names[at : at + 4] == [
        "model.layers.1.input_layernorm",
        "model.layers.1.self_attn",
        "model.layers.1.post_attention_layernorm",
        "model.layers.1.mlp",
    ]
    want_out, want_grads = whole(job)
    got_out, got_grads = chained(job)
    torch.testing.assert_close(um.logits_of(got_out), um.logits_of(want_out), atol=ATOL, rtol=0)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)


def test_compute_balancing_counts_a_model_that_reads_values_on_the_cpu() -> None:
    """Hugging Face's forward reads its mask's values, which the meta device cannot
    give: the estimate comes from one forward on the CPU, each decoder layer the same."""
    job = job_of("hf_llama", 2, balance="compute")
    with pytest.raises(SurveyUnavailable):
        _model_costs(job)  # on meta
    plan = plan_split(job)
    assert plan.costs is not None
    names = unit_names(job)
    layers = [plan.costs[names.index(f"model.layers.{i}")] for i in range(um.BLOCKS)]
    assert layers[0] > 0 and layers == [layers[0]] * um.BLOCKS
    assert plan.costs[names.index("lm_head")] > 0
    assert unit_costs(job) == list(plan.costs)


def test_a_skip_connection_travels_to_the_stage_that_uses_it() -> None:
    job = job_of("unet", 2, split_points=["dec2"])
    first = build_stage_module(job, partition(job)[0])
    x, _ = first_microbatch(job)
    sent = call(first, x)
    # enc1's output is used by dec1 on stage 1, so it crosses as a tensor; the
    # inputs do not (nothing on stage 1 computes with them).
    tree, leaves = flatten(sent)
    assert isinstance(tree["d"]["enc1#0"], int)
    assert "z" in tree["d"]["in"]["d"]["a"]["l"][0]
    assert len(leaves) == 3  # enc1, enc2 and mid's outputs


def test_values_collected_by_hooks_and_attributes_reach_the_loss_with_their_gradients() -> None:
    """Per-block auxiliary losses, collected by a forward hook on each block's gate
    or set as a block's attribute, cross to the last stage; their gradients reach
    the first stage's gates. Collected by appending to a list, they are refused."""
    for route in ("hook", "attribute"):
        job = job_of(f"aux_{route}", 4)
        assert plan_split(job).sizes[0] <= unit_names(job).index("blocks.1")
        (want_loss, want), (got_loss, got) = whole(job), chained(job)
        torch.testing.assert_close(got_loss, want_loss, atol=ATOL, rtol=0)
        assert want["blocks.0.gate.weight"].abs().sum() > 0
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, atol=ATOL, rtol=0, msg=f"{route}: {key}")
    with pytest.raises(SpecError, match=r"unit blocks\.0 \(call 0\) computes a \(\) tensor") as err:
        plan_split(job_of("aux_list", 2))
    assert "\n" not in str(err.value)


def test_a_stand_in_never_reaches_real_computation() -> None:
    ghost = stand_in((2, 3), torch.float32, torch.device("cpu"))
    derived = ghost * 2 + 1  # model-level code on a stand-in gives a stand-in
    assert type(derived).__name__ == "StandIn" and derived.shape == (2, 3)
    assert type(torch.zeros_like(derived)) is torch.Tensor  # its shape is real
    with pytest.raises(StandInUsed, match="reads a value"):
        bool(derived.sum() > 0)
    with pytest.raises(StandInUsed, match="writes a value"):
        torch.zeros(2, 3).add_(derived)
    # A stage that were not sent the skip connection it needs refuses to compute.
    job = job_of("unet", 2, split_points=["dec2"])
    first, second = (build_stage_module(job, r) for r in partition(job))
    x, _ = first_microbatch(job)
    sent = call(first, x)
    sent["enc1#0"] = stand_in(sent["enc1#0"].shape, torch.float32, torch.device("cpu"))
    with pytest.raises(StandInUsed, match="dec1 receives a value that another stage computes"):
        call(second, sent)


def test_bad_models_are_refused_before_any_process() -> None:
    def cached() -> torch.nn.Module:
        model = um.hf_llama()
        model.config.use_cache = True
        return model

    with pytest.raises(SpecError, match="use_cache"):
        plan_split(job_of("hf_llama", 2, model=cached))

    class Backwards(torch.nn.Module):
        """Calls its second layer first: the units follow the calls."""

        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    job = Job(
        name="backwards",
        model=Backwards,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=(torch.randn(8, 3), torch.randn(8, 3)),
        batch_size=4,
        stages=2,
        max_steps=1,
    )
    assert plan_split(job).units == ("b", "a")

    class Sandwich(Backwards):
        """Calls ``a``, whose buffer is one stage's state, before and after ``b``:
        a stage may begin at ``c`` only."""

        def __init__(self) -> None:
            super().__init__()
            self.a.register_buffer("scale", torch.ones(3))
            self.c = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.a(self.b(self.a(x))))

    sandwich = job.with_overrides(model=Sandwich)
    assert plan_split(sandwich).sizes == (2, 1)  # the balancer proposes only what can run
    with pytest.raises(SpecError, match=r"start the stage at 'c' instead"):
        plan_split(sandwich.with_overrides(split_points=["b"]))
    with pytest.raises(SpecError, match=r"can be split at only 1 place.*at most 2 stages"):
        plan_split(sandwich.with_overrides(stages=3))

    class Branching(Backwards):
        """Chooses its second layer by the value of the first one's output."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h) if h.sum() > 0 else self.b(-h)

    with capture_logs() as logs:
        plan_split(job.with_overrides(model=Branching))
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["units"] == ["a"] and "differs from the traced one" in warning["event"]

    class Mismatched(Backwards):
        """Its second layer cannot take the first one's output."""

        def __init__(self) -> None:
            super().__init__()
            self.b = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with pytest.raises(SpecError, match="its forward failed on the first microbatch") as err:
        plan_split(job.with_overrides(model=Mismatched))
    assert "\n" not in str(err.value)


def write(
    directory: Path,
    name: str,
    stages: int,
    steps: int,
    helper: str = "unmodified_models",
    **fields: Any,
) -> Path:
    """A spec file calling ``make_job`` of tests/helpers/<helper>.py."""
    spec = directory / f"{name}_{stages}_spec.py"
    args = "".join(f", {k}={v!r}" for k, v in fields.items())
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
        f"from helpers import {helper}\n"
        f"job = {helper}.make_job({name!r}, {stages}, {steps}, "
        f"{str(directory / f'run{stages}')!r}{args})\n"
    )
    return spec


def train_and_compare(
    tmp_path: Path,
    name: str,
    stage_counts: tuple[int, ...],
    helper: str = "unmodified_models",
    **fields: Any,
) -> dict[str, torch.Tensor]:
    """Launch ``name`` at each stage count; every run's weights equal one process's,
    which it returns."""
    steps = 5
    # The same fields: with replicas a microbatch holds fewer samples, and a loss
    # averaged over a microbatch's tokens depends on how they are grouped.
    one = {k: v for k, v in fields.items() if k not in ("schedule", "virtual_stages", "hooks")}
    want, _ = reference(load_job(write(tmp_path, name, 1, steps, helper, **one)), steps)
    for stages in stage_counts:
        spec = write(tmp_path, name, stages, steps, helper, **fields)
        dump = tmp_path / f"dump{stages}"
        launch(spec, "--dump-weights", str(dump))
        got: dict[str, torch.Tensor] = {}
        for shard in dumped(dump):
            got.update(shard)
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=f"{stages}: {key}")
        params = {k for k in want if not k.endswith(("running_mean", "running_var", "tracked"))}
        assert params <= set(got) | _aliases(load_job(spec)), sorted(params - set(got))
    return want


# The other models launch in tests/test_unmodified_launch.py, so that the two
# halves run side by side.
LAUNCHED = [("hf_llama", (4,)), ("llama_style", (4,))]


@pytest.mark.slow
def test_an_interleaved_hugging_face_pipeline_trains_as_one_process(tmp_path: Path) -> None:
    """Two chunks per stage, each running the model's own forward from the top."""
    train_and_compare(tmp_path, "hf_llama", (2,), schedule="interleaved", virtual_stages=2)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage_counts"), LAUNCHED, ids=[n for n, _ in LAUNCHED])
def test_launched_runs_train_as_one_process(
    tmp_path: Path, name: str, stage_counts: tuple[int, ...]
) -> None:
    train_and_compare(tmp_path, name, stage_counts)


@pytest.mark.slow
def test_two_replicas_of_a_hugging_face_pipeline_train_as_one_process(tmp_path: Path) -> None:
    train_and_compare(tmp_path, "hf_qwen2", (2,), data_parallel=2)


def test_activation_checkpointing_keeps_the_gradients() -> None:
    """Hugging Face's Llama with every held unit checkpointed: the same gradients."""
    job = job_of("hf_llama", 2, activation_checkpointing=True)
    _, want_grads = whole(job)
    stages = [build_stage_module(job, r) for r in partition(job)]
    runs: list[str] = []
    mlp = stages[1].get_submodule("model.layers.2.mlp")
    mlp.register_forward_pre_hook(lambda *_: runs.append("mlp"))
    _, got_grads = chained(job, stages)
    assert len(runs) == 2  # the forward, and its recomputation in the backward
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)


def test_hugging_face_checkpointing_keeps_the_gradients() -> None:
    """The model's own checkpointing (``activation_checkpointing_enable()``) on
    stages that stand in for each other's layers: recomputed, the same gradients."""
    job = job_of("hf_llama", 2, model=um.hf_llama_checkpointed)
    _, want_grads = whole(job)
    stages = [build_stage_module(job, r) for r in partition(job)]
    runs: list[str] = []
    stages[1].get_submodule("model.layers.2.mlp").register_forward_pre_hook(
        lambda *_: runs.append("mlp")
    )
    _, got_grads = chained(job, stages)
    assert len(runs) == 2  # the forward, and its recomputation in the backward
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)


def test_bf16_stages_equal_the_whole_model() -> None:
    """Under the run's bf16 autocast the boundary carries what the model computes."""
    job = job_of("hf_llama", 2, precision="bf16")
    with autocast("bf16", torch.device("cpu")):
        want_out, want_grads = whole(job)
        got_out, got_grads = chained(job)
    assert got_out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(got_out.logits, want_out.logits, atol=0, rtol=0)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=0, rtol=0, msg=key)


def _aliases(job: Job) -> set[str]:
    return {n for g in tied_groups(job) for n in g.names[1:]}


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_bert"])
def test_hugging_face_examples_split_as_they_are(name: str) -> None:
    job = load_job(TESTS_DIR.parent / "examples" / f"{name}.py")
    assert plan_split(job).sizes[0] < len(unit_names(job))
    want_out, want_grads = whole(job)
    got_out, got_grads = chained(job)
    torch.testing.assert_close(got_out.logits, want_out.logits, atol=ATOL, rtol=0)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=0, msg=key)
