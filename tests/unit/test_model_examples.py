"""The real-model examples in one process: the GPT's split contract, ties and padding; the ResNet;
a Llama-style decoder (rotary buffers on the root, a mask built in forward) split by name.

The spec files are imported as plain modules (their ``make_job()`` is not
called), so these tests exercise the models and data themselves.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from evtrain.job import Job
from evtrain.stages.job_data import job_data
from evtrain.stages.partition import (
    KeptItems,
    build_full_model,
    build_stage_module,
    partition,
    plan_split,
    unit_names,
)
from evtrain.stages.pytree import call

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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


def _crops(resnet: ModuleType, image: torch.Tensor) -> list[tuple[int, int, bool, torch.Tensor]]:
    """Every crop `crop_and_flip` may return for ``image``: (top, left, flipped, crop)."""
    pad, size = resnet.CROP_PAD, resnet.IMAGE_SIZE
    padded = F.pad(image, (pad,) * 4, value=resnet.BACKGROUND)
    out = []
    for top, left, flipped in itertools.product(range(2 * pad + 1), range(2 * pad + 1), (0, 1)):
        crop = padded[:, top : top + size, left : left + size]
        out.append((top, left, bool(flipped), crop.flip(-1) if flipped else crop))
    return out


def test_resnet_augments_by_random_crops_and_flips_drawn_from_the_seed(
    resnet: ModuleType,
) -> None:
    images, labels = resnet.digits("train")
    augmented = resnet.Digits("train", augment=True)
    plain = resnet.Digits("eval")
    assert len(augmented) == len(labels) and len(plain) == len(resnet.digits("eval")[1])
    # Held-out images are read as they are.
    image, label = plain[3]
    assert torch.equal(image, resnet.digits("eval")[0][3]) and label == resnet.digits("eval")[1][3]

    drawn = set()
    for seed in range(40):
        torch.manual_seed(seed)
        image, label = augmented[7]
        torch.manual_seed(seed)
        again, _ = augmented[7]
        assert torch.equal(image, again)  # the same seed, the same crop and flip
        assert image.shape == (1, resnet.IMAGE_SIZE, resnet.IMAGE_SIZE) and label == labels[7]
        matches = [c[:3] for c in _crops(resnet, images[7]) if torch.equal(c[3], image)]
        assert matches, seed  # a shifted crop of the padded image, mirrored or not
        drawn.update(matches)
    assert {flipped for _, _, flipped in drawn} == {False, True}
    assert len({(top, left) for top, left, _ in drawn}) > 5


def test_resnet_job_reads_augmented_digits_through_the_data_loader(resnet: ModuleType) -> None:
    job = resnet.make_job()
    assert job.data_loader is not None and job.data_loader["num_workers"] == 2
    train, evaluation = job_data(job).train_dataset(), job_data(job).eval_dataset()
    assert isinstance(train, resnet.Digits) and train.augment
    assert isinstance(evaluation, resnet.Digits) and not evaluation.augment
    inputs, targets = job_data(job).example_batch(4)
    assert inputs.shape == (4, 1, resnet.IMAGE_SIZE, resnet.IMAGE_SIZE)
    assert targets.shape == (4,) and targets.dtype == torch.int64


# ------------------------------------------------------------------ a Llama-style decoder
#
# Written as Llama and torchtitan write theirs, but for the split-by-name
# contract: every top-level module may be None, the blocks are iterated,
# and a stage without the head returns (h, attention_mask). The rotary
# table is a buffer of the root module, so every stage keeps it; the
# attention mask is built in forward from the (B, T) padding mask.

LLAMA_SEQ = 16
LLAMA_VOCAB = 37
LLAMA_PAD = 0
IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = LLAMA_VOCAB
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    """Fewer key/value heads than query heads (grouped-query attention, as Llama 2 70B and 3)."""
    hidden_dim: int = 64
    max_seq_len: int = LLAMA_SEQ
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    layers: str = "list"
    """``"list"``: blocks in an nn.ModuleList (nanoGPT); ``"dict"``: a ModuleDict (torchtitan)."""
    rope: str = "complex"
    """``"complex"``: one complex ``freqs_cis`` buffer (Llama, torchtitan); ``"cos_sin"``: two
    real ones, ``rope_cos`` and ``rope_sin``."""
    persistent: bool = False
    """Whether the rotary buffers are in the state_dict (torchtitan: yes; Meta's Llama: no)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The precomputed rotary buffers: ``freqs_cis`` (complex) or ``rope_cos``/``rope_sin``."""
    head_dim = config.dim // config.n_heads
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(config.max_seq_len).float(), freqs)
    if config.rope == "complex":
        return {"freqs_cis": torch.polar(torch.ones_like(angles), angles)}
    return {"rope_cos": angles.cos(), "rope_sin": angles.sin()}


