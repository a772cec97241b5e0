"""A small decoder for launch tests: dict samples, a padding mask used by every block,
input and output embeddings tied, given as a whole model split by module name
(``KIND=model``) or as layers passing ``(hidden, mask)`` tuples (``KIND=layers``).

Spec files written by tests/integration/test_real_models.py set the module-level knobs
and then ``from real_model_spec import *``-style build the job with `make_job`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evtrain.job import Job, layer

VOCAB, SEQ, WIDTH, BLOCKS = 13, 8, 16, 4
SAMPLES = 64


class Block(nn.Module):
    """Pre-LN attention and MLP; padded keys are masked out (a position always sees itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls = os.environ.get("EVTRAIN_TEST_BLOCK_CALLS")
        if calls:  # one line per forward run, recomputations included
            with open(calls, "a") as f:
                f.write("b\n")
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        allowed = causal & mask[:, None, :] | torch.eye(SEQ, dtype=torch.bool)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + self.proj(attn)
        return h + self.mlp(self.ln2(h)), mask


class CountingBlock(Block):
    """Returns a Python int beside the tensors: it cannot cross a stage boundary."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> Any:  # type: ignore[override]
        return super().forward(h, mask)[0], 3


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tok(input_ids) + self.pos.weight, attention_mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(h))


class TinyGPT(nn.Module):
    """The same network as one model, following the split contract (None-able modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: Embed | None = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head: Head | None = Head()
        self.head.out.weight = self.embed.tok.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        if self.embed is not None:
            h, mask = self.embed(input_ids, attention_mask)
        else:
            h, mask = input_ids, attention_mask
        for block in self.blocks:
            h, mask = block(h, mask)
        if self.head is None:
            return h, mask
        return self.head(h, mask)


class UnawareGPT(TinyGPT):
    """Breaks the pruned-forward rules: its forward always uses the embedding."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        assert self.embed is not None
        return super().forward(input_ids, attention_mask)


def samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (SAMPLES,), generator=g)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    labels = torch.roll(ids, -1, dims=1).masked_fill(~mask, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "unused": ids * 0}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def scaled_loss(gain: float, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return gain * loss_fn(logits, labels)


def make_job(
    kind: str,
    stages: int,
    steps: int,
    run_dir: str,
    split_points: Sequence[str] | None = None,
    **fields: Any,
) -> Job:
    common: dict[str, Any] = dict(
        name="tiny-gpt",
        loss_fn=loss_fn,
        # SGD: Adam would turn float noise in gradients that are zero in exact
        # arithmetic (the key bias of attention) into full-size updates.
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        train_data=samples,
        input_keys=("input_ids", "attention_mask"),
        target_keys="labels",
        batch_size=16,
        num_microbatches=4,
        max_steps=steps,
        stages=stages,
        run_dir=run_dir,
        threads=1,
    )
    gain = float(fields.pop("loss_gain", 1.0))
    if gain != 1.0:
        common["loss_fn"] = functools.partial(scaled_loss, gain)
    common.update(fields)
    if split_points is not None:
        common["split_points"] = split_points  # refused for layers: a test checks it
    if kind in ("model", "unaware"):
        return Job(model=TinyGPT if kind == "model" else UnawareGPT, **common)
    if kind == "bad_leaf":
        return Job(layers=[layer(Embed), layer(CountingBlock), layer(Head)], **common)
    common.setdefault("tied", [("0.tok.weight", f"{BLOCKS + 1}.out.weight")])
    return Job(layers=[layer(Embed), *(layer(Block) for _ in range(BLOCKS)), layer(Head)], **common)
