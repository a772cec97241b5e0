"""The real-model examples in one process: the GPT's split contract, ties and padding; the ResNet.

The spec files are imported as plain modules (their ``make_job()`` is not
called), so these tests exercise the models and data themselves.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from evtrain.stages.boundary import call

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _import(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    module_name = f"_example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    return _import("gpt")


@pytest.fixture(scope="module")
def resnet() -> ModuleType:
    return _import("resnet")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _model(gpt: ModuleType, **config: int) -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(**config))


def _batch(gpt: ModuleType, n: int = 6) -> dict[str, torch.Tensor]:
    return {k: v[:n] for k, v in gpt.samples("train").items()}


# ------------------------------------------------------------------ the split contract


def _keep_only(model: nn.Module, units: set[str], style: str) -> nn.Module:
    """A copy of ``model`` holding only ``units`` (the model-split contract, by hand).

    A unit is a child of the model or an item of one of its containers. An
    absent plain child is None; an absent list item is removed, the others
    keeping their names; an absent dict item is removed or, with
    ``style="none"``, set to None.
    """
    part = copy.deepcopy(model)

    def prune(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            fqn = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                prune(child, f"{fqn}.")
            elif fqn in units:
                continue
            elif isinstance(parent, nn.ModuleList) or (
                isinstance(parent, nn.ModuleDict) and style == "remove"
            ):
                # Deleting from _modules, unlike `del container[i]`, renumbers nothing.
                del parent._modules[name]
            else:
                setattr(parent, name, None)

    prune(part, "")
    return part


def _units(model: nn.Module) -> list[str]:
    names: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                walk(child, f"{prefix}{name}.")
            else:
                names.append(f"{prefix}{name}")

    walk(model, "")
    return names


def test_units_are_nanogpts_module_names(gpt: ModuleType) -> None:
    units = _units(_model(gpt, n_layer=3))
    assert units == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
        "lm_head",
    ]


def test_lm_head_weight_is_the_token_embedding(gpt: ModuleType) -> None:
    model = _model(gpt)
    head, embedding = (model.get_parameter(n) for n in ("lm_head.weight", "transformer.wte.weight"))
    assert head is embedding
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in all_names
    # Changing one name changes the other: they are one tensor.
    with torch.no_grad():
        head.add_(1.0)
    assert torch.equal(model.get_parameter("transformer.wte.weight"), head)


@pytest.mark.parametrize("style", ["remove", "none"])
@pytest.mark.parametrize("split", ["transformer.h.2", "transformer.h.1", "transformer.ln_f"])
def test_split_by_name_equals_the_full_model(gpt: ModuleType, style: str, split: str) -> None:
    full = _model(gpt)
    units = _units(full)
    cut = units.index(split)
    first = _keep_only(full, set(units[:cut]), style)
    second = _keep_only(full, set(units[cut:]), style)
    batch = _batch(gpt)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]

    # The first stage gets the sample's input keys as keyword arguments.
    boundary = call(first, {"input_ids": ids, "attention_mask": mask})
    assert isinstance(boundary, tuple) and len(boundary) == 2
    hidden, passed_mask = boundary
    assert hidden.shape == (ids.shape[0], ids.shape[1], gpt.GPTConfig().n_embd)
    assert passed_mask is mask

    # The second stage receives the boundary value by the calling convention,
    # as a leaf of its own autograd graph (it arrived over the wire).
    received = hidden.detach().requires_grad_()
    logits = call(second, (received, passed_mask))
    expected = full(ids, mask)
    assert torch.equal(logits, expected)

    loss = gpt.lm_loss(logits, labels)
    loss.backward()
    assert received.grad is not None
    hidden.backward(received.grad)
    gpt.lm_loss(expected, labels).backward()
    full_grads = dict(full.named_parameters(remove_duplicate=False))
    for part in (first, second):
        for name, param in part.named_parameters():
            assert param.grad is not None, name
            if name not in ("transformer.wte.weight", "lm_head.weight"):
                torch.testing.assert_close(param.grad, full_grads[name].grad, rtol=0, atol=1e-6)
    # The tied weight's gradient is the sum of its two uses, one on each stage.
    first_use = first.get_parameter("transformer.wte.weight").grad
    second_use = second.get_parameter("lm_head.weight").grad
    assert first_use is not None and second_use is not None
    torch.testing.assert_close(
        first_use + second_use, full_grads["lm_head.weight"].grad, rtol=0, atol=1e-6
    )

    # Names are kept: the two stages' state together is the full model's.
    assert set(first.state_dict()) | set(second.state_dict()) == set(full.state_dict())
    assert not set(first.state_dict()) & set(second.state_dict())


def test_forward_without_a_mask_is_causal_only(gpt: ModuleType) -> None:
    model = _model(gpt)
    ids = _batch(gpt)["input_ids"]
    ones = torch.ones_like(ids)
    torch.testing.assert_close(model(ids), model(ids, ones), rtol=0, atol=1e-6)


def test_a_later_position_does_not_change_an_earlier_one(gpt: ModuleType) -> None:
    model = _model(gpt)
    ids = _batch(gpt)["input_ids"].clone()
    before = model(ids)
    ids[:, -1] = (ids[:, -1] + 1) % len(gpt.VOCAB)
    after = model(ids)
    torch.testing.assert_close(after[:, :-1], before[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, -1], before[:, -1])


# ------------------------------------------------------------------ padding


def test_padded_keys_are_never_attended(gpt: ModuleType) -> None:
    """Whatever ids sit at masked positions, the other positions' outputs stay the same."""
    model = _model(gpt)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, len(gpt.VOCAB), (4, gpt.SEQ_LEN), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, 10:14] = 0  # a gap inside
    mask[2, 20:] = 0  # right padding
    other_ids = torch.where(mask.bool(), ids, torch.randint_like(ids, 1, len(gpt.VOCAB)))
    assert not torch.equal(other_ids, ids)
    real = mask.bool()
    a, b = model(ids, mask), model(other_ids, mask)
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)
    # Without the mask the same change is visible: the mask is what hides it.
    assert not torch.allclose(model(ids)[real], model(other_ids)[real], atol=1e-3)