def apply_rotary(x: torch.Tensor, tables: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rotate the (even, odd) pairs of ``x`` ``(B, T, H, D)`` by the angles of their positions."""
    t = x.shape[1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if "freqs_cis" in tables:
        rotated = torch.view_as_real(
            torch.view_as_complex(pairs) * tables["freqs_cis"][:t, None, :]
        )
    else:
        cos, sin = tables["rope_cos"][:t, None, :], tables["rope_sin"][:t, None, :]
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def llama_allowed(
    attention_mask: torch.Tensor | None, t: int, device: torch.device
) -> torch.Tensor:
    """Causal and key-padding mask, ``(B, 1, T, T)``; the diagonal is kept so no row is empty."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal
    keys = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return (causal & keys) | torch.eye(t, dtype=torch.bool, device=device)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, tables: dict[str, torch.Tensor], allowed: torch.Tensor
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, tables), apply_rotary(k, tables)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, tables: dict[str, torch.Tensor], allowed: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), tables, allowed)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding, blocks, final RMSNorm, an untied output head; torchtitan's names."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Module | None = nn.Embedding(config.vocab_size, config.dim)
        blocks = [LlamaBlock(config) for _ in range(config.n_layers)]
        self.layers: nn.Module = (
            nn.ModuleList(blocks)
            if config.layers == "list"
            else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        self.norm: nn.Module | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Module | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        # On the root, as Llama and torchtitan do: no stage owns it, every stage keeps it.
        for name, table in rotary_tables(config).items():
            self.register_buffer(name, table, persistent=config.persistent)
        for param in self.parameters():
            if param.dim() == 2:
                nn.init.trunc_normal_(param, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # A later stage gets the previous stage's hidden state in place of input_ids.
        h = input_ids
        # Built before the embedding, as Llama does; (B, T) and (B, T, D) agree on T.
        allowed = llama_allowed(attention_mask, h.shape[1], h.device)
        tables = {name: buf for name, buf in self.named_buffers(recurse=False)}
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        # Iterated, never indexed: a stage holds blocks under their original keys.
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for block in blocks:
            h = block(h, tables, allowed)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h, attention_mask
        return self.output(h)


def llama_samples() -> dict[str, torch.Tensor]:
    """Random token ids with right padding of varied lengths; labels shifted, -100 at padding."""
    gen = torch.Generator().manual_seed(0)
    n = 8
    tokens = torch.randint(1, LLAMA_VOCAB, (n, LLAMA_SEQ + 1), generator=gen)
    lengths = torch.tensor([16, 16, 12, 9, 16, 5, 14, 1])
    keep = torch.arange(LLAMA_SEQ)[None, :] < lengths[:, None]
    return {
        "input_ids": torch.where(keep, tokens[:, :-1], LLAMA_PAD),
        "attention_mask": keep.long(),
        "labels": torch.where(keep, tokens[:, 1:], IGNORE_INDEX),
    }


def llama_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def _llama_job(config: LlamaConfig, stages: int, seed: int = 0, **split: Any) -> Job:
    return Job(
        name="llama",
        model=functools.partial(Llama, config),
        stages=stages,
        input_keys=("input_ids", "attention_mask"),
        target_keys="labels",
        loss_fn=llama_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_data=llama_samples,
        batch_size=8,
        num_microbatches=2,
        max_steps=1,
        seed=seed,
        pruned_forward=True,
        **split,
    )


LLAMA_VARIANTS = [
    pytest.param(
        LlamaConfig(layers=layers, rope=rope, persistent=persistent),
        id=f"{layers}-{rope}-{'persistent' if persistent else 'nonpersistent'}",
    )
    for layers in ("list", "dict")
    for rope in ("complex", "cos_sin")
    for persistent in (False, True)
]

LLAMA_SPLITS = [
    pytest.param(2, {"split_points": ["layers.2"]}, id="2-at-layers.2"),
    # Stage 0 holds no block: it returns the embedding with the mask it was given.
    pytest.param(2, {"balance": [1, 6]}, id="2-embedding-alone"),
    pytest.param(3, {"split_points": ["layers.1", "layers.3"]}, id="3-at-layers.1-layers.3"),
    # The middle stage is the final norm alone; the last stage only the head.
    pytest.param(3, {"balance": [5, 1, 1]}, id="3-norm-alone"),
]


def _chain_forward_backward(
    stages: list[nn.Module], batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Run the stages as a pipeline does, each boundary value a fresh leaf; then backward."""
    value: Any = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    sent: list[tuple[torch.Tensor, torch.Tensor]] = []
    for stage in stages[:-1]:
        out = call(stage, value)
        assert isinstance(out, tuple) and len(out) == 2
        hidden, mask = out
        assert hidden.shape == (*batch["input_ids"].shape, LlamaConfig().dim)
        # The integer padding mask travels forward unchanged, with no gradient.
        assert mask is batch["attention_mask"]
        received = hidden.detach().requires_grad_()
        sent.append((hidden, received))
        value = (received, mask)
    logits = call(stages[-1], value)
    llama_loss(logits, batch["labels"]).backward()
    for hidden, received in reversed(sent):
        assert received.grad is not None
        hidden.backward(received.grad)
    return logits


def _root_buffer_names(config: LlamaConfig) -> set[str]:
    return set(rotary_tables(config))


@pytest.mark.parametrize("config", LLAMA_VARIANTS)
@pytest.mark.parametrize(("num_stages", "split"), LLAMA_SPLITS)
def test_llama_split_by_name_equals_the_full_model(
    config: LlamaConfig, num_stages: int, split: dict[str, Any]
) -> None:
    job = _llama_job(config, num_stages, **split)
    ranges = partition(job)
    assert len(ranges) == num_stages
    names = unit_names(job)
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "norm", "output"]
    stages = [build_stage_module(job, r) for r in ranges]
    full = build_full_model(job)
    batch = llama_samples()

    logits = _chain_forward_backward(stages, batch)
    expected = full(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (8, LLAMA_SEQ, LLAMA_VOCAB)
    # The same operations on the same weights: equal to the bit, not just close.
    assert torch.equal(logits, expected)
    llama_loss(expected, batch["labels"]).backward()

    full_params = dict(full.named_parameters())
    stage_params = [dict(s.named_parameters()) for s in stages]
    # Every parameter is on exactly one stage, under its unsplit name.
    assert sorted(n for p in stage_params for n in p) == sorted(full_params)
    for params in stage_params:
        for name, param in params.items():
            assert param.grad is not None, name
            full_grad = full_params[name].grad
            assert full_grad is not None and full_grad.abs().sum() > 0, name
            torch.testing.assert_close(param.grad, full_grad, rtol=0, atol=1e-6)

    # Root buffers stay on every stage, equal to the full model's, in the
    # state_dict only when persistent. So the stages' state_dicts together
    # are the full model's, and two stages share keys only for those buffers.
    tables = _root_buffer_names(config)
    full_buffers = dict(full.named_buffers())
    assert set(full_buffers) == tables
    for stage in stages:
        held = dict(stage.named_buffers())
        assert set(held) == tables
        for name in tables:
            assert torch.equal(held[name], full_buffers[name])
    states = [set(s.state_dict()) for s in stages]
    assert set().union(*states) == set(full.state_dict())
    in_state = tables if config.persistent else set()
    assert tables & set(full.state_dict()) == in_state
    for a, b in itertools.combinations(states, 2):
        assert a & b == in_state
    if config.layers == "list":
        # A pruned ModuleList keeps its items under their original indices.
        for stage, r in zip(stages, ranges, strict=True):
            kept = [int(n.split(".")[1]) for n in (names[i] for i in r) if n.startswith("layers.")]
            assert [int(k) for k in stage.layers._modules] == kept
            # A stage holding every block keeps the list itself.
            assert isinstance(stage.layers, KeptItems) == (len(kept) < config.n_layers)


def test_llama_rotary_layouts_agree_and_padding_is_masked_across_stages() -> None:
    """Both buffer layouts are one rotary embedding; the mask built in forward hides padding."""
    batch = llama_samples()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    inputs = {"input_ids": ids, "attention_mask": mask}
    logits = {}
    for rope in ("complex", "cos_sin"):
        job = _llama_job(LlamaConfig(rope=rope), 2, split_points=["layers.2"])
        logits[rope] = build_full_model(job)(ids, mask)
    torch.testing.assert_close(logits["complex"], logits["cos_sin"], rtol=0, atol=1e-5)

    job = _llama_job(LlamaConfig(), 2, split_points=["layers.2"])
    first, second = (build_stage_module(job, r) for r in partition(job))
    # Right padding alone proves nothing: causal attention never looks ahead.
    mask = mask.clone()
    mask[0, :5] = 0  # left padding
    mask[1, 6:9] = 0  # a gap inside
    inputs["attention_mask"] = mask
    real = mask.bool()
    other_ids = torch.where(real, ids, torch.randint_like(ids, 1, LLAMA_VOCAB))
    assert not torch.equal(other_ids, ids)
    with torch.no_grad():
        a = call(second, call(first, inputs))
        b = call(second, call(first, {"input_ids": other_ids, "attention_mask": mask}))
        torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)
        # Without the padding mask the same change shows: the mask is what hides it.
        c = call(second, call(first, {"input_ids": ids}))
        d = call(second, call(first, {"input_ids": other_ids}))
    assert not torch.allclose(c[real], d[real], atol=1e-3)


@pytest.mark.parametrize("rope", ["complex", "cos_sin"])
def test_llama_rotary_scores_depend_on_the_offset_only(rope: str) -> None:
    config = LlamaConfig(rope=rope)
    tables = rotary_tables(config)
    gen = torch.Generator().manual_seed(0)
    head_dim = config.dim // config.n_heads
    one = torch.randn(1, 1, 1, head_dim, generator=gen)
    q = one.expand(1, LLAMA_SEQ, 1, head_dim)
    k = torch.randn(1, 1, 1, head_dim, generator=gen).expand(1, LLAMA_SEQ, 1, head_dim)
    rq, rk = apply_rotary(q, tables), apply_rotary(k, tables)
    # Position 0 is not rotated; a rotation keeps the length.
    torch.testing.assert_close(rq[0, 0], q[0, 0])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    scores = rq[0, :, 0] @ rk[0, :, 0].T  # (query position, key position)
    # The score of query m and key n is a function of m - n ...
    torch.testing.assert_close(scores[3, 1], scores[9, 7], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[5, 5], scores[12, 12], rtol=0, atol=1e-5)
    # ... and it does change with the offset.
    assert not torch.isclose(scores[3, 1], scores[3, 2], atol=1e-3)


def _banner_imbalance(costs: tuple[float, ...], sizes: tuple[int, ...]) -> float:
    totals, start = [], 0
    for size in sizes:
        totals.append(sum(costs[start : start + size]))
        start += size
    return max(totals) / (sum(totals) / len(totals))


@pytest.mark.parametrize("config", LLAMA_VARIANTS)
def test_llama_plan_split_runs_on_meta_and_counts_costs(config: LlamaConfig) -> None:
    job = _llama_job(config, 2, split_points=["layers.2"])
    # A model that cannot run on meta is only warned about; the check here is
    # that nothing was: the root buffers and the mask built in forward run there.
    with capture_logs() as logs:
        plan = plan_split(job)
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
    assert plan.units == tuple(unit_names(job))
    assert plan.sizes == (3, 4)
    c = LlamaConfig()
    head_dim = c.dim // c.n_heads
    block_params = 2 * c.dim + c.dim * (c.n_heads + 2 * c.n_kv_heads) * head_dim
    block_params += c.dim * c.n_heads * head_dim + 3 * c.dim * c.hidden_dim
    assert plan.params == (
        c.vocab_size * c.dim,
        *[block_params] * c.n_layers,
        c.dim,
        c.dim * c.vocab_size,
    )
    assert plan.costs is not None and len(plan.costs) == len(plan.units)
    embedding, *blocks, norm, head = plan.costs
    # FLOPs are counted in matrix products: a lookup and a norm cost none.
    assert embedding == 0 and norm == 0
    assert len(set(blocks)) == 1 and blocks[0] > 0
    microbatch = job.batch_size // job.num_microbatches
    # Forward, input gradient and weight gradient: three times the head's matmul.
    assert head == 3 * 2 * microbatch * LLAMA_SEQ * c.dim * c.vocab_size
    assert plan.imbalance == pytest.approx(_banner_imbalance(plan.costs, plan.sizes))
    assert plan.describe() == (
        "tok_embeddings..layers.1 | layers.2..output"
        f"  (estimated compute imbalance {plan.imbalance:.2f})"
    )
    assert f"{plan.imbalance:.2f}" == "1.03"

    # By compute the three stages get the same split at any container style.
    three = plan_split(_llama_job(config, 3, balance="compute"))
    assert three.costs == plan.costs
    assert three.describe() == (
        "tok_embeddings..layers.0 | layers.1..layers.2 | layers.3..output"
        "  (estimated compute imbalance 1.46)"
    )


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(persistent=True), LlamaConfig(layers="dict", rope="cos_sin")],
    ids=["list-complex-persistent", "dict-cos_sin-nonpersistent"],
)
def test_llama_initial_weights_do_not_depend_on_the_stage_count(config: LlamaConfig) -> None:
    two = _llama_job(config, 2, split_points=["layers.2"])
    three = _llama_job(config, 3, split_points=["layers.1", "layers.3"])
    # The caller's RNG state differs before each build and must not matter.
    torch.manual_seed(1)
    first_of_two = build_stage_module(two, partition(two)[0]).state_dict()
    torch.manual_seed(2)
    first_of_three = build_stage_module(three, partition(three)[0]).state_dict()
    shared = set(first_of_two) & set(first_of_three)
    shared_units = {u for u in unit_names(two) for k in shared if k.startswith(u + ".")}
    assert shared_units == {"tok_embeddings", "layers.0"}
    for key in shared:
        assert torch.equal(first_of_two[key], first_of_three[key]), key

    # Every unit, on whichever stage it lands, starts from the full model's weights.
    full = build_full_model(two).state_dict()
    for job in (two, three):
        for r in partition(job):
            for key, value in build_stage_module(job, r).state_dict().items():
                assert torch.equal(value, full[key]), key

    # The job's seed is what decides them.
    reseeded = build_stage_module(
        _llama_job(config, 2, seed=1, split_points=["layers.2"]), partition(two)[0]
    ).state_dict()
    for key in ("tok_embeddings.weight", "layers.0.attention.wq.weight"):
        assert not torch.equal(reseeded[key], first_of_two[key])
