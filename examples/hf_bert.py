"""Hugging Face's ``BertForSequenceClassification``, unmodified, on 2 stages.

Run it with ``evtrain launch examples/hf_bert.py`` after
``pip install -e '.[hf]'``. The task: which of the three poems bundled with
``examples/gpt.py`` a line comes from, read character by character by a small
BERT built from its config.

The encoder's layers sit in ``bert.encoder.layer``, two levels down; evtrain
finds them and splits before layer 2. The classifier reads the pooled first
position, so only stage 1 holds the pooler and the head; the attention mask
built from the padding mask is rebuilt on stage 1 from the inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from gpt import PAD, SEQ_LEN, TEXT, VOCAB, encode

from evtrain.job import Job

POEMS = (0, 20, 36)
"""The first line of each poem in `TEXT`: The Tyger, The Lamb, Hope."""


def lines(part: str) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and the poem's index as ``label``; every 4th
    line is held out."""
    rows = [
        (encode(line)[:SEQ_LEN], sum(i >= start for start in POEMS) - 1)
        for i, line in enumerate(TEXT.splitlines())
        if (i % 4 == 3) == (part == "eval")
    ]
    ids = torch.full((len(rows), SEQ_LEN), PAD, dtype=torch.int64)
    for i, (tokens, _) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
    return {
        "input_ids": ids,
        "attention_mask": (ids != PAD).long(),
        "label": torch.tensor([poem for _, poem in rows]),
    }


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=SEQ_LEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=len(POEMS),
        pad_token_id=PAD,
    )
    return BertForSequenceClassification(config)


def loss(output: Any, label: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, label)


def accuracy(output: Any, label: torch.Tensor) -> torch.Tensor:
    return (output.logits.argmax(-1) == label).float().mean()


def make_job() -> Job:
    return Job(
        name="hf-bert",
        model=bert,
        split_points=["bert.encoder.layer.2"],
        input_keys=("input_ids", "attention_mask"),
        target_keys="label",
        loss_fn=loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        train_data=functools.partial(lines, "train"),
        eval_data=functools.partial(lines, "eval"),
        metrics={"accuracy": accuracy},
        batch_size=8,
        num_microbatches=2,
        max_steps=60,
        eval_every=30,
        stages=2,
        threads=1,
        hooks=[dict(type="logging", every=10)],
    )