def test_padding_does_not_change_the_loss_of_the_real_positions(gpt: ModuleType) -> None:
    model = _model(gpt)
    data = gpt.samples("train")
    lengths = data["attention_mask"].sum(dim=1).tolist()
    i = next(i for i, n in enumerate(lengths) if 3 < n < gpt.SEQ_LEN - 5)
    n = lengths[i]
    padded = gpt.lm_loss(
        model(data["input_ids"][i : i + 1], data["attention_mask"][i : i + 1]),
        data["labels"][i : i + 1],
    )
    trimmed = gpt.lm_loss(
        model(data["input_ids"][i : i + 1, :n], data["attention_mask"][i : i + 1, :n]),
        data["labels"][i : i + 1, :n],
    )
    torch.testing.assert_close(padded, trimmed, rtol=0, atol=1e-5)


def test_no_nan_with_padding_even_for_an_all_padding_row(gpt: ModuleType) -> None:
    model = _model(gpt)
    batch = _batch(gpt, 4)
    mask = batch["attention_mask"].clone()
    mask[0] = 0
    labels = batch["labels"].clone()
    logits = model(batch["input_ids"], mask)
    assert torch.isfinite(logits).all()
    gpt.lm_loss(logits, labels).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_allowed_mask_is_causal_without_padding_keys_and_keeps_the_diagonal(
    gpt: ModuleType,
) -> None:
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]])
    allowed = gpt.attention_allowed(mask, 4, torch.device("cpu"))
    assert allowed.shape == (2, 1, 4, 4)
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(allowed[0, 0], expected)
    assert torch.equal(allowed[1, 0], torch.eye(4, dtype=torch.bool))


# ------------------------------------------------------------------ the data


