"""Hugging Face's ``GPT2LMHeadModel`` (head tied to the embedding), computing its own loss.

Run it with ``evtrain launch examples/hf_gpt2.py`` after
``pip install -e '.[hf]'``; built from a small `GPT2Config`, trained on the
verse bundled with ``examples/gpt.py``.

Two things show here. The input embedding ``transformer.wte`` sits on stage 0
and the tied ``lm_head`` on stage 1: evtrain finds the shared weight in the
model itself and keeps both copies one weight. And the model computes its
own loss, as Hugging Face models do when given ``labels``: ``loss_fn=None``
takes ``output.loss``. The labels are an input the model reads on the last
stage, so they travel there with the hidden state.
"""

from __future__ import annotations

import functools

import torch
from gpt import IGNORE, PAD, SEQ_LEN, VOCAB, cosine, samples

from evtrain.job import Job


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(VOCAB),
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_positions=SEQ_LEN,
        resid_pdrop=0.0,  # dropout draws from each stage's own generator
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=PAD,
        eos_token_id=PAD,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def with_labels(part: str) -> dict[str, torch.Tensor]:
    """The samples with Hugging Face's labels: the inputs themselves (the model shifts
    them), ignored at the padding."""
    data = samples(part)
    data["labels"] = data["input_ids"].masked_fill(data["attention_mask"] == 0, IGNORE)
    return data


def make_job() -> Job:
    return Job(
        name="hf-gpt2",
        model=gpt2,
        split_points=["transformer.h.2"],
        input_keys=("input_ids", "attention_mask", "labels"),
        target_keys="labels",
        loss_fn=None,  # GPT2LMHeadModel returns output.loss when given labels=
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
        lr_scheduler=cosine,
        train_data=functools.partial(with_labels, "train"),
        eval_data=functools.partial(with_labels, "eval"),
        batch_size=16,
        num_microbatches=4,
        eval_batch_size=8,
        max_steps=100,
        eval_every=50,
        grad_clip=1.0,
        stages=2,
        threads=1,
        hooks=[dict(type="logging", every=10)],
    )