def test_samples_are_padded_lines_with_shifted_labels(gpt: ModuleType) -> None:
    train, held_out = gpt.samples("train"), gpt.samples("eval")
    for data in (train, held_out):
        assert set(data) == {"input_ids", "attention_mask", "labels"}
        ids, mask, labels = data["input_ids"], data["attention_mask"], data["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.shape[1] == gpt.SEQ_LEN
        assert ids.dtype == mask.dtype == labels.dtype == torch.int64
        pad = mask == 0
        assert torch.equal(labels == gpt.IGNORE, pad)
        assert (ids[pad] == gpt.PAD).all() and (ids[~pad] != gpt.PAD).all()
        # Padding only on the right: the mask never turns back on.
        assert (mask[:, 1:] <= mask[:, :-1]).all()
        # Labels are the next characters.
        assert torch.equal(labels[:, :-1][~pad[:, 1:]], ids[:, 1:][~pad[:, 1:]])
    lines = gpt.TEXT.splitlines()
    assert len(lines[0]) < gpt.SEQ_LEN
    first_labels = train["labels"][0]
    assert gpt.decode(train["input_ids"][0]) == lines[0]
    assert gpt.decode(first_labels[first_labels != gpt.IGNORE]) == lines[0][1:] + "\n"
    # A line longer than SEQ_LEN continues in the next sample.
    total = train["input_ids"].shape[0] + held_out["input_ids"].shape[0]
    assert total == sum(-(-len(line) // gpt.SEQ_LEN) for line in lines)
    assert total > len(lines)
    assert held_out["input_ids"].shape[0] == total // gpt.EVAL_EVERY_NTH


def test_gpt_loss_falls(gpt: ModuleType) -> None:
    model = _model(gpt)
    batch = _batch(gpt, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = gpt.lm_loss(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(float(torch.log(torch.tensor(len(gpt.VOCAB)))), abs=0.2)
    assert losses[-1] < losses[0] - 0.7


# ------------------------------------------------------------------ the ResNet


def _resnet_layers(resnet: ModuleType) -> list[nn.Module]:
    layers = []
    for i, factory in enumerate(resnet.LAYERS):
        torch.manual_seed(i)
        layers.append(factory())
    return layers


def test_resnet_trains_and_its_loss_falls(resnet: ModuleType) -> None:
    images, labels = resnet.digits("train")
    held_images, held_labels = resnet.digits("eval")
    assert images.shape[1:] == (1, resnet.IMAGE_SIZE, resnet.IMAGE_SIZE)
    assert len(images) + len(held_images) == 1797
    net = nn.Sequential(*_resnet_layers(resnet))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    losses = []
    steps, microbatches = 25, 4
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (64,), generator=gen)
        optimizer.zero_grad()
        total = 0.0
        # As a pipeline stage does: BatchNorm sees each microbatch on its own.
        for part in idx.chunk(microbatches):
            loss = nn.functional.cross_entropy(net(images[part]), labels[part]) / microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    net.eval()
    with torch.no_grad():
        held_accuracy = (net(held_images).argmax(-1) == held_labels).float().mean().item()
    assert held_accuracy > 0.5
    # BatchNorm learned running statistics, which eval mode uses.
    bn = net.get_submodule("0.bn")
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_var is not None
    assert bn.num_batches_tracked is not None
    assert int(bn.num_batches_tracked) == steps * microbatches
    assert not torch.allclose(bn.running_var, torch.ones(16))


def test_resnet_blocks_cost_alike_while_their_parameters_grow(resnet: ModuleType) -> None:
    """Why the example balances by compute: FLOPs are flat across blocks, parameters are not."""
    layers = _resnet_layers(resnet)
    x = resnet.digits("eval")[0][:8]
    flops, params = [], []
    for layer in layers:
        with FlopCounterMode(display=False) as counter:
            x = layer(x)
        flops.append(counter.get_total_flops())
        params.append(sum(p.numel() for p in layer.parameters()))
    blocks = slice(1, 6)
    assert max(flops[blocks]) < 1.5 * min(flops[blocks])
    assert max(params[blocks]) > 10 * min(params[blocks])
    assert x.shape == (8, resnet.CLASSES)
